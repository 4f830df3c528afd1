"""The contract every backend fulfils (a `Backend` row: its facts and one `compile(graphs, model,
settings, progress) -> CompiledGraphs`), and what a device run returns (docs/ENGINE.md, "The three
pieces")."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from ..device.experts import CPU_THREAD_FLOP_PER_BYTE
from ..errors import SettingsError
from .facts import BackendFacts

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
class Backend(BackendFacts):
    """One backend: its facts (`facts.BackendFacts`, the flags the rest of the library asks of it,
    never a comparison of its name) and what compiles its graphs."""

    compile: CompileFn | None = None
    compile_one: Callable[..., CompiledGraph] | None = None  # one graph on its own (the benchmark suite)
    label: str = ""  # the record's `compiler`

    @classmethod
    def wire(cls, row: BackendFacts, **callables: Any) -> Backend:
        """`row`'s facts with its compile functions (and label) wired in: a `registry.BACKENDS` row."""
        return cls(**{f.name: getattr(row, f.name) for f in fields(BackendFacts)}, **callables)

    @property
    def compute_balance(self) -> float | None:
        """FLOPs per byte its graphs are built for (one CPU thread's, or None: bytes decide)."""
        return CPU_THREAD_FLOP_PER_BYTE if self.cpu_balance else None


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
