"""Log-probabilities of a reply's tokens (OpenAI's `logprobs`, `top_logprobs`), from the very logits
the engine chose each token from: the row is watched (`runtime.LogitsWatch`), so nothing is run
twice. They are the model's own distribution, softcapped as Gemma's head is, before temperature or
top-p (what vLLM reports too): a client compares them across settings.
"""

from __future__ import annotations

from typing import Any

import torch

from ..runtime import LogitsWatch, softcap


class Forced:
    """Makes a row choose `tokens` in order, then lets it choose freely: a completions prompt echoed
    with its log-probabilities is teacher-forced through the engine's own decode graph (the prefill
    keeps only its last position's logits), one step a prompt token, with `TokenLogprobs` around it."""

    def __init__(self, tokens: list[int]):
        self.tokens, self.at = tokens, 0

    def logits(self, logits: torch.Tensor) -> torch.Tensor:
        if self.at >= len(self.tokens):
            return logits
        return torch.full_like(logits, float("-inf")).index_fill_(0, torch.tensor([self.tokens[self.at]]), 0.0)

    def chosen(self, token: int) -> None:
        self.at += 1


class TokenLogprobs:
    """Watches one row: for each chosen token, (token, its log-probability, the `top` most likely as
    (token, log-probability)). Written by the scheduler thread, read by the HTTP side in order."""

    def __init__(self, top: int, cap: float | None, inner: LogitsWatch | None = None):
        self.top, self.cap, self.inner = int(top), cap, inner  # inner: a grammar's mask, after the record
        self.entries: list[tuple[int, float, list[tuple[int, float]]]] = []
        self._last: torch.Tensor | None = None

    def logits(self, logits: torch.Tensor) -> torch.Tensor:
        self._last = torch.log_softmax(softcap(logits.float(), self.cap), dim=-1)
        return logits if self.inner is None else self.inner.logits(logits)

    def chosen(self, token: int) -> None:
        if self.inner is not None:
            self.inner.chosen(token)
        last = self._last
        if last is None:
            return
        best = torch.topk(last, self.top) if self.top else None
        top = [] if best is None else [(int(i), float(v)) for v, i in zip(best.values, best.indices, strict=True)]
        self.entries.append((int(token), float(last[token]), top))


def chat_logprobs(entries: list[tuple[int, float, list[tuple[int, float]]]], codec: Any) -> dict[str, Any]:
    """OpenAI chat's `logprobs`: each token's text, bytes, log-probability and its top alternatives."""

    def one(token: int, logprob: float) -> dict[str, Any]:
        text = codec.decode([token], raw=True)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**one(t, lp), "top_logprobs": [one(i, v) for i, v in top]} for t, lp, top in entries]}


def completion_logprobs(entries: list[Any], codec: Any, offset: int = 0) -> dict[str, Any]:
    """OpenAI completions' `logprobs`: tokens, their log-probabilities, the top ones as {token: lp}, and
    each token's character offset in the text (from `offset`). An echoed prompt's first token has
    none: (token, None, None)."""
    tokens = [codec.decode([t], raw=True) for t, _, _ in entries]
    offsets = [offset + sum(len(x) for x in tokens[:i]) for i in range(len(tokens))]
    return {
        "tokens": tokens,
        "token_logprobs": [lp for _, lp, _ in entries],
        "top_logprobs": [
            None if top is None else {codec.decode([i], raw=True): v for i, v in top} for *_, top in entries
        ],
        "text_offset": offsets,
    }
