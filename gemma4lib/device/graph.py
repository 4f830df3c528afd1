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
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from . import attention as attention_forms
from . import packed_linear
from .experts import StaticExperts, read_form
from .kv_layout import SLIDING, KVLayout
from .quant import Int8Linear, check_weights, target_linears


@dataclass(frozen=True)
class GraphShape:
    """Static shapes a graph is compiled for."""

    batch: int
    tokens: int  # query length: 1 for decode, k + 1 for a verify, the bucket length for prefill
    context_length: int
    ring: bool = False  # sliding layers keep only `sliding_window` slots
    # a context bucket: the graph attends over the first `reads` slots of every full-length buffer (the
    # K/V of positions 0 .. reads - 1; every row it runs ends before that). None: the whole context
    reads: int | None = None

    def slots_read(self, slots: int) -> int:
        """The slots attended over in a buffer of `slots`: a full-length buffer's first `reads`; a ring's all."""
        return self.reads if self.reads and slots == self.context_length else slots

    @property
    def key(self) -> dict:
        """The shape's part of a cache key: `reads` only when set (a whole-context graph keeps its key)."""
        return {k: v for k, v in vars(self).items() if v is not None}

    @property
    def phase(self) -> str:
        return "decode" if self.tokens == 1 else "prefill"


# Index inputs (start, length, position) are int32 on every backend: NxD Inference converts them to
# int32 before the device and the Neuron compiler truncates INT64 to INT32 anyway.
INDEX_DTYPE = torch.int32


def index_tensor(values) -> torch.Tensor:
    """A row-index input (`start`, `length`, `position`) as every compiled graph takes it."""
    return torch.as_tensor(values, dtype=INDEX_DTYPE).reshape(-1)


def slot_positions(last_position: torch.Tensor, slots: int, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Position held by each buffer slot after contiguous writes up to `last_position [B]`: `[B, slots]`.

    A buffer of `slots` entries written at `position % slots` holds, in slot s, the latest
    position p <= last_position with p = s (mod slots). Negative means "never written".
    For a full-length buffer this is simply s (or negative for s > last_position). `positions`: the
    slots 0 .. slots - 1 as an input carries them (a context bucket's key on neuron, `device.context_key`).
    """
    s = positions if positions is not None and positions.shape[0] == slots else None
    s = torch.arange(slots, device=last_position.device, dtype=last_position.dtype) if s is None else s
    last = last_position[:, None]
    return last - torch.remainder(last - s[None, :], slots)


def row_positions(start: torch.Tensor, tokens: int) -> torch.Tensor:
    """Each row's query positions `[B, tokens]`: `start[b] + i`."""
    return start[:, None] + torch.arange(tokens, device=start.device, dtype=start.dtype)[None, :]


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where attention is allowed, a large finite negative elsewhere.

    Finite on purpose: a fully masked row (a padding query, an idle batch row) must stay NaN-free,
    or its NaN K/V would poison later steps through 0 * NaN.
    """
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.full((), torch.finfo(dtype).min, dtype=dtype, device=allowed.device))


class ExplicitKV:
    """The cache object handed to transformers' attention for one forward call, one row per prompt.

    `update(k, v, layer_idx)` is the only method transformers calls. It writes the new K/V into
    each row's buffer at the positions this call covers (`start[b]`, `length[b]` tokens) and
    returns the keys/values to attend over. Decode (one token) writes first and attends over the
    whole buffer (a context bucket: its first `shape.reads` slots); a row with `length` 0 (idle, or
    not part of this call) writes nothing. Prefill (or a verify) on a ring buffer attends over old
    buffer + the new chunk (a chunk longer than the window would not fit the ring), then keeps the
    newest `slots` tokens.

    `inplace=True` mutates the given buffers (CPU: torch.export turns it into input mutation that
    the compiler performs in place); `inplace=False` leaves them untouched and records fresh
    tensors in `updated` (XLA, Neuron: returned as outputs and aliased to the inputs).
    """

    def __init__(
        self,
        buffers: dict[int, tuple[torch.Tensor, torch.Tensor]],
        shape: GraphShape,
        start: torch.Tensor,
        length: torch.Tensor,
        inplace: bool,
        rows: torch.Tensor | None = None,  # a join's one buffer row `[1]` (`row_join`); None: every row
    ):
        self.buffers, self.shape, self.rows = buffers, shape, rows
        self.start, self.length, self.tokens, self.inplace = start, length, shape.tokens, inplace
        self.updated: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k_old, v_old = self.buffers[layer_idx]
        ring_prefill = self.tokens > 1 and k_old.shape[2] < self.shape.context_length
        if ring_prefill:
            keys, values = (torch.cat([self._read(t), n], 2) for t, n in ((k_old, key_states), (v_old, value_states)))
        k_new, v_new = self._write(k_old, key_states), self._write(v_old, value_states)
        self.updated[layer_idx] = (k_new, v_new)
        if ring_prefill:
            return keys, values
        reads = self.shape.slots_read(k_old.shape[2])  # a context bucket: a static slice, the rest unread
        return tuple(self._read(t if reads == t.shape[2] else t[:, :, :reads]) for t in (k_new, v_new))

    def _read(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer if self.rows is None else buffer.index_select(0, self.rows)  # the call's rows

    def _write(self, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """Put the call's new positions into `old`, nothing else. Token t of row b goes to slot
        (start[b] + t) % slots: an index_put of T slices per row and head, which Inductor performs in
        place on the K/V input and XLA lowers as a scatter of T x D-wide rows (NxD Inference's
        context-encoding write), not a rewrite of every slot. A token past its row's length (padding,
        an idle row) puts back what its slot holds. A ring shorter than the chunk would take two
        tokens in one slot: there each slot takes its newest token, a D-wide row of the chunk."""
        b, (heads, slots, _), tokens = new.shape[0], old.shape[1:], new.shape[2]
        if tokens > slots:
            s = torch.arange(slots, device=old.device, dtype=self.start.dtype)
            last = (self.length - 1)[:, None]  # [B, 1]
            src = last - torch.remainder(self.start[:, None] + last - s[None, :], slots)  # [B, S]
            keep_old = (src < 0).view(b, 1, slots, 1)
            # D-wide rows of the chunk (an XLA gather of [1, 1, 1, D] slices, never one element each)
            rows_at = torch.arange(b, device=old.device).view(b, 1, 1)
            heads_at = torch.arange(heads, device=old.device).view(1, heads, 1)
            picked = new[rows_at, heads_at, src.clamp(min=0).long().view(b, 1, slots)]
            merged = torch.where(keep_old, self._read(old), picked)
            if self.rows is not None:  # a join: the row's whole ring
                return old.index_copy(0, self.rows, merged)
            return old.copy_(merged) if self.inplace else merged
        t = torch.arange(tokens, device=old.device, dtype=self.start.dtype)
        rows = (torch.arange(b, device=old.device) if self.rows is None else self.rows).view(b, 1, 1)
        heads_at = torch.arange(heads, device=old.device).view(1, heads, 1)
        # one index dtype (XLA refuses a mix)
        slot = torch.remainder(self.start[:, None] + t[None, :], slots).long().view(b, 1, tokens)
        index = (rows, heads_at, slot)
        written = (t[None, :] < self.length[:, None]).view(b, 1, tokens, 1)
        value = torch.where(written, new, old[index])
        return old.index_put_(index, value) if self.inplace else old.index_put(index, value)


def key_blocks(blocks: torch.Tensor, k_pos: torch.Tensor, start: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    """The image block of every key `[B, K]` (0: not an image token): a key written by this call
    takes its chunk token's block, any other key 0 (an image lies inside one prefill chunk)."""
    offset = k_pos - start[:, None]
    inside = (offset >= 0) & (offset < length[:, None])
    index = offset.clamp(0, blocks.shape[1] - 1).long()
    return torch.where(inside, torch.gather(blocks, 1, index), torch.zeros_like(index).to(blocks.dtype))


def build_masks(
    layout: KVLayout,
    shape: GraphShape,
    start: torch.Tensor,
    length: torch.Tensor,
    dtype: torch.dtype,
    blocks: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Additive masks `[B, 1, tokens, keys]` per layer type, matching what `ExplicitKV.update` returns.

    `blocks [B, tokens]` (a prefill with images on a config bidirectional over them): each chunk
    token's image, 1, 2, ... (0: text). On the sliding layers a token then also sees the later tokens
    of its own image, inside the window: `(causal OR same image) AND window`; full layers stay causal
    (the model's intended masks, `models.image_attention`). `positions`: see `slot_positions`."""
    device = start.device
    q_pos = row_positions(start, shape.tokens)  # [B, T]
    masks = {}
    for layer_type in sorted({layer.layer_type for layer in layout.layers}):
        slots = layout.slots(layer_type, shape.context_length, shape.ring)
        ring_prefill = shape.tokens > 1 and slots < shape.context_length
        slots = shape.slots_read(slots)
        if ring_prefill:
            # ring prefill: keys are [old ring contents, new chunk], per row
            old = slot_positions(start - 1, slots)  # [B, S]
            new_idx = torch.arange(shape.tokens, device=device, dtype=start.dtype)
            k_pos = torch.cat([old, q_pos], 1)
            k_valid = torch.cat([old >= 0, new_idx[None, :] < length[:, None]], 1)
        else:
            # keys are the buffer after this call's writes
            k_pos = slot_positions(start + length - 1, slots, positions)
            k_valid = k_pos >= 0
        seen = k_pos[:, None, :] <= q_pos[:, :, None]  # [B, T, K]: causal
        if layer_type == SLIDING:
            if blocks is not None:
                if ring_prefill:
                    k_block = torch.cat([torch.zeros_like(old).to(blocks.dtype), blocks], 1)
                else:
                    k_block = key_blocks(blocks, k_pos, start, length)
                same = (blocks[:, :, None] == k_block[:, None, :]) & (blocks[:, :, None] > 0)
                seen = seen | same
            seen = seen & (q_pos[:, :, None] - k_pos[:, None, :] < layout.sliding_window)
        masks[layer_type] = additive_mask(k_valid[:, None, :] & seen, dtype)[:, None]
    return masks


def last_valid(hidden: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    """Each row's hidden state at its last valid token: `[B, T, H]` -> `[B, 1, H]` (an idle row,
    length 0, gives its first position's: its logits are never read)."""
    index = (length - 1).clamp(min=0).long().view(-1, 1, 1).expand(-1, 1, hidden.shape[-1])
    return torch.gather(hidden, 1, index)


def inverse_cdf(cdf: torch.Tensor, u: torch.Tensor | float) -> torch.Tensor:
    """Where a draw u in (0, 1] falls in cumulative sums `cdf [..., vocab]` (scaled by their total):
    the one sampling rule of the host (`runtime.choose_token`) and the device (`choose_tokens`)."""
    return (cdf < u * cdf[..., -1:]).sum(-1).clamp(max=cdf.shape[-1] - 1)


def nucleus(probs: torch.Tensor, top_p: torch.Tensor | float) -> torch.Tensor:
    """`probs [..., vocab]` with only each row's top-p nucleus kept: the tokens of probability >= the
    largest floor whose tokens still hold top_p of the mass (the sorted-cumsum nucleus, ties kept
    whole). Found by bisection (no sort of the vocabulary on the device; torch_xla has no bit cast):
    64 halvings of [0, 2] end on adjacent floats for any floor above 2^-40, so the kept set is exact
    there; the host (`runtime.sampling_probs`) runs the same rule."""
    top_p = torch.as_tensor(top_p, dtype=torch.float32, device=probs.device).expand(probs.shape[:-1])[..., None]
    total = probs.sum(-1, keepdim=True)
    low, high = torch.zeros_like(top_p), torch.full_like(top_p, 2.0)  # floor 0 holds all the mass, 2 none
    for _ in range(64):
        mid = low + (high - low) / 2
        holds = torch.where(probs >= mid, probs, 0.0).sum(-1, keepdim=True) >= top_p * total
        low, high = torch.where(holds, mid, low), torch.where(holds, high, mid)
    return torch.where((probs >= low) | (top_p >= 1.0), probs, 0.0)


def choose_tokens(logits: torch.Tensor, sampling: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Each row's next token from its raw logits `[B, vocab]` and `sampling [B, 3]` = (temperature,
    u in (0, 1], top_p): the argmax at temperature 0, else the token where u falls in the cumulative
    sum of the softcapped, tempered distribution's nucleus (`nucleus`, `inverse_cdf`: the host's
    `runtime.choose_token`). -1 for a row whose logits are not finite (the host ends that row)."""
    temperature, u, top_p = sampling[:, :1].float(), sampling[:, 1:2].float(), sampling[:, 2].float()
    logits = logits.float()
    capped = cap * torch.tanh(logits / cap) if cap else logits
    cdf = torch.cumsum(nucleus(torch.softmax(capped / temperature.clamp(min=1e-5), -1), top_p), -1)
    drawn = inverse_cdf(cdf, u)
    token = torch.where(temperature[:, 0] > 0, drawn, torch.argmax(logits, -1))
    return torch.where(torch.isfinite(logits).all(-1), token, -1).to(INDEX_DTYPE)


def greedy_verdicts(logits: torch.Tensor, drafts: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    """A greedy verify's outcome per row from its raw logits `[B, T, vocab]`, the drafts `[B, T - 1]`
    and its length (1 + its drafts): `[B, T + 1]` int32, the drafts kept, then the target's argmax at
    every position (-1 where the logits are not finite; `acceptance.greedy_verdict` on the host).
    The first mismatch by a minimum, not a cumulative product: one reduction on every compiler."""
    predicted = torch.where(torch.isfinite(logits).all(-1), torch.argmax(logits, -1), -1).to(INDEX_DTYPE)
    steps = torch.arange(drafts.shape[1], device=drafts.device)
    same = (predicted[:, :-1] == drafts) & (steps[None, :] < (length[:, None] - 1))
    kept = torch.where(same, drafts.shape[1], steps[None, :]).min(-1).values if drafts.shape[1] else length * 0
    return torch.cat([kept.to(INDEX_DTYPE)[:, None], predicted], dim=1)


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
    """Prefill, decode or verify over explicit K/V buffers, for B rows: the pure core every recipe
    compiles. One forward; the mode comes from the shape (tokens 1: decode; more: a prefill chunk or
    a k + 1-token verify) and from what it returns.

    `forward(inputs_embeds, [per_layer_inputs,] start, length, *kv)`, `start`/`length` int32 `[B]`
    (row b's chunk covers positions `start[b] .. start[b] + length[b] - 1`; right-padded; length 0:
    the row is idle and writes nothing), returns the raw (un-softcapped) logits: of each row's last
    valid token `[B, vocab]`, or of every position `[B, tokens, vocab]` with `every_position` (the
    verify). `hidden=True` also returns the final hidden states in the same layout (the assistant
    drafts from them). `chooses=True` (a serving step on a device across a bus) returns token ids,
    not the vocabulary's logits: a decode takes `sampling [B, 3]` after `length` and returns each
    row's next token `[B]` int32 (`choose_tokens`: 4 bytes a row); a verify takes the drafts
    `[B, tokens - 1]` int32 there and returns the greedy verdict `[B, tokens + 1]` (`greedy_verdicts`)
    and, with `hidden`, the hidden state at the last kept position `[B, H]` only. With `inplace=True` the K/V tensors
    passed in are updated in place; with `inplace=False` the updated K/V follow the outputs.

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
        every_position: bool = False,
        hidden: bool = False,
        image_blocks: bool = False,
        chooses: bool = False,
    ):
        super().__init__()
        self.chooses = bool(chooses)
        self.cap = getattr(text_model.config, "final_logit_softcapping", None)
        # a prefill over images on a config bidirectional over them: takes each token's image (`build_masks`)
        self.image_blocks = bool(image_blocks)
        # the target's FLOPs per byte (`packed_linear`); set only for CPU targets (`experts_read`)
        self.compute_balance = compute_balance
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
        # (two or three rows: weight-left where this machine measures it faster)
        swap = None
        if not int8 and packed_linear.packs(self.rows, lm_head.weight.dtype, compute_balance):
            swap = functools.partial(packed_linear.maybe_pack, rows=self.rows)
        elif not int8 and packed_linear.weight_left(self.rows, lm_head.weight.dtype, compute_balance):
            swap = packed_linear.maybe_weight_left
        lm_head = swap(lm_head) if swap else lm_head
        for layer in model.layers:
            if getattr(layer, "experts", None) is not None:
                layer.experts = StaticExperts(layer.experts, self.experts_read, int8=int8)
            if int8:
                _swap_linears(layer, Int8Linear.from_linear)
            elif swap:
                _swap_linears(layer, swap)
            layer.self_attn = _shallow_clone(layer.self_attn)
            layer.self_attn.config = attn_config
            # a parameter (the host's buffer, shared), not a buffer: the compiler folds buffers into the
            # program, so every model (trained, witness, vision fixture) would need a compile of its own
            if (scalar := layer._buffers.pop("layer_scalar", None)) is not None:
                layer.layer_scalar = nn.Parameter(scalar, requires_grad=False)
        self.model = model
        self.lm_head = lm_head
        # "plain" unless a linear was swapped: a graph whose program did not change keeps its key
        swapped = {type(m) for m in (lm_head, *model.modules())}
        forms = {packed_linear.PackedLinear: packed_linear.FORM, packed_linear.WeightLeftLinear: packed_linear.LEFT}
        self.linear_form = next((form for cls, form in forms.items() if cls in swapped), "plain")
        self.layout, self.shape, self.inplace, self.expert_form = layout, shape, inplace, expert_form
        self.weights, self.attention = weights, attention
        self.every_position, self.returns_hidden = every_position, hidden
        self.tags: dict[str, str] = {}  # anything else that changes the program (e.g. a fault-lab fault)
        self.kv_class: type[ExplicitKV] = ExplicitKV  # the cache's class (the fault lab swaps it)
        self.key_positions: torch.Tensor | None = None  # set for a call by `context_key.ContextKey`
        self.has_ple = bool(getattr(text_model.config, "hidden_size_per_layer_input", 0))
        self.dtype = lm_head.weight.dtype

    def key_parts(self) -> dict:
        """What distinguishes this graph's program beyond config, weights and shapes (cache key)."""
        routed = self.expert_routing[1] > 0  # without experts the form asked for changes nothing: one key
        return {
            "class": type(self).__qualname__,
            "inplace": self.inplace,
            "expert_form": self.expert_form if routed else "dense",
            "attention": self.attention,
            "producers": [layer.producer for layer in self.layout.layers],
            "outputs": {"every_position": self.every_position, "hidden": self.returns_hidden},
            "index_dtype": str(INDEX_DTYPE),
            # only when quantized: full-precision keys stay as they were (warm caches stay valid)
            **({"weights": self.weights} if self.weights == "int8" else {}),
            # only when a batch changes them: every other graph's key stays as it was
            **({"linear_form": self.linear_form} if self.linear_form != "plain" else {}),
            **({"experts_read": self.experts_read} if routed and self.experts_read != self.expert_form else {}),
            **({"image_blocks": True} if self.image_blocks else {}),
            **({"chooses": True} if self.chooses else {}),
            **self.tags,
        }

    @property
    def rows(self) -> int:
        """Tokens per call: the M of every linear's product."""
        return self.shape.batch * self.shape.tokens

    @property
    def num_inputs(self) -> int:
        """Inputs before the K/V: embeddings, (PLE,) (image blocks,) start, length, (sampling)."""
        return 3 + int(self.has_ple) + int(self.image_blocks) + int(self.chooses)

    @property
    def experts_read(self) -> str:
        """The expert form this graph runs: `expert_form`, except a batched selective graph, which
        reads each routed expert once (`experts.read_form`: grouped on a CPU target, else dense
        from B x tokens x k >= the experts held).
        Batch-1 graphs always run the form asked for (their programs do not move)."""
        top_k, held = self.expert_routing
        if self.shape.batch == 1:
            return self.expert_form
        # a CPU target (compute_balance set: cpu, eager) runs the data-dependent `grouped` form
        return read_form(self.expert_form, self.rows, top_k, held, grouped=self.compute_balance is not None)

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        """Zero inputs of the compiled shapes; every tensor distinct (aliased examples mislead export)."""
        cfg = self.model.config
        b, t = self.shape.batch, self.shape.tokens
        inputs = [torch.zeros(b, t, cfg.hidden_size, dtype=self.dtype)]
        if self.has_ple:
            inputs.append(torch.zeros(b, t, cfg.num_hidden_layers, cfg.hidden_size_per_layer_input, dtype=self.dtype))
        if self.image_blocks:
            inputs.append(torch.zeros(b, t, dtype=INDEX_DTYPE))
        inputs += [torch.zeros(b, dtype=INDEX_DTYPE), torch.ones(b, dtype=INDEX_DTYPE)]  # one per row
        if self.chooses:  # a verify's drafts, or a decode's sampling
            inputs.append(torch.zeros(b, t - 1, dtype=INDEX_DTYPE) if self.every_position else torch.zeros(b, 3))
        inputs += self.new_kv()
        return tuple(inputs)

    def new_kv(self) -> list[torch.Tensor]:
        shapes = self.layout.buffer_shapes(self.shape.batch, self.shape.context_length, self.shape.ring)
        return [torch.zeros(s, dtype=self.dtype) for s in shapes]

    def forward(self, inputs_embeds: torch.Tensor, *args: torch.Tensor):
        if self.chooses:  # sampling (or the drafts) follows length: out before the text model's inputs
            at = self.num_inputs - 2
            sampling, args = args[at], (*args[:at], *args[at + 1 :])
        hidden, length, cache = self._hidden(inputs_embeds, *args)
        if self.every_position and self.chooses:  # the greedy verdict, the hidden state it keeps
            verdict = greedy_verdicts(self.lm_head(hidden).float(), sampling, length)
            index = verdict[:, 0].long().view(-1, 1, 1).expand(-1, 1, hidden.shape[-1])
            out: tuple[torch.Tensor, ...] = (verdict,)
            kept = torch.gather(hidden, 1, index)[:, 0, :]
        elif self.every_position:
            out = (self.lm_head(hidden).float(),)
            kept = hidden
        else:
            # the last valid token of a right-padded chunk, per row
            kept = last_valid(hidden, length)
            out = (self.lm_head(kept)[:, 0, :].float(),)
            kept = kept[:, 0, :]
        if self.chooses and not self.every_position:
            out = (choose_tokens(out[0], sampling, self.cap),)
        if self.returns_hidden:
            out = (*out, kept)
        if not self.inplace:
            out = (*out, *self._updated_kv(cache))
        return out[0] if len(out) == 1 else out

    def _hidden(
        self, inputs_embeds: torch.Tensor, *args: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, ExplicitKV]:
        """The text model over the K/V: its final hidden states `[b, tokens, hidden]`, the valid
        lengths, and the cache (`_updated_kv` reads the new K/V from it)."""
        rest = list(args)
        per_layer_inputs = rest.pop(0) if self.has_ple else None
        blocks = rest.pop(0) if self.image_blocks else None
        start, length, *kv = rest
        producers = self.layout.producers
        buffers = {layer.index: (kv[2 * i], kv[2 * i + 1]) for i, layer in enumerate(producers)}
        cache = self.kv_class(buffers, self.shape, start, length, self.inplace)
        masks = build_masks(self.layout, self.shape, start, length, inputs_embeds.dtype, blocks, self.key_positions)
        kwargs = dict(
            inputs_embeds=inputs_embeds,
            position_ids=row_positions(start, self.shape.tokens).long(),
            attention_mask=masks,
            past_key_values=cache,
            use_cache=True,
        )
        if self.has_ple:
            kwargs["per_layer_inputs"] = per_layer_inputs
        return self.model(**kwargs).last_hidden_state, length, cache

    def _updated_kv(self, cache: ExplicitKV) -> list[torch.Tensor]:
        """The updated K/V tensors in input order (the functional form's outputs after the others)."""
        return [t for layer in self.layout.producers for t in cache.updated[layer.index]]
