"""Backend `eager`: the device graphs run as they are, uncompiled. The same code path as `cpu`
without the compiler, so a difference between the two is the compiler's."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..device.build import Graphs, device_graphs
from ..runtime import HostRuntime
from .base import CompiledGraph, CompiledGraphs, runner

if TYPE_CHECKING:
    from ..cache.artifacts import ArtifactCache
    from ..device.graph import DeviceGraph
    from ..models.loading import LoadedModel
    from ..settings import PortSettings

COMPILER = "eager"


def compile(
    model: LoadedModel, settings: PortSettings, *, graphs: Graphs | None = None, progress: bool = False
) -> CompiledGraphs:
    prefill, decode = graphs or device_graphs(model, settings)
    runtime = HostRuntime(
        model, dict(prefill), decode, decode.new_kv(), settings.context_length, batch=decode.shape.batch
    )
    return CompiledGraphs(runtime, 0.0, [], COMPILER)


run = runner(compile)


def compile_one(graph: DeviceGraph, cache: ArtifactCache | None) -> CompiledGraph:
    """The graph as built (the benchmark suite's schema in seconds)."""
    return CompiledGraph(graph)
