"""The host side of every device graph: word embeddings and per-layer embeddings (PLE) looked up
on the host and passed in, so the big tables never reach a device (E2B's PLE table is 2.35 B of
its 4.63 B parameters).

One embedder for every path: the host runtime, the TP ranks and the Neuron recipes' host loops.
The math is transformers' own: `embed_tokens` is Gemma's scaled embedding, and the PLE inputs are
`embed_tokens_per_layer(ids)` (scaled by sqrt(ple_dim)) reshaped to `[batch, tokens, layers,
ple_dim]`, which is what `Gemma4TextModel.get_per_layer_inputs(ids)` computes.
"""

from __future__ import annotations

import torch
from torch import nn


class HostEmbedder(nn.Module):
    """Token and PLE lookups on the host, right-padded to a compiled prefill length."""

    def __init__(
        self, embed_tokens: nn.Module, embed_tokens_per_layer: nn.Module | None, num_layers: int, ple_dim: int
    ):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.embed_tokens_per_layer = embed_tokens_per_layer
        self.num_layers, self.ple_dim = num_layers, ple_dim

    @classmethod
    def from_text_model(cls, text_model: nn.Module) -> HostEmbedder:
        """The text model's own tables (shared, not copied)."""
        cfg = text_model.config
        tables = (text_model.embed_tokens, getattr(text_model, "embed_tokens_per_layer", None))
        return cls(*tables, int(cfg.num_hidden_layers), int(getattr(cfg, "hidden_size_per_layer_input", 0) or 0))

    @property
    def has_ple(self) -> bool:
        return self.embed_tokens_per_layer is not None

    @torch.no_grad()
    def inputs(
        self, ids: torch.Tensor, pad_to: int | None = None, dtype: torch.dtype | None = None
    ) -> list[torch.Tensor]:
        """[inputs_embeds(, per_layer_inputs)] for `ids` [batch, n], zero-padded to `pad_to` tokens."""
        batch, n = ids.shape
        parts = [self.embed_tokens(ids)]
        if self.has_ple:
            parts.append(self.embed_tokens_per_layer(ids).reshape(batch, n, self.num_layers, self.ple_dim))
        if pad_to is not None and pad_to > n:
            parts = [torch.cat([p, p.new_zeros(batch, pad_to - n, *p.shape[2:])], 1) for p in parts]
        return [p.to(dtype) for p in parts] if dtype is not None else parts
