"""The contract every backend module fulfils, and the registry (the graphs come from `device.build`).

A backend module exposes `compile(model, settings, *, graphs=None, progress=False)` returning
`CompiledGraphs`. `graphs` lets a caller hand over prefill and decode graphs it built itself (the
fault lab injects faults into them); only backends that compile the in-place graph form accept
them (`cpu`, `eager`). The exception is `gloo`, whose generations live inside its rank processes:
it offers `run_device` instead, and `port.run_device` calls it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ..device.build import Graphs
from ..errors import UnknownNameError

if TYPE_CHECKING:  # type names only: nothing below `port` imports it at run time
    from ..models.loading import LoadedModel
    from ..runtime import HostRuntime
    from ..settings import PortSettings

BACKEND_MODULES = {
    "cpu": "gemma4lib.backends.cpu",
    "eager": "gemma4lib.backends.eager",
    "xla": "gemma4lib.backends.xla",
    "neuron": "gemma4lib.backends.neuron",
    "gloo": "gemma4lib.backends.gloo",
}


@dataclass
class CompiledGraphs:
    """What a backend hands back: the runtime to generate with, and what compiling cost."""

    runtime: HostRuntime
    compile_s: float
    cache_hits: list[bool]
    compiler: str  # what compiled the graphs, e.g. "cpu-aotinductor", "neuron-model_builder"
    info: dict[str, Any] = field(default_factory=dict)
    report: Callable[[], dict[str, Any]] | None = None  # backend figures gathered after the run


def backend_for(settings: PortSettings) -> str:
    """The backend module a setting selects: `gloo` for the CPU backends at TP > 1 (the ranks run
    the rank graph uncompiled), else `settings.backend`."""
    if settings.backend in ("cpu", "eager") and int(settings.tp_degree) > 1:
        return "gloo"
    return settings.backend


def get_backend(name: str) -> ModuleType:
    """The backend module by name (imported now: `xla` and `neuron` only where their packages are)."""
    if name not in BACKEND_MODULES:
        raise UnknownNameError("backend", name, BACKEND_MODULES)
    return importlib.import_module(BACKEND_MODULES[name])


def compile_graphs(
    model: LoadedModel, settings: PortSettings, *, graphs: Graphs | None = None, progress: bool = False
) -> CompiledGraphs:
    """Compile the device graphs of `model` with the backend `settings` select."""
    return get_backend(backend_for(settings)).compile(model, settings, graphs=graphs, progress=progress)


def refuse_graphs(graphs: Graphs | None, backend: str) -> None:
    """Backends that build their own graph form do not take prebuilt graphs."""
    if graphs is not None:
        raise ValueError(
            f"backend {backend!r} builds its own graphs from the model; pass graphs only to 'cpu' or 'eager'"
        )
