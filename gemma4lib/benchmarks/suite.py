"""Side-by-side decode benchmarks: this project's compiled graphs vs Hugging Face `generate`.

`run_suite("cpu")` (what `python -m gemma4lib bench --suite cpu --json` prints) runs, in one process,
on the same model, prompt ids and thread count:

- `gemma4lib`: the device graphs compiled with AOTInductor (ring KV, the recommended expert form
  for decode) driven by the host runtime;
- `hf_eager`: `lm.generate` with the dynamic cache (what a user runs by default);
- `hf_static_compile`: `lm.generate(cache_implementation="static")` with transformers' own
  `torch.compile` of the forward (a failure or a time-out is recorded with its reason, not dropped).

on the five tiny variants and the two medium configs (`medium.py`), and measures this machine's
memory bandwidth in the same run, so every model gets `bytes_per_step` (computed from shapes,
`roofline.py`) and `roofline_fraction = tok/s / (bandwidth / bytes_per_step)`. It also reports the
three decode-side fixes: ring KV at 512-4,096 context (before/after), dense vs selective experts
(decode and prefill), and prefill ms per bucket; and weight-only int8 against the same model's
full-precision graphs (`int8`: decode tok/s, bytes per step, their ratios, the logit error against
the full-precision reference). `targets` checks the issue's figures.

Method: one thread (recorded), warm-up runs excluded, medians over `iters` runs, and the paths of
one model are measured interleaved (A, B, C, A, B, C, ...) so load from other processes on the
shared cores hits them alike — compare ratios within one run, not absolute figures across runs.
Decode tok/s of HF paths is timed per step with a logits processor (prefill excluded), like the
runtime's own per-step timing (`benchmarks.hf`). Timings are never asserted in tests.

The graphs come from the backend layer's constructor and compilers (`device.build.device_graph`,
`compile_cpu.compile_graph`); `GraphFactory` only caches them by shape, so the runtime, the ring
sweep and the experts comparison share one graph per shape. The recommendation the report states
is `PortSettings`' defaults (and the backends' prefill expert form), read from them, not restated.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import os
import signal
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from ..artifacts import ArtifactCache
from ..backends.base import GRAPH_BACKENDS, get_backend, prefill_logits_error
from ..device.build import PREFILL_EXPERTS, device_graph
from ..device.graph import DeviceGraph, GraphShape
from ..device.quant import round_model_weights
from ..environment import machine, versions
from ..errors import UnknownNameError
from ..inf2.bandwidth import measure_bandwidth
from ..inf2.roofline import GB, decode_bytes
from ..models.loading import LoadedModel, build_tiny
from ..models.medium import build_medium, get_medium
from ..models.variants import VARIANTS
from ..reference import random_prompt, reference_greedy, teacher_forced_logits
from ..runtime import HostRuntime, softcap
from ..settings import PortSettings
from ..timing import peak_rss_mb, time_decode_steps
from .hf import hf_generate, hf_static_compile_kwargs

log = logging.getLogger(__name__)

SUITES = ("cpu",)
TINY_VARIANTS = tuple(VARIANTS)
MEDIUM_MODELS = ("medium-dense", "medium-moe")
PATHS = ("gemma4lib", "hf_eager", "hf_static_compile")
SCHEMA_VERSION = 1
SECTIONS = ("models", "ring_kv", "experts", "prefill_buckets", "int8")


def recommendation() -> dict[str, Any]:
    """What the measurements recommend (docs/ROOFLINE.md), which is what a port runs by default: read
    from `PortSettings`' field defaults and the backends' prefill form, so the report cannot state a
    recommendation the library does not follow."""
    defaults = {f.name: f.default for f in dataclasses.fields(PortSettings)}
    return {
        "ring_kv": defaults["ring_kv"],
        "decode_experts": defaults["decode_experts"],
        "prefill_experts": PREFILL_EXPERTS,
    }


@dataclass
class SuiteOptions:
    """Sizes and repetitions; `quick()` shrinks them to a schema check."""

    tiny_variants: tuple[str, ...] = TINY_VARIANTS
    medium_models: tuple[str, ...] = MEDIUM_MODELS
    backend: str = "cpu"  # "cpu" (AOTInductor) or "eager" (the same graphs uncompiled; tests)
    warmup: int = 1
    iters: int = 5
    tiny_context: int = 64
    tiny_bucket: int = 32
    tiny_prompt_tokens: int = 20
    tiny_new_tokens: int = 32
    medium_context: int = 512
    medium_bucket: int = 16
    medium_prompt_tokens: int = 16
    medium_new_tokens: int = 32
    medium_iters: int = 3
    ring_contexts: tuple[int, ...] = (512, 1024, 2048, 4096)
    ring_steps: int = 16
    prefill_buckets: tuple[int, ...] = (16, 64, 256)
    bucket_check_tokens: int = 4
    hf_compile: bool = True
    hf_compile_timeout_s: float = 1800.0
    bandwidth_mb: int = 512
    sections: tuple[str, ...] = SECTIONS

    @classmethod
    def quick(cls, **changes: Any) -> SuiteOptions:
        """Tiny models only, two timed runs, no torch.compile: the report's schema in minutes, not figures."""
        base = cls(medium_models=(), warmup=1, iters=2, hf_compile=False, bandwidth_mb=256, sections=("models",))
        return replace(base, **changes)


# ---- small helpers ---------------------------------------------------------------------------
def _median(values: Sequence[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


class _Deadline:
    """Raise TimeoutError in the main thread after `seconds` (SIGALRM; no-op where unavailable)."""

    def __init__(self, seconds: float | None):
        self.seconds = seconds

    def __enter__(self):
        self.active = bool(self.seconds) and hasattr(signal, "SIGALRM") and _in_main_thread()
        if self.active:

            def fire(signum, frame):
                raise TimeoutError(f"gave up after {self.seconds:.0f} s")

            self.previous = signal.signal(signal.SIGALRM, fire)
            signal.setitimer(signal.ITIMER_REAL, self.seconds)
        return self

    def __exit__(self, *exc):
        if self.active:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.previous)
        return False


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


# ---- the project's path: graphs from the backend layer, cached by shape ----------------------------
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
        if backend not in GRAPH_BACKENDS:
            raise UnknownNameError("bench backend", backend, GRAPH_BACKENDS)
        self.model, self.backend, self.cache, self.weights = model, backend, cache, weights
        self.steps: dict[tuple, BenchGraph] = {}

    @property
    def compiler(self) -> str:
        """The compiler's name as a port's record gives it (`cpu-aotinductor`, `eager`)."""
        return get_backend(self.backend).COMPILER

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
    ) -> HostRuntime:
        """A host runtime over cached graphs: one decode graph and a prefill graph per bucket."""
        decode = self.get(1, context_length, ring, decode_form)
        prefill = {b: self.get(b, context_length, ring, prefill_form).fn for b in buckets}
        kv = decode.graph.new_kv()
        return HostRuntime(self.model, prefill, decode.fn, kv, context_length)

    def compile_report(self) -> list[dict[str, Any]]:
        """Every graph built so far, in build order."""
        return [step.describe() for step in self.steps.values()]


# ---- one model, three paths --------------------------------------------------------------------
def bench_model(
    name: str,
    model: LoadedModel,
    factory: GraphFactory,
    *,
    context_length: int,
    bucket: int,
    prompt: Sequence[int],
    new_tokens: int,
    warmup: int,
    iters: int,
    hf_compile: bool,
    hf_compile_timeout_s: float,
    bandwidth_mb: int,
    decode_form: str,
) -> dict[str, Any]:
    """Interleaved medians of the three paths on one model, with bytes/step and roofline."""
    lm = model.lm
    is_moe = bool(getattr(model.config, "enable_moe_block", False))
    decode_form = decode_form if is_moe else "dense"
    ring = recommendation()["ring_kv"]

    bandwidth = [measure_bandwidth(bandwidth_mb)]
    reference = reference_greedy(lm, prompt, new_tokens)
    result: dict[str, Any] = {
        "name": name,
        "params": model.param_count(),
        "source": model.source,
        "reference_distinct_tokens": len(set(reference)),
        "context_length": context_length,
        "prefill_bucket": bucket,
        "prompt_tokens": len(prompt),
        "new_tokens": new_tokens,
        "ring_kv": ring,
        "decode_experts": decode_form if is_moe else None,
        "threads": torch.get_num_threads(),
    }
    paths: dict[str, dict[str, Any]] = {}

    # gemma4lib: compile (or load) once; warm-up run excluded
    started = time.perf_counter()
    try:
        runtime = factory.runtime(context_length, (bucket,), ring, decode_form)
    except Exception as exc:  # noqa: BLE001 — recorded, the suite goes on
        log.exception("compiling %s failed", name)
        paths["gemma4lib"] = {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:500]}
        runtime = None
    if runtime is not None:
        paths["gemma4lib"] = {
            "status": "ok",
            "compiler": factory.compiler,
            "setup_s": time.perf_counter() - started,
            "graphs": factory.compile_report(),
            "decode_tok_s_runs": [],
            "prefill_ms_runs": [],
        }

    paths["hf_eager"] = {"status": "ok", "cache": "dynamic", "decode_tok_s_runs": []}
    compile_kwargs: dict[str, Any] | None = None
    if hf_compile:
        paths["hf_static_compile"] = {"status": "ok", "cache": "static", "decode_tok_s_runs": []}
        try:
            compile_kwargs = hf_static_compile_kwargs()
            paths["hf_static_compile"]["compile_config"] = {
                k: v for k, v in compile_kwargs["compile_config"].to_dict().items()
            }
            torch._dynamo.reset()
            with _Deadline(hf_compile_timeout_s):
                tokens, _, wall = hf_generate(lm, prompt, new_tokens, **compile_kwargs)
            paths["hf_static_compile"]["first_call_s"] = wall  # includes torch.compile of prefill + decode
            paths["hf_static_compile"]["tokens_match_reference"] = tokens == reference
        except Exception as exc:  # noqa: BLE001 — a broken/slow torch.compile is a result, not a crash
            log.warning("HF static cache + torch.compile failed on %s: %s", name, exc)
            paths["hf_static_compile"] = {
                "status": "error",
                "cache": "static",
                "error": f"{type(exc).__name__}: {exc}"[:500],
            }
            compile_kwargs = None
    else:
        paths["hf_static_compile"] = {"status": "skipped", "reason": "quick mode (torch.compile takes minutes)"}

    runners: list[tuple[str, Callable[[], None]]] = []
    if runtime is not None:

        def run_ours():
            prefill_s = runtime.time_prefill(prompt)
            generation = runtime.generate(prompt, new_tokens)
            paths["gemma4lib"]["decode_tok_s_runs"].append(generation.decode_tok_s)
            paths["gemma4lib"]["prefill_ms_runs"].append(prefill_s * 1000)
            paths["gemma4lib"]["tokens_match_reference"] = generation.tokens == reference

        runners.append(("gemma4lib", run_ours))

    def run_eager():
        tokens, tok_s, _ = hf_generate(lm, prompt, new_tokens)
        paths["hf_eager"]["decode_tok_s_runs"].append(tok_s)
        paths["hf_eager"]["tokens_match_reference"] = tokens == reference

    runners.append(("hf_eager", run_eager))

    if compile_kwargs is not None:

        def run_compiled():
            tokens, tok_s, _ = hf_generate(lm, prompt, new_tokens, **compile_kwargs)
            paths["hf_static_compile"]["decode_tok_s_runs"].append(tok_s)
            paths["hf_static_compile"]["tokens_match_reference"] = tokens == reference

        runners.append(("hf_static_compile", run_compiled))

    for i in range(warmup + iters):
        for path, run in runners:
            try:
                run()
            except Exception as exc:  # noqa: BLE001
                log.exception("%s on %s failed", path, name)
                paths[path].update(status="error", error=f"{type(exc).__name__}: {exc}"[:500])
                runners = [(p, r) for p, r in runners if p != path]
        if i < warmup:  # drop warm-up figures
            for path in paths.values():
                for key in ("decode_tok_s_runs", "prefill_ms_runs"):
                    if key in path:
                        path[key].clear()
    bandwidth.append(measure_bandwidth(bandwidth_mb))

    if runtime is not None and paths["gemma4lib"]["status"] == "ok":
        # the strong check where a random model's greedy tokens vary little: prefill logits themselves
        paths["gemma4lib"]["prefill_logits_max_abs_diff"] = prefill_logits_error(model, runtime, list(prompt))
    for path in paths.values():
        if "decode_tok_s_runs" in path:
            path["decode_tok_s"] = _median(path["decode_tok_s_runs"])
        if "prefill_ms_runs" in path:
            path["prefill_ms"] = _median(path["prefill_ms_runs"])
    eager = paths["hf_eager"].get("decode_tok_s")
    result["paths"] = paths
    result["speedup_vs_hf_eager"] = {p: _ratio(paths[p].get("decode_tok_s"), eager) for p in PATHS}

    steps = decode_bytes(model, context_length=context_length, ring=ring, experts=decode_form if is_moe else "dense")
    bw = statistics.mean(b["bandwidth_bytes_s"] for b in bandwidth)
    ceiling = bw / steps.total
    result["bytes_per_step"] = {
        "weights": steps.weights,
        "kv": steps.kv,
        "total": steps.total,
        "experts_form": steps.experts_form,
        "ring": steps.ring,
        "basis": "the gemma4lib decode graph: device weights (tied LM head once, routed "
        "experts only when selective) + every K/V buffer as allocated",
    }
    result["bandwidth"] = {"gb_s": bw / GB, "samples": bandwidth}
    result["ceiling_tok_s"] = ceiling
    result["roofline_fraction"] = {p: _ratio(paths[p].get("decode_tok_s"), ceiling) for p in PATHS}
    return result


# ---- the three fixes ---------------------------------------------------------------------------
def bench_ring_kv(
    model: LoadedModel, factory: GraphFactory, contexts: Sequence[int], steps: int, warmup: int, iters: int
) -> dict[str, Any]:
    """Decode tok/s at each context, full-length buffers (before) vs ring buffers (after).

    Steps are timed at the last `steps` positions of the context (where a long conversation decodes).
    """
    graphs = {(ctx, kind): factory.get(1, ctx, kind == "ring") for ctx in contexts for kind in ("full", "ring")}
    runs: dict[tuple[int, str], list[float]] = {key: [] for key in graphs}
    for i in range(warmup + iters):
        for (ctx, kind), step in graphs.items():
            positions = range(ctx - steps - 1, ctx - 1)
            tok_s = time_decode_steps(model, step, positions)
            if i >= warmup:
                runs[(ctx, kind)].append(tok_s)
    table: dict[str, Any] = {}
    for ctx in contexts:
        row = {}
        for kind in ("full", "ring"):
            b = decode_bytes(model, context_length=ctx, ring=kind == "ring")
            step = graphs[(ctx, kind)]
            row[kind] = {
                "decode_tok_s": _median(runs[(ctx, kind)]),
                "runs": runs[(ctx, kind)],
                "kv_bytes": b.kv,
                "bytes_per_step": b.total,
                "same_graph_as_full": graphs[(ctx, "full")] is graphs[(ctx, "ring")],
            }
        row["ring_speedup"] = _ratio(row["ring"]["decode_tok_s"], row["full"]["decode_tok_s"])
        table[str(ctx)] = row
    first, last = str(contexts[0]), str(contexts[-1])

    def longest_over_shortest(kind: str) -> float | None:
        return _ratio(table[last][kind]["decode_tok_s"], table[first][kind]["decode_tok_s"])

    return {
        "contexts": table,
        "steps_per_run": steps,
        "sliding_window": model.layout.sliding_window,
        "graphs": factory.compile_report(),
        f"ring_tok_s_{last}_over_{first}": longest_over_shortest("ring"),
        f"full_tok_s_{last}_over_{first}": longest_over_shortest("full"),
    }


def bench_experts(
    model: LoadedModel,
    factory: GraphFactory,
    *,
    context_length: int,
    bucket: int,
    prompt: Sequence[int],
    new_tokens: int,
    warmup: int,
    iters: int,
) -> dict[str, Any]:
    """Dense vs selective experts: decode tok/s + bytes/step (and token equality), prefill ms."""
    reference = reference_greedy(model.lm, prompt, new_tokens)
    recommended = recommendation()
    ring = recommended["ring_kv"]
    forms = ("dense", "selective")
    runtimes = {form: factory.runtime(context_length, (bucket,), ring, form, PREFILL_EXPERTS) for form in forms}
    prefill_steps = {form: factory.get(bucket, context_length, ring, form) for form in forms}
    decode_runs: dict[str, list[float]] = {f: [] for f in forms}
    prefill_runs: dict[str, list[float]] = {f: [] for f in forms}
    match: dict[str, bool] = {}
    prompt_bucket = list(prompt)[:bucket]
    first_reference = reference_greedy(model.lm, prompt_bucket, 1)
    prefill_runtimes = {
        form: HostRuntime(
            model, {bucket: prefill_steps[form].fn}, runtimes[form].decode, runtimes[form].kv, context_length
        )
        for form in forms
    }
    prefill_match = {
        form: prefill_runtimes[form].generate(prompt_bucket, 1).tokens == first_reference for form in forms
    }
    for i in range(warmup + iters):
        for form in forms:
            generation = runtimes[form].generate(prompt, new_tokens)
            match[form] = generation.tokens == reference
            prefill_s = prefill_runtimes[form].time_prefill(prompt_bucket)
            if i >= warmup:
                decode_runs[form].append(generation.decode_tok_s)
                prefill_runs[form].append(prefill_s * 1000)
    decode = {}
    for form in forms:
        b = decode_bytes(model, context_length=context_length, ring=ring, experts=form)
        decode[form] = {
            "decode_tok_s": _median(decode_runs[form]),
            "runs": decode_runs[form],
            "bytes_per_step": b.total,
            "weight_bytes": b.weights,
            "tokens_match_reference": match[form],
        }
    prefill = {
        form: {
            "prefill_ms": _median(prefill_runs[form]),
            "runs": prefill_runs[form],
            "first_token_matches_reference": prefill_match[form],
        }
        for form in forms
    }
    faster_decode = max(forms, key=lambda f: decode[f]["decode_tok_s"] or 0)
    faster_prefill = min(forms, key=lambda f: prefill[f]["prefill_ms"] or float("inf"))
    return {
        "decode": decode,
        "prefill": prefill,
        "prefill_bucket": bucket,
        "selective_over_dense_decode": _ratio(decode["selective"]["decode_tok_s"], decode["dense"]["decode_tok_s"]),
        "dense_over_selective_bytes": _ratio(decode["dense"]["bytes_per_step"], decode["selective"]["bytes_per_step"]),
        "recommendation": {
            "decode": faster_decode,
            "prefill": faster_prefill,
            "port_settings_default_decode": recommended["decode_experts"],
        },
        "graphs": factory.compile_report(),
    }


def int8_model(model: LoadedModel) -> LoadedModel:
    """A copy of `model` whose quantized weights are rounded to `q * scale`: the int8 graphs'
    weight source and their own host reference (`quant.round_model_weights`)."""
    lm = copy.deepcopy(model.lm)
    round_model_weights(lm)
    return dataclasses.replace(model, lm=lm, source=f"{model.source}+int8")


def bench_int8(
    model: LoadedModel,
    factory: GraphFactory,
    *,
    context_length: int,
    bucket: int,
    prompt: Sequence[int],
    new_tokens: int,
    warmup: int,
    iters: int,
    decode_form: str,
) -> dict[str, Any]:
    """Weight-only int8 against the same model's full-precision graphs, interleaved in one run:
    decode tok/s and bytes per step of each, their ratios, and the int8 logit error.

    `logits_max_abs_error_vs_full`: the int8 graph's softcapped logits at every generated position
    against the full-precision HF model's, teacher-forced on the int8 tokens (the cost of int8);
    `logits_max_abs_diff_vs_own_reference`: the same against the rounded host model (the compiler's
    faithfulness: SEQ_MATCH is judged against this reference)."""
    is_moe = bool(getattr(model.config, "enable_moe_block", False))
    form = decode_form if is_moe else "dense"
    ring = recommendation()["ring_kv"]
    quantized = int8_model(model)
    int8_factory = GraphFactory(quantized, factory.backend, factory.cache, weights="int8")
    factories = {"full": factory, "int8": int8_factory}
    runtimes = {k: f.runtime(context_length, (bucket,), ring, form, PREFILL_EXPERTS) for k, f in factories.items()}
    references = {"full": reference_greedy(model.lm, prompt, new_tokens)}
    references["int8"] = reference_greedy(quantized.lm, prompt, new_tokens)
    runs: dict[str, list[float]] = {k: [] for k in runtimes}
    generations = {}
    for i in range(warmup + iters):
        for kind, runtime in runtimes.items():
            generation = runtime.generate(prompt, new_tokens, keep_logits=i == 0)
            generations.setdefault(kind, generation)
            if i >= warmup:
                runs[kind].append(generation.decode_tok_s)
    int8_run = generations["int8"]
    cap = model.config.final_logit_softcapping
    device = softcap(int8_run.step_logits, cap).double()
    vs_full = teacher_forced_logits(model.lm, prompt, int8_run.tokens)
    vs_own = teacher_forced_logits(quantized.lm, prompt, int8_run.tokens)
    out: dict[str, Any] = {"decode_experts": form if is_moe else None, "context_length": context_length}
    for kind in runtimes:
        b = decode_bytes(
            model,
            context_length=context_length,
            ring=ring,
            experts=form,
            weight_format="int8" if kind == "int8" else "bf16",
        )
        tokens = generations[kind].tokens
        out[kind] = {
            "decode_tok_s": _median(runs[kind]),
            "runs": runs[kind],
            "bytes_per_step": b.total,
            "weight_bytes": b.weights,
            "tokens_match_own_reference": tokens == references[kind],
        }
    full_tokens, int8_tokens = references["full"], generations["int8"].tokens
    agree = next((i for i, (a, b) in enumerate(zip(full_tokens, int8_tokens, strict=False)) if a != b), None)
    out.update(
        int8_over_full_decode=_ratio(out["int8"]["decode_tok_s"], out["full"]["decode_tok_s"]),
        full_over_int8_bytes=_ratio(out["full"]["bytes_per_step"], out["int8"]["bytes_per_step"]),
        logits_max_abs_error_vs_full=float((device - vs_full).abs().max()),
        logits_max_abs_diff_vs_own_reference=float((device - vs_own).abs().max()),
        int8_tokens_equal_full_reference=agree is None,
        first_token_differing_from_full=agree,
        graphs={kind: f.compile_report() for kind, f in factories.items()},
    )
    return out


def bench_prefill_buckets(
    model: LoadedModel,
    factory: GraphFactory,
    *,
    context_length: int,
    buckets: Sequence[int],
    check_tokens: int,
    warmup: int,
    iters: int,
    seed: int = 11,
) -> dict[str, Any]:
    """Prefill ms per bucket (a prompt filling it), and which bucket prompts of other lengths take."""
    runtime = factory.runtime(context_length, buckets, recommendation()["ring_kv"], "dense")
    vocab = model.config.vocab_size
    runs: dict[int, list[float]] = {b: [] for b in buckets}
    for i in range(warmup + iters):
        for b in buckets:
            elapsed = runtime.time_prefill(random_prompt(vocab, b, seed))
            if i >= warmup:
                runs[b].append(elapsed * 1000)
    # prompts just past the previous bucket: each must take the smallest bucket that fits, and match
    lengths = [max(1, (prev or 0) + 1) for prev in (None, *buckets[:-1])]
    placement = []
    for n in lengths:
        prompt = random_prompt(vocab, n, seed + n)
        generation = runtime.generate(prompt, check_tokens)
        reference = reference_greedy(model.lm, prompt, check_tokens)
        placement.append(
            {
                "prompt_tokens": n,
                "bucket": generation.bucket,
                "smallest_fitting": min(b for b in buckets if b >= n),
                "tokens_match_reference": generation.tokens == reference,
            }
        )
    return {
        "context_length": context_length,
        "buckets": {str(b): {"prefill_ms": _median(runs[b]), "runs": runs[b]} for b in buckets},
        "placement": placement,
        "graphs": factory.compile_report(),
    }


# ---- targets -------------------------------------------------------------------------------------
def check_targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, evaluated from the figures (None = not measured in this run)."""
    targets = []

    def add(name: str, value: float | None, threshold: float):
        targets.append(
            {
                "target": name,
                "value": value,
                "threshold": threshold,
                "met": None if value is None else value >= threshold,
            }
        )

    models = {m["name"]: m for m in report.get("models", [])}
    for name, m in models.items():
        if name in TINY_VARIANTS:
            add(f"{name} tiny: gemma4lib decode / HF eager >= 5", m["speedup_vs_hf_eager"].get("gemma4lib"), 5.0)
    if "medium-dense" in models:
        m = models["medium-dense"]
        add("medium-dense: gemma4lib decode / HF eager >= 1.15", m["speedup_vs_hf_eager"].get("gemma4lib"), 1.15)
        add("medium-dense: roofline_fraction >= 0.85", m["roofline_fraction"].get("gemma4lib"), 0.85)
    ring = report.get("ring_kv")
    if ring:
        key = next((k for k in ring if k.startswith("ring_tok_s_")), None)
        add(f"medium-dense: {key} >= 0.9", ring.get(key), 0.9)
    experts = report.get("experts")
    if experts:
        add("medium-moe: selective / dense decode >= 2", experts.get("selective_over_dense_decode"), 2.0)
    return targets


# ---- the suite ------------------------------------------------------------------------------------
def load_bench_model(name: str) -> LoadedModel:
    """A suite model by name: a tiny variant at its seed, or a medium config (`medium.py`)."""
    if name in VARIANTS:
        variant = VARIANTS[name]
        return build_tiny(variant, seed=variant.tiny_seed)
    return build_medium(name)


def _medium_prompt(name: str, model: LoadedModel, options: SuiteOptions) -> list[int]:
    return random_prompt(model.config.vocab_size, options.medium_prompt_tokens, get_medium(name).prompt_seed)


def run_suite(
    suite: str = "cpu",
    quick: bool = False,
    *,
    options: SuiteOptions | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run a benchmark suite and return its JSON-ready report (see the module docstring)."""
    if suite not in SUITES:
        raise UnknownNameError("benchmark suite", suite, SUITES)
    options = options or (SuiteOptions.quick() if quick else SuiteOptions())
    recommended = recommendation()
    say = progress or (lambda message: log.info("%s", message))
    started = time.perf_counter()
    report: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "suite": suite,
        "quick": quick,
        "threads": torch.get_num_threads(),
        "backend": options.backend,
        "options": asdict(options),
        "versions": versions(),
        "machine": machine(),
        "load_average_start": _load_average(),
    }
    say("measuring memory bandwidth")
    report["bandwidth"] = measure_bandwidth(options.bandwidth_mb)
    report["models"] = []
    factories: dict[str, GraphFactory] = {}
    loaded: dict[str, LoadedModel] = {}

    def model_and_factory(name: str) -> tuple[LoadedModel, GraphFactory]:
        if name not in loaded:
            loaded[name] = load_bench_model(name)
            factories[name] = GraphFactory(loaded[name], options.backend)
        return loaded[name], factories[name]

    def bench_sized(
        name: str, prompt: list[int], context_length: int, bucket: int, new_tokens: int, iters: int
    ) -> None:
        """One model's three paths at one set of sizes, appended to the report."""
        model, factory = model_and_factory(name)
        report["models"].append(
            bench_model(
                name,
                model,
                factory,
                context_length=context_length,
                bucket=bucket,
                prompt=prompt,
                new_tokens=new_tokens,
                warmup=options.warmup,
                iters=iters,
                hf_compile=options.hf_compile,
                hf_compile_timeout_s=options.hf_compile_timeout_s,
                bandwidth_mb=options.bandwidth_mb,
                decode_form=recommended["decode_experts"],
            )
        )

    if "models" in options.sections:
        for name in options.tiny_variants:
            say(f"tiny {name}")
            model, _ = model_and_factory(name)
            prompt = random_prompt(model.config.vocab_size, options.tiny_prompt_tokens, VARIANTS[name].tiny_seed + 1)
            bench_sized(name, prompt, options.tiny_context, options.tiny_bucket, options.tiny_new_tokens, options.iters)
            loaded.pop(name), factories.pop(name)
        for name in options.medium_models:
            say(f"medium {name}")
            model, _ = model_and_factory(name)
            bench_sized(
                name,
                _medium_prompt(name, model, options),
                options.medium_context,
                options.medium_bucket,
                options.medium_new_tokens,
                options.medium_iters,
            )
            torch._dynamo.reset()

    if "medium-dense" in options.medium_models:
        model, factory = model_and_factory("medium-dense")
        if "ring_kv" in options.sections:
            say("ring KV sweep")
            report["ring_kv"] = {
                "model": "medium-dense",
                **bench_ring_kv(
                    model, factory, options.ring_contexts, options.ring_steps, options.warmup, options.medium_iters
                ),
            }
        if "prefill_buckets" in options.sections:
            say("prefill buckets")
            report["prefill_buckets"] = {
                "model": "medium-dense",
                **bench_prefill_buckets(
                    model,
                    factory,
                    context_length=options.medium_context,
                    buckets=options.prefill_buckets,
                    check_tokens=options.bucket_check_tokens,
                    warmup=options.warmup,
                    iters=options.medium_iters,
                ),
            }
    if "medium-moe" in options.medium_models and "experts" in options.sections:
        say("experts: dense vs selective")
        model, factory = model_and_factory("medium-moe")
        prompt = _medium_prompt("medium-moe", model, options)
        report["experts"] = {
            "model": "medium-moe",
            **bench_experts(
                model,
                factory,
                context_length=options.medium_context,
                bucket=options.medium_bucket,
                prompt=prompt,
                new_tokens=options.medium_new_tokens,
                warmup=options.warmup,
                iters=options.medium_iters,
            ),
        }

    if "int8" in options.sections:
        report["int8"] = []
        for name in options.medium_models:
            say(f"int8 {name}: weight-only int8 vs full precision")
            model, factory = model_and_factory(name)
            report["int8"].append(
                {
                    "model": name,
                    **bench_int8(
                        model,
                        factory,
                        context_length=options.medium_context,
                        bucket=options.medium_bucket,
                        prompt=_medium_prompt(name, model, options),
                        new_tokens=options.medium_new_tokens,
                        warmup=options.warmup,
                        iters=options.medium_iters,
                        decode_form=recommended["decode_experts"],
                    ),
                }
            )
            loaded.pop(name), factories.pop(name)
            torch._dynamo.reset()

    report["targets"] = check_targets(report)
    report["recommendation"] = recommended
    report["load_average_end"] = _load_average()
    report["peak_rss_mb"] = peak_rss_mb()
    report["wall_s"] = time.perf_counter() - started
    return report


def _load_average() -> list[float] | None:
    with contextlib.suppress(OSError, AttributeError):
        return [round(x, 2) for x in os.getloadavg()]
    return None
