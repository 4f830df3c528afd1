"""Parameter counts of a model as a port places them: on the device, on the host, per expert and per TP rank.

Counted from shapes (a model on the meta device for the released sizes, `meta_model`), so the
released variants are counted on any machine; the memory plan and the lab's roofline
(`gemma4lab.inf2.roofline`: what a decode step reads of them) read them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..device.quant import LINEAR_WEIGHT_NAME


@dataclass
class ParamCounts:
    """Parameter counts by how a decode step reads them."""

    lm_head: int  # tied word embeddings: read whole by the LM head every step
    ple_table: int  # host-only tables: the PLE token table (and untied word embeddings)
    experts: int  # MoE expert weights (all experts)
    other: int  # everything else on the device (attention, dense MLP, norms, router, PLE projections)
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate: int = 0  # per expert
    linear: int = 0  # the part of `other` int8 applies to (attention and dense-MLP projections)
    linear_rows: int = 0  # their output channels: one int8 scale each
    expert_rows: int = 0  # output channels of all experts' weights (E * (2I + H) per layer)

    @property
    def total(self) -> int:
        return self.lm_head + self.ple_table + self.experts + self.other


def count_params(lm: nn.Module) -> ParamCounts:
    """Classify the parameters of a `*ForCausalLM` (real, random or on the meta device)."""
    head = lm.lm_head.weight
    embed = lm.model.embed_tokens.weight
    lm_head = head.numel()
    ple = experts = other = linear = linear_rows = expert_rows = 0
    for name, param in lm.named_parameters():  # tied tensors appear once
        if param is head:
            continue
        if param is embed or "embed_tokens_per_layer" in name:  # untied embeddings: a host lookup too
            ple += param.numel()
        elif ".experts." in name:
            experts += param.numel()
            expert_rows += param.numel() // param.shape[-1]
        else:
            other += param.numel()
            if LINEAR_WEIGHT_NAME.search(name):
                linear += param.numel()
                linear_rows += param.shape[0]
    # a buffer in transformers, a weight of the device graph (`DeviceGraph`: loaded, not compiled in)
    other += sum(b.numel() for name, b in lm.named_buffers() if name.endswith(".layer_scalar"))
    config = lm.config
    moe = bool(getattr(config, "enable_moe_block", False))
    return ParamCounts(
        lm_head,
        ple,
        experts,
        other,
        int(getattr(config, "num_experts", 0) or 0) if moe else 0,
        int(getattr(config, "top_k_experts", 0) or 0) if moe else 0,
        int(getattr(config, "moe_intermediate_size", 0) or 0) if moe else 0,
        linear,
        linear_rows,
        expert_rows,
    )


def meta_model(variant: Any, which: str = "real", overrides: tuple = ()) -> nn.Module:
    """A variant's `*ForCausalLM` on the meta device: real shapes, no memory (cached per variant);
    `overrides`: config fields as sorted (key, value) pairs, a list as a tuple (a reduced-depth model)."""
    from ..models.variants import get_variant

    variant = get_variant(variant) if isinstance(variant, str) else variant
    return _meta_model(variant.name, which, overrides)


@functools.lru_cache(maxsize=16)
def _meta_model(name: str, which: str, overrides: tuple) -> nn.Module:
    from ..models.loading import _text_classes, text_config
    from ..models.variants import get_variant

    variant = get_variant(name)
    config = text_config(variant, which, **{k: list(v) if isinstance(v, tuple) else v for k, v in overrides})
    _, lm_cls = _text_classes(variant)
    with torch.device("meta"):
        return lm_cls(config)
