"""Backend `eager`: the device graphs run as they are, uncompiled. The same code path as `cpu`
without the compiler, so a difference between the two is the compiler's."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import CompiledGraph, CompiledGraphs
from .engine import named_steps

if TYPE_CHECKING:
    from ..cache.artifacts import ArtifactCache
    from ..device.build import GraphSet
    from ..device.graph import DeviceGraph
    from ..models.loading import LoadedModel
    from ..settings import PortSettings

COMPILER = "eager"


def compile(graphs: GraphSet, model: LoadedModel, settings: PortSettings, progress: bool = False) -> CompiledGraphs:
    kv = graphs.new_kv()
    return CompiledGraphs(named_steps(graphs.named(), kv), 0.0, [], COMPILER, kv=kv)


def compile_one(graph: DeviceGraph, cache: ArtifactCache | None) -> CompiledGraph:
    """The graph as built (the benchmark suite's schema in seconds)."""
    return CompiledGraph(graph)
