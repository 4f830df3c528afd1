"""Parameter counts of a model as a port places them: on the device, on the host, per expert and per TP rank.

Counted from shapes (a model on the meta device for the released sizes, `meta_model`), so the
released variants are counted on any machine; `roofline.decode_bytes` and the memory plan read them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..device.experts import EXPERT_SPLITS, default_expert_split
from ..device.quant import LINEAR_WEIGHT_NAME
from ..errors import UnknownNameError


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

    def read_fraction(self, experts: str = "dense", tp: int = 1, expert_split: str | None = None) -> float:
        """The share of the expert weights one decode step reads, summed over `tp` ranks
        (`device_params`): 1 for dense, k / E (or tp * k / E under the expert split) for selective."""
        if not self.experts:
            return 0.0
        return (self.device_params(experts, tp, expert_split) - self.lm_head - self.other) / self.experts

    def device_bytes(
        self,
        experts: str = "dense",
        tp: int = 1,
        expert_split: str | None = None,
        dtype_bytes: int = 2,
        weight_format: str = "bf16",
    ) -> float:
        """Weight bytes read per decode step, summed over `tp` ranks. `weight_format="int8"`: the
        quantized weights at one byte each plus a 4-byte scale per output channel (`quant.py`).
        Scales are counted once: on TP ranks a row-parallel weight's scales (o_proj, down_proj)
        are replicated per rank, which this leaves out (under 5 % of those weights' bytes even for
        the 26B-A4B's 88-wide expert slices at TP=8, under 2 % of a step)."""
        params = self.device_params(experts, tp, expert_split)
        if weight_format != "int8":
            return params * dtype_bytes
        share = self.read_fraction(experts, tp, expert_split)
        full = (self.lm_head + self.other - self.linear) * dtype_bytes
        return full + self.linear + 4 * self.linear_rows + share * (self.experts + 4 * self.expert_rows)

    def expert_split(self, tp: int = 1, expert_split: str | None = None) -> str | None:
        """The split a TP plan uses at `tp` (`experts.default_expert_split` unless given); None
        for a dense model."""
        if not self.num_experts:
            return None
        if expert_split is not None:
            if expert_split not in EXPERT_SPLITS:
                raise UnknownNameError("expert_split", expert_split, EXPERT_SPLITS)
            return expert_split
        return default_expert_split(self.num_experts, self.moe_intermediate, max(1, tp))

    def device_params(self, experts: str = "dense", tp: int = 1, expert_split: str | None = None) -> float:
        """Parameters read per decode step, summed over `tp` ranks (fractional for selective experts:
        `top_k / num_experts` of the expert weights on one device or under the intermediate split,
        `tp * top_k` whole-expert slices under the expert split; `tp.plan`'s rules)."""
        if experts not in ("dense", "selective"):
            raise UnknownNameError("experts form", experts, ("dense", "selective"))
        read_experts = self.experts
        if experts == "selective" and self.num_experts:
            split = self.expert_split(tp, expert_split)
            slices = self.top_k * (max(1, tp) if split == "experts" else 1)
            read_experts = self.experts * slices / self.num_experts  # repeats count, as gathers read
        return self.lm_head + self.other + read_experts


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
