#!/usr/bin/env bash
# Create the XLA lane's pinned environment (README, "Environments"): torch 2.9.0 + torch-xla 2.9.0
# from PyPI, the project's transformers pin, and gemma4lib itself (editable, no deps), in $VENV
# (default: <repo>/.venv-xla, kept out of the main venv and gitignored via `.venv-*/`).
#
#   scripts/setup_xla_env.sh            # create or verify (idempotent: exits early if pins match)
#   VENV=/some/where scripts/setup_xla_env.sh
#   FORCE=1 scripts/setup_xla_env.sh    # rebuild from scratch
#   scripts/setup_xla_env.sh --print-pins   # print the requirements it would install, and exit
#
# Then: PJRT_DEVICE=CPU .venv-xla/bin/python -m gemma4lab.tools.xla_check --variant e2b
#       PJRT_DEVICE=CPU .venv-xla/bin/python -m pytest tests/test_xla_lane.py
#
# torch 2.9.0's PyPI wheel is a CUDA build: it pulls its nvidia-* wheels (~7 GB in all) and needs
# them even to import on a machine with no GPU. torch-xla 2.9.0 matches the torch the Neuron SDK
# 2.28 torch-neuronx 2.9.0.2.12.22436 build is made for.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$(realpath -m "${VENV:-$REPO/.venv-xla}")"  # absolute: the install runs from $REPO
PYTHON="${PYTHON:-python3.11}"

# The pins are read, never copied: torch and torch-xla from `SDK_CONSTRAINTS` in
# gemma4lib/recipes/neuron_env.py (the torch the SDK 2.28 packages are built against; read with ast,
# so nothing is imported), transformers and the rest of gemma4lib's dependencies (and pytest) from
# pyproject.toml. Output: the three versions, then one requirement a line.
pins() {
  "$PYTHON" - "$REPO" <<'PY'
import ast, pathlib, sys, tomllib

root = pathlib.Path(sys.argv[1])
tree = ast.parse((root / "gemma4lib/recipes/neuron_env.py").read_text())
sdk = next(ast.literal_eval(node.value) for node in ast.walk(tree)
           if isinstance(node, (ast.Assign, ast.AnnAssign))
           and "SDK_CONSTRAINTS" in [t.id for t in getattr(node, "targets", [getattr(node, "target", None)])
                                     if isinstance(t, ast.Name)])
project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
deps = project["dependencies"]
tests = [r for r in project["optional-dependencies"]["test"] if r.startswith("pytest")]
transformers = next(r.split("==", 1)[1] for r in deps if r.startswith("transformers=="))
print(sdk["torch"].removeprefix("=="), sdk["torch-xla"].removeprefix("=="), transformers, sep="\n")
print(*(f"{name}{sdk[name]}" for name in ("torch", "torch-xla")), *deps, *tests, sep="\n")
PY
}
mapfile -t PINS < <(pins)
if [[ "${#PINS[@]}" -lt 4 ]]; then
  echo "setup_xla_env: could not read the pins (pyproject.toml, neuron_env.SDK_CONSTRAINTS) with $PYTHON" >&2
  exit 1
fi
TORCH="${PINS[0]}"
TORCH_XLA="${PINS[1]}"
TRANSFORMERS="${PINS[2]}"
REQUIREMENTS=("${PINS[@]:3}")
if [[ "${1:-}" == "--print-pins" ]]; then
  printf '%s\n' "${REQUIREMENTS[@]}"
  exit 0
fi

check() {
  "$VENV/bin/python" - "$TORCH" "$TORCH_XLA" "$TRANSFORMERS" <<'PY' 2>/dev/null
import sys, importlib.metadata as md
want = dict(zip(("torch", "torch_xla", "transformers"), sys.argv[1:]))
have = {name: md.version(name.replace("_", "-")) for name in want}
bad = {k: (have[k], v) for k, v in want.items() if have[k].split("+")[0] != v}
for mod in ("torch", "torch_xla", "transformers", "gemma4lib", "pytest"):
    md.version({"torch_xla": "torch-xla"}.get(mod, mod))
sys.exit(1 if bad else 0)
PY
}

if [[ -z "${FORCE:-}" && -x "$VENV/bin/python" ]] && check; then
  echo "setup_xla_env: $VENV already has torch $TORCH, torch-xla $TORCH_XLA, transformers $TRANSFORMERS"
  exit 0
fi

start=$(date +%s)
[[ -n "${FORCE:-}" ]] && rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
# through uv, as setup_env.sh: the ~7 GB of CUDA wheels fetched and unpacked in parallel (pip took 1,643 s
# in CI, niced beside the main suite)
cd "$REPO"
# shellcheck source=scripts/uv_args.sh
source scripts/uv_args.sh
"$VENV/bin/python" -m pip install --quiet "$(PYTHON="$PYTHON" installer_pin)"
uv_args_from_pip "$VENV/bin/python"
uv=("$VENV/bin/python" -m uv pip install --quiet --python "$VENV/bin/python" "${uv_args[@]}")
"${uv[@]}" "${REQUIREMENTS[@]}"
# (the filter: setuptools' editable-install banner, see setup_env.sh)
PYTHONWARNINGS="ignore:Editable installation:UserWarning" "${uv[@]}" --no-deps -e "$REPO"
check || { echo "setup_xla_env: installed, but the pins do not check out" >&2; exit 1; }
echo "setup_xla_env: $VENV ready in $(( $(date +%s) - start ))s ($(du -sh "$VENV" | cut -f1))"
