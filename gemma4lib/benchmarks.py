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
(decode and prefill), and prefill ms per bucket. `targets` checks the issue's figures.

Method: one thread (recorded), warm-up runs excluded, medians over `iters` runs, and the paths of
one model are measured interleaved (A, B, C, A, B, C, ...) so load from other processes on the
shared cores hits them alike — compare ratios within one run, not absolute figures across runs.
Decode tok/s of HF paths is timed per step with a logits processor (prefill excluded), like the
runtime's own per-step timing. Timings are never asserted in tests.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from transformers import LogitsProcessor

from .artifacts import ArtifactCache
from .bench import peak_rss_mb
from .environment import machine, versions
from .errors import UnknownNameError
from .graph import DeviceGraph, GraphShape
from .loading import LoadedModel, build_tiny
from .medium import build_medium, get_medium
from .port import PortSettings, prefill_logits_error
from .reference import random_prompt, reference_greedy
from .roofline import GB, decode_bytes, measure_bandwidth
from .runtime import HostRuntime
from .variants import VARIANTS

log = logging.getLogger(__name__)

SUITES = ("cpu",)
TINY_VARIANTS = tuple(VARIANTS)
MEDIUM_MODELS = ("medium-dense", "medium-moe")
PATHS = ("gemma4lib", "hf_eager", "hf_static_compile")
SCHEMA_VERSION = 1

# What the measurements recommend (docs/ROOFLINE.md; `recommendation` in the suite output), and what
# `PortSettings` defaults to. Prefill stays dense although short CPU prompts measured faster selective:
# the gathered slices grow with tokens x k, and the dense form is the one that shards over TP ranks.
RECOMMENDED_RING_KV = True
RECOMMENDED_DECODE_EXPERTS = "selective"
RECOMMENDED_PREFILL_EXPERTS = "dense"


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
    sections: tuple[str, ...] = ("models", "ring_kv", "experts", "prefill_buckets")

    @classmethod
    def quick(cls, **changes: Any) -> SuiteOptions:
        base = cls(medium_models=(), warmup=1, iters=2, hf_compile=False, bandwidth_mb=256,
                   sections=("models",))
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
    import threading
    return threading.current_thread() is threading.main_thread()


# ---- Hugging Face paths ----------------------------------------------------------------------
class _StepClock(LogitsProcessor):
    """A logits processor that only records when each generation step's logits arrive."""

    def __init__(self):
        self.stamps: list[float] = []

    def __call__(self, input_ids, scores):
        self.stamps.append(time.perf_counter())
        return scores

    def decode_tok_s(self) -> float | None:
        if len(self.stamps) < 2:
            return None
        return (len(self.stamps) - 1) / (self.stamps[-1] - self.stamps[0])


def hf_generate(lm: torch.nn.Module, prompt: Sequence[int], new_tokens: int, **kwargs: Any
                ) -> tuple[list[int], float | None, float]:
    """Greedy `generate` of exactly `new_tokens`; returns (tokens, decode tok/s, wall s)."""
    from transformers import LogitsProcessorList

    ids = torch.as_tensor(list(prompt), dtype=torch.long)[None]
    clock = _StepClock()
    started = time.perf_counter()
    with torch.no_grad():
        out = lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                          logits_processor=LogitsProcessorList([clock]), **kwargs)
    wall = time.perf_counter() - started
    return out[0, ids.shape[1]:].tolist(), clock.decode_tok_s(), wall


def hf_static_compile_kwargs() -> dict[str, Any]:
    """transformers' own route: a static cache and its auto-compile of the forward, opted in on CPU."""
    from transformers import CompileConfig

    config = CompileConfig(fullgraph=False, dynamic=False, mode="default")
    config._compile_all_devices = True  # auto-compile is off for CPU unless asked for
    return {"cache_implementation": "static", "compile_config": config}


# ---- the project's path ---------------------------------------------------------------------
@dataclass
class Step:
    """One compiled (or eager) graph with where it came from."""

    fn: Callable[..., torch.Tensor]
    shape: GraphShape
    expert_form: str
    compile_s: float = 0.0  # seconds this run spent compiling (0 on a cache hit)
    build_s: float | None = None  # seconds the artifact took to compile when it was built
    cache_hit: bool | None = None
    graph: DeviceGraph | None = None

    def describe(self) -> dict[str, Any]:
        return {"tokens": self.shape.tokens, "context_length": self.shape.context_length, "ring": self.shape.ring,
                "expert_form": self.expert_form, "compile_s": self.compile_s, "artifact_build_s": self.build_s,
                "cache_hit": self.cache_hit}


class GraphFactory:
    """Builds and compiles (or loads from the artifact cache) each graph once per model."""

    def __init__(self, model: LoadedModel, backend: str = "cpu", cache: ArtifactCache | None = None):
        if backend not in ("cpu", "eager"):
            raise UnknownNameError("bench backend", backend, ("cpu", "eager"))
        self.model, self.backend, self.cache = model, backend, cache
        self.steps: dict[tuple, Step] = {}

    @property
    def recipe(self) -> str:
        if self.backend == "eager":
            return "eager"
        from .compile_cpu import RECIPE
        return RECIPE

    def get(self, tokens: int, context_length: int, ring: bool, expert_form: str = "dense") -> Step:
        model = self.model
        if not getattr(model.config, "enable_moe_block", False):
            expert_form = "dense"  # no experts: one graph whatever the form
        if model.layout.sliding_window >= context_length:
            ring = True  # the ring holds the whole context: the same buffers and program as full length
        key = (tokens, context_length, ring, expert_form)
        if key not in self.steps:
            graph = DeviceGraph(model.text_model, model.lm_head, model.layout,
                                GraphShape(1, tokens, context_length, ring), inplace=True, expert_form=expert_form)
            if self.backend == "eager":
                self.steps[key] = Step(graph, graph.shape, expert_form, graph=graph)
            else:
                from .compile_cpu import compile_graph
                compiled = compile_graph(graph, self.cache)
                self.steps[key] = Step(compiled, graph.shape, expert_form, compiled.compile_s,
                                       compiled.entry.meta.get("compile_s", compiled.entry.meta.get("build_s")),
                                       compiled.cache_hit, graph)
        return self.steps[key]

    def runtime(self, context_length: int, buckets: Iterable[int], ring: bool, decode_form: str,
                prefill_form: str = "dense") -> HostRuntime:
        decode = self.get(1, context_length, ring, decode_form)
        prefill = {b: self.get(b, context_length, ring, prefill_form).fn for b in buckets}
        kv = decode.graph.new_kv()
        return HostRuntime(self.model, prefill, decode.fn, kv, context_length)

    def compile_report(self) -> list[dict[str, Any]]:
        return [step.describe() for step in self.steps.values()]


@torch.no_grad()
def time_decode_steps(model: LoadedModel, step: Step, positions: Sequence[int], token: int = 5) -> float:
    """Decode tok/s of `step` over the given positions, as the runtime's decode loop runs it
    (host embedding + step + greedy argmax), on fresh buffers (timing does not depend on contents)."""
    runtime = HostRuntime(model, {}, step.fn, step.graph.new_kv(), step.shape.context_length)
    started = time.perf_counter()
    for position in positions:
        inputs = runtime.embed(torch.tensor([[token]]))
        logits = step.fn(*inputs, torch.tensor([position]), torch.tensor([1]), *runtime.kv)
        token = int(torch.argmax(logits[0]))
    return len(positions) / (time.perf_counter() - started)


# ---- one model, three paths --------------------------------------------------------------------
def bench_model(name: str, model: LoadedModel, factory: GraphFactory, *, context_length: int, bucket: int,
                prompt: Sequence[int], new_tokens: int, warmup: int, iters: int, hf_compile: bool,
                hf_compile_timeout_s: float, bandwidth_mb: int, decode_form: str) -> dict[str, Any]:
    """Interleaved medians of the three paths on one model, with bytes/step and roofline."""
    lm = model.lm
    is_moe = bool(getattr(model.config, "enable_moe_block", False))
    decode_form = decode_form if is_moe else "dense"
    ring = RECOMMENDED_RING_KV

    bandwidth = [measure_bandwidth(bandwidth_mb)]
    reference = reference_greedy(lm, prompt, new_tokens)
    result: dict[str, Any] = {"name": name, "params": model.param_count(), "source": model.source,
                              "reference_distinct_tokens": len(set(reference)),
                              "context_length": context_length, "prefill_bucket": bucket,
                              "prompt_tokens": len(prompt), "new_tokens": new_tokens, "ring_kv": ring,
                              "decode_experts": decode_form if is_moe else None, "threads": torch.get_num_threads()}
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
        paths["gemma4lib"] = {"status": "ok", "recipe": factory.recipe, "setup_s": time.perf_counter() - started,
                              "graphs": factory.compile_report(), "decode_tok_s_runs": [], "prefill_ms_runs": []}

    paths["hf_eager"] = {"status": "ok", "cache": "dynamic", "decode_tok_s_runs": []}
    compile_kwargs: dict[str, Any] | None = None
    if hf_compile:
        paths["hf_static_compile"] = {"status": "ok", "cache": "static", "decode_tok_s_runs": []}
        try:
            compile_kwargs = hf_static_compile_kwargs()
            paths["hf_static_compile"]["compile_config"] = {
                k: v for k, v in compile_kwargs["compile_config"].to_dict().items()}
            torch._dynamo.reset()
            with _Deadline(hf_compile_timeout_s):
                tokens, _, wall = hf_generate(lm, prompt, new_tokens, **compile_kwargs)
            paths["hf_static_compile"]["first_call_s"] = wall  # includes torch.compile of prefill + decode
            paths["hf_static_compile"]["tokens_match_reference"] = tokens == reference
        except Exception as exc:  # noqa: BLE001 — a broken/slow torch.compile is a result, not a crash
            log.warning("HF static cache + torch.compile failed on %s: %s", name, exc)
            paths["hf_static_compile"] = {"status": "error", "cache": "static",
                                          "error": f"{type(exc).__name__}: {exc}"[:500]}
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
    result["bytes_per_step"] = {"weights": steps.weights, "kv": steps.kv, "total": steps.total,
                                "experts_form": steps.experts_form, "ring": steps.ring,
                                "basis": "the gemma4lib decode graph: device weights (tied LM head once, routed "
                                         "experts only when selective) + every K/V buffer as allocated"}
    result["bandwidth"] = {"gb_s": bw / GB, "samples": bandwidth}
    result["ceiling_tok_s"] = ceiling
    result["roofline_fraction"] = {p: _ratio(paths[p].get("decode_tok_s"), ceiling) for p in PATHS}
    return result


# ---- the three fixes ---------------------------------------------------------------------------
def bench_ring_kv(model: LoadedModel, factory: GraphFactory, contexts: Sequence[int], steps: int, warmup: int,
                  iters: int) -> dict[str, Any]:
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
            row[kind] = {"decode_tok_s": _median(runs[(ctx, kind)]), "runs": runs[(ctx, kind)],
                         "kv_bytes": b.kv, "bytes_per_step": b.total,
                         "same_graph_as_full": graphs[(ctx, "full")] is graphs[(ctx, "ring")]}
        row["ring_speedup"] = _ratio(row["ring"]["decode_tok_s"], row["full"]["decode_tok_s"])
        table[str(ctx)] = row
    first, last = str(contexts[0]), str(contexts[-1])
    return {
        "contexts": table,
        "steps_per_run": steps,
        "sliding_window": model.layout.sliding_window,
        "graphs": factory.compile_report(),
        f"ring_tok_s_{last}_over_{first}": _ratio(table[last]["ring"]["decode_tok_s"],
                                                  table[first]["ring"]["decode_tok_s"]),
        f"full_tok_s_{last}_over_{first}": _ratio(table[last]["full"]["decode_tok_s"],
                                                  table[first]["full"]["decode_tok_s"]),
    }


def bench_experts(model: LoadedModel, factory: GraphFactory, *, context_length: int, bucket: int,
                  prompt: Sequence[int], new_tokens: int, warmup: int, iters: int) -> dict[str, Any]:
    """Dense vs selective experts: decode tok/s + bytes/step (and token equality), prefill ms."""
    reference = reference_greedy(model.lm, prompt, new_tokens)
    forms = ("dense", "selective")
    runtimes = {form: factory.runtime(context_length, (bucket,), RECOMMENDED_RING_KV, form, "dense") for form in forms}
    prefill_steps = {form: factory.get(bucket, context_length, RECOMMENDED_RING_KV, form) for form in forms}
    decode_runs: dict[str, list[float]] = {f: [] for f in forms}
    prefill_runs: dict[str, list[float]] = {f: [] for f in forms}
    match: dict[str, bool] = {}
    prompt_bucket = list(prompt)[:bucket]
    first_reference = reference_greedy(model.lm, prompt_bucket, 1)
    prefill_runtimes = {form: HostRuntime(model, {bucket: prefill_steps[form].fn}, runtimes[form].decode,
                                          runtimes[form].kv, context_length) for form in forms}
    prefill_match = {form: prefill_runtimes[form].generate(prompt_bucket, 1).tokens == first_reference
                     for form in forms}
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
        b = decode_bytes(model, context_length=context_length, ring=RECOMMENDED_RING_KV, experts=form)
        decode[form] = {"decode_tok_s": _median(decode_runs[form]), "runs": decode_runs[form],
                        "bytes_per_step": b.total, "weight_bytes": b.weights, "tokens_match_reference": match[form]}
    prefill = {form: {"prefill_ms": _median(prefill_runs[form]), "runs": prefill_runs[form],
                      "first_token_matches_reference": prefill_match[form]} for form in forms}
    faster_decode = max(forms, key=lambda f: decode[f]["decode_tok_s"] or 0)
    faster_prefill = min(forms, key=lambda f: prefill[f]["prefill_ms"] or float("inf"))
    return {
        "decode": decode,
        "prefill": prefill,
        "prefill_bucket": bucket,
        "selective_over_dense_decode": _ratio(decode["selective"]["decode_tok_s"], decode["dense"]["decode_tok_s"]),
        "dense_over_selective_bytes": _ratio(decode["dense"]["bytes_per_step"], decode["selective"]["bytes_per_step"]),
        "recommendation": {"decode": faster_decode, "prefill": faster_prefill,
                           "port_settings_default_decode": PortSettings.decode_experts},
        "graphs": factory.compile_report(),
    }


def bench_prefill_buckets(model: LoadedModel, factory: GraphFactory, *, context_length: int,
                          buckets: Sequence[int], check_tokens: int, warmup: int, iters: int,
                          seed: int = 11) -> dict[str, Any]:
    """Prefill ms per bucket (a prompt filling it), and which bucket prompts of other lengths take."""
    runtime = factory.runtime(context_length, buckets, RECOMMENDED_RING_KV, "dense")
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
        placement.append({"prompt_tokens": n, "bucket": generation.bucket,
                          "smallest_fitting": min(b for b in buckets if b >= n),
                          "tokens_match_reference":
                              generation.tokens == reference_greedy(model.lm, prompt, check_tokens)})
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
        targets.append({"target": name, "value": value, "threshold": threshold,
                        "met": None if value is None else value >= threshold})

    models = {m["name"]: m for m in report.get("models", [])}
    for name, m in models.items():
        if name in TINY_VARIANTS:
            add(f"{name} tiny: gemma4lib decode / HF eager >= 5", m["speedup_vs_hf_eager"].get("gemma4lib"), 5.0)
    if "medium-dense" in models:
        m = models["medium-dense"]
        add("medium-dense: gemma4lib decode / HF eager >= 1.15", m["speedup_vs_hf_eager"].get("gemma4lib"), 1.15)
        add("medium-dense: roofline_fraction >= 0.7", m["roofline_fraction"].get("gemma4lib"), 0.7)
    ring = report.get("ring_kv")
    if ring:
        key = next((k for k in ring if k.startswith("ring_tok_s_")), None)
        add(f"medium-dense: {key} >= 0.85", ring.get(key), 0.85)
    experts = report.get("experts")
    if experts:
        add("medium-moe: selective / dense decode >= 2", experts.get("selective_over_dense_decode"), 2.0)
    return targets


# ---- the suite ------------------------------------------------------------------------------------
def _load(name: str) -> LoadedModel:
    if name in VARIANTS:
        variant = VARIANTS[name]
        return build_tiny(variant, seed=variant.tiny_seed)
    return build_medium(name)


def _medium_prompt(name: str, model: LoadedModel, options: SuiteOptions) -> list[int]:
    return random_prompt(model.config.vocab_size, options.medium_prompt_tokens, get_medium(name).prompt_seed)


def run_suite(suite: str = "cpu", quick: bool = False, *, options: SuiteOptions | None = None,
              progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run a benchmark suite and return its JSON-ready report (see the module docstring)."""
    if suite not in SUITES:
        raise UnknownNameError("benchmark suite", suite, SUITES)
    options = options or (SuiteOptions.quick() if quick else SuiteOptions())
    say = progress or (lambda message: log.info("%s", message))
    started = time.perf_counter()
    report: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION, "suite": suite, "quick": quick, "threads": torch.get_num_threads(),
        "backend": options.backend, "options": asdict(options), "versions": versions(), "machine": machine(),
        "load_average_start": _load_average(),
    }
    say("measuring memory bandwidth")
    report["bandwidth"] = measure_bandwidth(options.bandwidth_mb)
    report["models"] = []
    factories: dict[str, GraphFactory] = {}
    loaded: dict[str, LoadedModel] = {}

    def model_and_factory(name: str) -> tuple[LoadedModel, GraphFactory]:
        if name not in loaded:
            loaded[name] = _load(name)
            factories[name] = GraphFactory(loaded[name], options.backend)
        return loaded[name], factories[name]

    if "models" in options.sections:
        for name in options.tiny_variants:
            say(f"tiny {name}")
            model, factory = model_and_factory(name)
            prompt = random_prompt(model.config.vocab_size, options.tiny_prompt_tokens, VARIANTS[name].tiny_seed + 1)
            report["models"].append(bench_model(
                name, model, factory, context_length=options.tiny_context, bucket=options.tiny_bucket, prompt=prompt,
                new_tokens=options.tiny_new_tokens, warmup=options.warmup, iters=options.iters,
                hf_compile=options.hf_compile, hf_compile_timeout_s=options.hf_compile_timeout_s,
                bandwidth_mb=options.bandwidth_mb, decode_form=RECOMMENDED_DECODE_EXPERTS))
            loaded.pop(name), factories.pop(name)
        for name in options.medium_models:
            say(f"medium {name}")
            model, factory = model_and_factory(name)
            prompt = _medium_prompt(name, model, options)
            report["models"].append(bench_model(
                name, model, factory, context_length=options.medium_context, bucket=options.medium_bucket,
                prompt=prompt, new_tokens=options.medium_new_tokens, warmup=options.warmup,
                iters=options.medium_iters, hf_compile=options.hf_compile,
                hf_compile_timeout_s=options.hf_compile_timeout_s, bandwidth_mb=options.bandwidth_mb,
                decode_form=RECOMMENDED_DECODE_EXPERTS))
            torch._dynamo.reset()

    if "medium-dense" in options.medium_models:
        model, factory = model_and_factory("medium-dense")
        if "ring_kv" in options.sections:
            say("ring KV sweep")
            report["ring_kv"] = {"model": "medium-dense", **bench_ring_kv(
                model, factory, options.ring_contexts, options.ring_steps, options.warmup, options.medium_iters)}
        if "prefill_buckets" in options.sections:
            say("prefill buckets")
            report["prefill_buckets"] = {"model": "medium-dense", **bench_prefill_buckets(
                model, factory, context_length=options.medium_context, buckets=options.prefill_buckets,
                check_tokens=options.bucket_check_tokens, warmup=options.warmup, iters=options.medium_iters)}
    if "medium-moe" in options.medium_models and "experts" in options.sections:
        say("experts: dense vs selective")
        model, factory = model_and_factory("medium-moe")
        prompt = _medium_prompt("medium-moe", model, options)
        report["experts"] = {"model": "medium-moe", **bench_experts(
            model, factory, context_length=options.medium_context, bucket=options.medium_bucket, prompt=prompt,
            new_tokens=options.medium_new_tokens, warmup=options.warmup, iters=options.medium_iters)}

    report["targets"] = check_targets(report)
    report["recommendation"] = {"ring_kv": RECOMMENDED_RING_KV, "decode_experts": RECOMMENDED_DECODE_EXPERTS,
                                "prefill_experts": RECOMMENDED_PREFILL_EXPERTS}
    report["load_average_end"] = _load_average()
    report["peak_rss_mb"] = peak_rss_mb()
    report["wall_s"] = time.perf_counter() - started
    return report


def _load_average() -> list[float] | None:
    with contextlib.suppress(OSError, AttributeError):
        return [round(x, 2) for x in os.getloadavg()]
    return None


# ---- markdown (docs/ROOFLINE.md, notebooks) --------------------------------------------------------
def _f(value: Any, digits: int = 2, suffix: str = "") -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    return f"{value:.{digits}f}{suffix}"


def format_report(report: dict[str, Any]) -> str:
    """The suite's figures as markdown tables."""
    bw = report.get("bandwidth", {})
    lines = [f"Threads: {report.get('threads')}; bandwidth at start: GEMV {_f(bw.get('gemv_gb_s'))} GB/s, "
             f"stream {_f(bw.get('stream_gb_s'))} GB/s; load average {report.get('load_average_start')} → "
             f"{report.get('load_average_end')}.", "",
             "| model | params | gemma4lib tok/s | HF eager tok/s | HF static+compile tok/s | speedup vs eager "
             "| HF compile vs eager | bytes/step MB | bandwidth GB/s | ceiling tok/s | roofline fraction | tokens = HF "
             "| prefill logits Δ |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in report.get("models", []):
        p = m["paths"]
        compiled = p["hf_static_compile"]
        hf_compile = _f(compiled.get("decode_tok_s"), 1) if compiled.get("status") == "ok" else compiled.get("status")
        match = p["gemma4lib"].get("tokens_match_reference")
        lines.append(
            f"| {m['name']} | {m['params'] / 1e6:.1f}M | {_f(p['gemma4lib'].get('decode_tok_s'), 1)} | "
            f"{_f(p['hf_eager'].get('decode_tok_s'), 1)} | {hf_compile} | "
            f"{_f(m['speedup_vs_hf_eager'].get('gemma4lib'), 2, 'x')} | "
            f"{_f(m['speedup_vs_hf_eager'].get('hf_static_compile'), 2, 'x')} | "
            f"{m['bytes_per_step']['total'] / 1e6:.1f} | {_f(m['bandwidth']['gb_s'])} | {_f(m['ceiling_tok_s'], 1)} | "
            f"{_f(m['roofline_fraction'].get('gemma4lib'))} | {_f(match)} | "
            f"{_f(p['gemma4lib'].get('prefill_logits_max_abs_diff'), 6)} |")
    ring = report.get("ring_kv")
    if ring:
        lines += ["", f"Ring KV ({ring['model']}, window {ring['sliding_window']}; decode steps at the end of "
                  "the context):", "",
                  "| context | full-length tok/s | ring tok/s | ring / full | KV MB full | KV MB ring |",
                  "|---|---|---|---|---|---|"]
        for ctx, row in ring["contexts"].items():
            lines.append(f"| {ctx} | {_f(row['full']['decode_tok_s'])} | {_f(row['ring']['decode_tok_s'])} | "
                         f"{_f(row['ring_speedup'], 2, 'x')} | {row['full']['kv_bytes'] / 1e6:.1f} | "
                         f"{row['ring']['kv_bytes'] / 1e6:.1f} |")
        ratios = {k: v for k, v in ring.items() if k.endswith("_over_" + next(iter(ring["contexts"])))}
        lines += ["", ", ".join(f"{k} = {_f(v)}" for k, v in ratios.items())]
    experts = report.get("experts")
    if experts:
        d, pf = experts["decode"], experts["prefill"]
        lines += ["", f"Experts ({experts['model']}):", "",
                  "| form | decode tok/s | bytes/step MB | tokens = HF | prefill ms (bucket "
                  f"{experts['prefill_bucket']}) | first token = HF |", "|---|---|---|---|---|---|"]
        for form in ("dense", "selective"):
            lines.append(f"| {form} | {_f(d[form]['decode_tok_s'])} | {d[form]['bytes_per_step'] / 1e6:.1f} | "
                         f"{_f(d[form]['tokens_match_reference'])} | {_f(pf[form]['prefill_ms'], 1)} | "
                         f"{_f(pf[form]['first_token_matches_reference'])} |")
        rec = experts["recommendation"]
        lines += ["", f"selective / dense decode = {_f(experts['selective_over_dense_decode'])}x "
                  f"(bytes dense / selective = {_f(experts['dense_over_selective_bytes'])}x); measured choice: "
                  f"prefill {rec['prefill']}, decode {rec['decode']} (PortSettings default decode: "
                  f"{rec['port_settings_default_decode']})."]
    buckets = report.get("prefill_buckets")
    if buckets:
        lines += ["", f"Prefill buckets ({buckets['model']}, context {buckets['context_length']}):", "",
                  "| bucket | prefill ms |", "|---|---|"]
        lines += [f"| {b} | {_f(row['prefill_ms'], 1)} |" for b, row in buckets["buckets"].items()]
        lines += ["", "| prompt tokens | bucket used | smallest that fits | tokens = HF |", "|---|---|---|---|"]
        lines += [f"| {p['prompt_tokens']} | {p['bucket']} | {p['smallest_fitting']} | "
                  f"{_f(p['tokens_match_reference'])} |" for p in buckets["placement"]]
    if report.get("targets"):
        lines += ["", "| target | value | met |", "|---|---|---|"]
        lines += [f"| {t['target']} | {_f(t['value'])} | {_f(t['met'])} |" for t in report["targets"]]
    return "\n".join(lines)
