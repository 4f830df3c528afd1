"""The contract every backend module fulfils, the registry, and the device graphs they build.

A backend module exposes `compile(model, settings, *, graphs=None, progress=False)` returning
`CompiledGraphs`. `graphs` lets a caller hand over prefill and decode graphs it built itself (the
fault lab injects faults into them); only backends that compile the in-place graph form accept
them (`cpu`, `eager`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ..errors import UnknownNameError
from ..graph import DeviceGraph, GraphShape

if TYPE_CHECKING:  # type names only: nothing below `port` imports it at run time
    from ..loading import LoadedModel
    from ..runtime import HostRuntime
    from ..settings import PortSettings

BACKEND_MODULES = {
    "cpu": "gemma4lib.backends.cpu",
    "eager": "gemma4lib.backends.eager",
    "xla": "gemma4lib.backends.xla",
    "neuron": "gemma4lib.backends.neuron",
    "gloo": "gemma4lib.backends.gloo",
}

Graphs = tuple[dict[int, DeviceGraph], DeviceGraph]


@dataclass
class CompiledGraphs:
    """What a backend hands back: the runtime to generate with, and what compiling cost."""

    runtime: HostRuntime
    compile_s: float
    cache_hits: list[bool]
    compiler: str  # what compiled the graphs, e.g. "cpu-aotinductor", "neuron-model_builder"
    info: dict[str, Any] = field(default_factory=dict)
    report: Callable[[], dict[str, Any]] | None = None  # backend figures gathered after the run

    @property
    def recipe(self) -> str:
        """The record's historical name for `compiler`."""
        return self.compiler


def backend_for(settings: PortSettings) -> str:
    """The backend module a setting selects: `gloo` for the CPU at TP > 1, else `settings.backend`."""
    if settings.backend == "cpu" and int(settings.tp_degree) > 1:
        return "gloo"
    return settings.backend


def get_backend(name: str) -> ModuleType:
    """The backend module by name (imported now: `xla` and `neuron` only where their packages are)."""
    if name not in BACKEND_MODULES:
        raise UnknownNameError("backend", name, BACKEND_MODULES)
    return importlib.import_module(BACKEND_MODULES[name])


def compile_graphs(model: LoadedModel, settings: PortSettings, *, graphs: Graphs | None = None,
                   progress: bool = False) -> CompiledGraphs:
    """Compile the device graphs of `model` with the backend `settings` select."""
    return get_backend(backend_for(settings)).compile(model, settings, graphs=graphs, progress=progress)


def device_graphs(model: LoadedModel, settings: PortSettings, inplace: bool = True) -> Graphs:
    """Prefill graphs (one per bucket; MoE experts all-dense) and the decode graph (the settings'
    expert form), over the model's own modules: the graphs every single-device backend compiles."""
    layout = model.layout
    prefill = {bucket: DeviceGraph(model.text_model, model.lm_head, layout,
                                   GraphShape(1, bucket, settings.context_length, settings.ring_kv),
                                   inplace=inplace, expert_form="dense")
               for bucket in settings.prefill_buckets}
    decode = DeviceGraph(model.text_model, model.lm_head, layout,
                         GraphShape(1, 1, settings.context_length, settings.ring_kv),
                         inplace=inplace, expert_form=settings.decode_experts)
    return prefill, decode


def refuse_graphs(graphs: Graphs | None, backend: str) -> None:
    """Backends that build their own graph form do not take prebuilt graphs."""
    if graphs is not None:
        raise ValueError(f"backend {backend!r} builds its own graphs from the model; pass graphs only to "
                         f"'cpu' or 'eager'")
