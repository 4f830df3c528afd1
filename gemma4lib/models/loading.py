"""A loaded Gemma-4 text decoder (`LoadedModel`), and the seeded tiny random builds.

Whatever its source (a tiny random build here, a released checkpoint in `checkpoint`, a trained
fixture in `trained`), a model is a `Gemma4ForCausalLM` (or the unified 12B's
`Gemma4UnifiedForCausalLM`): the text-only language model with its tied LM head. It is both the
host fp32 reference and the source of the device graph's weights.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..device.kv_layout import KVLayout
from ..environment import check_transformers
from .variants import Variant, config_kwargs
from .weights_identity import declare_identity


@dataclass
class LoadedModel:
    variant: Variant
    lm: nn.Module  # *ForCausalLM, eval mode: the reference and the weight source
    tokenizer: Any | None = None
    source: str = "tiny-random"
    # the multimodal `*ForConditionalGeneration` that `lm` shares its decoder with, and its image
    # processor, when the model was loaded with its vision part (`models.vision`); None: text only
    multimodal: nn.Module | None = None
    processor: Any | None = None

    @property
    def config(self):
        return self.lm.config

    @property
    def text_model(self) -> nn.Module:
        return self.lm.model

    @property
    def lm_head(self) -> nn.Module:
        return self.lm.lm_head

    @property
    def layout(self) -> KVLayout:
        return KVLayout.from_config(self.lm.config)

    def param_count(self) -> int:
        return sum(p.numel() for p in self.lm.parameters())


def _text_classes(variant: Variant):
    check_transformers()
    if variant.unified:
        from transformers.models.gemma4_unified import Gemma4UnifiedForCausalLM, Gemma4UnifiedTextConfig

        return Gemma4UnifiedTextConfig, Gemma4UnifiedForCausalLM
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    return Gemma4TextConfig, Gemma4ForCausalLM


def text_config(variant: Variant, which: str = "tiny", **overrides: Any):
    """A transformers text config for the variant ('tiny' or 'real' sizes)."""
    config_cls, _ = _text_classes(variant)
    return config_cls(**config_kwargs(variant, which, **overrides))


def _seed_layer_scalars(lm: nn.Module, seed: int) -> None:
    """Give every layer a distinct, non-trivial `layer_scalar` (released checkpoints do).

    Left at its init value of 1 a missing-buffer fault would be invisible in tests.
    """
    layers = lm.model.layers
    for i, layer in enumerate(layers):
        layer.layer_scalar.fill_(0.5 - 0.4 * i / max(1, len(layers) - 1))


def build_random(
    variant: Variant, which: str = "tiny", seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any
) -> LoadedModel:
    """A seeded random-weight model of the variant's 'tiny' or 'real' text config (plus overrides,
    e.g. fewer layers); identical across builds."""
    config_cls, lm_cls = _text_classes(variant)
    config = config_cls(**config_kwargs(variant, which, **overrides))
    attn = variant.attn_implementation
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        if which == "tiny":  # the tiny seeds (variants.tiny_seed) were picked for this exact build
            lm = lm_cls._from_config(config, dtype=dtype, attn_implementation=attn)
        else:
            # Allocate once: a plain build first allocates an untied LM head (vocab x hidden, 4 GB
            # for the 12B in fp32) and frees it when tying, so the peak is one table higher.
            with torch.device("meta"):
                lm = lm_cls._from_config(config, dtype=dtype, attn_implementation=attn)
            lm.to_empty(device="cpu")  # gives the tied head a tensor of its own: tie again first
            lm.tie_weights()
            lm.init_weights()  # transformers' own init of every parameter and buffer, then tying
    _seed_layer_scalars(lm, seed)
    label = "tiny-random" if which == "tiny" else f"{which}-random"
    built_from = hashlib.sha256(f"{config.to_json_string(use_diff=False)}:{dtype}".encode()).hexdigest()[:16]
    declare_identity(lm, f"{label}(seed={seed}):{built_from}")
    return LoadedModel(variant, lm.eval(), None, f"{label}(seed={seed})")


def build_tiny(variant: Variant, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any) -> LoadedModel:
    """A seeded random-weight tiny model with every feature of `variant`; identical across
    builds."""
    return build_random(variant, "tiny", seed, dtype, **overrides)
