"""The pure judge: results + baseline + tolerances in, verdicts and the exit code out.

No file is read or written here and nothing is printed, so the rule that decides whether a run
passed can be read and tested on its own; `run.finish` loads the inputs, calls `judge_results`,
then writes the baseline, the history and the summaries.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import baselines


@dataclass
class Judgement:
    verdicts: dict[str, baselines.Verdict]
    exit_code: int


def judge_results(
    results: Mapping[str, Any],
    baseline: Mapping[str, Any] | None,
    tolerances: Mapping[str, Any],
    *,
    notebooks: Mapping[str, str],
    errors: Mapping[str, str],
    runs: Mapping[str, Any],
    baseline_error: str | None = None,
    allow_missing_baseline: bool = False,
    updating_baseline: bool = False,
) -> Judgement:
    """Verdict per notebook, and the run's exit code: 0 pass, 1 a failure or regression (or the
    overview or 07_serve notebook failing), 2 a baseline that exists but cannot be read (unless it is being
    replaced)."""
    verdicts = baselines.judge_all(dict(results), baseline, tolerances, dict(notebooks), dict(errors))
    if baseline_error:
        for verdict in verdicts.values():
            if verdict.status == "no-baseline":
                verdict.reasons = [f"baseline unusable: {baseline_error}"]
    exit_code = baselines.exit_code(verdicts, allow_missing_baseline, updating_baseline)
    if any((runs.get(name) or {}).get("status", "ok") != "ok" for name in ("overview", "serve")):
        exit_code = 1  # the notebooks without a verdict (no baseline): their own run decides
    if baseline_error and not updating_baseline:
        exit_code = 2
    return Judgement(verdicts, exit_code)


__all__ = ["Judgement", "judge_results"]
