"""The audio part of a port on inf2 (issue 50): its weights, its 30 s graph's working set and where it runs.

Every figure is **computed from transformers 5.23.0's default audio configs (`Gemma4AudioConfig()`,
`Gemma4UnifiedAudioConfig()`) at the variant's real text width, unverified against the released config.json**
(`AUDIO_SOURCE`), counted on transformers' own modules on the meta device, for one 30 s clip: the graph
`serve --hear` compiles (750 soft tokens). The audio graph sits beside the vision graph on rank 0's core
(`recipes.neuron_vision.vision_core`; `vision_plan.PLACEMENT`): no core of its own, so a Ray replica reserves its
TP degree with audio or without (`ray_app.replica_resources`); `memory_plan.plan_core_memory(audio=True)`
counts it there, as the port's preflight does for a run that hears (the serving host counts its weights). The
plan is the vision plan's type (`VisionPlan`, `tower="audio"`): `patches` are then the graph's input frames.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch
from torch import nn

from ..environment import TRANSFORMERS_PIN
from ..errors import UnknownNameError
from ..models.audio import HEARING_VARIANTS, MAX_SECONDS, MELS, RATE, graph_shape, soft_tokens
from ..models.loading import text_config
from ..models.variants import Variant, get_variant
from .vision_plan import VisionPlan

AUDIO_SOURCE = (
    f"computed from transformers {TRANSFORMERS_PIN} config defaults (Gemma4AudioConfig() / Gemma4UnifiedAudioConfig())"
    " at the real text width, one 30 s clip (the `serve --hear` graph), unverified against the released config.json"
)


def audio_modules(variant: Variant) -> nn.Module:
    """transformers' own audio modules of `variant` on the meta device at its real text width, their config as
    `.config`: the conformer `Gemma4AudioModel` + `embed_audio` (E2B, E4B), or the 12B's `embed_audio` alone."""
    import transformers
    from transformers.models.gemma4 import modeling_gemma4 as g4
    from transformers.models.gemma4_unified import modeling_gemma4_unified as g4u

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
    return VisionPlan(
        variant=v.name, params=params, tower_params=tower, buffers=buffers, activation_bytes=working, patches=frames,
        soft_tokens=tokens, layers=int(getattr(parts.config, "num_hidden_layers", 0)), encoder_free=v.unified,
        source=AUDIO_SOURCE, dtype_bytes=dtype_bytes, tower="audio",
    )  # fmt: skip
