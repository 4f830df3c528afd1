"""Peak host RSS of one stretch of code, measured (for the serving-host plan and its tests).

`ru_maxrss` only ever grows, so it cannot say what one step added after an earlier, larger one.
Linux resets a process's peak ("VmHWM") when "5" is written to `/proc/self/clear_refs`; the peak
of a stretch is then VmHWM after it minus VmRSS before it. Where that file cannot be written,
a thread samples the RSS every few milliseconds instead (it can miss a short spike: the result
says which way it was measured). Measure in a process of its own: a test session's other
allocations and freed-but-kept heap blur what one call adds.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")
_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


def _status_kb(field: str) -> int | None:
    try:
        with open(_STATUS) as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_bytes() -> int:
    """This process's resident set now."""
    kb = _status_kb("VmRSS")
    if kb is not None:
        return kb * 1024
    import psutil

    return int(psutil.Process().memory_info().rss)


def _reset_peak() -> bool:
    try:
        with open(_CLEAR_REFS, "w") as handle:
            handle.write("5")
    except OSError:
        return False
    return _status_kb("VmHWM") is not None


@dataclass(frozen=True)
class PeakMeasurement:
    """What a stretch of code held at its peak, over what was resident before it."""

    before_bytes: int
    peak_bytes: int
    after_bytes: int
    method: str  # "VmHWM" (exact) or "sampled"

    @property
    def extra_bytes(self) -> int:
        return max(0, self.peak_bytes - self.before_bytes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "before_gb": self.before_bytes / 1e9,
            "peak_gb": self.peak_bytes / 1e9,
            "after_gb": self.after_bytes / 1e9,
            "extra_gb": self.extra_bytes / 1e9,
            "method": self.method,
        }


def measure_peak(fn: Callable[[], T], interval_s: float = 0.005) -> tuple[T, PeakMeasurement]:
    """Run `fn()`; return its result and the host RSS before, at the peak and after."""
    gc.collect()
    before = rss_bytes()
    if _reset_peak():
        result = fn()
        peak = (_status_kb("VmHWM") or 0) * 1024
        return result, PeakMeasurement(before, max(peak, before), rss_bytes(), "VmHWM")
    highest = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            highest[0] = max(highest[0], rss_bytes())
            time.sleep(interval_s)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        result = fn()
    finally:
        done.set()
        sampler.join()
    highest[0] = max(highest[0], rss_bytes())
    return result, PeakMeasurement(before, highest[0], rss_bytes(), "sampled")


__all__ = ["PeakMeasurement", "measure_peak", "rss_bytes"]
