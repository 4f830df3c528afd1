#!/usr/bin/env bash
# Opens the notebooks in JupyterLab: on a CPU machine over .venv (scripts/setup_env.sh), on an inf2
# over the Neuron venv; then runs jupyter lab rooted at notebooks/.
#
#   bash scripts/lab.sh                       # this machine: http://127.0.0.1:8888/lab
#   bash scripts/lab.sh --remote              # a remote host (an inf2 instance): listen on every address
#   bash scripts/lab.sh --neuron /opt/aws_neuronx_venv_pytorch_2_9_nxd_inference   # the Neuron venv
#   bash scripts/lab.sh --cpu                 # .venv even where the DLAMI's Neuron venv exists
#   LAB_IP=0.0.0.0 LAB_PORT=8890 bash scripts/lab.sh   # the same through the environment
#   bash scripts/lab.sh --port 8890 -- --IdentityProvider.token=...   # after --, arguments go to jupyter lab
#   bash scripts/lab.sh --neuron VENV --no-start   # install and register the kernel only
#
# Neuron mode (--neuron VENV, or found: the SDK 2.28 DLAMI venv below): installs gemma4lib into VENV
# with pip constraints written from VENV's whole `pip freeze` (gemma4lab.tools.venv_pins) less the
# four packages this project must change (transformers, tokenizers, huggingface-hub, safetensors), so
# nothing else in the venv can change; checks first that VENV's setuptools builds the project
# (pyproject.toml [build-system], needed by --no-build-isolation); checks afterwards that nothing
# constrained moved and that `pip check` reports nothing but NxD Inference's own transformers pin;
# registers a kernel named for VENV ("gemma4lib-<venv>");
# puts VENV/bin and /opt/aws/neuron/bin on PATH (the libneuronpjrt-path fix); starts VENV's jupyter.
# The CPU .venv (torch 2.13, no torch-neuronx) is never built there.
# The kernel: the notebooks name the `python3` kernelspec. JupyterLab started from a venv's jupyter
# resolves `python3` to ipykernel's built-in spec, which runs sys.executable, i.e. that venv's python
# with gemma4lib installed. This script checks it.
# On a remote host, either forward the port (ssh -L 8888:127.0.0.1:8888 host, then run without --remote)
# or use --remote and open the printed URL with the host's address in place of 0.0.0.0; the URL carries the
# token, so keep it to yourself.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${GEMMA4LIB_VENV:-.venv}"
# = gemma4lib.recipes.neuron_env.DLAMI_VENV_PATH (tests/test_lab_neuron.py checks they agree)
DLAMI_VENV_PATH="${GEMMA4LIB_DLAMI_VENV:-/opt/aws_neuronx_venv_pytorch_2_9_nxd_inference}"
NEURON_BIN=/opt/aws/neuron/bin
ip="${LAB_IP:-127.0.0.1}"
port="${LAB_PORT:-8888}"
neuron=""
cpu=0
start=1
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --remote) ip="0.0.0.0" ;;
    --ip) ip="$2"; shift ;;
    --port) port="$2"; shift ;;
    --neuron) neuron="${2:?--neuron needs the venv folder}"; shift ;;
    --cpu) cpu=1 ;;
    --no-start) start=0 ;;
    --) shift; extra=("$@"); break ;;
    -h | --help) sed -n '2,27p' "$0"; exit 0 ;;
    *) echo "[lab] unknown argument $1 (try --help)" >&2; exit 2 ;;
  esac
  shift
done
if [ -z "$neuron" ] && [ "$cpu" -eq 0 ] && [ -z "${GEMMA4LIB_VENV:-}" ] && [ -x "$DLAMI_VENV_PATH/bin/python" ]; then
  neuron="$DLAMI_VENV_PATH"
  echo "[lab] found the Neuron venv $neuron (use --cpu for the CPU .venv instead)"
fi
if [ -n "$neuron" ]; then
  VENV="$(cd "$neuron" && pwd)"
  py="$VENV/bin/python"
  [ -x "$py" ] || { echo "[lab] $neuron has no bin/python: not a venv" >&2; exit 2; }
  name="$(basename "$VENV")"
  kernel="gemma4lib-$name"
  pins="$(mktemp)"
  checked="$(mktemp)"
  trap 'rm -f "$pins" "$checked"' EXIT
  # the venv's own versions, read by its own Python (stdlib only: gemma4lib is not installed there yet)
  PYTHONPATH="$PWD" "$py" -m gemma4lab.tools.venv_pins --require torch --require torch-neuronx > "$pins"
  # --no-build-isolation builds with the venv's setuptools: refuse one too old for pyproject.toml
  PYTHONPATH="$PWD" "$py" -m gemma4lab.tools.venv_pins --check-build pyproject.toml || {
    echo "[lab] error: fix the setuptools above, then run lab.sh again" >&2
    exit 1
  }
  echo "[lab] installing gemma4lib[notebooks] into $VENV; its $(wc -l < "$pins") other packages stay as they" \
    "are (all but transformers, tokenizers, huggingface-hub, safetensors), among them:"
  grep -E '^(torch|torch-neuronx|torch-xla|neuronx-cc|neuronx-distributed|neuronx-distributed-inference|libneuronxla|numpy)==' \
    "$pins" | sed 's/^/[lab]   /' || true
  PYTHONWARNINGS="ignore:Editable installation:UserWarning" \
    "$py" -m pip install --quiet --no-build-isolation -c "$pins" -e ".[notebooks]"
  PYTHONPATH="$PWD" "$py" -m gemma4lab.tools.venv_pins --compare "$pins" || {
    echo "[lab] error: the install changed the venv's packages (above)" >&2
    exit 1
  }
  "$py" -m pip check > "$checked" 2>&1 || true
  PYTHONPATH="$PWD" "$py" -m gemma4lab.tools.venv_pins --check-pip < "$checked" || {
    echo "[lab] error: the venv has broken requirements other than NxD Inference's transformers pin" >&2
    exit 1
  }
  "$py" -m ipykernel install --prefix "$VENV" --name "$kernel" --display-name "Python ($name, gemma4lib)" >/dev/null
  export PATH="$VENV/bin:$NEURON_BIN:$PATH"  # the libneuronpjrt-path fix, inherited by the kernels
  echo "[lab] kernel $kernel registered in $VENV/share/jupyter/kernels (it and python3 run $py)"
else
  bash scripts/setup_env.sh
fi
kernel_python="$("$VENV/bin/python" -c \
  'from jupyter_client.kernelspec import KernelSpecManager as M; print(M().get_kernel_spec("python3").argv[0])')"
case "$kernel_python" in
  python | python3 | "$PWD/$VENV"/bin/python* | "$VENV"/bin/python*) ;;
  *) echo "[lab] warning: the python3 kernel runs $kernel_python, not $VENV's Python; remove that kernelspec" >&2 ;;
esac
if [ "$(id -u)" -eq 0 ]; then
  extra=(--allow-root "${extra[@]}")  # containers and CI run as root; Jupyter refuses root without it
fi
if [ "$start" -eq 0 ]; then
  echo "[lab] ready; start it with: $VENV/bin/python -m jupyterlab --no-browser --ip=$ip --port=$port --ServerApp.root_dir=$PWD/notebooks"
  exit 0
fi
echo "[lab] JupyterLab on http://$ip:$port/lab over $PWD/notebooks (kernel python3 = $VENV/bin/python); Ctrl-C stops it"
exec "$VENV/bin/python" -m jupyterlab --no-browser --ip="$ip" --port="$port" --ServerApp.root_dir="$PWD/notebooks" "${extra[@]}"
