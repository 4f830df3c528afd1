"""How an image's tokens attend to each other where the config asks (`use_bidirectional_attention
="vision"`: the 12B here): the model's intended masks (full layers causal; sliding layers `(causal OR
same image) AND the window`), which transformers 5.23.0's `Gemma4UnifiedModel.forward` does not build
given `mm_token_type_ids` alone (it lays the image block over every layer and past the window; its
`generate` with the default dynamic cache takes that path). So every reference call with images
passes the intended masks itself (`intended_masks`), greedy `generate` runs with a static cache
(`REFERENCE_CACHE`), and the device graph builds the same masks (`device.graph.build_masks` with
`image_blocks`). docs/IMAGES.md, "The 12B", has the measurement and the transformers issue.
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
