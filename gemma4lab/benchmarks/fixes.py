"""The three fixes, measured: ring K/V buffers, the expert forms, int8 weights, and the prefill buckets."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import Any

from gemma4lab.benchmarks.graphs import GraphFactory, time_decode_steps
from gemma4lab.benchmarks.measure import _median, _ratio, recommendation
from gemma4lab.inf2.roofline import decode_bytes
from gemma4lib.device.build import PREFILL_EXPERTS
from gemma4lib.device.quant import round_model_weights
from gemma4lib.models.loading import LoadedModel
from gemma4lib.reference import random_prompt, reference_greedy, teacher_forced_logits
from gemma4lib.runtime import softcap


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
    prefill_runtimes = {form: factory.runtime(context_length, (bucket,), ring, form, form) for form in forms}
    decode_runs: dict[str, list[float]] = {f: [] for f in forms}
    prefill_runs: dict[str, list[float]] = {f: [] for f in forms}
    match: dict[str, bool] = {}
    prompt_bucket = list(prompt)[:bucket]
    first_reference = reference_greedy(model.lm, prompt_bucket, 1)
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
