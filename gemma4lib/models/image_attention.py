"""How an image's tokens attend to each other where the config asks (`use_bidirectional_attention
="vision"`: the 12B here; the released 31B and 26B-A4B set it too, per vLLM's Gemma-4 support, not
our tiny fixtures of them).

The model's intended masks, as Google's reference implementation, vLLM and transformers' own
`create_masks_for_generate` of the multimodal class (`create_masks_for_vision_model`) build them:
full-attention layers stay causal; sliding layers allow `(causal OR same image) AND the window`.

transformers 5.23.0 has a second path that differs: `Gemma4UnifiedModel.forward`, given
`mm_token_type_ids` and no ready masks, builds them with the generic `create_masks_for_generate`,
which lays the image block over *every* layer type and past the sliding window (the question of
transformers issue #46711; fixed for the window in PR #46850, not for the full layers in 5.23.0).
`generate` takes that path with its default dynamic cache and the class's path with a static cache:
on a random 12B the first logits differ by 3.1 between the two (measured here). So every reference
call with images passes the intended masks itself (`intended_masks`), and greedy `generate` runs with
a static cache (`REFERENCE_CACHE`); the device graph builds the same masks (`device.graph.build_masks`
with `image_blocks`).
"""

from __future__ import annotations

from typing import Any

import torch

# the cache `generate` takes on an image prompt with a bidirectional config: its masks are the class's
REFERENCE_CACHE = "static"


def bidirectional_images(config: Any) -> bool:
    """Whether the (text) config asks for bidirectional attention inside an image."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "use_bidirectional_attention", None) == "vision"


def intended_masks(
    multimodal: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, token_types: torch.Tensor
) -> dict[str, torch.Tensor] | None:
    """The model's intended prefill masks `{layer type: mask}` for a forward over `input_ids` with
    images (module docstring), or None where the config keeps images causal (the forward's own masks
    are then the intended ones)."""
    if not bidirectional_images(multimodal.config):
        return None
    b, n = input_ids.shape
    dtype = next(multimodal.parameters()).dtype
    return type(multimodal).create_masks_for_generate(
        config=multimodal.config,
        inputs_embeds=torch.empty(b, n, 0, dtype=dtype),
        attention_mask=attention_mask if attention_mask is not None else torch.ones_like(input_ids),
        past_key_values=None,
        position_ids=torch.arange(n)[None].expand(b, n),
        mm_token_type_ids=token_types,
    )


def generate_kwargs(multimodal: Any) -> dict[str, Any]:
    """What `generate` needs beyond the image tensors for the intended masks (module docstring)."""
    return {"cache_implementation": REFERENCE_CACHE} if bidirectional_images(multimodal.config) else {}
