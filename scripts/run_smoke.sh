#!/usr/bin/env bash
# The README's main job: set up .venv if needed, then run all eight notebooks headless in the smoke
# profile, judge them against papermill_runs/baselines/smoke/<machine-kind>.json and write the
# executed notebooks, results.json, summary.md/.csv and plots into runs/smoke (gitignored).
# Extra arguments go to papermill_runs, e.g. --variant e2b, --update-baseline.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "${GEMMA4LIB_VENV:-.venv}/bin/python" -m papermill_runs run --profile smoke --out runs/smoke "$@"
