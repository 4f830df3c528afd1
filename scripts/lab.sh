#!/usr/bin/env bash
# Opens the notebooks in JupyterLab: sets up .venv if needed (scripts/setup_env.sh), then runs
# .venv/bin/jupyter lab rooted at notebooks/.
#
#   bash scripts/lab.sh                       # this machine: http://127.0.0.1:8888/lab
#   bash scripts/lab.sh --remote              # a remote host (an inf2 instance): listen on every address
#   LAB_IP=0.0.0.0 LAB_PORT=8890 bash scripts/lab.sh   # the same through the environment
#   bash scripts/lab.sh --port 8890 -- --IdentityProvider.token=...   # after --, arguments go to jupyter lab
#
# The kernel: the notebooks name the `python3` kernelspec. JupyterLab started from .venv/bin/jupyter
# resolves `python3` to ipykernel's built-in spec, which runs sys.executable, i.e. .venv/bin/python with
# gemma4lib installed (setup_env.sh also registers it as "Python 3 (gemma4lib)"). This script checks it.
# On a remote host, either forward the port (ssh -L 8888:127.0.0.1:8888 host, then run without --remote)
# or use --remote and open the printed URL with the host's address in place of 0.0.0.0; the URL carries the
# token, so keep it to yourself.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${GEMMA4LIB_VENV:-.venv}"
ip="${LAB_IP:-127.0.0.1}"
port="${LAB_PORT:-8888}"
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --remote) ip="0.0.0.0" ;;
    --ip) ip="$2"; shift ;;
    --port) port="$2"; shift ;;
    --) shift; extra=("$@"); break ;;
    -h | --help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "[lab] unknown argument $1 (try --help)" >&2; exit 2 ;;
  esac
  shift
done
bash scripts/setup_env.sh
kernel_python="$("$VENV/bin/jupyter" kernelspec list --json | "$VENV/bin/python" -c \
  'import json, sys; print(json.load(sys.stdin)["kernelspecs"]["python3"]["spec"]["argv"][0])')"
case "$kernel_python" in
  python | python3 | "$PWD/$VENV"/bin/python* | "$VENV"/bin/python*) ;;
  *) echo "[lab] warning: the python3 kernel runs $kernel_python, not $VENV's Python; remove that kernelspec" >&2 ;;
esac
if [ "$(id -u)" -eq 0 ]; then
  extra=(--allow-root "${extra[@]}")  # containers and CI run as root; Jupyter refuses root without it
fi
echo "[lab] JupyterLab on http://$ip:$port/lab over $PWD/notebooks (kernel python3 = $VENV/bin/python); Ctrl-C stops it"
exec "$VENV/bin/jupyter" lab --no-browser --ip="$ip" --port="$port" --ServerApp.root_dir="$PWD/notebooks" "${extra[@]}"
