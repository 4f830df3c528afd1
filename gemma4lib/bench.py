"""Benchmark figures for one port: prefill ms and decode tok/s (medians), peak host RSS.

Timings are medians over repeated runs after warm-up; the thread count is recorded with them.
They are measurements to record and compare as ratios within one run, never asserted in tests.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm

from .environment import peak_rss_mb  # noqa: F401  (re-exported: the run record reads it)
from .runtime import HostRuntime


@dataclass
class BenchFigures:
    prefill_ms: float
    decode_tok_s: float
    prefill_ms_runs: list[float]
    decode_tok_s_runs: list[float]
    decode_tokens: int
    threads: int
    warmup: int
    iters: int

    def to_dict(self) -> dict:
        return asdict(self)


def benchmark(runtime: HostRuntime, prompt_ids: Sequence[int], max_new_tokens: int, warmup: int = 1,
              iters: int = 3, progress: bool = False) -> BenchFigures:
    """Median prefill latency and decode throughput of full generations (eos ignored)."""
    prefill_ms, decode_tok_s = [], []
    runs = range(warmup + iters)
    for i in tqdm(runs, desc="benchmark", disable=not progress, leave=False):
        prefill_s = runtime.time_prefill(prompt_ids)
        generation = runtime.generate(prompt_ids, max_new_tokens)
        if i >= warmup:
            prefill_ms.append(prefill_s * 1000)
            if generation.decode_tok_s:
                decode_tok_s.append(generation.decode_tok_s)
    return BenchFigures(statistics.median(prefill_ms), statistics.median(decode_tok_s) if decode_tok_s else 0.0,
                        prefill_ms, decode_tok_s, max_new_tokens - 1, torch.get_num_threads(), warmup, iters)
