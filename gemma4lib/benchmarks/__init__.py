"""Benchmarks: timing one runtime, and the side-by-side suite against Hugging Face `generate`.

- `timing` (below `port`): `benchmark` (prefill ms, decode tok/s medians of one runtime),
  `time_decode_steps`, `peak_rss_mb`;
- `hf` (below `port`): Hugging Face `generate` timed per step, and its static cache + torch.compile route;
- `suite` (above `port`): `run_suite`, `SuiteOptions`, the per-model / ring KV / experts / prefill-bucket
  benches, `check_targets`;
- `report` (a leaf): `format_report`, the suite's report as markdown.

The package spans `port`: `port` times its runs with `timing`, while the suite compares against
`port`'s logits check. So the suite's names are resolved on first use (PEP 562), not when the
package is imported: importing `benchmarks.timing` from `port` must not load the suite, which
would import `port` back before it is defined.
"""

from __future__ import annotations

from typing import Any

from ..timing import BenchFigures, benchmark, peak_rss_mb, time_decode_steps
from .report import format_report

_SUITE_NAMES = ("PATHS", "SuiteOptions", "check_targets", "run_suite")

__all__ = ["BenchFigures", "benchmark", "format_report", "peak_rss_mb", "time_decode_steps", *_SUITE_NAMES]


def __getattr__(name: str) -> Any:
    """`from gemma4lib.benchmarks import run_suite` (and the suite's other names) loads the suite here."""
    if name in _SUITE_NAMES:
        from . import suite

        return getattr(suite, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_SUITE_NAMES])
