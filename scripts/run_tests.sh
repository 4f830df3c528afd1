#!/usr/bin/env bash
# The README's test command: set up .venv if needed, then run the test suite.
# With no arguments it runs everything CI runs (all but the `slow` marker: training determinism by
# full retraining, Gemma 3 270M compiled). Arguments go to pytest as they are, e.g. `-m slow`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
if [ "$#" -eq 0 ]; then
  set -- -m "not slow"
fi
exec .venv/bin/python -m pytest "$@"
