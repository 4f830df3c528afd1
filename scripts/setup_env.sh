#!/usr/bin/env bash
# Creates (or refreshes) the project's CPU virtualenv at .venv with every dependency pinned in
# pyproject.toml. Idempotent: a second run only re-checks. Used by the README's two commands.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${GEMMA4LIB_VENV:-.venv}"
PY="${PYTHON:-python3}"
stamp="$VENV/.gemma4lib-installed"
want="$(sha256sum pyproject.toml | cut -c1-16)"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing gemma4lib[cpu,notebooks,real,serve,test] into $VENV (torch 2.13.0 CPU build)"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  # The filter drops one banner setuptools prints on every editable install ("Editable installation.
  # Please be careful with folders ... with the same name as your package"): nothing here to act on.
  PYTHONWARNINGS="ignore:Editable installation:UserWarning" \
    "$VENV/bin/python" -m pip install --quiet -e ".[cpu,notebooks,real,serve,test]"
  "$VENV/bin/python" -m ipykernel install --prefix "$VENV" --name gemma4lib --display-name "Python 3 (gemma4lib)" >/dev/null
  echo "$want" > "$stamp"
fi
