"""Backend `cpu`: every graph exported and compiled with AOTInductor (`compile_cpu`), cached by
the program's digest. One set of host K/V buffers serves all graphs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..cache.artifacts import ArtifactCache
from ..cache.bundle import cache_for
from ..runtime import Steps, bind_kv, bind_kv_rows
from .base import CompiledGraph, CompiledGraphs
from .compile_cpu import RECIPE, compile_graph

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
        steps_over(graphs, compiled, kv),
        sum(c.compile_s for c in compiled.values()),
        [c.cache_hit for c in compiled.values()],
        RECIPE,
        {"artifacts": {name: str(c.entry.path) for name, c in compiled.items()}},
        kv=kv,
    )


def steps_over(graphs: GraphSet, fns: dict, kv: list) -> Steps:
    """`Steps` from callables named as `graphs.named()`, each taking the K/V `kv` as trailing inputs
    (but the vision graph, which reads none, and the one-row prefills, which take one row of them)."""
    bound = {name: bind_kv(fn, kv) for name, fn in fns.items() if name != "vision"}
    return Steps(
        prefill={b: bound[f"prefill{b}"] for b in graphs.prefill},
        row_prefill={b: bind_kv_rows(fns[f"row_prefill{b}"], kv) for b in graphs.row_prefill},
        decode=bound.get("decode"),
        verify=bound.get("verify"),
        draft=bound.get("draft"),
        vision=fns.get("vision"),  # reads no K/V
    )


def compile_one(graph: DeviceGraph, cache: ArtifactCache | None) -> CompiledGraph:
    """One graph through AOTInductor and the artifact cache (the benchmark suite's graphs)."""
    compiled = compile_graph(graph, cache)
    build_s = compiled.entry.meta.get("compile_s", compiled.entry.meta.get("build_s"))
    return CompiledGraph(compiled, compiled.compile_s, build_s, compiled.cache_hit)
