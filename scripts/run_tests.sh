#!/usr/bin/env bash
# The README's test command: set up .venv if needed, then run the test suite.
# It leaves out the `slow` marker (training determinism by full retraining, Gemma 3 270M compiled)
# unless the arguments select markers themselves: `bash scripts/run_tests.sh -q` runs what CI runs,
# `bash scripts/run_tests.sh -m slow` the slow ones. Other arguments go to pytest as they are.
# Compiled graphs are cached across runs in .cache/gemma4lib-tests (gitignored); set GEMMA4LIB_CACHE
# to use another folder (tests/conftest.py gives a session without it a fresh temporary cache).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export GEMMA4LIB_CACHE="${GEMMA4LIB_CACHE:-$PWD/.cache/gemma4lib-tests}"
markers_given=0
for arg in "$@"; do
  case "$arg" in
    -m | -m?*) markers_given=1 ;;
  esac
done
if [ "$markers_given" -eq 0 ]; then
  set -- -m "not slow" "$@"
fi
exec "${GEMMA4LIB_VENV:-.venv}/bin/python" -m pytest "$@"
