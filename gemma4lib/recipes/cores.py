"""Which loaded models hold which NeuronCores, so a second load fails with a clear message instead
of doubling device memory.

Re-running a notebook's compile cell builds the new model while the cell's variable still holds the
old one: two copies on the same cores (31B at TP=8: 2 x 7.2 GiB + working memory > 16 GiB per core),
and the second load fails deep in the runtime. Each load claims its cores with a weak reference to
its model; a claim on cores a live model holds raises `NeuronCoresBusyError`, naming what to release.
A model deleted (and collected) frees its claim by itself.
"""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass
from typing import Any

from ..errors import NeuronCoresBusyError


@dataclass
class _Claim:
    ref: weakref.ref
    cores: range
    label: str


_CLAIMS: list[_Claim] = []


def _live() -> list[_Claim]:
    _CLAIMS[:] = [c for c in _CLAIMS if c.ref() is not None]
    return _CLAIMS


def check_free(first_core: int, count: int, label: str) -> None:
    """Raise `NeuronCoresBusyError` when a live model holds any of cores first_core .. +count."""
    wanted = range(first_core, first_core + count)
    busy = [c for c in _live() if set(c.cores) & set(wanted)]
    if busy:
        gc.collect()  # a model only the garbage collector still holds (a reference cycle) is free
        busy = [c for c in _live() if set(c.cores) & set(wanted)]
    if busy:
        held = "; ".join(f"{c.label} on cores {c.cores.start}-{c.cores.stop - 1}" for c in busy)
        raise NeuronCoresBusyError(
            f"cannot load {label} onto NeuronCores {wanted.start}-{wanted.stop - 1}: {held} is still loaded and "
            "referenced (e.g. the `compiled` of an earlier run of this cell). Release it first — `del compiled` (and "
            "any runtime or generation object that holds it), then `import gc; gc.collect()`, and run the cell again"
        )


def claim(model: Any, first_core: int, count: int, label: str) -> Any:
    """Record that `model` now holds `count` cores from `first_core`; returns `model`."""
    _live().append(_Claim(weakref.ref(model), range(first_core, first_core + count), label))
    return model
