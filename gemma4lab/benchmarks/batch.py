"""The suite's `batch` section: total decode tok/s of the batched graphs at B = 1, 2, 4, 8, 16, next
to Hugging Face `generate` on the same batched prompts, with the bandwidth measured beside each model.

Per model and batch size: B random prompts of different lengths, this project's decode graph of
batch B (compiled by the suite's backend; prefill runs the same batched prefill graph uncompiled,
it is not timed), the engine's `generate_rows` timed per decode step (eos off, every row
decodes `new_tokens`), and HF `generate` on the same prompts left-padded with an attention mask,
timed by its own step clock; the two are timed interleaved (ours, HF, ours, HF, ...). The step's
bytes come from `batch_roofline.batch_decode_bytes` (the weights once, the selective experts as the
graph reads them: per row, each once past B x k >= E where the graph's `experts_read` is dense, or
at most min(B x k, E) slices where it is grouped (each routed expert once); K/V x B), so each
figure also reads as the bandwidth it drew (steps/s x bytes/step) and its fraction of the
machine's stream and GEMV bandwidth, measured before and after the model (best of several
repeats); `bandwidth_moved` flags a model whose two measurements differ by more than
`BANDWIDTH_TOLERANCE` (the neighbours changed the machine under it).

`speedup_b8_over_b1`: total tok/s at B=8 over B=1, this project's graphs.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import torch

from gemma4lab.benchmarks.hf import StepClock
from gemma4lab.inf2.bandwidth import measure_bandwidth
from gemma4lab.inf2.batch_roofline import batch_decode_bytes
from gemma4lab.inf2.roofline import GB
from gemma4lib.backends.engine import engine_over
from gemma4lib.backends.registry import cpu_balance, get_backend
from gemma4lib.device.build import device_graph
from gemma4lib.device.graph import GraphShape
from gemma4lib.models.loading import LoadedModel
from gemma4lib.reference import random_prompt, reference_greedy
from gemma4lib.runtime import Engine, Request

BATCH_SIZES = (1, 2, 4, 8, 16)
BANDWIDTH_TOLERANCE = 0.15  # relative change between the before and after measurements


def best_bandwidth(size_mb: int, samples: int = 3) -> dict[str, float]:
    """The best of `samples` runs of `inf2.bandwidth.measure_bandwidth` (each a median of 7), per kind."""
    runs = [measure_bandwidth(size_mb) for _ in range(samples)]
    return {
        "stream_gb_s": max(r["stream_gb_s"] for r in runs),
        "gemv_gb_s": max(r["gemv_gb_s"] for r in runs),
        "samples": samples,
    }


def batch_prompts(model: LoadedModel, batch: int, tokens: int, seed: int) -> list[list[int]]:
    """`batch` seeded random prompts of different lengths: `tokens`, then 1 fewer per row (>= 4)."""
    vocab = model.config.vocab_size
    return [random_prompt(vocab, max(4, tokens - (i % 8)), seed + i) for i in range(batch)]


def hf_batch_generate(lm: torch.nn.Module, prompts: Sequence[Sequence[int]], new_tokens: int) -> dict[str, Any]:
    """HF greedy `generate` of the whole batch (left-padded, attention mask), exactly `new_tokens`."""
    from transformers import LogitsProcessorList

    longest = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, longest - len(p) :] = torch.tensor(list(p))
        mask[r, longest - len(p) :] = 1
    clock = StepClock()
    with torch.no_grad():
        out = lm.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            logits_processor=LogitsProcessorList([clock]),
        )
    steps = clock.decode_tok_s()
    return {"tokens": out[:, longest:].tolist(), "decode_tok_s": None if steps is None else steps * len(prompts)}


def batch_engine(
    model: LoadedModel, batch: int, context_length: int, bucket: int, form: str, backend: str, cache
) -> tuple[Engine, Any]:
    """The engine over a batch-`batch` decode graph compiled by `backend` (one graph on its own:
    `compile_one`) and the same batch's prefill graph uncompiled (not timed); and the decode graph."""
    decode = device_graph(model, GraphShape(batch, 1, context_length, True), form, compute_balance=cpu_balance(backend))
    prefill = device_graph(model, GraphShape(batch, bucket, context_length, True), "dense")
    fns = {f"prefill{bucket}": prefill, "decode": get_backend(backend).compile_one(decode, cache).fn}
    return engine_over(model, fns, decode, kv=decode.new_kv()), decode


def bench_batch_model(
    name: str,
    model: LoadedModel,
    *,
    backend: str = "cpu",
    batch_sizes: Sequence[int] = BATCH_SIZES,
    context_length: int = 128,
    bucket: int = 16,
    prompt_tokens: int = 16,
    new_tokens: int = 16,
    warmup: int = 1,
    iters: int = 2,
    decode_form: str = "selective",
    bandwidth_mb: int = 512,
    seed: int = 7,
    cache=None,
) -> dict[str, Any]:
    """One model's batch sweep (module doc); figures are medians over `iters` timed generations."""
    before = best_bandwidth(bandwidth_mb)
    form = decode_form if getattr(model.config, "enable_moe_block", False) else "dense"
    dtype_bytes = next(model.lm.parameters()).element_size()
    rows = []
    # the prompts of batch b are the first b of the largest batch's: one reference per prompt
    all_prompts = batch_prompts(model, max(batch_sizes), prompt_tokens, seed)
    references = [reference_greedy(model.lm, p, new_tokens) for p in all_prompts]
    for b in batch_sizes:
        prompts = all_prompts[:b]
        requests = [Request(p, new_tokens) for p in prompts]  # greedy, no eos: every row decodes new_tokens
        engine, decode_graph = batch_engine(model, b, context_length, bucket, form, backend, cache)
        ours, hf = [], []
        for _ in range(warmup):
            generation = engine.generate_rows(requests)
        for _ in range(iters):  # interleaved (ours, HF, ours, HF): load hits both sides of the ratio alike
            generation = engine.generate_rows(requests)
            if generation.decode_tok_s:
                ours.append(generation.decode_tok_s)
            hf.append(hf_batch_generate(model.lm, prompts, new_tokens))
        hf_tok_s = [h["decode_tok_s"] for h in hf if h["decode_tok_s"]]
        read = decode_graph.experts_read
        steps = batch_decode_bytes(
            model.lm,
            b,
            context_length=context_length,
            ring=True,
            experts=form,
            dtype_bytes=dtype_bytes,
            experts_read=read,
        )
        total = statistics.median(ours) if ours else None
        drawn = None if total is None else total / b * steps["total"] / GB  # GB/s the step rate draws
        rows.append(
            {
                "batch": b,
                "prompt_lengths": [len(p) for p in prompts],
                "gemma4lib_tok_s": total,
                "gemma4lib_tok_s_per_row": None if total is None else total / b,
                "gemma4lib_tok_s_runs": ours,
                "hf_eager_tok_s": statistics.median(hf_tok_s) if hf_tok_s else None,
                "hf_eager_tok_s_runs": hf_tok_s,
                "over_hf": (total / statistics.median(hf_tok_s)) if total and hf_tok_s else None,
                "rows_match_reference": [r.tokens == ref for r, ref in zip(generation.rows, references, strict=False)],
                "rows_equal_hf": [
                    mine == theirs
                    for mine, theirs in zip(
                        [r.tokens for r in generation.rows], hf[-1]["tokens"] if hf else [], strict=False
                    )
                ],
                "experts_read": read if form != "dense" else None,
                "bytes_per_step_gb": steps["total"] / GB,
                "drawn_gb_s": drawn,
            }
        )
    after = best_bandwidth(bandwidth_mb)
    best = {kind: max(before[kind], after[kind]) for kind in ("stream_gb_s", "gemv_gb_s")}
    for row in rows:  # against the machine's best of the two measurements
        drawn = row["drawn_gb_s"]
        row["fraction_of_stream"] = None if drawn is None else drawn / best["stream_gb_s"]
        row["fraction_of_gemv"] = None if drawn is None else drawn / best["gemv_gb_s"]
    moved = {
        kind: abs(after[kind] - before[kind]) / before[kind] > BANDWIDTH_TOLERANCE
        for kind in ("stream_gb_s", "gemv_gb_s")
    }
    by_b = {r["batch"]: r for r in rows}
    b1, b8 = by_b.get(1, {}).get("gemma4lib_tok_s"), by_b.get(8, {}).get("gemma4lib_tok_s")
    return {
        "model": name,
        "decode_experts": form,
        "backend": backend,
        "context_length": context_length,
        "new_tokens": new_tokens,
        "threads": torch.get_num_threads(),
        "bandwidth_before": before,
        "bandwidth_after": after,
        "bandwidth_moved": any(moved.values()),
        "rows": rows,
        "tokens_match_reference": all(all(r["rows_match_reference"]) for r in rows),
        "speedup_b8_over_b1": (b8 / b1) if b1 and b8 else None,
        "min_over_hf": min((r["over_hf"] for r in rows if r["over_hf"]), default=None),
    }


__all__ = ["BATCH_SIZES", "batch_engine", "bench_batch_model", "best_bandwidth", "hf_batch_generate"]
