"""The vision part of a port on inf2: its weights, its graph's activations and where it runs.

The released vision configs are not among the facts this project checked (DESIGN §2 lists the text
decoders only), so every figure here is **computed from transformers 5.23.0 config defaults,
unverified against the released config.json** (`SOURCE`), at the image processors' default patch
budget (`PROCESSOR_DEFAULTS`), counted on transformers' own modules on the meta device. Third-party
copies of the 31B's and 26B-A4B's tower report a larger one (`variants.REPORTED_VISION`):
`vision_spec(variant, source="reported")` plans with it for comparison.

Placement: its own compiled graph on one NeuronCore, not sharded (`PLACEMENT`; the audio graph's too,
`inf2.audio_plan`), rank 0's core (`recipes.neuron_vision.vision_core`), where the plan counts it. Its activations
are planned as eager attention holds them (one layer's full score matrix): an upper estimate.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..environment import TRANSFORMERS_PIN
from ..errors import UnknownNameError
from ..models.variants import REPORTED_VISION, Variant, get_variant
from .hardware import GIB

SOURCE = (
    f"computed from transformers {TRANSFORMERS_PIN} config defaults (Gemma4VisionConfig() / "
    "Gemma4UnifiedVisionConfig() and the image processors' patch_size 16, max_soft_tokens 280, "
    "pooling_kernel_size 3), unverified against the released config.json"
)
PLACEMENT = "replicated on one core: each media graph (vision, audio) is its own graph on one NeuronCore, no TP"
# The image processors' defaults (transformers 5.23.0 `Gemma4ImageProcessorPil`, `Gemma4UnifiedImageProcessor`)
PROCESSOR_DEFAULTS = {"patch_size": 16, "max_soft_tokens": 280, "pooling_kernel_size": 3}
IMAGE_MARKERS = 2  # `<|image>` and `<image|>` around an image's soft tokens in the prompt
SOFTMAX_BYTES = 4  # eager attention's softmax runs in float32

VISION_SOURCES = ("defaults", "reported")


@dataclass(frozen=True)
class VisionSpec:
    """The vision part of one variant as planned: its config, the patch budget and where the
    figures come from. `patches` go through the graph per image, `soft_tokens` come out of it."""

    variant: str
    encoder_free: bool
    config: Any  # Gemma4VisionConfig | Gemma4UnifiedVisionConfig
    text_hidden: int
    patches: int
    soft_tokens: int
    patch_dim: int
    source: str

    @property
    def layers(self) -> int:
        return 0 if self.encoder_free else int(self.config.num_hidden_layers)


def vision_config(variant: Variant | str, source: str = "defaults", **overrides: Any) -> Any:
    """transformers 5.23.0's default vision config of the variant's kind (`REPORTED_VISION` widths with
    `source="reported"` where a report exists), with `overrides`."""
    v = get_variant(variant) if isinstance(variant, str) else variant
    if source not in VISION_SOURCES:
        raise UnknownNameError("vision source", source, VISION_SOURCES)
    if v.unified:
        from transformers.models.gemma4_unified import Gemma4UnifiedVisionConfig

        return Gemma4UnifiedVisionConfig(**overrides)
    from transformers import Gemma4VisionConfig

    reported = REPORTED_VISION.get(v.name, {}).get("config", {}) if source == "reported" else {}
    return Gemma4VisionConfig(**{**reported, **overrides})


def vision_spec(variant: Variant | str, source: str = "defaults", max_soft_tokens: int | None = None) -> VisionSpec:
    """The planned vision part of `variant` at the processor's patch budget (`PROCESSOR_DEFAULTS`)."""
    from ..models.loading import text_config

    v = get_variant(variant) if isinstance(variant, str) else variant
    config = vision_config(v, source)
    soft = int(max_soft_tokens or PROCESSOR_DEFAULTS["max_soft_tokens"])
    pool, patch = int(config.pooling_kernel_size), int(config.patch_size)
    text_hidden = int(text_config(v, "real").hidden_size)
    if v.unified:  # one merged (pool x patch)^2 patch per soft token
        patches, patch_dim = soft, 3 * (pool * patch) ** 2
    else:
        patches, patch_dim = soft * pool**2, 3 * patch**2
    label = REPORTED_VISION[v.name]["source"] if source == "reported" and v.name in REPORTED_VISION else SOURCE
    return VisionSpec(v.name, v.unified, config, text_hidden, patches, soft, patch_dim, label)


def vision_modules(config: Any, text_hidden: int) -> nn.Module:
    """transformers' own vision modules for `config` on the meta device: the encoder's
    `Gemma4VisionModel` + `Gemma4MultimodalEmbedder`, or the 12B's `Gemma4UnifiedVisionEmbedder`."""
    from transformers import Gemma4TextConfig

    text = Gemma4TextConfig(hidden_size=int(text_hidden))
    with torch.device("meta"):
        if config.model_type == "gemma4_unified_vision":
            from transformers.models.gemma4_unified.modeling_gemma4_unified import Gemma4UnifiedVisionEmbedder

            return Gemma4UnifiedVisionEmbedder(config, text)
        from transformers.models.gemma4.modeling_gemma4 import Gemma4MultimodalEmbedder, Gemma4VisionModel

        parts = nn.Module()
        parts.vision_tower = Gemma4VisionModel(config)
        parts.embed_vision = Gemma4MultimodalEmbedder(config, text)
        return parts


@functools.lru_cache(maxsize=32)
def _counts(name: str, source: str) -> tuple[int, int, int]:
    spec = vision_spec(name, source)
    modules = vision_modules(spec.config, spec.text_hidden)
    tower = getattr(modules, "vision_tower", None)
    params, buffers = sum(p.numel() for p in modules.parameters()), sum(b.numel() for b in modules.buffers())
    tower_params = sum(p.numel() for p in tower.parameters()) if tower is not None else 0
    return params, tower_params, buffers


def activation_bytes(spec: VisionSpec, dtype_bytes: int = 2) -> int:
    """The vision graph's largest working set for one image at the patch budget, as eager
    attention holds it: the patch inputs, the residual stream and one layer's normed input, plus
    the larger of the attention step (q, k, v and the [heads, P, P] scores in float32 with their
    dtype copy) and the MLP step (its two intermediate tensors); then the pooler's one-hot weights
    [P, soft] (float32) and the soft tokens out. The 12B: its patches, the projection's two
    layer-normed tensors and the soft tokens. An upper estimate (a fused kernel holds no score
    matrix); unverified on inf2."""
    p, soft, out = spec.patches, spec.soft_tokens, spec.soft_tokens * spec.text_hidden * dtype_bytes
    inputs = p * spec.patch_dim * dtype_bytes
    c = spec.config
    if spec.encoder_free:
        width = int(c.mm_embed_dim)
        return inputs * 2 + 3 * p * width * dtype_bytes + out  # ln1 copy, dense, ln2 / + posemb, ln3
    h, heads, kv, d = int(c.hidden_size), int(c.num_attention_heads), int(c.num_key_value_heads), int(c.head_dim)
    stream = 2 * p * h * dtype_bytes
    attention = p * (heads + 2 * kv) * d * dtype_bytes + heads * p * p * (SOFTMAX_BYTES + dtype_bytes)
    mlp = 2 * p * int(c.intermediate_size) * dtype_bytes
    pooler = p * soft * 4
    return inputs + stream + max(attention, mlp, pooler) + out


@dataclass(frozen=True)
class VisionPlan:
    """What the vision part adds on inf2 for one variant (bf16 unless `dtype_bytes` says otherwise): the
    counts as fields, the figures derived from them as properties."""

    variant: str
    params: int
    tower_params: int
    buffers: int
    activation_bytes: int
    patches: int
    soft_tokens: int
    layers: int
    encoder_free: bool
    source: str
    dtype_bytes: int = 2
    tower: str = "vision"  # or "audio": `patches` are then its input frames, `soft_tokens` 25 a second
    placement: str = PLACEMENT

    @property
    def embedder_params(self) -> int:
        return self.params - self.tower_params

    @property
    def weights_gib(self) -> float:
        return (self.params + self.buffers) * self.dtype_bytes / GIB

    @property
    def activations_gib(self) -> float:
        return self.activation_bytes / GIB

    @property
    def total_gib(self) -> float:
        """What the plan adds on the core that runs the tower's graph."""
        return self.weights_gib + self.activations_gib


def vision_plan(variant: Variant | str, source: str = "defaults", dtype_bytes: int = 2) -> VisionPlan:
    """The vision part of `variant` on inf2 (module docstring: computed, unverified)."""
    v = get_variant(variant) if isinstance(variant, str) else variant
    spec = vision_spec(v, source)
    params, tower_params, buffers = _counts(v.name, source)
    return VisionPlan(
        variant=v.name, params=params, tower_params=tower_params, buffers=buffers,
        activation_bytes=activation_bytes(spec, dtype_bytes), patches=spec.patches, soft_tokens=spec.soft_tokens,
        layers=spec.layers, encoder_free=spec.encoder_free, source=spec.source, dtype_bytes=dtype_bytes,
    )  # fmt: skip
