"""The device graph's per-row pieces for a batch of B > 1 prompts of different lengths.

A batch-1 graph takes `start` and `length` as one-element tensors; a batched graph takes them as
`[B]` tensors, one value per row, so every row has its own positions, its own masks and its own
K/V slots (rows of the `[B, kv_heads, slots, head_dim]` buffers, rings included). Prompts are
**right-padded** to the prefill bucket: row b's valid tokens are chunk positions
`0 .. length[b] - 1`, the padding after them is never written to K/V and never attended to, and the
logits come from each row's own last valid token. Decode feeds one token per row, each at its own
position `start[b]`.

Everything here is shape-static and made of ops every compiler here lowers (arange, remainder,
where, gather, scatter): the batched graph is the same graph for cpu, eager, xla and Neuron.
Batch-1 graphs keep their own code (`graph.py`), so their programs, cache keys and audited bytes
do not move.
"""

from __future__ import annotations

import torch

from .kv_layout import SLIDING, KVLayout


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where allowed, the dtype's finite minimum elsewhere (`graph.additive_mask`'s rule: finite,
    so a fully masked padding query stays NaN-free)."""
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.full((), torch.finfo(dtype).min, dtype=dtype, device=allowed.device))


def row_slot_positions(last_position: torch.Tensor, slots: int) -> torch.Tensor:
    """`graph.slot_positions` per row: `last_position [B]` -> `[B, slots]` (negative: never written)."""
    s = torch.arange(slots, device=last_position.device)
    last = last_position[:, None]
    return last - torch.remainder(last - s[None, :], slots)


def row_positions(start: torch.Tensor, tokens: int) -> torch.Tensor:
    """Each row's query positions `[B, tokens]`: `start[b] + i`."""
    return start[:, None] + torch.arange(tokens, device=start.device)[None, :]


def build_row_masks(
    layout: KVLayout, shape, start: torch.Tensor, length: torch.Tensor, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Additive masks `[B, 1, tokens, keys]` per layer type, row by row what `build_masks` does."""
    device = start.device
    q_pos = row_positions(start, shape.tokens)  # [B, T]
    masks = {}
    for layer_type in sorted({layer.layer_type for layer in layout.layers}):
        slots = layout.slots(layer_type, shape.context_length, shape.ring)
        if shape.tokens > 1 and slots < shape.context_length:
            # ring prefill: keys are [old ring contents, new chunk], per row
            old = row_slot_positions(start - 1, slots)  # [B, S]
            new_idx = torch.arange(shape.tokens, device=device)
            k_pos = torch.cat([old, q_pos], 1)
            k_valid = torch.cat([old >= 0, new_idx[None, :] < length[:, None]], 1)
        else:
            k_pos = row_slot_positions(start + length - 1, slots)
            k_valid = k_pos >= 0
        allowed = k_valid[:, None, :] & (k_pos[:, None, :] <= q_pos[:, :, None])  # [B, T, K]
        if layer_type == SLIDING:
            allowed = allowed & (q_pos[:, :, None] - k_pos[:, None, :] < layout.sliding_window)
        masks[layer_type] = additive_mask(allowed, dtype)[:, None]
    return masks


class RowKV:
    """`graph.ExplicitKV` with one start and one length per row: each row writes its own slots.

    Decode writes each row's new K/V into slot `start[b] % slots` of its own row; prefill keeps,
    per row and slot, the newest valid chunk token that maps there (or the old contents). The same
    constructor and `update` contract as `ExplicitKV` (kept free of `graph.py`: no import cycle).
    """

    def __init__(self, buffers, shape, start: torch.Tensor, length: torch.Tensor, inplace: bool):
        self.buffers, self.shape = buffers, shape
        self.start, self.length, self.tokens, self.inplace = start, length, shape.tokens, inplace
        self.updated: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k_old, v_old = self.buffers[layer_idx]
        ring_prefill = self.tokens > 1 and k_old.shape[2] < self.shape.context_length
        if ring_prefill:
            keys, values = torch.cat([k_old, key_states], 2), torch.cat([v_old, value_states], 2)
        k_new, v_new = self._write(k_old, key_states), self._write(v_old, value_states)
        self.updated[layer_idx] = (k_new, v_new)
        return (keys, values) if ring_prefill else (k_new, v_new)

    def _write(self, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        b, heads, slots, dim = old.shape
        if self.tokens == 1:
            # old[row, head, slot[row]] = new[row, head, 0]: an index_put, which Inductor performs in
            # place on the K/V input; a scatter was lowered as a copy of the whole buffer every step
            # (54 ms of a 254 ms medium-dense step at B=8, context 512: docs/ROOFLINE.md)
            rows = torch.arange(b, device=old.device).view(b, 1)
            heads_at = torch.arange(heads, device=old.device).view(1, heads)
            slot = torch.remainder(self.start, slots).view(b, 1)
            index = (rows, heads_at, slot)
            value = new[:, :, 0, :]
            return old.index_put_(index, value) if self.inplace else old.index_put(index, value)
        s = torch.arange(slots, device=old.device)
        last = (self.length - 1)[:, None]  # [B, 1]
        src = last - torch.remainder(self.start[:, None] + last - s[None, :], slots)  # [B, S]
        keep_old = (src < 0).view(b, 1, slots, 1)
        index = src.clamp(min=0).view(b, 1, slots, 1).expand(b, heads, slots, new.shape[-1])
        merged = torch.where(keep_old, old, torch.gather(new, 2, index))
        return old.copy_(merged) if self.inplace else merged


def last_valid(hidden: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    """Each row's hidden state at its last valid token: `[B, T, H]` -> `[B, 1, H]`."""
    index = (length - 1).view(-1, 1, 1).expand(-1, 1, hidden.shape[-1])
    return torch.gather(hidden, 1, index)


__all__ = ["RowKV", "build_row_masks", "last_valid", "row_positions", "row_slot_positions"]
