"""Timing one runtime: prefill ms and decode tok/s (medians), decode steps alone, peak host RSS.

This is the part of the benchmarks that sits below `port`: `port` times its own run with
`benchmark`, and the suite (`benchmarks.suite`, above `port`) times its graphs with the same code,
so a figure in a run record and one in a suite report are measured alike.

Timings are medians over repeated runs after warm-up; the thread count is recorded with them.
They are measurements to record and compare as ratios within one run, never asserted in tests.
"""

from __future__ import annotations

import resource
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from ..runtime import HostRuntime

if TYPE_CHECKING:  # type names only: the suite sits above `port`, this module below it
    from ..loading import LoadedModel
    from .suite import Step


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, in MiB (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 1024 / (1024 if sys.platform == "darwin" else 1)


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


def benchmark(runtime: HostRuntime, prompt_ids: Sequence[int], max_new_tokens: int, warmup: int = 1,
              iters: int = 3, progress: bool = False) -> BenchFigures:
    """Median prefill latency and decode throughput of full generations (eos ignored, so every run
    decodes the same number of tokens and runs compare)."""
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


@torch.no_grad()
def time_decode_steps(model: LoadedModel, step: Step, positions: Sequence[int], token: int = 5) -> float:
    """Decode tok/s of `step` over the given positions, as the runtime's decode loop runs it
    (host embedding + step + greedy argmax), on fresh buffers: timing does not depend on their
    contents, so any position of a long context can be timed without filling it first."""
    runtime = HostRuntime(model, {}, step.fn, step.graph.new_kv(), step.shape.context_length)
    started = time.perf_counter()
    for position in positions:
        inputs = runtime.embed(torch.tensor([[token]]))
        logits = step.fn(*inputs, torch.tensor([position]), torch.tensor([1]), *runtime.kv)
        token = int(torch.argmax(logits[0]))
    return len(positions) / (time.perf_counter() - started)
