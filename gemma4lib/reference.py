"""The host fp32 reference: Hugging Face's own greedy `generate` on the same prompt ids."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def random_prompt(vocab_size: int, n: int, seed: int) -> list[int]:
    """A seeded prompt for a model without a tokenizer; ids >= 3 avoid pad, eos and bos."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (n,), generator=generator).tolist()


@torch.no_grad()
def reference_greedy(lm: nn.Module, prompt_ids: Sequence[int], max_new_tokens: int,
                     eos_token_ids: Sequence[int] = ()) -> list[int]:
    """Greedy tokens from `lm.generate` with the dynamic cache; eos switched off when none is given."""
    ids = torch.as_tensor(list(prompt_ids), dtype=torch.long)[None]
    eos = list(eos_token_ids) or None
    out = lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                      eos_token_id=eos, pad_token_id=0, use_cache=True)
    tokens = out[0, ids.shape[1]:].tolist()
    if eos:  # generate pads after eos when stopping early in a batch; keep up to and including eos
        for i, token in enumerate(tokens):
            if token in eos:
                return tokens[: i + 1]
    return tokens


@torch.no_grad()
def reference_last_logits(lm: nn.Module, prompt_ids: Sequence[int]) -> torch.Tensor:
    """Softcapped logits of the last prompt token from a plain forward (what prefill must match)."""
    ids = torch.as_tensor(list(prompt_ids), dtype=torch.long)[None]
    return lm(ids).logits[0, -1].float()
