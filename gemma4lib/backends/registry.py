"""The one table of backends, and the route from settings to a device run through it.

`compile_graphs(model, settings)`: the settings' graphs (`device.build.device_graphs`, in the
backend's form), compiled by the backend, with the one generation engine (`runtime.Engine`) and the
settings' drafter on top. `run_device(model, settings, requests)`: that engine over every request
(one row each), the prefill logits check, and the benchmark. Adding a backend is a module with a
`compile` and a row here (its facts: a row in `facts.FACTS`). Both routes begin with `preflight`:
what needs a bundle, the SDK or an inf2 plan, checked before anything compiles.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

from ..device.build import GraphSet, device_graphs
from ..errors import SettingsError
from ..generation.drafters import make_drafter
from ..reference import reference_for, reference_last_logits
from ..runtime import Request, RowResult, softcap
from ..timing import bench_drafted, benchmark
from . import cpu, eager, gloo, neuron, xla
from .base import Backend, CompiledGraphs, DeviceRun, refuse_graphs
from .engine import engine_over
from .facts import FACTS, facts, row_at
from .preflight import preflight

if TYPE_CHECKING:
    from ..models.loading import LoadedModel
    from ..settings import PortSettings

# each row's compile functions; its facts are `facts.FACTS`'s row of the same name
_WIRING: dict[str, dict[str, Any]] = {
    "cpu": dict(compile=cpu.compile, compile_one=cpu.compile_one, label=cpu.COMPILER),
    "eager": dict(compile=eager.compile, compile_one=eager.compile_one, label=eager.COMPILER),
    "xla": dict(compile=xla.compile, label=xla.COMPILER),
    "neuron": dict(compile=neuron.compile, label="neuron"),
    "gloo": dict(compile=gloo.compile, label=gloo.COMPILER),
}
# The one table: `facts.FACTS` itself, each row replaced by its `Backend` (facts + compile), so that a
# backend registered here (a test's) is a backend `settings` knows too.
FACTS.update({name: Backend.wire(FACTS[name], **wiring) for name, wiring in _WIRING.items()})
BACKENDS = cast("dict[str, Backend]", FACTS)


def get_backend(name: str) -> Backend:
    """The row of backend `name` (`UnknownNameError` naming the selectable ones)."""
    return cast(Backend, facts(name))


def backend_of(settings: PortSettings) -> Backend:
    """The backend a setting runs on: `gloo` for a CPU backend at TP > 1 (the ranks run the rank
    graph uncompiled), else `settings.backend`."""
    return get_backend(row_at(settings.backend, settings.tp_degree).name)


def cpu_balance(name: str) -> float | None:
    """The compute balance backend `name`'s graphs are built for (one CPU thread's, or None)."""
    return get_backend(name).compute_balance


def compile_graphs(
    model: LoadedModel,
    settings: PortSettings,
    *,
    graphs: GraphSet | None = None,
    progress: bool = False,
) -> CompiledGraphs:
    """The settings' graphs compiled by their backend, under the generation engine with the settings'
    drafter. `graphs`: prebuilt graphs (the fault lab's faulty ones; backends that take them)."""
    preflight(settings)
    backend = backend_of(settings)
    refuse_graphs(graphs, backend)
    assistant = None
    if graphs is None:
        if settings.draft == "assistant":
            from ..models.assistant import load_assistant

            assistant = load_assistant(model, settings)
        shaped = replace(settings, weights="bf16") if backend.quantizes_itself else settings  # no host int8 copies
        graphs = device_graphs(
            model,
            shaped,
            backend.inplace,
            compute_balance=backend.compute_balance,
            assistant=assistant,
        )
    compiled = backend.compile(graphs, model, settings, progress)
    compiled.graphs, compiled.assistant = graphs, assistant
    stepping = graphs.decode or graphs.verify  # the run records how its batched MoE reads its experts
    if stepping is not None and stepping.experts_read != stepping.expert_form:
        compiled.info["experts_read"] = stepping.experts_read
    compiled.runtime = engine_over(model, compiled.steps, graphs, drafter=make_drafter(settings.draft))
    return compiled


def prefill_logits_error(model: LoadedModel, row: RowResult, request: Request | None = None) -> float:
    """Max |device softcapped logits - HF logits| for the last prompt token of `row` (with the
    request's images bound to HF's multimodal model when it has any)."""
    device = softcap(row.first_logits.float(), model.config.final_logit_softcapping)
    lm = reference_for(model, request.media if request is not None else None)  # with its images bound
    return float((device - reference_last_logits(lm, row.prompt_ids)).abs().max())


def run_device(
    model: LoadedModel,
    settings: PortSettings,
    requests: Sequence[Request],
    *,
    graphs: GraphSet | None = None,
    progress: bool = False,
    bench: bool = True,
) -> DeviceRun:
    """One device run: every request in its own row of the engine (keeping the logits that chose
    each token), the prefill logits check of row 0, and the benchmark when asked."""
    preflight(settings)
    backend = backend_of(settings)
    sampled = [i for i, r in enumerate(requests) if not r.sampling.greedy]
    if sampled and settings.draft and not backend.samples_drafts:
        raise SettingsError(
            f"requests {sampled} sample, and sampled drafted rows are verified by rejection sampling, which backend "
            f"{backend.name!r} (tp_degree {settings.tp_degree}) does not run: its drafting steps verify greedily; "
            f"sample without a draft there, or use tp_degree=1 on backend 'cpu', 'eager' or 'xla'"
        )
    compiled = compile_graphs(model, settings, graphs=graphs, progress=progress)
    return run_compiled(compiled, model, settings, requests, progress=progress, bench=bench)


def run_compiled(
    compiled: CompiledGraphs,
    model: LoadedModel,
    settings: PortSettings,
    requests: Sequence[Request],
    *,
    progress: bool = False,
    bench: bool = True,
) -> DeviceRun:
    """Generate every request over a compiled engine; check and (when asked) benchmark it."""
    engine = compiled.runtime
    generation = engine.generate_rows(list(requests), keep_logits=True)
    run = DeviceRun(
        rows=generation.rows,
        compiler=compiled.compiler,
        compile_s=compiled.compile_s,
        prefill_logits_max_abs_diff=prefill_logits_error(model, generation.rows[0], requests[0]),
        cache_hits=compiled.cache_hits,
        prefill_ms=generation.prefill_s * 1000,
        decode_tok_s=generation.decode_tok_s,
        details={**compiled.info, **drafting_fields(generation.rows, settings, compiled)},
        assistant=compiled.assistant,
    )
    if bench:
        warmup = max(settings.warmup, backend_of(settings).min_warmup)
        timed = [replace(r, eos_token_ids=()) for r in requests]  # eos ignored: every run decodes alike
        if engine.drafter is None:
            figures = benchmark(engine, timed, warmup, settings.iters, progress)
            run.bench, run.prefill_ms, run.decode_tok_s = figures, figures.prefill_ms, figures.decode_tok_s
        else:
            plain = compile_graphs(model, without_draft(settings)).runtime  # what drafting is compared against
            run.details.update(bench_drafted(engine, plain, timed, warmup, settings.iters))
            run.decode_tok_s = run.details["decode_tok_s_with_draft"]
    if len(requests) > 1 and run.decode_tok_s:
        run.details["decode_tok_s_per_row"] = run.decode_tok_s / len(requests)
    if compiled.report:  # after the benchmark: the backend counts what the whole run did
        run.details.update(compiled.report())
    return run


def drafting_fields(rows: Sequence[RowResult], settings: PortSettings, compiled: CompiledGraphs) -> dict[str, Any]:
    """What a drafted record carries beside the tokens: acceptance (row 0's, and per row)."""
    if settings.draft is None:
        return {}
    graphs = compiled.graphs
    out: dict[str, Any] = {
        "draft": settings.draft,
        "draft_tokens": settings.draft_tokens,
        "verify_steps": len(rows[0].emitted),
        "accepted_per_step": rows[0].accepted_per_step,
        "drafts_accepted": rows[0].accepted,
        "sliding_ring_slots": graphs.layout.slots("sliding_attention", settings.context_length, settings.ring_kv),
    }
    if getattr(graphs.target.model.config, "enable_moe_block", False):
        out["verify_experts"] = graphs.verify.expert_form
    if graphs.draft is not None:
        out["assistant_reads_layers"] = graphs.draft.read_layers
    return out


def without_draft(settings: PortSettings) -> PortSettings:
    """The plain-decode settings a drafted benchmark compares against (an export bundles their graphs too)."""
    return replace(settings, draft=None, draft_tokens=None, verify_experts=None)
