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
workers_given=0
for arg in "$@"; do
  case "$arg" in
    -m | -m?*) markers_given=1 ;;
    -n | -n?* | --numprocesses*) workers_given=1 ;;
  esac
done
if [ "$markers_given" -eq 0 ]; then
  set -- -m "not slow" "$@"
fi
# Two workers (pytest-xdist), a test file per worker: most tests wait on one single-threaded compile,
# so two cores finish the suite in a little over half the time. Workers share GEMMA4LIB_CACHE, whose
# build lock compiles each graph once. GEMMA4LIB_TEST_WORKERS=0 runs in this process (no xdist).
if [ "$workers_given" -eq 0 ] && [ "${GEMMA4LIB_TEST_WORKERS:-2}" != "0" ]; then
  set -- -n "${GEMMA4LIB_TEST_WORKERS:-2}" --dist loadfile "$@"
fi
exec "${GEMMA4LIB_VENV:-.venv}/bin/python" -m pytest "$@"
