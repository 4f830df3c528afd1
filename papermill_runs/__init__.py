"""Run the cookbook notebooks headless, collect their records, and judge them against baselines.

`python -m papermill_runs run --profile smoke` is the project's main job; see `run.py` for the
options and exit codes, `baselines.py` for the verdict, `tolerances.json` and `profiles.json`
for the configuration.
"""

from .baselines import Verdict, judge, judge_all, load_baseline, load_tolerances, machine_kind
from .run import VARIANT_NOTEBOOKS, main

__all__ = [
    "VARIANT_NOTEBOOKS",
    "Verdict",
    "judge",
    "judge_all",
    "load_baseline",
    "load_tolerances",
    "machine_kind",
    "main",
]
