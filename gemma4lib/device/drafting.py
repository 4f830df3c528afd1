"""Device graphs for drafting with Gemma-4's own assistant: draft one token, verify k + 1.

- The target's graphs are `graph.DeviceGraph` itself with `hidden=True` (the final hidden state,
  which the assistant takes as input): a prefill returns the last valid token's logits and hidden
  state; the *verify* (k + 1 tokens at `start`, `every_position=True`) returns them for every
  position. MoE: its experts in the form that reads fewer bytes for k + 1 tokens (`verify_expert_form`).
- `DraftGraph` is the assistant's forward over the target's K/V buffers: one token per row at the
  constant position of the row's last seen token, as transformers'
  `SinglePositionMultiTokenCandidateGenerator` drafts. It reads the K/V buffers and never writes them.

What the draft sees (`draft_masks`): the K/V of every *committed* position before the last seen
token `p` (full layers: all of them; sliding layers: the `sliding_window + 1` positions before `p`,
as transformers' assistant masks them: its window is inclusive). A rejected draft's stale K/V is
never read: the target's next verify overwrites it before attending, the draft masks it out. A
sliding layer's ring holds the window *plus k + 1* slots (`RoomyLayout`) so that a verify's writes
past what is committed never overwrite a position a later window still needs. Why both hold, with
the worst case worked through: docs/DRAFTING.md, "Rejected tokens and the K/V".
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from .graph import (
    INDEX_DTYPE,
    GraphShape,
    _shallow_clone,
    additive_mask,
    layer_types_in_order,
    slot_positions,
)
from .kv_layout import SLIDING, KVLayout


@dataclass(frozen=True)
class RoomyLayout(KVLayout):
    """The target's layout with `room` extra slots in each sliding ring (room = draft tokens k + 1)."""

    room: int = 0

    @classmethod
    def around(cls, layout: KVLayout, room: int) -> RoomyLayout:
        return cls(layout.layers, layout.sliding_window, layout.num_attention_heads, int(room))

    def slots(self, layer_type: str, context_length: int, ring: bool) -> int:
        if layer_type == SLIDING and ring:
            return min(self.sliding_window + self.room, context_length)
        return context_length


def verify_expert_form(config, draft_tokens: int, asked: str | None = None) -> str:
    """The verify graph's MoE expert form: `asked`, else "selective" when gathering the routed
    experts of its k + 1 tokens ((k + 1) x top_k slices a layer, repeats included: the batch
    decode's gather with the tokens as rows) reads fewer bytes than all E experts, else "dense"
    (and "dense" for a model without experts: its graphs keep their programs).
    The lab's `gemma4lab.inf2.mtp_roofline.verify_bytes` counts the bytes of the form this picks."""
    if asked is not None:
        return asked
    experts = int(getattr(config, "num_experts", 0) or 0) if getattr(config, "enable_moe_block", False) else 0
    if experts and (int(draft_tokens) + 1) * int(config.top_k_experts) < experts:
        return "selective"
    return "dense"


def draft_masks(
    layout: KVLayout,
    shape: GraphShape,
    position: torch.Tensor,
    dtype: torch.dtype,
    positions: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Additive masks `[B, 1, 1, slots]` for a draft at each row's last seen token's `position` p:
    slots holding committed positions < p (sliding: also >= p - 1 - window), over the slots the graph
    reads (a context bucket's first `shape.reads`; `positions`, a bucket key's input). See the module
    docstring."""
    masks = {}
    for layer_type in sorted({layer.layer_type for layer in layout.layers}):
        slots = shape.slots_read(layout.slots(layer_type, shape.context_length, shape.ring))
        k_pos = slot_positions(position - 1, slots, positions)  # [B, S]
        allowed = k_pos >= 0
        if layer_type == SLIDING:
            allowed = allowed & (k_pos >= (position - 1 - layout.sliding_window)[:, None])
        masks[layer_type] = additive_mask(allowed[:, None, :], dtype)[:, None]
    return masks


def ordered_logits(masked_embedding: nn.Module, hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
    """transformers' `Gemma4AssistantMaskedEmbedder` (score only the top centroids' tokens) with the
    fill value kept a tensor (its `.item()` would end the graph): same scores, same argmax."""
    batch, seq = hidden.shape[:2]
    top_k = masked_embedding.centroid_intermediate_top_k
    per_centroid = masked_embedding.vocab_size_per_centroid
    _, top = torch.topk(masked_embedding.centroids(hidden), k=top_k, dim=-1)
    canonical = masked_embedding.token_ordering.long().view(masked_embedding.num_centroids, per_centroid)[top]
    flat = canonical.reshape(-1)
    selected = lm_head_weight[flat].view(batch, seq, top_k * per_centroid, hidden.shape[-1])
    scores = (hidden.unsqueeze(-2) @ selected.transpose(-1, -2)).squeeze(-2)
    fill = (scores.min() - 1.0).to(hidden.dtype)
    out = fill.expand(batch, seq, masked_embedding.vocab_size).clone()
    return out.scatter(-1, canonical.view(batch, seq, -1), scores)


class DraftGraph(nn.Module):
    """One assistant step: `forward(inputs_embeds [B, 1, 2 * target_hidden], position [B], *kv)` ->
    `(logits [B, vocab], projected hidden [B, target_hidden])`, each row at its own position. `kv` is
    the target's flat K/V list (every producer, as the target graphs take it); the graph reads the
    buffers of `read_layers`.

    transformers' `Gemma4AssistantForCausalLM.forward` builds its masks from a 2-D padding mask over
    the shared K/V's length; over position-indexed (and ring) buffers the masks come from the
    position instead (`draft_masks`), and the rest of the forward is the assistant's own modules.
    `chooses=True` (greedy drafting on a device across a bus): the argmax `[B]` int32 in place of the
    logits, 4 bytes a row, not the vocabulary (a sampled row needs q: the logits form). A context
    bucket (`at`, `shape.reads`) reads the first slots of the full-length buffers only.
    """

    image_blocks = False  # (what a context bucket's key, `ContextKey`, asks of the graph it wraps)

    def __init__(
        self,
        assistant: nn.Module,
        layout: KVLayout,
        shape: GraphShape,
        read_layers: dict[str, int],
        *,
        chooses: bool = False,
        **_: object,
    ):
        super().__init__()
        self.chooses = bool(chooses)
        self.model = _shallow_clone(assistant.model)
        # transformers' text model iterates a set of layer types: its order (and the exported
        # program's digest, the cache key) followed PYTHONHASHSEED; a list in layer order does not
        self.model.unique_layer_types = layer_types_in_order(self.model.config)
        self.model.embed_tokens = None  # its input is the projected target embedding, never a token id
        self.pre_projection, self.post_projection = assistant.pre_projection, assistant.post_projection
        self.lm_head = assistant.lm_head
        self.masked_embedding = assistant.masked_embedding
        self.layout, self.shape, self.read_layers = layout, shape, dict(read_layers)
        order = [layer.index for layer in layout.producers]
        self.kv_index = {t: order.index(i) for t, i in self.read_layers.items()}
        self.backbone = int(assistant.config.backbone_hidden_size)
        self.assistant_config = assistant.config  # the gloo ranks cut the assistant from this graph's weights
        self.dtype = self.pre_projection.weight.dtype
        self.inplace = True  # reads the K/V, never writes them
        self.writes_kv = False  # (the XLA session: no K/V outputs to rebind)
        self.inputs_before_kv = self.num_inputs = 2  # inputs_embeds, position
        self.key_positions: torch.Tensor | None = None  # set for a call by `context_key.ContextKey`
        self.tags: dict[str, str] = {}

    def at(self, shape: GraphShape) -> DraftGraph:
        """The same graph (shared modules) at `shape`: a context bucket's, reading `shape.reads` slots."""
        other = copy.copy(self)  # a new __dict__ sharing the submodule and parameter dicts
        other.shape = shape
        return other

    def key_parts(self) -> dict:
        return {
            "class": type(self).__qualname__,
            "read_layers": self.read_layers,
            "ordered_embeddings": self.masked_embedding is not None,
            "index_dtype": str(INDEX_DTYPE),
            "buffers": [list(s) for s in self.buffer_shapes()],
            **({"reads": self.shape.reads} if self.shape.reads else {}),
            **({"chooses": True} if self.chooses else {}),
            **self.tags,
        }

    def buffer_shapes(self) -> list[tuple[int, ...]]:
        return self.layout.buffer_shapes(self.shape.batch, self.shape.context_length, self.shape.ring)

    def new_kv(self) -> list[torch.Tensor]:
        return [torch.zeros(s, dtype=self.dtype) for s in self.buffer_shapes()]

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        inputs = [
            torch.zeros(self.shape.batch, 1, 2 * self.backbone, dtype=self.dtype),
            torch.zeros(self.shape.batch, dtype=INDEX_DTYPE),
        ]
        return (*inputs, *self.new_kv())

    def forward(self, inputs_embeds: torch.Tensor, position: torch.Tensor, *kv: torch.Tensor):
        if self.shape.reads:  # a bucket: the first slots of each full-length buffer
            kv = tuple(t[:, :, : self.shape.reads] if t.shape[2] == self.shape.context_length else t for t in kv)
        shared = {t: (kv[2 * i], kv[2 * i + 1]) for t, i in self.kv_index.items()}
        masks = draft_masks(self.layout, self.shape, position, inputs_embeds.dtype, self.key_positions)
        hidden = self.pre_projection(inputs_embeds)
        out = self.model(
            inputs_embeds=hidden,
            attention_mask=masks,
            position_ids=position.long()[:, None],
            shared_kv_states=shared,
            use_cache=False,
        ).last_hidden_state
        if self.masked_embedding is not None:
            logits = ordered_logits(self.masked_embedding, out, self.lm_head.weight)
        else:
            logits = self.lm_head(out)
        first = torch.argmax(logits[:, 0, :], -1).to(INDEX_DTYPE) if self.chooses else logits[:, 0, :].float()
        return first, self.post_projection(out)[:, 0, :]
