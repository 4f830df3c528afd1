"""Drafters: what proposes the tokens the engine's verify step checks, behind one interface
(`runtime.Drafter.propose(engine, counts)`):

- `AssistantDrafter`: Gemma-4's own MTP assistant on the device (`device.drafting.DraftGraph`),
  every row at once, reading the target's K/V (docs/DRAFTING.md). A sampled row draws its own
  `counts[row]` drafts from the assistant's q with its own seeded generator (so what it draws
  depends on its request alone) and hands q over for rejection sampling.
- `PromptLookupDrafter`: n-gram matches in the row's own prompt and output (transformers'
  `prompt_lookup_num_tokens`, vLLM's ngram speculation): no second model, no device work.
- `CallableDrafter`: any `fn(history, n) -> tokens` (tests: always right, always wrong).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from ..device.graph import index_tensor
from ..errors import SettingsError, UnknownNameError
from ..runtime import sampling_probs

if TYPE_CHECKING:
    from ..runtime import Engine

Proposals = dict[int, tuple[list[int], torch.Tensor | None]]


class AssistantDrafter:
    """Gemma-4's assistant over the target's K/V: `step` is the compiled draft graph
    (`engine.steps.draft`), `[B, 1, 2H]` inputs and a position per row."""

    def propose(self, engine: Engine, counts: Mapping[int, int]) -> Proposals:
        if not counts:
            return {}
        rows = engine.rows
        token = torch.zeros(engine.batch, 1, dtype=torch.long)
        hidden = torch.zeros(engine.batch, 1, _hidden_width(engine), dtype=engine.dtype)
        position = [0] * engine.batch
        for r in counts:
            token[r, 0], position[r] = rows[r].tokens[-1], rows[r].position
            hidden[r, 0] = rows[r].hidden.to(engine.dtype)
        drafts: dict[int, list[int]] = {r: [] for r in counts}
        qs: dict[int, list[torch.Tensor]] = {r: [] for r in counts}
        at = index_tensor(position)
        # every row greedy: the draft that returns its argmax, where built (`Steps.draft_ids`), else q's logits
        greedy = all(rows[r].request.sampling.greedy for r in counts)
        name = "draft_ids" if greedy and engine.steps.draft_ids is not None else "draft"
        # it reads the committed K/V, positions < each row's: the context bucket that holds them
        step = engine.reading(name, getattr(engine.steps, name), max(position))
        if step is None:
            raise SettingsError("sampled rows draft from the assistant's q: this backend's draft returns only ids")
        for i in range(max(counts.values())):
            x = torch.cat([engine.embed(token)[0], hidden], dim=-1)
            out = step(x, at)
            logits, projected = (p.to("cpu") for p in out[:2])
            for r in [r for r, n in counts.items() if n > i]:  # a row done drafting draws no more numbers
                sampling = rows[r].request.sampling
                if logits.dim() == 1:  # the device's argmax
                    t = int(logits[r])
                elif sampling.greedy:
                    t = int(torch.argmax(logits[r]))
                else:
                    q = sampling_probs(logits[r], sampling, None)  # the assistant's forward has no softcap
                    t = int(torch.multinomial(q, 1, generator=rows[r].generator))
                    qs[r].append(q)
                drafts[r].append(t)
                token[r, 0] = t
            hidden = projected[:, None, :].to(engine.dtype)
        return {r: (drafts[r], torch.stack(qs[r]) if qs[r] else None) for r in counts}


def _hidden_width(engine: Engine) -> int:
    return int(engine.embedder.embed_tokens.weight.shape[-1])


class PromptLookupDrafter:
    """Propose the tokens that followed the last earlier occurrence of the row's trailing n-gram
    (longest n first, `max_ngram` down to `min_ngram`), in its prompt and output so far."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise SettingsError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = int(max_ngram), int(min_ngram)

    def propose(self, engine: Engine, counts: Mapping[int, int]) -> Proposals:
        return {r: (lookup(engine.rows[r].history, n, self.max_ngram, self.min_ngram), None) for r, n in counts.items()}


def lookup(history: Sequence[int], n: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to `n` tokens that followed the latest earlier match of `history`'s trailing n-gram."""
    history = list(history)
    for size in range(min(max_ngram, len(history) - 1), min_ngram - 1, -1):
        tail = history[-size:]
        for start in range(len(history) - size - 1, -1, -1):
            if history[start : start + size] == tail:
                follow = history[start + size : start + size + n]
                if follow:
                    return follow
    return []


class CallableDrafter:
    """Any `fn(history, n) -> up to n tokens` as a drafter (deterministic: verified as a point mass)."""

    def __init__(self, fn: Callable[[list[int], int], Sequence[int]]):
        self.fn = fn

    def propose(self, engine: Engine, counts: Mapping[int, int]) -> Proposals:
        return {r: ([int(t) for t in self.fn(engine.rows[r].history, n)][:n], None) for r, n in counts.items()}


DRAFTERS = {"assistant": AssistantDrafter, "prompt_lookup": PromptLookupDrafter}


def make_drafter(kind: str | None):
    """The drafter `PortSettings.draft` names (None: plain decode)."""
    if kind is None:
        return None
    if kind not in DRAFTERS:
        raise UnknownNameError("draft", kind, DRAFTERS)
    return DRAFTERS[kind]()
