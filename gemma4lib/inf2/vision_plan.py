"""The media towers of a port on inf2 (vision; audio: `audio_plan`): their weights, activations and placement.

The released vision configs are not among the facts this project checked (DESIGN §2 lists the text
decoders only), so every figure here is **computed from transformers 5.23.0 config defaults,
unverified against the released config.json** (`SOURCE`), at the image processors' default patch
budget (`PROCESSOR_DEFAULTS`), counted on transformers' own modules on the meta device. Third-party
copies of the 31B's and 26B-A4B's tower report a larger one (`REPORTED`):
`vision_spec(variant, source="reported")` plans with it for comparison.

Placement: each tower its own compiled graph on one NeuronCore, not sharded (`PLACEMENT`), the core of rank 0
(`recipes.neuron_vision.vision_core`), where the plan counts it. Its activations are planned as eager
attention holds them (one layer's full score matrix): an upper estimate.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from ..environment import TRANSFORMERS_PIN
from ..errors import UnknownNameError
from ..models.audio import HEARING_VARIANTS, MAX_SECONDS, MELS, RATE, graph_shape, soft_tokens
from ..models.variants import REPORTED_VISION, Variant, get_variant
from .hardware import GIB

SOURCE = (
    f"computed from transformers {TRANSFORMERS_PIN} config defaults (Gemma4VisionConfig() / "
    "Gemma4UnifiedVisionConfig() and the image processors' patch_size 16, max_soft_tokens 280, "
    "pooling_kernel_size 3), unverified against the released config.json"
)
PLACEMENT = (
    "replicated on one core: each media graph (vision, audio) is its own compiled graph on one NeuronCore, no TP"
)
AUDIO_SOURCE = (
    f"computed from transformers {TRANSFORMERS_PIN} config defaults (Gemma4AudioConfig() / Gemma4UnifiedAudioConfig())"
    " at the real text width, one 30 s clip (the `serve --hear` graph), unverified against the released config.json"
)
# The image processors' defaults (transformers 5.23.0 `Gemma4ImageProcessorPil`, `Gemma4UnifiedImageProcessor`)
PROCESSOR_DEFAULTS = {"patch_size": 16, "max_soft_tokens": 280, "pooling_kernel_size": 3}
IMAGE_MARKERS = 2  # `<|image>` and `<image|>` around an image's soft tokens in the prompt
SOFTMAX_BYTES = 4  # eager attention's softmax runs in float32

# Vision towers reported by third parties for two releases (`variants.REPORTED_VISION`)
REPORTED: dict[str, dict[str, Any]] = REPORTED_VISION
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
    """transformers 5.23.0's default vision config of the variant's kind (`REPORTED` widths with
    `source="reported"` where a report exists), with `overrides`."""
    v = get_variant(variant) if isinstance(variant, str) else variant
    if source not in VISION_SOURCES:
        raise UnknownNameError("vision source", source, VISION_SOURCES)
    if v.unified:
        from transformers.models.gemma4_unified import Gemma4UnifiedVisionConfig

        return Gemma4UnifiedVisionConfig(**overrides)
    from transformers import Gemma4VisionConfig

    reported = REPORTED.get(v.name, {}).get("config", {}) if source == "reported" else {}
    return Gemma4VisionConfig(**{**reported, **overrides})


def vision_spec(variant: Variant | str, source: str = "defaults", max_soft_tokens: int | None = None) -> VisionSpec:
    """The planned vision part of `variant` at the processor's patch budget (`PROCESSOR_DEFAULTS`)."""
    from ..models.loading import text_config

    v = get_variant(variant) if isinstance(variant, str) else variant
    config = vision_config(v, source)
    soft = int(max_soft_tokens or PROCESSOR_DEFAULTS["max_soft_tokens"])
    pool = int(config.pooling_kernel_size)
    patch = int(config.patch_size)
    text_hidden = int(text_config(v, "real").hidden_size)
    if v.unified:  # one merged (pool x patch)^2 patch per soft token
        patches, patch_dim = soft, 3 * (pool * patch) ** 2
    else:
        patches, patch_dim = soft * pool**2, 3 * patch**2
    label = REPORTED[v.name]["source"] if source == "reported" and v.name in REPORTED else SOURCE
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
    params = sum(p.numel() for p in modules.parameters())
    tower_params = sum(p.numel() for p in tower.parameters()) if tower is not None else 0
    buffers = sum(b.numel() for b in modules.buffers())
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
    """What the vision part adds on inf2 for one variant (bf16 unless `dtype_bytes` says otherwise)."""

    variant: str
    params: int
    tower_params: int
    embedder_params: int
    weights_gib: float
    activations_gib: float
    patches: int
    soft_tokens: int
    layers: int
    encoder_free: bool
    placement: str
    source: str
    dtype_bytes: int = 2
    tower: str = "vision"  # or "audio": `patches` are then its input frames, `soft_tokens` 25 a second

    @property
    def total_gib(self) -> float:
        """What the plan adds on the core that runs the tower's graph."""
        return self.weights_gib + self.activations_gib


def vision_plan(variant: Variant | str, source: str = "defaults", dtype_bytes: int = 2) -> VisionPlan:
    """The vision part of `variant` on inf2 (module docstring: computed, unverified)."""
    v = get_variant(variant) if isinstance(variant, str) else variant
    spec = vision_spec(v, source)
    params, tower, buffers = _counts(v.name, source)
    return VisionPlan(
        v.name,
        params,
        tower,
        params - tower,
        (params + buffers) * dtype_bytes / GIB,
        activation_bytes(spec, dtype_bytes) / GIB,
        spec.patches,
        spec.soft_tokens,
        spec.layers,
        spec.encoder_free,
        PLACEMENT,
        spec.source,
        dtype_bytes,
    )


def audio_modules(variant: Variant) -> nn.Module:
    """transformers' own audio modules of `variant` on the meta device at its real text width, their config as
    `.config`: the conformer `Gemma4AudioModel` + `embed_audio` (E2B, E4B), or the 12B's `embed_audio` alone."""
    import transformers
    from transformers.models.gemma4 import modeling_gemma4 as g4
    from transformers.models.gemma4_unified import modeling_gemma4_unified as g4u

    from ..models.loading import text_config

    parts, text = nn.Module(), text_config(variant, "real")
    with torch.device("meta"):
        if variant.unified:
            parts.config = transformers.Gemma4UnifiedAudioConfig()
            parts.embed_audio = g4u.Gemma4UnifiedMultimodalEmbedder(parts.config, text)
        else:
            parts.config = transformers.Gemma4AudioConfig()
            parts.audio_tower = g4.Gemma4AudioModel(parts.config)
            parts.embed_audio = g4.Gemma4MultimodalEmbedder(parts.config, text)
    return parts


def audio_activation_bytes(config: Any, frames: int, tokens: int, text_hidden: int, dtype_bytes: int = 2) -> int:
    """The audio graph's largest working set for one clip of `frames` log-mel frames (`tokens` soft tokens), as
    eager holds it: the features, the residual stream and the largest of the first convolution's output with its
    normed copy, one layer's attention in float32 (q, k, v, the K/V windows, the three [heads, blocks, chunk,
    context] score tensors) and its feed-forward's two [tokens, 4 x hidden]; then the soft tokens out. The 12B:
    its frames, their normed copy and the soft tokens. An upper estimate; unverified on inf2."""
    out = tokens * text_hidden * dtype_bytes
    if config.model_type == "gemma4_unified_audio":
        return 2 * frames * int(config.audio_embed_dim) * dtype_bytes + out
    h, chunk, heads = int(config.hidden_size), int(config.attention_chunk_size), int(config.num_attention_heads)
    context = chunk + int(config.attention_context_left) - 1 + int(config.attention_context_right)
    blocks = -(-tokens // chunk)
    conv = 2 * int(config.subsampling_conv_channels[0]) * -(-frames // 2) * (MELS // 2) * dtype_bytes
    attention = 4 * ((3 * tokens + 2 * blocks * context) * h + 3 * heads * blocks * chunk * context)
    mlp = 2 * tokens * 4 * h * dtype_bytes
    return frames * MELS * dtype_bytes + 2 * tokens * h * dtype_bytes + max(conv, attention, mlp) + out


@functools.lru_cache(maxsize=8)
def audio_plan(variant: str, dtype_bytes: int = 2) -> VisionPlan:
    """The audio part of `variant` (e2b, e4b, 12b) on inf2 for one 30 s clip, on rank 0's core (`AUDIO_SOURCE`)."""
    v = get_variant(variant)
    if v.name not in HEARING_VARIANTS:
        raise UnknownNameError("variant that hears", v.name, HEARING_VARIANTS)
    parts, (_, frames, _) = audio_modules(v), graph_shape([], v.unified)
    tokens = soft_tokens(np.zeros(RATE * MAX_SECONDS, np.float32), v.unified)
    params, buffers = sum(p.numel() for p in parts.parameters()), sum(b.numel() for b in parts.buffers())
    tower = sum(p.numel() for p in parts.audio_tower.parameters()) if hasattr(parts, "audio_tower") else 0
    working = audio_activation_bytes(parts.config, frames, tokens, parts.embed_audio.text_hidden_size, dtype_bytes)
    layers = int(getattr(parts.config, "num_hidden_layers", 0))
    return VisionPlan(
        v.name, params, tower, params - tower, (params + buffers) * dtype_bytes / GIB, working / GIB, frames, tokens,
        layers, v.unified, PLACEMENT, AUDIO_SOURCE, dtype_bytes, "audio",
    )  # fmt: skip
