"""The audio graph: clips' features to the soft tokens the decoder reads, one compiled graph of fixed
shape beside the vision graph (docs/AUDIO.md). What runs is transformers' own modules as
`Gemma4Model.get_audio_features` calls them: E2B/E4B the conformer `Gemma4AudioModel` over log-mel frames
and their mask, then `embed_audio`; the 12B its encoder-free `embed_audio` over raw 640-sample frames.
transformers keeps the valid soft tokens by a boolean index (a data-dependent shape); the graph returns
every slot and the tower's valid mask, and the host keeps each clip's (they come first). One op is swapped
for the same values: the attention's K/V windows are `Tensor.unfold`, which torch_xla does not lower (a
CPU fallback, a graph break on inf2); the graph's clones of the attention gather them by index instead.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import AudioInputError
from .graph import INDEX_DTYPE, _shallow_clone


@dataclass(frozen=True)
class AudioShape:
    """Clips per call, frames per clip, values per frame (128 mel bins; the 12B: 640 samples)."""

    clips: int
    frames: int
    features: int

    @property
    def phase(self) -> str:
        return "audio"

    @property
    def key(self) -> dict:
        return dict(vars(self))


def has_audio(multimodal: nn.Module | None) -> bool:
    """Whether a loaded `*ForConditionalGeneration` carries an audio part (E2B, E4B, 12B configs)."""
    return getattr(getattr(multimodal, "model", None), "embed_audio", None) is not None


def _block_context(attn: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """transformers' `Gemma4AudioAttention._extract_block_context` as one index gather (module docstring)."""
    hidden = F.pad(hidden, (0, 0, 0, 0, attn.max_past_horizon, attn.max_future_horizon + attn.chunk_size - 1))
    blocks, device = (hidden.shape[1] - attn.context_size) // attn.chunk_size + 1, hidden.device
    starts = torch.arange(blocks, device=device) * attn.chunk_size
    return hidden[:, starts[:, None] + torch.arange(attn.context_size, device=device)]  # [B, blocks, context, ...]


class _Parts(nn.Module):
    """The audio modules a graph runs, with the audio config the program key reads."""

    def __init__(self, multimodal: nn.Module):
        super().__init__()
        inner = multimodal.model
        self.config = inner.config.audio_config
        tower = getattr(inner, "audio_tower", None)  # None on the 12B (encoder-free)
        if tower is not None:  # shallow clones down to each attention (shared weights): `_block_context`
            tower = _shallow_clone(tower)
            tower.layers = nn.ModuleList([_shallow_clone(layer) for layer in tower.layers])
            for layer in tower.layers:
                layer.self_attn = _shallow_clone(layer.self_attn)
                layer.self_attn._extract_block_context = functools.partial(_block_context, layer.self_attn)
        self.audio_tower = tower
        self.embed_audio = inner.embed_audio


class AudioGraph(nn.Module):
    """`forward(features [n, frames, features], mask [n, frames] int32: index inputs are, on every backend)`
    -> (soft tokens `[n, slots, text_hidden]`, valid `[n, slots]` bool). Shares the model's weights."""

    def __init__(self, multimodal: nn.Module, shape: AudioShape):
        super().__init__()
        if not has_audio(multimodal):
            raise AudioInputError(
                "this model has no audio part (no audio_config): only e2b, e4b and 12b hear; load one that does "
                "(model='random', or a fixture trained to hear)"
            )
        self.model = _Parts(multimodal)
        self.shape = shape
        self.encoder_free = self.model.audio_tower is None
        self.dtype = next(self.model.embed_audio.parameters()).dtype
        self.tags: dict[str, str] = {}
        self.inputs_before_kv = 2  # features, mask (reads and writes no K/V, as the vision graph)
        self.writes_kv = False

    def key_parts(self) -> dict:
        """What distinguishes this graph's program beyond config, weights and shapes (cache key)."""
        return {"class": type(self).__qualname__, "encoder_free": self.encoder_free, **self.tags}

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        n, frames, features = self.shape.clips, self.shape.frames, self.shape.features
        return torch.zeros(n, frames, features, dtype=self.dtype), torch.ones(n, frames, dtype=INDEX_DTYPE)

    def forward(self, features: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mask = mask.bool()
        if self.encoder_free:
            return self.model.embed_audio(inputs_embeds=features), mask
        encoded = self.model.audio_tower(features, mask, return_dict=True)
        return self.model.embed_audio(inputs_embeds=encoded.last_hidden_state), encoded.attention_mask
