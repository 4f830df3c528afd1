#!/usr/bin/env bash
# Installs what tests/test_browser.py needs, on top of .venv (scripts/setup_env.sh):
#  - Debian's `chromium` and `chromium-driver` (apt-get, only when a binary is missing; needs root or sudo);
#  - the Python side, the `notebooks` extra's jupyterlab and the `browser` extra's selenium, read from
#    pyproject.toml, installed into the venv only when they do not import yet.
# Idempotent: a second run only checks. `--no-venv` skips scripts/setup_env.sh (for a venv that is already
# set up, e.g. one shared by several worktrees, so its editable install is left pointing where it points).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${GEMMA4LIB_VENV:-.venv}"
if [ "${1:-}" != "--no-venv" ]; then
  bash scripts/setup_env.sh
fi

if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { echo "[browser] chromium missing and not root: install chromium and chromium-driver" >&2; exit 1; }
    sudo="sudo"
  fi
  echo "[browser] installing Debian's chromium and chromium-driver (apt-get)"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "[browser] no $VENV: run scripts/setup_env.sh first (or this script without --no-venv)" >&2
  exit 1
fi
# The requirement strings come from pyproject.toml (the one place for pins), not from this script.
mapfile -t wanted < <("$VENV/bin/python" - <<'PY'
import tomllib
extras = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]
for req in extras["browser"] + [r for r in extras["notebooks"] if r.startswith("jupyterlab")]:
    print(req)
PY
)
if ! "$VENV/bin/python" -c "import jupyterlab, selenium" 2>/dev/null; then
  echo "[browser] installing ${wanted[*]} into $VENV"
  "$VENV/bin/python" -m pip install --quiet "${wanted[@]}"
fi
echo "[browser] $(chromium --version 2>/dev/null | head -1); $(chromedriver --version | head -1)"
