"""The project's path in the benchmarks: device graphs from the backend layer, compiled one by one
(`compile_one` of a backend that takes graphs) and cached by shape, so every bench reuses a graph."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gemma4lib.backends.engine import engine_over
from gemma4lib.backends.registry import BACKENDS, get_backend
from gemma4lib.cache.artifacts import ArtifactCache
from gemma4lib.device.build import PREFILL_EXPERTS, device_graph
from gemma4lib.device.graph import DeviceGraph, GraphShape
from gemma4lib.errors import SettingsError, UnknownNameError
from gemma4lib.models.loading import LoadedModel
from gemma4lib.runtime import Engine


@dataclass
class BenchGraph:
    """One compiled (or eager) graph with where it came from (what the report's `graphs` lists)."""

    fn: Callable[..., torch.Tensor]
    shape: GraphShape
    expert_form: str
    compile_s: float = 0.0  # seconds this run spent compiling (0 on a cache hit)
    build_s: float | None = None  # seconds the artifact took to compile when it was built
    cache_hit: bool | None = None
    graph: DeviceGraph | None = None

    def describe(self) -> dict[str, Any]:
        return {
            "tokens": self.shape.tokens,
            "context_length": self.shape.context_length,
            "ring": self.shape.ring,
            "expert_form": self.expert_form,
            "compile_s": self.compile_s,
            "artifact_build_s": self.build_s,
            "cache_hit": self.cache_hit,
        }


class GraphFactory:
    """A cache of one model's device graphs keyed by shape.

    Graphs are built with `device.build.device_graph` and compiled by backend `cpu`'s compiler or
    run eager, as a port would; this class adds only the cache, so the runtime of each model, the
    ring sweep and the experts comparison reuse a graph (and report its compile once) instead of
    compiling one per use.
    """

    def __init__(
        self, model: LoadedModel, backend: str = "cpu", cache: ArtifactCache | None = None, weights: str = "bf16"
    ):
        compiles_one = [name for name, b in BACKENDS.items() if b.compile_one is not None]
        if backend not in compiles_one:
            raise UnknownNameError("bench backend", backend, compiles_one)
        self.model, self.backend, self.cache, self.weights = model, backend, cache, weights
        self.steps: dict[tuple, BenchGraph] = {}

    @property
    def compiler(self) -> str:
        """The compiler's name as a port's record gives it (`cpu-aotinductor`, `eager`)."""
        return get_backend(self.backend).label

    def get(self, tokens: int, context_length: int, ring: bool, expert_form: str = "dense") -> BenchGraph:
        """The graph of this shape, built and compiled on first use."""
        model = self.model
        if not getattr(model.config, "enable_moe_block", False):
            expert_form = "dense"  # no experts: one graph whatever the form
        if model.layout.sliding_window >= context_length:
            ring = True  # the ring holds the whole context: the same buffers and program as full length
        key = (tokens, context_length, ring, expert_form)
        if key not in self.steps:
            graph = device_graph(model, GraphShape(1, tokens, context_length, ring), expert_form, weights=self.weights)
            one = get_backend(self.backend).compile_one(graph, self.cache)
            self.steps[key] = BenchGraph(
                one.fn, graph.shape, graph.expert_form, one.compile_s, one.build_s, one.cache_hit, graph
            )
        return self.steps[key]

    def runtime(
        self,
        context_length: int,
        buckets: Iterable[int],
        ring: bool,
        decode_form: str,
        prefill_form: str = PREFILL_EXPERTS,
    ) -> Engine:
        """The engine over cached graphs (one set of fresh K/V): one decode graph and a prefill graph per bucket."""
        decode = self.get(1, context_length, ring, decode_form)
        fns = {f"prefill{b}": self.get(b, context_length, ring, prefill_form).fn for b in buckets}
        return engine_over(self.model, {**fns, "decode": decode.fn}, decode.graph, kv=decode.graph.new_kv())

    def compile_report(self) -> list[dict[str, Any]]:
        """Every graph built so far, in build order."""
        return [step.describe() for step in self.steps.values()]


@torch.no_grad()
def time_decode_steps(model: LoadedModel, step: BenchGraph, positions: Sequence[int], token: int = 5) -> float:
    """Decode tok/s of `step` over consecutive `positions`, through the engine's own decode step
    (host embedding + step + greedy argmax), on fresh buffers: timing does not depend on their
    contents, so any position of a long context can be timed without filling it first."""
    positions = list(positions)
    if positions != list(range(positions[0], positions[0] + len(positions))):
        raise SettingsError(
            "time_decode_steps times consecutive positions, as decoding visits them: pass e.g. range(start, stop)"
        )
    engine = engine_over(model, {"decode": step.fn}, step.graph, kv=step.graph.new_kv())
    seconds = engine.time_steps(token, positions[0], len(positions))
    return len(positions) / seconds
