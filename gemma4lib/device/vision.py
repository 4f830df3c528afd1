"""The vision graph: an image's pixels to the soft tokens the decoder reads, as one compiled graph
of fixed shape (the image processor's patch budget), beside the decoder's prefill and decode graphs.

What runs is transformers' own vision modules, unchanged: the `Gemma4VisionModel`'s patch embedder,
encoder and pooler, then `Gemma4MultimodalEmbedder`; on the 12B the encoder-free
`Gemma4UnifiedVisionEmbedder`. Two data-dependent steps no static compiler takes are replaced, with
the same values: transformers strips the padding soft tokens with a boolean index (a data-dependent
shape), where the graph returns every slot `[images, slots, hidden]` and the host keeps each image's
first `num_soft_tokens` (the pooler puts an image's valid tokens first); and the encoder's padding
mask is built here, by transformers' own `create_bidirectional_mask` with its "no padding: no mask"
shortcut off (the shortcut reads `mask.all()` on the host: a CPU fallback and a second graph on XLA).

The soft tokens then go where PLE goes: into the decoder's input embeddings on the host
(`runtime.Engine.admit`), at the image token positions the chat template and processor laid out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.masking_utils import create_bidirectional_mask


@dataclass(frozen=True)
class VisionShape:
    """Static shapes of the vision graph: images per call, the processor's patch budget, the
    values per patch (3 x patch^2, or the 12B's merged patch)."""

    images: int
    patches: int
    patch_dim: int

    @property
    def phase(self) -> str:
        return "vision"

    @property
    def key(self) -> dict:
        """The shape's part of a cache key (as `GraphShape.key`)."""
        return dict(vars(self))


def has_vision(multimodal: nn.Module | None) -> bool:
    """Whether a loaded `*ForConditionalGeneration` carries a vision part."""
    inner = getattr(multimodal, "model", None)
    return inner is not None and getattr(inner, "embed_vision", None) is not None


def encoder_free(multimodal: nn.Module) -> bool:
    """Whether the vision part is the 12B's encoder-free embedder (no vision tower)."""
    return getattr(multimodal.model, "vision_tower", None) is None


def soft_token_slots(multimodal: nn.Module, patches: int) -> int:
    """Soft-token slots the graph returns per image: patches / pooling^2 (encoder), or one per
    merged patch (the 12B's encoder-free path)."""
    if encoder_free(multimodal):
        return patches
    return patches // (int(multimodal.model.config.vision_config.pooling_kernel_size) ** 2)


class _Parts(nn.Module):
    """The vision modules a graph runs, with the vision config the program key reads."""

    def __init__(self, multimodal: nn.Module):
        super().__init__()
        inner = multimodal.model
        self.config = inner.config.vision_config
        self.vision_tower = getattr(inner, "vision_tower", None)
        self.embed_vision = inner.embed_vision


class VisionGraph(nn.Module):
    """`forward(pixel_values [n, patches, patch_dim], position_ids [n, patches, 2] int32)` ->
    soft tokens `[n, slots, text_hidden]` (module docstring). Shares the model's weights."""

    def __init__(self, multimodal: nn.Module, shape: VisionShape):
        super().__init__()
        self.model = _Parts(multimodal)
        self.shape = shape
        self.slots = soft_token_slots(multimodal, shape.patches)
        self.encoder_free = encoder_free(multimodal)
        self.dtype = next(self.model.embed_vision.parameters()).dtype
        self.tags: dict[str, str] = {}
        # how a backend that holds K/V as device state (xla) calls it: two inputs, no K/V read or written
        self.inputs_before_kv = 2  # pixel_values, position_ids
        self.writes_kv = False

    def key_parts(self) -> dict:
        """What distinguishes this graph's program beyond config, weights and shapes (cache key)."""
        return {"class": type(self).__qualname__, "encoder_free": self.encoder_free, "slots": self.slots, **self.tags}

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        n, p = self.shape.images, self.shape.patches
        side = max(1, int(p**0.5))
        grid = torch.stack([torch.arange(p) % side, torch.arange(p) // side], -1).to(torch.int32)
        return torch.zeros(n, p, self.shape.patch_dim, dtype=self.dtype), grid[None].repeat(n, 1, 1)

    def forward(self, pixel_values: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        position_ids = position_ids.long()
        if self.encoder_free:
            return self.model.embed_vision(pixel_values, position_ids).pooler_output
        tower = self.model.vision_tower
        padding = (position_ids == -1).all(dim=-1)
        embeds = tower.patch_embedder(pixel_values, position_ids, padding)
        mask = create_bidirectional_mask(
            config=tower.encoder.config,
            inputs_embeds=embeds,
            attention_mask=~padding,
            allow_is_bidirectional_skip=False,  # (module docstring)
        )
        hidden = tower.encoder(inputs_embeds=embeds, attention_mask=mask, pixel_position_ids=position_ids)
        pooled, _ = tower.pooler(
            hidden_states=hidden.last_hidden_state,
            pixel_position_ids=position_ids,
            padding_positions=padding,
            output_length=self.slots,
        )
        if tower.config.standardize:
            pooled = (pooled - tower.std_bias.float()) * tower.std_scale.float()
        return self.model.embed_vision(inputs_embeds=pooled.to(embeds.dtype))


def vision_graph(multimodal: nn.Module, images: int, patches: int, patch_dim: int) -> VisionGraph:
    return VisionGraph(multimodal, VisionShape(images, patches, patch_dim))
