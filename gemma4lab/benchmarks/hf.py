"""The Hugging Face side of the suite: greedy `generate`, timed per step like the runtime times itself.

Decode tok/s of a `generate` call cannot be read off its wall time (that includes prefill and,
on the static-cache path, torch.compile), so a logits processor stamps the arrival of each step's
logits and the rate is taken between the first and the last stamp: prefill excluded, as in
the engine's own step clock (`runtime.Engine`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from transformers import LogitsProcessor

from gemma4lib.reference import hf_greedy


class StepClock(LogitsProcessor):
    """A logits processor that only records when each generation step's logits arrive."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.stamps.append(time.perf_counter())
        return scores

    def decode_tok_s(self) -> float | None:
        """Steps per second after the first (prefill's) logits; None with fewer than two steps."""
        if len(self.stamps) < 2:
            return None
        return (len(self.stamps) - 1) / (self.stamps[-1] - self.stamps[0])


def hf_generate(
    lm: torch.nn.Module, prompt: Sequence[int], new_tokens: int, **kwargs: Any
) -> tuple[list[int], float | None, float]:
    """Greedy `generate` of exactly `new_tokens` (no eos stop, so runs compare); returns
    (tokens, decode tok/s, wall s)."""
    from transformers import LogitsProcessorList

    clock = StepClock()
    started = time.perf_counter()
    tokens, _ = hf_greedy(lm, prompt, new_tokens, exact=True, logits_processor=LogitsProcessorList([clock]), **kwargs)
    wall = time.perf_counter() - started
    return tokens, clock.decode_tok_s(), wall


def hf_static_compile_kwargs() -> dict[str, Any]:
    """transformers' own route: a static cache and its auto-compile of the forward, opted in on CPU."""
    from transformers import CompileConfig

    config = CompileConfig(fullgraph=False, dynamic=False, mode="default")
    config._compile_all_devices = True  # auto-compile is off for CPU unless asked for
    return {"cache_implementation": "static", "compile_config": config}
