"""Backend `cpu`: every graph exported and compiled with AOTInductor (`compile_cpu`), cached by
the program's digest. One set of host K/V buffers serves all graphs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..cache.artifacts import ArtifactCache
from ..cache.bundle import cache_for
from .base import CompiledGraph, CompiledGraphs
from .compile_cpu import RECIPE, compile_graph
from .engine import named_steps

COMPILER = RECIPE

if TYPE_CHECKING:
    from ..device.build import GraphSet
    from ..device.graph import DeviceGraph
    from ..models.loading import LoadedModel
    from ..settings import PortSettings


def compile(graphs: GraphSet, model: LoadedModel, settings: PortSettings, progress: bool = False) -> CompiledGraphs:
    from tqdm.auto import tqdm

    cache = cache_for(settings, model)  # with settings.artifacts: the bundle's entries, never a compile
    todo = list(graphs.named().items())
    compiled = {
        name: compile_graph(graph, cache)
        for name, graph in tqdm(todo, desc="compile", disable=not progress, leave=False)
    }
    kv = graphs.new_kv()
    return CompiledGraphs(
        named_steps(compiled, kv),
        sum(c.compile_s for c in compiled.values()),
        [c.cache_hit for c in compiled.values()],
        RECIPE,
        {"artifacts": {name: str(c.entry.path) for name, c in compiled.items()}},
        kv=kv,
    )


def compile_one(graph: DeviceGraph, cache: ArtifactCache | None) -> CompiledGraph:
    """One graph through AOTInductor and the artifact cache (the benchmark suite's graphs)."""
    compiled = compile_graph(graph, cache)
    build_s = compiled.entry.meta.get("compile_s", compiled.entry.meta.get("build_s"))
    return CompiledGraph(compiled, compiled.compile_s, build_s, compiled.cache_hit)
