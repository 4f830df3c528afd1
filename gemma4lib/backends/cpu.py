"""Backend `cpu`: every graph exported and compiled with AOTInductor (`compile_cpu`), cached by
the program's digest, wrapped in the host runtime. One set of host K/V buffers serves all graphs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..cache.artifacts import ArtifactCache
from ..cache.bundle import cache_for
from ..device.build import Graphs, device_graphs
from ..runtime import HostRuntime
from .base import CompiledGraph, CompiledGraphs, runner
from .compile_cpu import RECIPE, compile_graph

COMPILER = RECIPE

if TYPE_CHECKING:
    from ..device.graph import DeviceGraph
    from ..models.loading import LoadedModel
    from ..settings import PortSettings


def compile(
    model: LoadedModel, settings: PortSettings, *, graphs: Graphs | None = None, progress: bool = False
) -> CompiledGraphs:
    from tqdm.auto import tqdm

    prefill, decode = graphs or device_graphs(model, settings)
    cache = cache_for(settings, model)  # with settings.artifacts: the bundle's entries, never a compile
    todo = [*prefill.items(), ("decode", decode)]
    compiled = {
        name: compile_graph(graph, cache)
        for name, graph in tqdm(todo, desc="compile", disable=not progress, leave=False)
    }
    steps = {name: step for name, step in compiled.items() if name != "decode"}
    runtime = HostRuntime(
        model, steps, compiled["decode"], decode.new_kv(), settings.context_length, batch=decode.shape.batch
    )
    return CompiledGraphs(
        runtime,
        sum(c.compile_s for c in compiled.values()),
        [c.cache_hit for c in compiled.values()],
        RECIPE,
        {"artifacts": {str(k): str(c.entry.path) for k, c in compiled.items()}},
    )


run = runner(compile)


def compile_one(graph: DeviceGraph, cache: ArtifactCache | None) -> CompiledGraph:
    """One graph through AOTInductor and the artifact cache (the benchmark suite's graphs)."""
    compiled = compile_graph(graph, cache)
    build_s = compiled.entry.meta.get("compile_s", compiled.entry.meta.get("build_s"))
    return CompiledGraph(compiled, compiled.compile_s, build_s, compiled.cache_hit)
