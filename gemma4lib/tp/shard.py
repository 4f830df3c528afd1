"""Per-rank checkpoints: cut the reference model's weights for one rank of a `TPPlan`.

The keys are the rank graph's state-dict keys (`rank_graph.RankGraph`), so a shard loads with
`load_state_dict` on CPU and is exactly what NxD's `initialize(weights_per_rank, ...)` takes on
inf2. Besides the parameters a shard carries:

- the buffers (`layer_scalar`, one per decoder layer), which NxD's checkpoint sharding does not
  handle: left out, a graph keeps their init value of 1 and the model talks nonsense;
- the rank tensor `spmd_rank.rank = [rank]` (int32), the SPMDRank convention.

Embedding and PLE tables stay on the host and are not in any shard.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..errors import TensorParallelError
from .plan import COLUMN, REPLICATE, MoEPlan, TPPlan

HOST_ONLY = ("model.embed_tokens.weight", "model.embed_tokens_per_layer.weight")
RANK_KEY = "spmd_rank.rank"


def layer_key(key: str) -> tuple[int, str] | None:
    parts = key.split(".")
    if len(parts) >= 4 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
        return int(parts[2]), ".".join(parts[3:])
    return None


def _chunk(tensor: torch.Tensor, dim: int, tp: int, rank: int) -> torch.Tensor:
    return tensor.chunk(tp, dim=dim)[rank]


def rank_tensor(plan: TPPlan, key: str, tensor: torch.Tensor, rank: int) -> tuple[str, torch.Tensor] | None:
    """(rank-graph key, this rank's tensor) for one reference state-dict entry; None if host-only."""
    if key in HOST_ONLY:
        return None
    tp = plan.tp
    if key == "lm_head.weight":
        return key, (_chunk(tensor, 0, tp, rank) if plan.lm_head == COLUMN else tensor)
    located = layer_key(key)
    if located is None:
        return key, tensor
    i, sub = located
    attn = plan.attention(i)
    hd = attn.head_dim
    if sub == "self_attn.q_proj.weight":
        heads = attn.q_heads_of(rank)
        return key, tensor.view(attn.q_heads, hd, -1)[heads].reshape(len(heads) * hd, -1)
    if sub in ("self_attn.k_proj.weight", "self_attn.v_proj.weight"):
        heads = attn.kv_heads_of(rank)
        return key, tensor.view(attn.kv_heads, hd, -1)[heads].reshape(len(heads) * hd, -1)
    if sub == "self_attn.o_proj.weight":
        heads = attn.q_heads_of(rank)
        return key, tensor.view(tensor.shape[0], attn.q_heads, hd)[:, heads].reshape(tensor.shape[0], -1)
    if sub in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
        return key, _chunk(tensor, 0, tp, rank)
    if sub == "mlp.down_proj.weight":
        return key, _chunk(tensor, 1, tp, rank)
    prefix = key[: -len(sub)]
    moe = plan.layers[i].moe
    if sub == "experts.gate_up_proj":  # [E, 2I, H] -> [experts held * 2i, H]
        return prefix + "experts.gate_up.weight", _expert_gate_up(moe, tensor, rank)
    if sub == "experts.down_proj":  # [E, H, I] -> [H, experts held * i]
        return prefix + "experts.down.weight", _expert_down(moe, tensor, rank)
    return key, tensor


def _expert_gate_up(moe: MoEPlan, tensor: torch.Tensor, rank: int) -> torch.Tensor:
    """A rank's rows of the fused gate/up weights, expert-major, each expert's gate rows then its
    up rows: the layout `ShardedExperts` views as [experts held, 2i, H].

    Expert split: its whole experts. Intermediate split: rows [r*i, (r+1)*i) of every expert's
    gate *and* of its up (they sit I rows apart in [E, 2I, H], so the two are cut separately)."""
    local = _held_experts(moe, tensor, rank)  # [held, 2I, H]
    if moe.split == "intermediate":
        start, stop = moe.intermediate_of(rank)
        gate, up = local.chunk(2, dim=1)
        local = torch.cat([gate[:, start:stop], up[:, start:stop]], dim=1)  # [E, 2i, H]
    return local.reshape(-1, tensor.shape[-1])


def _expert_down(moe: MoEPlan, tensor: torch.Tensor, rank: int) -> torch.Tensor:
    """A rank's columns of the down weights, [H, held * i] expert-major (column e*i + j is
    expert e's intermediate column start + j): what its row-parallel linear multiplies the
    [tokens, held * i] activations by."""
    start, stop = moe.intermediate_of(rank)
    local = _held_experts(moe, tensor, rank)[:, :, start:stop]  # [held, H, i]
    return local.permute(1, 0, 2).reshape(tensor.shape[1], -1)


def _held_experts(moe: MoEPlan, tensor: torch.Tensor, rank: int) -> torch.Tensor:
    """The experts a rank holds (a consecutive range), as a view: no copy of a 1 GB bf16 layer of
    the released 26B-A4B's experts before the cut."""
    held = moe.experts_of(rank)
    return tensor[held[0] : held[-1] + 1]


def shard_state_dict(
    lm: nn.Module, plan: TPPlan, rank: int, *, include_buffers: bool = True, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """This rank's checkpoint: parameters cut by the plan, buffers, and the rank tensor.

    `lm` is the reference `*ForCausalLM`. `include_buffers=False` reproduces the NxD-loader fault
    (buffers such as `layer_scalar` missing from the shards). Tensors are contiguous copies.
    """
    if not 0 <= rank < plan.tp:
        raise TensorParallelError(f"rank {rank} is outside TP={plan.tp}; ranks are 0 .. {plan.tp - 1}")
    buffers = {name for name, _ in lm.named_buffers()}
    out: dict[str, torch.Tensor] = {}
    for key, tensor in lm.state_dict().items():
        if key in buffers and not include_buffers:
            continue
        cut = rank_tensor(plan, key, tensor, rank)
        if cut is None:
            continue
        new_key, value = cut
        out[new_key] = _as(value, dtype).contiguous().clone()
    out[RANK_KEY] = torch.tensor([rank], dtype=torch.int32)
    return out


def iter_shards(lm: nn.Module, plan: TPPlan, **kwargs: Any) -> Iterator[dict[str, torch.Tensor]]:
    for rank in range(plan.tp):
        yield shard_state_dict(lm, plan, rank, **kwargs)


def shard_kv(kv: list[torch.Tensor], plan: TPPlan, rank: int) -> list[torch.Tensor]:
    """This rank's slice of full (unsharded) K/V buffers: the KV heads the plan gives it.

    `kv` is the flat [K, V] list of the producer layers (`DeviceGraph.new_kv` order), e.g. written
    by a CPU prefill of the unsharded model; the result seeds that rank's device buffers.
    """
    out = []
    for i, layer in enumerate(plan.layout.producers):
        heads = torch.tensor(plan.attention(layer.index).kv_heads_of(rank))
        out += [kv[2 * i].index_select(1, heads).contiguous(), kv[2 * i + 1].index_select(1, heads).contiguous()]
    return out


def nxd_full_checkpoint(lm: nn.Module, plan: TPPlan, *, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """One checkpoint that NxD's contiguous sharding cuts back into exactly our per-rank shards (what a
    ModelBuilder `checkpoint_loader` returns; `shard_checkpoint` then reproduces `shard_state_dict(lm,
    plan, r)` for every r): each sharded key is every rank's piece concatenated along the partition
    dimension (replicated KV heads: one copy per rank), replicated keys as they are, the rank key
    `arange(tp)`.

    The MoE experts under the intermediate split are laid out *rank-major*: a rank needs rows [r*i,
    (r+1)*i) of every expert's gate and up, E * 2 runs spread over HF's expert-major tensor, so block r
    holds rank r's gate then up rows expert by expert ([E, 2i, H] flattened) and the down weight's
    column block r its [H, E, i]; NxD's plain contiguous cut then hands each rank its 1/tp of every
    expert. (Under the expert split HF's layout already is that.) Built one key at a time, so the host
    holds the model plus this one checkpoint, never every rank's shard too (`compile_host`).
    """
    full: dict[str, torch.Tensor] = {}
    for key, tensor in lm.state_dict().items():
        cuts = [rank_tensor(plan, key, tensor, rank) for rank in range(plan.tp)]
        if cuts[0] is None:
            continue
        new_key = cuts[0][0]
        pieces = [_as(value, dtype) for _, value in cuts]
        rule = plan.rule(new_key)
        full[new_key] = pieces[0].contiguous().clone() if rule.kind == REPLICATE else torch.cat(pieces, dim=rule.dim)
        del cuts, pieces
    full[RANK_KEY] = torch.arange(plan.tp, dtype=torch.int32)
    return full


def _as(value: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    value = value.detach()
    return value.to(dtype) if dtype is not None and value.is_floating_point() else value
