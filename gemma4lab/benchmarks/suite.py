"""Side-by-side decode benchmarks: this project's compiled graphs vs Hugging Face `generate`.

`run_suite("cpu")` (what `python -m gemma4lab bench --suite cpu --json` prints) runs, in one process,
on the same model, prompt ids and thread count:

- `gemma4lib`: the device graphs compiled with AOTInductor (ring KV, the recommended expert form
  for decode) driven by the generation engine (`runtime.Engine`);
- `hf_eager`: `lm.generate` with the dynamic cache (what a user runs by default);
- `hf_static_compile`: `lm.generate(cache_implementation="static")` with transformers' own
  `torch.compile` of the forward (a failure or a time-out is recorded with its reason, not dropped).

on the five tiny variants and the two medium configs (`models.medium`), and measures this machine's
memory bandwidth in the same run, so every model gets `bytes_per_step` (computed from shapes,
`inf2.roofline`) and `roofline_fraction = tok/s / (bandwidth / bytes_per_step)`. It also reports the
three decode-side fixes: ring KV at 512-4,096 context (before/after), dense vs selective experts
(decode and prefill), and prefill ms per bucket; and weight-only int8 against the same model's
full-precision graphs (`int8`: decode tok/s, bytes per step, their ratios, the logit error against
the full-precision reference); and the image prefill of the trained vision fixtures (`images`: the
compiled vision graph and image prefill against transformers' eager forward on the same
`pixel_values`, as ratios); and long contexts (`context`: decode with context buckets at 512 to
32K against the bytes each step reads, and an 8K prompt's TTFT against HF's sdpa prefill).
`targets` checks the issue's figures.

Method: one thread (recorded), warm-up runs excluded, medians over `iters` runs, and the paths of
one model are measured interleaved (A, B, C, A, B, C, ...) so load from other processes on the
shared cores hits them alike — compare ratios within one run, not absolute figures across runs.
Decode tok/s of HF paths is timed per step with a logits processor (prefill excluded), like the
runtime's own per-step timing (`benchmarks.hf`). Timings are never asserted in tests.

This module holds the options, the models and `run_suite`; the parts are their own modules:
`paths` (one model, three paths: `bench_model`), `fixes` (ring KV, expert forms, int8, prefill
buckets), `graphs` (`GraphFactory`: the device graphs from `device.build`, compiled by a backend's
`compile_one` and cached by shape, so every bench shares one graph per shape), `measure` (medians,
ratios, the deadline, `recommendation`: `PortSettings`' defaults, read from them, not restated),
`targets` (`check_targets`), `hf` and `report`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from gemma4lab.benchmarks.fixes import bench_experts, bench_int8, bench_prefill_buckets, bench_ring_kv
from gemma4lab.benchmarks.graphs import GraphFactory
from gemma4lab.benchmarks.measure import recommendation
from gemma4lab.benchmarks.paths import bench_model
from gemma4lab.benchmarks.targets import check_targets
from gemma4lab.inf2.bandwidth import measure_bandwidth
from gemma4lab.models.medium import build_medium, get_medium
from gemma4lib.environment import machine, versions
from gemma4lib.errors import UnknownNameError
from gemma4lib.models.loading import LoadedModel, build_tiny
from gemma4lib.models.variants import VARIANTS
from gemma4lib.reference import random_prompt
from gemma4lib.timing import peak_rss_mb

log = logging.getLogger(__name__)

SUITES = ("cpu",)
TINY_VARIANTS = tuple(VARIANTS)
MEDIUM_MODELS = ("medium-dense", "medium-moe")
SCHEMA_VERSION = 1
SECTIONS = ("models", "ring_kv", "experts", "prefill_buckets", "int8", "batch", "mtp", "serve", "images", "context")


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
    # the batch section (benchmarks/batch.py): batched decode graphs next to HF generate
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16)
    batch_context: int = 128
    batch_new_tokens: int = 16
    batch_iters: int = 2
    # the serve section (benchmarks/serve.py): the endpoint's compiled rows and the client counts
    serve_batch: int = 8
    serve_levels: tuple[int, ...] = (1, 4, 8, 16)
    # ... and side by side with `transformers serve` on the same folder (benchmarks/side_by_side.py)
    serve_side_by_side: tuple[str, ...] = ("e2b", "medium-dense")
    # the mtp section's figures where bytes decide (benchmarks/drafting.py): oracle / always-wrong
    # drafters and the verify cost on a bandwidth-bound model, prompt lookup on a real trained one
    mtp_variants: tuple[str, ...] | None = None  # the tiny targets drafted by their assistants (None: MTP_VARIANTS)
    mtp_bound_models: tuple[str, ...] = ("medium-dense",)
    mtp_bound_draft_tokens: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)
    mtp_bound_context: int = 128
    mtp_bound_new_tokens: int = 40
    prompt_lookup_models: tuple[str, ...] = ("gemma3-270m",)
    prompt_lookup_draft_tokens: tuple[int, ...] = (4,)
    prompt_lookup_new_tokens: int = 48
    # the images section (benchmarks/images.py): the trained vision fixtures' image prefill next to HF eager
    image_variants: tuple[str, ...] = ("e2b",)
    # the context section (benchmarks/context.py): decode with context buckets at each context, the
    # deployment's context the longest; prompts fill the contexts up to the fill limit (its prompt is
    # also the TTFT prompt against HF's sdpa prefill), in chunks of the prefill bucket
    context_model: str = "medium-dense"
    context_lengths: tuple[int, ...] = (512, 2048, 8192, 32768)
    context_fill_limit: int = 8192
    context_prefill_bucket: int = 512
    context_steps: int = 16

    @classmethod
    def quick(cls, **changes: Any) -> SuiteOptions:
        """Tiny models only, two timed runs, no torch.compile: the report's schema in minutes, not figures."""
        base = cls(medium_models=(), warmup=1, iters=2, hf_compile=False, bandwidth_mb=256, sections=("models",))
        return replace(base, **changes)


# ---- the suite ------------------------------------------------------------------------------------
def load_bench_model(name: str) -> LoadedModel:
    """A suite model by name: a tiny variant at its seed, or a medium config (`models.medium`)."""
    if name in VARIANTS:
        variant = VARIANTS[name]
        return build_tiny(variant, seed=variant.tiny_seed)
    return build_medium(name)


def _medium_prompt(name: str, model: LoadedModel, options: SuiteOptions) -> list[int]:
    return random_prompt(model.config.vocab_size, options.medium_prompt_tokens, get_medium(name).prompt_seed)


def _bench_prompt(name: str, model: LoadedModel, options: SuiteOptions) -> list[int]:
    """The suite's prompt for a model: a tiny variant's (its seed + 1), or a medium config's."""
    if name in VARIANTS:
        return random_prompt(model.config.vocab_size, options.tiny_prompt_tokens, VARIANTS[name].tiny_seed + 1)
    return _medium_prompt(name, model, options)


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

    if "batch" in options.sections:
        from gemma4lab.benchmarks.batch import bench_batch_model

        report["batch"] = []
        for name in options.medium_models:
            say(f"batch {name}: B = {options.batch_sizes}")
            model, _ = model_and_factory(name)
            report["batch"].append(
                bench_batch_model(
                    name,
                    model,
                    backend=options.backend,
                    batch_sizes=options.batch_sizes,
                    context_length=options.batch_context,
                    bucket=options.medium_bucket,
                    prompt_tokens=options.medium_prompt_tokens,
                    new_tokens=options.batch_new_tokens,
                    warmup=options.warmup,
                    iters=options.batch_iters,
                    decode_form=recommended["decode_experts"],
                    bandwidth_mb=options.bandwidth_mb,
                )
            )
            loaded.pop(name), factories.pop(name)

    if "mtp" in options.sections:  # drafting with the assistant vs plain decode (benchmarks/mtp.py)
        from gemma4lab.benchmarks.mtp import bench_mtp

        say("mtp: decode with and without the assistant's drafts")
        variants = {} if options.mtp_variants is None else {"variants": options.mtp_variants}
        report["mtp"] = bench_mtp(backend=options.backend, warmup=options.warmup, iters=options.iters, **variants)
        report["mtp"].update(drafting_where_bytes_decide(options, say))

    if "serve" in options.sections:  # the endpoint under concurrent streaming clients (benchmarks/serve.py)
        from gemma4lab.benchmarks.serve import bench_serve

        say(f"serve: e2b, B = {options.serve_batch}, {options.serve_levels} concurrent streaming clients")
        report["serve"] = bench_serve(batch=options.serve_batch, backend=options.backend, levels=options.serve_levels)
        from gemma4lab.benchmarks.side_by_side import bench_side_by_side

        report["serve"]["side_by_side"] = []
        for name in options.serve_side_by_side:
            say(f"serve side by side: {name}, this endpoint and transformers serve on the same folder")
            report["serve"]["side_by_side"].append(
                bench_side_by_side(
                    name, batch=options.serve_batch, backend=options.backend, levels=options.serve_levels
                )
            )

    if "images" in options.sections:  # image prefill: vision graph + prefill vs HF's forward (benchmarks/images.py)
        from gemma4lab.benchmarks.images import bench_images

        say(f"images: {options.image_variants}, the vision fixture's image prefill vs HF eager")
        report["images"] = bench_images(
            options.image_variants, backend=options.backend, warmup=options.warmup, iters=options.iters
        )
    if "context" in options.sections:  # long contexts: decode buckets vs bytes, TTFT vs HF sdpa (benchmarks/context.py)
        from gemma4lab.benchmarks.context import bench_context

        say(f"context: {options.context_model} at {options.context_lengths}, TTFT of {options.context_fill_limit}")
        report["context"] = bench_context(
            options.context_model,
            load_bench_model(options.context_model),
            backend=options.backend,
            contexts=options.context_lengths,
            fill_limit=options.context_fill_limit,
            prefill_bucket=options.context_prefill_bucket,
            steps=options.context_steps,
            warmup=options.warmup,
            iters=options.medium_iters,
            bandwidth_mb=options.bandwidth_mb,
        )
        torch._dynamo.reset()
    report["targets"] = check_targets(report)
    report["recommendation"] = recommended
    report["load_average_end"] = _load_average()
    report["peak_rss_mb"] = peak_rss_mb()
    report["wall_s"] = time.perf_counter() - started
    return report


def drafting_where_bytes_decide(options: SuiteOptions, say: Callable[[str], None]) -> dict[str, Any]:
    """The mtp section's bounds (oracle, always-wrong, verify cost) on the bandwidth-bound models and
    prompt lookup on the real trained ones (`benchmarks.drafting`), with their headline keys."""
    from gemma4lab.benchmarks.drafting import REPEAT_PROMPTS, bench_bounds, bench_prompt_lookup, summary_keys

    bounds, lookups = [], []
    for name in options.mtp_bound_models:
        say(f"mtp bounds {name}: oracle and always-wrong drafters, k = {options.mtp_bound_draft_tokens}")
        model = load_bench_model(name)
        bounds.append(
            bench_bounds(
                name,
                model,
                _bench_prompt(name, model, options),
                backend=options.backend,
                draft_tokens=options.mtp_bound_draft_tokens,
                context_length=options.mtp_bound_context,
                bucket=options.medium_bucket,
                new_tokens=options.mtp_bound_new_tokens,
                warmup=options.warmup,
                iters=options.medium_iters,
            )
        )
        del model
        torch._dynamo.reset()
    for name in options.prompt_lookup_models:
        say(f"mtp prompt lookup {name}: k = {options.prompt_lookup_draft_tokens}")
        model = load_real_model(name)
        if isinstance(model, str):  # not on this machine: say so in the report, never a substitute figure
            lookups.append({"model": name, "skipped": model, "rows": []})
            continue
        from gemma4lib.runtime import encode_prompt

        prompts = {p: encode_prompt(model.tokenizer, text, chat=False) for p, text in REPEAT_PROMPTS.items()}
        lookups.append(
            bench_prompt_lookup(
                name,
                model,
                prompts,
                backend=options.backend,
                draft_tokens=options.prompt_lookup_draft_tokens,
                new_tokens=options.prompt_lookup_new_tokens,
                warmup=options.warmup,
                iters=options.medium_iters,
            )
        )
        del model
        torch._dynamo.reset()
    return {"bounds": bounds, "prompt_lookup": lookups, **summary_keys(bounds, lookups)}


def load_real_model(name: str) -> LoadedModel | str:
    """A real trained model by name (only Gemma 3 270M, from its PyPI package), or why it cannot load."""
    from gemma4lab.models.gemma3_real import GEMMA3_270M, load_gemma3_270m
    from gemma4lib.errors import EnvironmentMismatchError

    if name != GEMMA3_270M.name:
        raise UnknownNameError("real model", name, (GEMMA3_270M.name,))
    try:
        return load_gemma3_270m()
    except EnvironmentMismatchError as error:
        return str(error)


def _load_average() -> list[float] | None:
    with contextlib.suppress(OSError, AttributeError):
        return [round(x, 2) for x in os.getloadavg()]
    return None
