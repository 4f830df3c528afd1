"""The device graph: Gemma-4's own forward with explicit K/V buffers, written once for every
variant and every compiler.

What runs here is transformers' `Gemma4TextModel.forward` (or the unified 12B's), unchanged. The
port changes only what it must:

- embeddings and the PLE token table are looked up on the host and passed in
  (`inputs_embeds=`, `per_layer_inputs=`), so the big tables never reach the device;
- the cache is `ExplicitKV`, an object of ours that reads and writes fixed-size K/V buffers at a
  position given as a tensor, so one compiled graph serves every step;
- the attention masks are built here from that position and passed in as
  `{"full_attention": ..., "sliding_attention": ...}`;
- MoE experts are swapped for a static form (`experts.StaticExperts`);
- attention is transformers' eager math with each K/V head's query group as matrix rows
  (`attention.GROUPED`; `attention="eager"` keeps transformers' own), so a one-token decode is a
  matrix product per K/V head rather than a matrix-vector product per query head;
- the final logit softcap is left off (monotonic: greedy argmax is unchanged; the host applies it
  when sampling needs probabilities).

Buffers exist only for producer layers; KV-sharing consumers read their producer's K/V through
transformers' own `shared_kv_states`, exactly as the reference does.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from . import attention as attention_forms
from . import batch_graph, packed_linear
from .experts import StaticExperts, read_form
from .kv_layout import SLIDING, KVLayout
from .quant import Int8Linear, check_weights, target_linears


@dataclass(frozen=True)
class GraphShape:
    """Static shapes a graph is compiled for."""

    batch: int
    tokens: int  # query length: 1 for decode, the bucket length for prefill
    context_length: int
    ring: bool = False  # sliding layers keep only `sliding_window` slots

    @property
    def phase(self) -> str:
        return "decode" if self.tokens == 1 else "prefill"


def slot_positions(last_position: torch.Tensor, slots: int) -> torch.Tensor:
    """Position held by each buffer slot after contiguous writes up to `last_position`.

    A buffer of `slots` entries written at `position % slots` holds, in slot s, the latest
    position p <= last_position with p = s (mod slots). Negative means "never written".
    For a full-length buffer this is simply s (or negative for s > last_position).
    """
    s = torch.arange(slots, device=last_position.device)
    return last_position - torch.remainder(last_position - s, slots)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where attention is allowed, a large finite negative elsewhere.

    Finite on purpose: a fully masked row (a padding query) must stay NaN-free, or its NaN K/V
    would poison later steps through 0 * NaN.
    """
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.full((), torch.finfo(dtype).min, dtype=dtype, device=allowed.device))


class ExplicitKV:
    """The cache object handed to transformers' attention for one forward call.

    `update(k, v, layer_idx)` is the only method transformers calls. It writes the new K/V into
    the layer's buffer at the positions this call covers and returns the keys/values to attend
    over. Decode (one token) writes first and attends over the whole buffer. Prefill on a ring
    buffer attends over old buffer + the new chunk (a chunk longer than the window would not fit
    the ring), then keeps the newest `slots` tokens.

    `inplace=True` mutates the given buffers (CPU: torch.export turns it into input mutation that
    the compiler performs in place); `inplace=False` leaves them untouched and records fresh
    tensors in `updated` (Neuron: returned as outputs and aliased to the inputs).
    """

    def __init__(
        self,
        buffers: dict[int, tuple[torch.Tensor, torch.Tensor]],
        shape: GraphShape,
        start: torch.Tensor,
        length: torch.Tensor,
        inplace: bool,
    ):
        self.buffers, self.shape = buffers, shape
        self.start, self.length, self.tokens, self.inplace = start, length, shape.tokens, inplace
        self.updated: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _write(self, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        slots = old.shape[2]
        if self.tokens == 1:
            slot = torch.remainder(self.start, slots)
            return old.index_copy_(2, slot, new) if self.inplace else old.index_copy(2, slot, new)
        # Chunk token i goes to slot (start + i) % slots; for each slot take the newest valid token.
        s = torch.arange(slots, device=old.device)
        last = self.length - 1
        src = last - torch.remainder(self.start + last - s, slots)
        keep_old = (src < 0).view(1, 1, slots, 1)
        gathered = new.index_select(2, src.clamp(min=0))
        merged = torch.where(keep_old, old, gathered)
        return old.copy_(merged) if self.inplace else merged

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k_old, v_old = self.buffers[layer_idx]
        ring_prefill = self.tokens > 1 and k_old.shape[2] < self.shape.context_length
        if ring_prefill:
            keys, values = torch.cat([k_old, key_states], 2), torch.cat([v_old, value_states], 2)
        k_new, v_new = self._write(k_old, key_states), self._write(v_old, value_states)
        self.updated[layer_idx] = (k_new, v_new)
        return (keys, values) if ring_prefill else (k_new, v_new)


def build_masks(
    layout: KVLayout, shape: GraphShape, start: torch.Tensor, length: torch.Tensor, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Additive masks [1, 1, tokens, keys] per layer type, matching what `ExplicitKV.update` returns."""
    device = start.device
    q_pos = start + torch.arange(shape.tokens, device=device)
    masks = {}
    for layer_type in sorted({layer.layer_type for layer in layout.layers}):
        slots = layout.slots(layer_type, shape.context_length, shape.ring)
        if shape.tokens > 1 and slots < shape.context_length:
            # ring prefill: keys are [old ring contents, new chunk]
            old = slot_positions(start - 1, slots)
            new_idx = torch.arange(shape.tokens, device=device)
            k_pos = torch.cat([old, start + new_idx])
            k_valid = torch.cat([old >= 0, new_idx < length])
        else:
            # keys are the buffer after this call's writes
            k_pos = slot_positions(start + length - 1, slots)
            k_valid = k_pos >= 0
        allowed = k_valid[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if layer_type == SLIDING:
            allowed = allowed & (q_pos[:, None] - k_pos[None, :] < layout.sliding_window)
        masks[layer_type] = additive_mask(allowed, dtype)[None, None]
    return masks


def layer_types_in_order(config) -> list[str]:
    """The attention types in order of first use. transformers' text model iterates
    `set(config.layer_types)` to build one RoPE table per type; a set's order follows PYTHONHASHSEED,
    and so did the exported program's code, its digest and the cache key (half of all fresh
    processes recompiled). A list in layer order gives every process the same program."""
    return list(dict.fromkeys(config.layer_types))


def _shallow_clone(module: nn.Module) -> nn.Module:
    """A new module object sharing parameters and buffers, with its own child/param/buffer dicts."""
    clone = copy.copy(module)
    clone._modules = dict(module._modules)
    clone._parameters = dict(module._parameters)
    clone._buffers = dict(module._buffers)
    return clone


def _swap_linears(layer: nn.Module, make: Callable[[nn.Module], nn.Module]) -> None:
    """Swap a cloned layer's attention and MLP linears for `make(linear)` (`quant.Int8Linear`,
    `packed_linear.PackedLinear`); the attention and MLP modules are cloned first, so the host
    model keeps its own."""
    for parent_name in ("self_attn", "mlp"):
        if getattr(layer, parent_name, None) is not None:
            setattr(layer, parent_name, _shallow_clone(getattr(layer, parent_name)))
    for parent, name in list(target_linears(layer)):
        setattr(parent, name, make(getattr(parent, name)))


class DeviceGraph(nn.Module):
    """Prefill or decode over explicit K/V buffers; the pure core every recipe compiles.

    `forward(inputs_embeds, [per_layer_inputs,] start, length, *kv)` returns the raw (un-softcapped)
    logits of the last valid token, `[batch, vocab]`. With `inplace=True` the K/V tensors passed in
    are updated in place; with `inplace=False` the updated K/V follow the logits in the output.

    The graph holds a shallow clone of the text model (shared weights) without the word-embedding
    and PLE tables, so they are never part of a compiled artifact.
    """

    def __init__(
        self,
        text_model: nn.Module,
        lm_head: nn.Module,
        layout: KVLayout,
        shape: GraphShape,
        *,
        inplace: bool = True,
        expert_form: str = "dense",
        weights: str = "bf16",
        attention: str = attention_forms.GROUPED,
        compute_balance: float | None = None,
    ):
        super().__init__()
        # the target's FLOPs per byte, for a batched MoE's expert form (`experts.read_form`); None: bytes decide
        self.compute_balance, self.expert_element = compute_balance, lm_head.weight.element_size()
        int8 = check_weights(weights) == "int8"
        model = _shallow_clone(text_model)
        model.unique_layer_types = layer_types_in_order(text_model.config)
        model.embed_tokens = None
        if getattr(model, "embed_tokens_per_layer", None) is not None:
            model.embed_tokens_per_layer = None
        model.layers = nn.ModuleList([_shallow_clone(layer) for layer in text_model.layers])
        attn_config = attention_forms.graph_config(text_model.config, attention)
        cfg = text_model.config
        # (top-k, experts held): a batched selective decode reads densely from B x k >= E (`read_form`)
        self.expert_routing = (int(getattr(cfg, "top_k_experts", 0) or 0), int(getattr(cfg, "num_experts", 0) or 0))
        self.shape, self.expert_form = shape, expert_form
        # one CPU thread's small-M products: batched decode packs its large fp32 linears (`packed_linear`)
        pack = not int8 and packed_linear.packs(self.rows, lm_head.weight.dtype, compute_balance)
        if pack:
            lm_head = packed_linear.maybe_pack(lm_head, self.rows)
        for layer in model.layers:
            if getattr(layer, "experts", None) is not None:
                layer.experts = StaticExperts(layer.experts, self.experts_read, int8=int8)
            if int8:
                _swap_linears(layer, Int8Linear.from_linear)
            elif pack:
                _swap_linears(layer, lambda linear: packed_linear.maybe_pack(linear, self.rows))
            layer.self_attn = _shallow_clone(layer.self_attn)
            layer.self_attn.config = attn_config
        self.model = model
        self.lm_head = lm_head
        # "plain" unless a linear was packed: a graph whose program did not change keeps its key
        packed = any(isinstance(m, packed_linear.PackedLinear) for m in (lm_head, *model.modules()))
        self.linear_form = packed_linear.FORM if packed else "plain"
        self.layout, self.shape, self.inplace, self.expert_form = layout, shape, inplace, expert_form
        self.weights, self.attention = weights, attention
        self.tags: dict[str, str] = {}  # anything else that changes the program (e.g. a fault-lab fault)
        self.kv_class: type[ExplicitKV] = ExplicitKV  # the cache's class (the fault lab swaps it)
        if shape.batch > 1:  # one start/length per row (batch_graph.py); batch-1 programs unchanged
            self.kv_class = batch_graph.RowKV
        self.has_ple = bool(getattr(text_model.config, "hidden_size_per_layer_input", 0))
        self.dtype = lm_head.weight.dtype

    def key_parts(self) -> dict:
        """What distinguishes this graph's program beyond config, weights and shapes (cache key)."""
        return {
            "class": type(self).__qualname__,
            "inplace": self.inplace,
            "expert_form": self.expert_form,
            "attention": self.attention,
            "producers": [layer.producer for layer in self.layout.layers],
            # only when quantized: full-precision keys stay as they were (warm caches stay valid)
            **({"weights": self.weights} if self.weights == "int8" else {}),
            # only when a batch changes them: every other graph's key stays as it was
            **({"linear_form": self.linear_form} if self.linear_form != "plain" else {}),
            **({"experts_read": self.experts_read} if self.experts_read != self.expert_form else {}),
            **self.tags,
        }

    @property
    def rows(self) -> int:
        """Tokens per call: the M of every linear's product."""
        return self.shape.batch * self.shape.tokens

    @property
    def experts_read(self) -> str:
        """The expert form this graph runs: `expert_form`, except a batched selective graph whose
        B x tokens x k reaches the experts held, which reads them densely (`experts.read_form`).
        Batch-1 graphs always run the form asked for (their programs do not move)."""
        top_k, held = self.expert_routing
        if self.shape.batch == 1:
            return self.expert_form
        return read_form(self.expert_form, self.rows, top_k, held, self.compute_balance, self.expert_element)

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        """Zero inputs of the compiled shapes; every tensor distinct (aliased examples mislead export)."""
        cfg = self.model.config
        b, t = self.shape.batch, self.shape.tokens
        inputs = [torch.zeros(b, t, cfg.hidden_size, dtype=self.dtype)]
        if self.has_ple:
            inputs.append(torch.zeros(b, t, cfg.num_hidden_layers, cfg.hidden_size_per_layer_input, dtype=self.dtype))
        inputs += [torch.zeros(b, dtype=torch.long), torch.ones(b, dtype=torch.long)]  # one per row
        inputs += self.new_kv()
        return tuple(inputs)

    def new_kv(self) -> list[torch.Tensor]:
        shapes = self.layout.buffer_shapes(self.shape.batch, self.shape.context_length, self.shape.ring)
        return [torch.zeros(s, dtype=self.dtype) for s in shapes]

    def forward(self, inputs_embeds: torch.Tensor, *args: torch.Tensor):
        hidden, length, cache = self._hidden(inputs_embeds, *args)
        # the last valid token of a right-padded chunk (per row in a batch)
        rows = self.shape.batch > 1
        last = batch_graph.last_valid(hidden, length) if rows else hidden.index_select(1, length - 1)
        logits = self.lm_head(last)[:, 0, :].float()
        if self.inplace:
            return logits
        return (logits, *self._updated_kv(cache))

    def _hidden(
        self, inputs_embeds: torch.Tensor, *args: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, ExplicitKV]:
        """The text model over the K/V: its final hidden states `[b, tokens, hidden]`, the valid
        lengths, and the cache (`_updated_kv` reads the new K/V from it). Shared by every graph
        that runs the target (`drafting.TargetGraph` too), so they trace the same ops."""
        if self.has_ple:
            per_layer_inputs, start, length, *kv = args
        else:
            per_layer_inputs, (start, length, *kv) = None, args
        producers = self.layout.producers
        buffers = {layer.index: (kv[2 * i], kv[2 * i + 1]) for i, layer in enumerate(producers)}
        cache = self.kv_class(buffers, self.shape, start, length, self.inplace)
        rows = self.shape.batch > 1
        masks = (batch_graph.build_row_masks if rows else build_masks)(
            self.layout, self.shape, start, length, inputs_embeds.dtype
        )
        if rows:
            position_ids = batch_graph.row_positions(start, self.shape.tokens)
        else:
            position_ids = (start + torch.arange(self.shape.tokens, device=start.device))[None].expand(
                inputs_embeds.shape[0], -1
            )
        kwargs = dict(
            inputs_embeds=inputs_embeds,
            position_ids=position_ids,
            attention_mask=masks,
            past_key_values=cache,
            use_cache=True,
        )
        if self.has_ple:
            kwargs["per_layer_inputs"] = per_layer_inputs
        return self.model(**kwargs).last_hidden_state, length, cache

    def _updated_kv(self, cache: ExplicitKV) -> list[torch.Tensor]:
        """The updated K/V tensors in input order (the functional form's outputs after the logits)."""
        return [t for layer in self.layout.producers for t in cache.updated[layer.index]]
