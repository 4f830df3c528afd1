"""Timing one runtime: prefill ms and decode tok/s (medians), decode steps alone, peak host RSS.

This is the part of the benchmarks that sits below `port`: `port` times its own run with
`benchmark`, and the suite (`benchmarks.suite`, above `port`) times its graphs with the same code,
so a figure in a run record and one in a suite report are measured alike.

Timings are medians over repeated runs after warm-up; the thread count is recorded with them.
They are measurements to record and compare as ratios within one run, never asserted in tests.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from .environment import peak_rss_mb  # noqa: F401  (re-exported with the other figures)
from .errors import SettingsError
from .runtime import HostRuntime, decode_loop

if TYPE_CHECKING:  # type names only
    from .benchmarks.graphs import BenchGraph  # the suite sits above `port`, this module below it
    from .models.loading import LoadedModel


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
    runtime: HostRuntime,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    warmup: int = 1,
    iters: int = 3,
    progress: bool = False,
) -> BenchFigures:
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
    return BenchFigures(
        statistics.median(prefill_ms),
        statistics.median(decode_tok_s) if decode_tok_s else 0.0,
        prefill_ms,
        decode_tok_s,
        max_new_tokens - 1,
        torch.get_num_threads(),
        warmup,
        iters,
    )


@torch.no_grad()
def time_decode_steps(model: LoadedModel, step: BenchGraph, positions: Sequence[int], token: int = 5) -> float:
    """Decode tok/s of `step` over consecutive `positions`, through the runtime's own decode loop
    (host embedding + step + greedy argmax), on fresh buffers: timing does not depend on their
    contents, so any position of a long context can be timed without filling it first."""
    positions = list(positions)
    if positions != list(range(positions[0], positions[0] + len(positions))):
        raise SettingsError(
            "time_decode_steps times consecutive positions, as decoding visits them: pass e.g. range(start, stop)"
        )
    runtime = HostRuntime(model, {}, step.fn, step.graph.new_kv(), step.shape.context_length)
    one = torch.tensor([1])
    start = torch.zeros(int(model.config.vocab_size))
    start[token] = 1.0  # the loop's first pick: `token`
    run = decode_loop(
        lambda inputs, position: step.fn(*inputs, position, one, *runtime.kv)[0],
        runtime.embed,
        start,
        positions[0],
        len(positions) + 1,
    )
    return len(run.step_s) / sum(run.step_s)
