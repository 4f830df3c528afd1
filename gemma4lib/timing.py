"""Timing one runtime: prefill ms and decode tok/s (medians), decode steps alone, peak host RSS.

This is the part of the benchmarks that sits below `port`: `port` times its own run with
`benchmark`, and the suite (`benchmarks.suite`, above `port`) times its graphs with the same code,
so a figure in a run record and one in a suite report are measured alike.

Timings are medians over repeated runs after warm-up; the thread count is recorded with them.
They are measurements to record and compare as ratios within one run, never asserted in tests.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from .environment import peak_rss_mb  # noqa: F401  (re-exported with the other figures)
from .runtime import Engine, Request


@dataclass
class BenchFigures:
    """Medians and the runs they came from, with the conditions (threads, warm-up) that shaped them."""

    prefill_ms: float
    decode_tok_s: float
    prefill_ms_runs: list[float]
    decode_tok_s_runs: list[float]
    decode_tokens: int
    threads: int
    warmup: int
    iters: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def benchmark(
    engine: Engine, requests: Sequence[Request], warmup: int = 1, iters: int = 3, progress: bool = False
) -> BenchFigures:
    """Median prefill latency (row 0's prompt) and decode throughput (all rows' tokens per second
    of steps) of full generations; pass requests without eos so every run decodes alike."""
    prefill_ms, decode_tok_s = [], []
    runs = range(warmup + iters)
    for i in tqdm(runs, desc="benchmark", disable=not progress, leave=False):
        prefill_s = engine.time_prefill(requests[0].prompt_ids)
        generation = engine.generate_rows(list(requests))
        if i >= warmup:
            prefill_ms.append(prefill_s * 1000)
            if generation.decode_tok_s:
                decode_tok_s.append(generation.decode_tok_s)
    return BenchFigures(
        statistics.median(prefill_ms),
        statistics.median(decode_tok_s) if decode_tok_s else 0.0,
        prefill_ms,
        decode_tok_s,
        max(r.max_new_tokens for r in requests) - 1,
        torch.get_num_threads(),
        warmup,
        iters,
    )


def time_interleaved(runs: Mapping[str, Callable[[], Any]], warmup: int, iters: int) -> dict[str, list[float]]:
    """decode tok/s of each named run (it returns an object with `decode_tok_s`), `iters` rounds after
    `warmup`, the runs taking turns within a round: load from other work then hits every run alike,
    so their ratio holds where back-to-back blocks of runs would each see different neighbours."""
    figures: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(warmup + iters):
        for name, run in runs.items():
            rate = run().decode_tok_s
            if i >= warmup and rate:
                figures[name].append(rate)
    return figures


def bench_drafted(
    engine: Engine, plain: Engine, requests: Sequence[Request], warmup: int, iters: int
) -> dict[str, Any]:
    """Decode tok/s with and without drafting over the same graphs' model, the two engines taking
    turns (`time_interleaved`), and whether they give the same tokens (greedy drafting must)."""
    requests = list(requests)
    runs = time_interleaved(
        {"with_draft": lambda: engine.generate_rows(requests), "without_draft": lambda: plain.generate_rows(requests)},
        warmup,
        iters,
    )
    drafted, undrafted = engine.generate_rows(requests), plain.generate_rows(requests)
    with_draft = statistics.median(runs["with_draft"]) if runs["with_draft"] else None
    without = statistics.median(runs["without_draft"]) if runs["without_draft"] else None
    return {
        "decode_tok_s_with_draft": with_draft,
        "decode_tok_s_without_draft": without,
        "speedup_with_draft": with_draft / without if with_draft and without else None,
        "bench_accepted_per_step": drafted.rows[0].accepted_per_step,
        "decode_tok_s_runs": runs,
        "bench_tokens": requests[0].max_new_tokens,
        "plain_tokens_match": [r.tokens for r in drafted.rows] == [r.tokens for r in undrafted.rows],
    }
