"""The contract every backend fulfils, and what a device run returns.

A backend is a `Backend` row (`backends.registry.BACKENDS`): its facts (the graph form its compiler
takes, the compute balance its graphs are built for, the warm-up its first calls need, what it runs)
and one function, `compile(graphs, model, settings, progress) -> CompiledGraphs`, which turns the
named graphs of `device.build.device_graphs` (prefill per bucket; decode, or verify and draft) into
`runtime.Steps` over one set of K/V. `registry.compile_graphs` builds the graphs, calls it and puts
the one generation engine (`runtime.Engine`) on top, with the drafter the settings name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import SettingsError

if TYPE_CHECKING:  # type names only: nothing below `port` imports it at run time
    import torch

    from ..device.build import GraphSet
    from ..models.loading import LoadedModel
    from ..runtime import Engine, RowResult, Steps
    from ..settings import PortSettings
    from ..timing import BenchFigures

CompileFn = Callable[["GraphSet", "LoadedModel", "PortSettings", bool], "CompiledGraphs"]


@dataclass
class CompiledGraphs:
    """What a backend's `compile` hands back: the steps, and what compiling cost and produced;
    `registry.compile_graphs` adds the engine (`runtime`) over the steps."""

    steps: Steps
    compile_s: float
    cache_hits: list[bool]
    compiler: str  # what compiled the graphs, e.g. "cpu-aotinductor", "neuron-model_builder"
    info: dict[str, Any] = field(default_factory=dict)
    report: Callable[[], dict[str, Any]] | None = None  # backend figures gathered after the run
    runtime: Engine | None = None
    graphs: GraphSet | None = None
    assistant: Any = None  # the loaded assistant when drafting with it (the port checks assisted generate)
    kv: list[torch.Tensor] | None = None  # host K/V buffers the steps update (cpu, eager); None: device state


@dataclass
class CompiledGraph:
    """One graph compiled on its own (`compile_one`): the callable and what compiling it cost."""

    fn: Callable[..., Any]
    compile_s: float = 0.0  # seconds this run spent compiling (0 on a cache hit)
    build_s: float | None = None  # seconds the artifact took to compile when it was built
    cache_hit: bool | None = None


@dataclass(frozen=True)
class Backend:
    """One backend: what compiles its graphs, where it runs, and the facts the rest of the library
    asks of it (never a comparison of its name)."""

    name: str
    compiler: str  # what compiles its graphs (the docs' table)
    runs_on: str
    compile: CompileFn | None = None
    compile_one: Callable[..., CompiledGraph] | None = None  # one graph on its own (the benchmark suite)
    label: str = ""  # the record's `compiler`
    inplace: bool = True  # the graph form it compiles: K/V updated in place, or returned (functional)
    compute_balance: float | None = None  # FLOPs per byte its graphs are built for (None: bytes decide)
    min_warmup: int = 0  # untimed runs its first calls need (xla compiles on the first call)
    selectable: bool = True  # a `PortSettings.backend` value (`gloo` is what cpu/eager select at TP > 1)
    takes_graphs: bool = False  # compiles prebuilt graphs a caller built (`graphs=`: the fault lab)
    quantizes_itself: bool = False  # reads only the graphs' shapes, int8 in its own layers: graphs stay full precision
    samples_drafts: bool = True  # runs sampled (rejection-sampling) drafted rows
    tp: bool = False  # runs TP > 1 itself (neuron: NeuronCores; gloo: CPU ranks)
    bundles: bool = False  # its artifacts can be exported and run from a bundle
    # runs one-row prefill graphs over a row of its K/V (`runtime.bind_kv_rows`: views of host buffers).
    # Not xla/neuron: their K/V are device states a graph takes and returns whole.
    row_prefill: bool = False


@dataclass
class DeviceRun:
    """One device run, as every backend returns it: a row per request (tokens, the logits that chose
    each, drafting figures), plus the record's device part."""

    rows: list[RowResult]
    compiler: str
    compile_s: float
    prefill_logits_max_abs_diff: float | None = None
    cache_hits: list[bool] | None = None
    bench: BenchFigures | dict[str, Any] | None = None
    prefill_ms: float | None = None
    decode_tok_s: float | None = None
    details: dict[str, Any] = field(default_factory=dict)  # the backend's own JSON-able figures
    assistant: Any = field(default=None, repr=False)  # the loaded assistant (drafting with it), not recorded

    @property
    def tokens(self) -> list[int]:
        return self.rows[0].tokens

    @property
    def step_logits(self) -> torch.Tensor | None:
        return self.rows[0].step_logits

    @property
    def artifacts(self) -> dict[str, str] | None:
        """The compiled artifacts' paths (backends with an artifact cache), to compare two runs' programs."""
        return self.details.get("artifacts")

    def record_fields(self) -> dict[str, Any]:
        """What the run record copies as it is (the record places tokens and the figures itself)."""
        out: dict[str, Any] = {"prefill_logits_max_abs_diff": self.prefill_logits_max_abs_diff}
        if self.cache_hits is not None:
            out["cache_hits"] = self.cache_hits
        if self.bench is not None:
            out["bench"] = self.bench if isinstance(self.bench, dict) else self.bench.to_dict()
        return {**out, **self.details}


def refuse_graphs(graphs: Any, backend: Backend) -> None:
    """Backends that build their own graph form do not take prebuilt graphs (but that form's spec:
    gloo's `RankGraphs`)."""
    if graphs is not None and not backend.takes_graphs and getattr(graphs, "backend", None) != backend.name:
        raise SettingsError(
            f"backend {backend.name!r} builds its own graphs from the model; pass graphs only to a backend that "
            f"compiles prebuilt in-place graphs ('cpu' or 'eager', at tp_degree 1)"
        )


__all__ = ["Backend", "CompiledGraph", "CompiledGraphs", "DeviceRun", "refuse_graphs"]
