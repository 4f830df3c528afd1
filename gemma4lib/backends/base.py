"""The contract every backend module fulfils, and the one registry of backends.

A backend module exposes
- `run(model, settings, ids, eos, *, graphs=None, progress=False, bench=True) -> DeviceRun`: one
  whole device run (compile or load, generate, the prefill logits check, the benchmark). `port`
  calls only this, whatever the backend;
- `compile(model, settings, *, graphs=None, progress=False) -> CompiledGraphs` where the backend
  hands a host runtime back (every one but `gloo`, whose generations live inside its rank
  processes); `run_compiled` turns it into the `DeviceRun`;
- `compile_one(graph, cache)` where one graph compiles on its own (`cpu`, `eager`: the benchmark
  suite compiles its graphs one by one with it).

`graphs` hands over prefill and decode graphs a caller built itself (the fault lab's faulty
graphs); only the backends that compile the in-place graph form take them (`cpu`, `eager`).
The graphs themselves come from `device.build`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ..device.build import Graphs
from ..errors import SettingsError, UnknownNameError
from ..reference import reference_last_logits
from ..runtime import softcap
from ..timing import BenchFigures, benchmark

if TYPE_CHECKING:  # type names only: nothing below `port` imports it at run time
    import torch

    from ..models.loading import LoadedModel
    from ..runtime import HostRuntime
    from ..settings import PortSettings


@dataclass(frozen=True)
class Backend:
    """One backend: its module, what it compiles with, where it runs, who may select it."""

    name: str
    module: str
    compiler: str  # what compiles its graphs
    runs_on: str
    selectable: bool = True  # a `PortSettings.backend` value (`gloo` is what cpu/eager select at TP > 1)
    takes_graphs: bool = False  # compiles prebuilt in-place graphs (`graphs=`, `compile_one`)


BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend("cpu", "gemma4lib.backends.cpu", "torch.export + AOTInductor, artifact cache", "any CPU", True, True),
        Backend("eager", "gemma4lib.backends.eager", "none: the same graphs, uncompiled", "any CPU", True, True),
        Backend("xla", "gemma4lib.backends.xla", "torch_xla (the front end torch-neuronx uses)", "CPU, .venv-xla"),
        Backend("neuron", "gemma4lib.backends.neuron", "the inf2 recipes in recipes/", "inf2"),
        Backend("gloo", "gemma4lib.backends.gloo", "none: one CPU process per TP rank", "any CPU (TP > 1)", False),
    )
}
SELECTABLE = tuple(name for name, b in BACKENDS.items() if b.selectable)
GRAPH_BACKENDS = tuple(name for name, b in BACKENDS.items() if b.takes_graphs)


@dataclass
class CompiledGraphs:
    """What a compiling backend hands back: the runtime to generate with, and what compiling cost."""

    runtime: HostRuntime
    compile_s: float
    cache_hits: list[bool]
    compiler: str  # what compiled the graphs, e.g. "cpu-aotinductor", "neuron-model_builder"
    info: dict[str, Any] = field(default_factory=dict)
    report: Callable[[], dict[str, Any]] | None = None  # backend figures gathered after the run


@dataclass
class CompiledGraph:
    """One graph compiled on its own (`compile_one`): the callable and what compiling it cost."""

    fn: Callable[..., Any]
    compile_s: float = 0.0  # seconds this run spent compiling (0 on a cache hit)
    build_s: float | None = None  # seconds the artifact took to compile when it was built
    cache_hit: bool | None = None


@dataclass
class DeviceRun:
    """One device run, as every backend returns it: the record's device part, plus the per-step
    logits LOGITS_MATCH needs (a tensor, kept out of the record)."""

    tokens: list[int]
    compiler: str
    compile_s: float
    prefill_logits_max_abs_diff: float | None = None
    cache_hits: list[bool] | None = None
    bench: BenchFigures | None = None
    prefill_ms: float | None = None
    decode_tok_s: float | None = None
    details: dict[str, Any] = field(default_factory=dict)  # the backend's own JSON-able figures
    step_logits: torch.Tensor | None = field(default=None, repr=False)

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any]) -> DeviceRun:
        """A device run from a runner that gathers its figures as named fields (the batch and the
        drafted runs): the known fields by name, the rest kept as the backend's details."""
        rest = dict(fields)
        known = {name: rest.pop(name) for name in _RUN_FIELDS if name in rest}
        if not isinstance(known.get("bench"), (BenchFigures, type(None))):
            rest["bench"] = known.pop("bench")  # a runner's own figures (a dict): recorded as they are
        return cls(**known, details=rest)

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
            out["bench"] = self.bench.to_dict()
        return {**out, **self.details}


_RUN_FIELDS = (
    "tokens",
    "compiler",
    "compile_s",
    "prefill_logits_max_abs_diff",
    "cache_hits",
    "bench",
    "prefill_ms",
    "decode_tok_s",
    "step_logits",
)


def backend_for(settings: PortSettings) -> str:
    """The backend module a setting selects: `gloo` for the CPU backends at TP > 1 (the ranks run
    the rank graph uncompiled), else `settings.backend`."""
    if settings.backend in GRAPH_BACKENDS and int(settings.tp_degree) > 1:
        return "gloo"
    return settings.backend


def get_backend(name: str) -> ModuleType:
    """The backend module by name (imported now: `xla` and `neuron` only where their packages are)."""
    if name not in BACKENDS:
        raise UnknownNameError("backend", name, BACKENDS)
    return importlib.import_module(BACKENDS[name].module)


def compile_graphs(
    model: LoadedModel, settings: PortSettings, *, graphs: Graphs | None = None, progress: bool = False
) -> CompiledGraphs:
    """Compile the device graphs of `model` with the backend `settings` select."""
    return get_backend(backend_for(settings)).compile(model, settings, graphs=graphs, progress=progress)


def run_device(
    model: LoadedModel,
    settings: PortSettings,
    ids: list[int],
    eos: list[int],
    *,
    graphs: Graphs | None = None,
    progress: bool = False,
    bench: bool = True,
) -> DeviceRun:
    """One device run with the backend `settings` select."""
    return get_backend(backend_for(settings)).run(
        model, settings, ids, eos, graphs=graphs, progress=progress, bench=bench
    )


def prefill_logits_error(model: LoadedModel, runtime: HostRuntime, ids: list[int]) -> float:
    """Max |device softcapped logits - HF logits| for the last prompt token."""
    generation = runtime.generate(ids, 1)
    device = softcap(generation.first_logits, model.config.final_logit_softcapping)
    return float((device - reference_last_logits(model.lm, ids)).abs().max())


def device_run_of(
    compiled: CompiledGraphs,
    model: LoadedModel,
    ids: list[int],
    tokens: list[int],
    *,
    step_logits: torch.Tensor | None = None,
    figures: BenchFigures | None = None,
) -> DeviceRun:
    """The `DeviceRun` of generated `tokens` over `compiled` (also what a notebook records after
    generating cell by cell); the backend's after-run report is read now."""
    run = _unfinished_run(compiled, model, ids, tokens, step_logits)
    return _finish(run, compiled, figures)


def _unfinished_run(
    compiled: CompiledGraphs, model: LoadedModel, ids: list[int], tokens: list[int], step_logits: torch.Tensor | None
) -> DeviceRun:
    return DeviceRun(
        tokens=list(tokens),
        compiler=compiled.compiler,
        compile_s=compiled.compile_s,
        prefill_logits_max_abs_diff=prefill_logits_error(model, compiled.runtime, ids),
        cache_hits=compiled.cache_hits,
        details=dict(compiled.info),
        step_logits=step_logits,
    )


def _finish(run: DeviceRun, compiled: CompiledGraphs, figures: BenchFigures | None) -> DeviceRun:
    if figures is not None:
        run.bench, run.prefill_ms, run.decode_tok_s = figures, figures.prefill_ms, figures.decode_tok_s
    if compiled.report:  # after the benchmark: the backend counts what the whole run did
        run.details.update(compiled.report())
    return run


def run_compiled(
    compiled: CompiledGraphs,
    model: LoadedModel,
    settings: PortSettings,
    ids: list[int],
    eos: list[int],
    *,
    progress: bool = False,
    bench: bool = True,
) -> DeviceRun:
    """Generate over a compiled runtime (keeping every step's logits), check the prefill logits,
    benchmark when asked: the device run of every backend that hands a runtime back."""
    runtime = compiled.runtime
    runtime.check_fits(ids, settings.max_new_tokens)
    generation = runtime.generate(ids, settings.max_new_tokens, eos_token_ids=eos, keep_logits=True)
    run = _unfinished_run(compiled, model, ids, generation.tokens, generation.step_logits)
    figures = None
    if bench:
        figures = benchmark(runtime, ids, settings.max_new_tokens, settings.warmup, settings.iters, progress)
    return _finish(run, compiled, figures)


def runner(compile_fn: Callable[..., CompiledGraphs]) -> Callable[..., DeviceRun]:
    """A backend's `run` from its `compile`: compile, then `run_compiled`."""

    def run(
        model: LoadedModel,
        settings: PortSettings,
        ids: list[int],
        eos: list[int],
        *,
        graphs: Graphs | None = None,
        progress: bool = False,
        bench: bool = True,
    ) -> DeviceRun:
        compiled = compile_fn(model, settings, graphs=graphs, progress=progress)
        return run_compiled(compiled, model, settings, ids, eos, progress=progress, bench=bench)

    run.__doc__ = f"One device run: `{compile_fn.__module__}.compile`, then `run_compiled`."
    return run


def refuse_graphs(graphs: Graphs | None, backend: str) -> None:
    """Backends that build their own graph form do not take prebuilt graphs."""
    if graphs is not None:
        raise SettingsError(
            f"backend {backend!r} builds its own graphs from the model; pass graphs only to "
            f"{' or '.join(map(repr, GRAPH_BACKENDS))} (at tp_degree 1)"
        )
