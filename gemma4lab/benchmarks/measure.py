"""Measuring within one run: medians, ratios of paths timed side by side, the per-run deadline, and
the recommendation (`PortSettings`' defaults) the benches compare their measured choice with."""

from __future__ import annotations

import dataclasses
import signal
import statistics
import threading
from collections.abc import Sequence
from typing import Any

from gemma4lib.device.build import PREFILL_EXPERTS
from gemma4lib.settings import PortSettings


def recommendation() -> dict[str, Any]:
    """What the measurements recommend (docs/ROOFLINE.md), which is what a port runs by default: read
    from `PortSettings`' field defaults and the backends' prefill form, so the report cannot state a
    recommendation the library does not follow."""
    defaults = {f.name: f.default for f in dataclasses.fields(PortSettings)}
    return {
        "ring_kv": defaults["ring_kv"],
        "decode_experts": defaults["decode_experts"],
        "prefill_experts": PREFILL_EXPERTS,
    }


def _median(values: Sequence[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


class _Deadline:
    """Raise TimeoutError in the main thread after `seconds` (SIGALRM; no-op where unavailable)."""

    def __init__(self, seconds: float | None):
        self.seconds = seconds

    def __enter__(self):
        self.active = bool(self.seconds) and hasattr(signal, "SIGALRM") and _in_main_thread()
        if self.active:

            def fire(signum, frame):
                raise TimeoutError(f"gave up after {self.seconds:.0f} s")

            self.previous = signal.signal(signal.SIGALRM, fire)
            signal.setitimer(signal.ITIMER_REAL, self.seconds)
        return self

    def __exit__(self, *exc):
        if self.active:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.previous)
        return False


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()
