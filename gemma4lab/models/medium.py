"""Medium random-weight Gemma-4 configs for benchmarks: big enough to be memory-bandwidth bound.

The tiny configs (`variants.py`) prove equality in seconds but are dominated by per-step overhead,
so they say nothing about how close a decode step gets to the memory roofline. These two are sized
like a small real model (a few hundred MB of fp32 weights, well past the last-level cache) while
keeping the Gemma-4 features that decide the bytes read per token:

- `medium-dense`: 31B-like (k_eq_v full layers with their own KV-head count and head_dim),
  sliding-heavy (5 sliding : 1 full), sliding window 512 — so a full-length KV buffer at 4,096
  context costs a fifth of the weight bytes, and a ring buffer almost nothing;
- `medium-moe`: 26B-A4B-like (parallel dense MLP + expert branch), 32 experts, top-4: the experts
  are ~80 % of the weights, so reading only the routed ones cuts the bytes per token ~3.5x.

Random weights only (nothing is downloaded); built through `loading.build_tiny`, so they are the
same transformers classes, seeded and identical across builds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from gemma4lib.errors import UnknownNameError
from gemma4lib.models.loading import LoadedModel, build_tiny, text_config
from gemma4lib.models.variants import MOE_VARIANT, VARIANTS, Variant, sliding_pattern


@dataclass(frozen=True)
class MediumSpec:
    name: str
    base_variant: str  # the variant whose transformers class and feature set it keeps
    overrides: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    prompt_seed: int = 1  # seed of the benchmark prompt (`reference.random_prompt`)
    notes: str = ""

    @property
    def variant(self) -> Variant:
        return VARIANTS[self.base_variant]

    @property
    def is_moe(self) -> bool:
        return bool(self.overrides.get("enable_moe_block"))


_COMMON = dict(
    vocab_size=32_768,
    final_logit_softcapping=30.0,
    # 0.02 (the transformers default) keeps a deep random model's activations tame; the attention
    # temperature is set by `temper_attention` after the build.
    initializer_range=0.02,
    max_position_embeddings=8192,
    hidden_size_per_layer_input=0,
    num_kv_shared_layers=0,
    attention_k_eq_v=True,
    # 31B-like attention in both: 8 query heads, 4 sliding KV heads of 128, 1 global KV head of 256
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=128,
    num_global_key_value_heads=1,
    global_head_dim=256,
    sliding_window=512,
)

MEDIUM: dict[str, MediumSpec] = {
    "medium-dense": MediumSpec(
        name="medium-dense",
        base_variant="31b",
        overrides=dict(
            _COMMON,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=18,
            layer_types=sliding_pattern(5, 18),
        ),
        prompt_seed=2,
        notes="~263M params fp32 (1.05 GB), 15 sliding + 3 full layers, window 512, k_eq_v",
    ),
    "medium-moe": MediumSpec(
        name="medium-moe",
        base_variant=MOE_VARIANT,
        overrides=dict(
            _COMMON,
            hidden_size=640,
            intermediate_size=640,
            num_hidden_layers=12,
            layer_types=sliding_pattern(5, 12),
            enable_moe_block=True,
            num_experts=32,
            top_k_experts=4,
            moe_intermediate_size=384,
        ),
        prompt_seed=3,
        notes="~340M params fp32, 32 experts top-4 (experts ~83 % of the weights), parallel dense MLP",
    ),
}


def get_medium(name: str) -> MediumSpec:
    if name not in MEDIUM:
        raise UnknownNameError("medium config", name, sorted(MEDIUM))
    return MEDIUM[name]


def medium_config(name: str):
    """The transformers text config of a medium model (no weights allocated)."""
    spec = get_medium(name)
    return text_config(spec.variant, "tiny", **spec.overrides)


@torch.no_grad()
def temper_attention(text_model: torch.nn.Module) -> int:
    """Scale every q_norm/k_norm weight to head_dim**-0.25, so random attention scores have unit variance.

    Gemma-4 attends with scaling 1.0 and lets the learnt q/k norm weights set the temperature. At
    their init value (ones) a random model's scores q.k have a standard deviation of sqrt(head_dim)
    (11-16 here): softmax is then one-hot, picked among near-equal scores by rounding, and fp32
    against fp64 logits drift by ~1.0 within 20 tokens. Greedy tokens of two correct implementations
    would then disagree, and the benchmark's token check would mean nothing. Returns the norms scaled."""
    scaled = 0
    for layer in text_model.layers:
        attn = layer.self_attn
        for norm in (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)):
            if norm is not None and getattr(norm, "weight", None) is not None:
                norm.weight.fill_(norm.weight.numel() ** -0.25)
                scaled += 1
    return scaled


def build_medium(name: str, seed: int | None = None, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """A seeded random medium model (a `LoadedModel`, like `build_tiny`'s)."""
    spec = get_medium(name)
    model = build_tiny(spec.variant, seed=spec.seed if seed is None else seed, dtype=dtype, **spec.overrides)
    temper_attention(model.text_model)
    model.source = f"medium-random({name}, seed={spec.seed if seed is None else seed})"
    return model
