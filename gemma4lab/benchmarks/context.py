"""The suite's `context` section (issue 48, "Bench"): decode at long contexts with context buckets,
each step against the bytes it must read, and the time to first token of a long prompt against
Hugging Face's sdpa prefill of the same prompt.

One deployment, what `PortSettings(context_length=L, prefill_buckets=(b,), context_buckets=S)`
compiles (`device.build.graph_set`, each graph through the suite's backend): the K/V buffers hold
the whole context L (sliding layers as rings), `decode@C` reads the first C slots of every
full-length buffer, `decode` the whole context. The buckets S are the measured contexts below L
(512 / 2,048 / 8,192 in a 32,768 context by default): the steps are timed just under each bucket,
so each reads ~ its live positions (97-100 %), one compile per measured context (a power-of-two
ladder would add compiles without changing any timed step, and only halve the worst case of a
step just past a bucket, which reads up to 4x its live positions here).

Per context c: a prompt of c - steps tokens, prefilled in chunks of b (`Engine.chunks`: the first
chunk through `prefill{b}@C`, the later ones through the whole-context prefill, as a port runs
them), then `steps` decode steps timed from there (`Engine.time_steps` over the filled K/V, so the
last step's reach is c: it runs `decode@c`). Contexts past `fill_limit` are timed over buffers that
were not filled (a step's time does not depend on what the K/V hold) and their fill time is
computed from the measured chunks instead (`fill_s_computed`), to keep the section's run short.
Each step's bytes are the weights (`inf2.roofline.decode_bytes`) plus the K/V it reads, counted
from the graph's own buffer shapes and `GraphShape.slots_read` (ring buffers read whole); its
bytes-bound time is those bytes over the machine's bandwidth, measured before and after in the
same run (`best_bandwidth`, the better of stream and GEMV); `over_bytes_bound` is the step's
measured time over it (goal <= 1.2). At the fill limit (8K) the same filled K/V are also decoded
by the whole-context graph (`decode`, every slot of L read): `bucket_speedup` is the gain of the
bucket, a ratio within the run.

TTFT: the prefill of the fill-limit prompt (chunked) in this deployment, and again in one sized
for the prompt (context = the fill limit, the same chunk bucket: its later chunks read that
context, not L), each next to HF's forward over the same prompt (`attn_implementation="sdpa"`,
same dtype and threads, the logits of the last position only, as `generate` asks for them). Every
first token must equal HF's (raised otherwise: equality before speed); `ttft_hf_over_ours` is the
speed-up (goal >= 1.5).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from gemma4lab.benchmarks.batch import best_bandwidth
from gemma4lab.inf2.roofline import GB, decode_bytes
from gemma4lib.backends.engine import engine_over
from gemma4lib.backends.registry import get_backend
from gemma4lib.device.build import graph_set
from gemma4lib.device.graph import DeviceGraph
from gemma4lib.errors import SettingsError
from gemma4lib.models.loading import LoadedModel
from gemma4lib.reference import random_prompt
from gemma4lib.runtime import Engine, softcap
from gemma4lib.timing import peak_rss_mb

CONTEXTS = (512, 2048, 8192, 32768)


def step_bytes(model: LoadedModel, graph: DeviceGraph, dtype_bytes: int) -> dict[str, float]:
    """Bytes one batch-1 decode step of `graph` reads: every weight once, and of each K/V buffer the
    slots its shape attends over (`GraphShape.slots_read`: a bucket's first C of a full-length
    buffer, a ring's all)."""
    shape = graph.shape
    kv = sum(
        b * heads * shape.slots_read(slots) * dim * dtype_bytes
        for b, heads, slots, dim in graph.layout.buffer_shapes(1, shape.context_length, shape.ring)
    )
    weights = decode_bytes(model, context_length=shape.context_length, ring=shape.ring).weights
    return {"weights": weights, "kv": float(kv), "total": weights + kv}


def hf_first_token(lm: torch.nn.Module, prompt: Sequence[int]) -> tuple[int, torch.Tensor, float]:
    """HF's forward over the whole prompt with sdpa attention (the cache built, the last position's
    logits only, as `generate`'s prefill does): (argmax, logits, seconds). The model's attention
    implementation is put back afterwards."""
    previous = lm.config._attn_implementation
    lm.set_attn_implementation("sdpa")
    try:
        ids = torch.tensor([list(prompt)])
        with torch.no_grad():
            started = time.perf_counter()
            logits = lm(input_ids=ids, use_cache=True, logits_to_keep=1).logits[0, -1]
            elapsed = time.perf_counter() - started
    finally:
        lm.set_attn_implementation(previous)
    return int(logits.argmax()), logits.double(), elapsed


def _engine(model: LoadedModel, backend: str, context_length: int, bucket: int, buckets: Sequence[int], cache):
    """A port's graph set (batch 1, ring K/V, dense) compiled one by one; the engine over it, the
    graphs, the compiled steps, the K/V and each graph's compile seconds."""
    graphs = graph_set(
        model,
        batch=1,
        context_length=context_length,
        ring=True,
        prefill_buckets=(bucket,),
        context_buckets=tuple(buckets),
        decode_experts="dense",
    )
    compiled, compile_s = {}, {}
    for name, graph in graphs.named().items():
        one = get_backend(backend).compile_one(graph, cache)
        compiled[name], compile_s[name] = one.fn, one.compile_s
    kv = graphs.decode.new_kv()
    return engine_over(model, compiled, graphs, kv=kv), graphs, compiled, kv, compile_s


def _timed_steps(engine: Engine, token: int, position: int, steps: int, warmup: int, iters: int) -> list[float]:
    """Seconds per step of `steps` decode steps from `position`, one figure per timed run."""
    runs = []
    for i in range(warmup + iters):
        seconds = engine.time_steps(token, position, steps)
        if i >= warmup:
            runs.append(seconds / steps)
    return runs


def _check_first_token(label: str, ours: int, hf: int) -> None:
    if ours != hf:
        raise RuntimeError(
            f"context bench: {label} chose token {ours} after the long prompt, HF's sdpa forward {hf}: the "
            "speed figures of a wrong answer mean nothing; run tests/test_context_buckets.py and "
            "tests/test_long_prompts.py to find which graph differs"
        )


def bench_context(
    name: str,
    model: LoadedModel,
    *,
    backend: str = "cpu",
    contexts: Sequence[int] = CONTEXTS,
    fill_limit: int = 8192,
    prefill_bucket: int = 512,
    steps: int = 16,
    warmup: int = 1,
    iters: int = 3,
    bandwidth_mb: int = 512,
    seed: int = 5,
    cache=None,
) -> dict[str, Any]:
    """The section on one model (module doc); step figures are medians over `iters` timed runs."""
    contexts = sorted(contexts)
    if fill_limit not in contexts or any(c <= steps for c in contexts):
        raise SettingsError(
            f"context bench: fill_limit {fill_limit} must be one of the contexts {contexts}, each longer than "
            f"steps {steps} (the TTFT prompt is the fill-limit context's prompt)"
        )
    before = best_bandwidth(bandwidth_mb)
    dtype_bytes = next(model.lm.parameters()).element_size()
    longest = contexts[-1]
    engine, graphs, compiled, kv, compile_s = _engine(model, backend, longest, prefill_bucket, contexts[:-1], cache)
    whole = engine_over(model, {"decode": compiled["decode"]}, graphs.decode, kv=kv)  # the same K/V, no bucket
    by_reads = {g.shape.reads: g for n, g in graphs.named().items() if n.startswith("decode")}
    rows, fills, first_token = [], {}, None
    chunk_s: list[float] = []
    for c in contexts:
        prompt = random_prompt(model.config.vocab_size, c - steps, seed + c)
        filled = c <= fill_limit
        token = 5
        if filled:
            started = time.perf_counter()
            result = engine.generate(prompt, 1, keep_logits=True)
            fills[c] = {"prompt": prompt, "result": result, "wall_s": time.perf_counter() - started}
            token = result.tokens[0]
            chunk_s.append(result.prefill_s / result.chunks)
        reads = next((r for r in sorted(x for x in by_reads if x) if r >= c), None)
        runs = _timed_steps(engine, token, c - steps, steps, warmup, iters)
        step_s = statistics.median(runs)
        bytes_read = step_bytes(model, by_reads[reads], dtype_bytes)
        row = {
            "context": c,
            "prompt_tokens": c - steps,
            "filled": filled,
            "chunks": fills[c]["result"].chunks if filled else math.ceil((c - steps) / prefill_bucket),
            "prefill_s": fills[c]["result"].prefill_s if filled else None,
            "graph": "decode" if reads is None else f"decode@{reads}",
            "slots_read": reads or longest,
            "step_s": step_s,
            "step_s_runs": runs,
            "decode_tok_s": 1 / step_s,
            "bytes": bytes_read,
        }
        if not filled:  # every chunk of a prompt this long reads the whole context, as the measured ones past the first
            row["fill_s_computed"] = row["chunks"] * max(chunk_s) if chunk_s else None
        if c == fill_limit and reads is not None:
            whole_runs = _timed_steps(whole, token, c - steps, steps, warmup, iters)
            row["whole_context"] = {
                "graph": "decode",
                "slots_read": longest,
                "step_s": statistics.median(whole_runs),
                "step_s_runs": whole_runs,
                "decode_tok_s": 1 / statistics.median(whole_runs),
                "bytes": step_bytes(model, graphs.decode, dtype_bytes),
            }
            row["bucket_speedup"] = row["whole_context"]["step_s"] / step_s
        rows.append(row)
        if c == fill_limit:
            first_token = token
    ttft = _ttft(model, backend, fills[fill_limit], fill_limit, prefill_bucket, longest, cache)
    _check_first_token(f"the {longest}-token deployment", first_token, ttft["hf"]["first_token"])
    after = best_bandwidth(bandwidth_mb)
    best = max(before["stream_gb_s"], before["gemv_gb_s"], after["stream_gb_s"], after["gemv_gb_s"]) * GB
    for row in [*rows, *(r["whole_context"] for r in rows if "whole_context" in r)]:
        row["bytes_bound_s"] = row["bytes"]["total"] / best
        row["over_bytes_bound"] = row["step_s"] / row["bytes_bound_s"]
    return {
        "model": name,
        "backend": backend,
        "context_length": longest,
        "context_buckets": list(contexts[:-1]),
        "prefill_bucket": prefill_bucket,
        "fill_limit": fill_limit,
        "steps": steps,
        "threads": torch.get_num_threads(),
        "dtype_bytes": dtype_bytes,
        "bandwidth_before": before,
        "bandwidth_after": after,
        "bandwidth_used_gb_s": best / GB,
        "rows": rows,
        "max_over_bytes_bound": max(r["over_bytes_bound"] for r in rows),
        "ttft": ttft,
        "kv_buffer_bytes": float(graphs.layout.buffer_bytes(longest, True, dtype_bytes)),
        "compile_s": compile_s,
        "peak_rss_mb": peak_rss_mb(),
    }


def _ttft(
    model: LoadedModel, backend: str, fill: dict[str, Any], tokens: int, bucket: int, longest: int, cache
) -> dict[str, Any]:
    """The fill-limit prompt's TTFT: the deployment's chunked prefill (already run: `fill`), the same in
    a deployment whose context is the prompt's (`tokens`), and HF's sdpa forward; tokens checked."""
    prompt, result = fill["prompt"], fill["result"]
    sized = _engine(model, backend, tokens, bucket, (), cache)[0]
    started = time.perf_counter()
    sized_result = sized.generate(prompt, 1, keep_logits=True)
    sized_s = time.perf_counter() - started
    hf_token, hf_logits, hf_s = hf_first_token(model.lm, prompt)
    _check_first_token(f"the {tokens}-token deployment", sized_result.tokens[0], hf_token)
    cap = model.config.final_logit_softcapping

    def ours(label: str, row, wall_s: float, context: int) -> dict[str, Any]:
        logits = softcap(row.first_logits.reshape(-1), cap).double()
        return {
            "deployment_context": context,
            "chunks": row.chunks,
            "ttft_s": wall_s,
            "prefill_s": row.prefill_s,
            "first_token": row.tokens[0],
            "first_token_equal_hf": row.tokens[0] == hf_token,
            "logits_max_abs_diff_hf": float((logits - hf_logits).abs().max()),
            "ttft_hf_over_ours": hf_s / wall_s,
            "label": label,
        }

    top2 = hf_logits.topk(2).values
    return {
        "prompt_tokens": len(prompt),
        "hf": {
            "attn_implementation": "sdpa",
            "ttft_s": hf_s,
            "first_token": hf_token,
            "margin": float(top2[0] - top2[1]),
        },
        "ours": [
            ours(f"context {longest}, buckets", result, fill["wall_s"], longest),
            ours(f"context {tokens} (sized for the prompt)", sized_result, sized_s, tokens),
        ],
    }


__all__ = ["CONTEXTS", "bench_context", "hf_first_token", "step_bytes"]
