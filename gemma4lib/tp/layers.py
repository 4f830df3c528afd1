"""The rank-local building blocks of a tensor-parallel graph, each the smallest thing that matches
its NxD counterpart, so the Neuron recipe can swap them one for one:

- `ColumnShard`  ~ `ColumnParallelLinear`: holds this rank's output rows; optional all-gather.
- `RowShard`     ~ `RowParallelLinear(input_is_parallel=True)`: holds this rank's input columns;
  the partial outputs are all-reduced.
- `SPMDRankParam` ~ `SPMDRank`: the rank as an int32 *parameter* loaded from the rank's shard, so
  one compiled graph serves every rank.
- `ShardedExperts`: this rank's MoE experts, one `ColumnShard` (`gate_up`) and one `RowShard`
  (`down`) cut by the plan's expert split, the slices gathered straight from the shard weights (no
  permuted view of the whole shard). `baked_rank=<int>` reproduces the field report's bug (README).

Collectives are a small object (`Collectives`): identity for one process, `torch.distributed`
for the CPU gloo run. Modules keep it as a plain attribute, not a submodule.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..device.experts import EXPERT_FORMS, EXPERT_SPLITS, gathered_experts
from ..errors import TensorParallelError, UnknownNameError


class Collectives:
    """World of one: every collective is the identity."""

    world_size = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return x


class TorchDistCollectives(Collectives):
    """Real collectives over the default `torch.distributed` process group (gloo on CPU)."""

    def __init__(self):
        import torch.distributed as dist

        self.dist = dist
        self.world_size = dist.get_world_size()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        self.dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self.dist.all_gather(parts, x)
        return torch.cat(parts, dim=dim)


class ColumnShard(nn.Linear):
    """`out_features_total / tp` output rows of a linear; `gather=True` all-gathers the outputs."""

    def __init__(
        self,
        in_features: int,
        out_features_total: int,
        tp: int,
        *,
        gather: bool = False,
        collectives: Collectives | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        if out_features_total % tp:
            raise TensorParallelError(
                f"{out_features_total} output features do not split over {tp} ranks; pick a TP degree that divides them"
            )
        super().__init__(in_features, out_features_total // tp, bias=False, dtype=dtype)
        self.weight.requires_grad_(False)
        self.tp, self.gather = tp, gather
        self.collectives = collectives or Collectives()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        return self.collectives.all_gather(y, -1) if self.gather else y


class RowShard(nn.Linear):
    """`in_features_total / tp` input columns of a linear; the partial outputs are all-reduced."""

    def __init__(
        self,
        in_features_total: int,
        out_features: int,
        tp: int,
        *,
        collectives: Collectives | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        if in_features_total % tp:
            raise TensorParallelError(
                f"{in_features_total} input features do not split over {tp} ranks; pick a TP degree that divides them"
            )
        super().__init__(in_features_total // tp, out_features, bias=False, dtype=dtype)
        self.weight.requires_grad_(False)
        self.tp = tp
        self.collectives = collectives or Collectives()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.collectives.all_reduce(F.linear(x, self.weight))


class SPMDRankParam(nn.Module):
    """This rank's index as an int32 parameter `[rank]`, filled from the rank's checkpoint shard."""

    def __init__(self, world_size: int):
        super().__init__()
        self.world_size = world_size
        self.rank = nn.Parameter(torch.zeros(1, dtype=torch.int32), requires_grad=False)

    def get_rank(self) -> torch.Tensor:
        return self.rank


class ShardedExperts(nn.Module):
    """Drop-in for the experts' `forward(hidden, top_k_index, top_k_weights)` on one rank.

    dense:     y = sum_e w_e * down_e(act(gate_e x) * up_e x)  =  down_local( [w_e * act(gate_e x) * up_e x]_e )
    summed over ranks: the routing weight is folded in before the down projection, so the whole
    expert block is one column-parallel and one row-parallel linear. Under the intermediate split
    the sum over ranks is the sum over each expert's intermediate slices (act is elementwise, so
    slicing the intermediate dimension is exact); under the expert split, over its experts.

    selective: the same sum over the k routed experts only (expert split: those in this rank's
    range; intermediate split: this rank's slice of each), indexed out of the two linears' `.weight`
    (NxD's parallel linears hold theirs in the same [out, in] layout), so both forms share one shard.

    `intermediate` is the unsharded per-expert width, `self.intermediate` this rank's share of it;
    `all_reduce` is the selective form's sum over ranks (default: the `RowShard`'s collectives).
    """

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        tp: int,
        act_fn,
        *,
        gate_up: nn.Module,
        down: nn.Module,
        baked_rank: int | None = None,
        form: str = "dense",
        all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
        split: str = "experts",
    ):
        super().__init__()
        if split not in EXPERT_SPLITS:
            raise UnknownNameError("expert split", split, EXPERT_SPLITS)
        if split == "experts" and num_experts % tp:
            raise TensorParallelError(
                f"{num_experts} experts do not split over {tp} ranks; use expert_split='intermediate'"
            )
        if split == "intermediate" and intermediate % tp:
            raise TensorParallelError(
                f"expert intermediate size {intermediate} does not split over {tp} ranks; use expert_split='experts'"
            )
        if split == "intermediate" and baked_rank is not None:
            raise TensorParallelError(
                "the intermediate split never reads the rank: there is no rank to bake "
                "in (the field report's bug lives in the expert split)"
            )
        if form not in EXPERT_FORMS:
            raise UnknownNameError("expert form", form, EXPERT_FORMS)
        self.split, self.num_experts, self.tp = split, num_experts, tp
        by_inner = split == "intermediate"
        self.local = num_experts if by_inner else num_experts // tp  # experts held (whole or sliced)
        self.hidden = hidden
        self.intermediate = intermediate // tp if by_inner else intermediate  # width held per expert
        self.act_fn = act_fn
        self.gate_up = gate_up  # [local * 2i, H] rows: expert-major, gate then up
        self.down = down  # [H, local * i] columns: expert-major
        self.baked_rank = baked_rank
        self.form = form  # the rank graph sets it per forward (prefill and decode share this module)
        self.all_reduce = all_reduce
        self.current_rank: torch.Tensor | None = None  # set by the rank graph for each forward

    def _rank(self) -> torch.Tensor:
        if self.current_rank is None:
            raise RuntimeError("ShardedExperts ran outside a rank graph: no rank tensor was provided")
        return self.current_rank.reshape(1).to(torch.long)

    def local_weights(self, weights: torch.Tensor) -> torch.Tensor:
        """This rank's columns of the [tokens, experts] routing weights (all of them under the
        intermediate split: every rank holds a slice of every expert)."""
        if self.split == "intermediate":
            return weights
        if self.baked_rank is not None:  # the bug: a Python int frozen into the graph
            start = self.baked_rank * self.local
            return weights[:, start : start + self.local]
        n = weights.shape[0]
        return weights.view(n, self.tp, self.local).index_select(1, self._rank()).reshape(n, self.local)

    def local_routes(
        self, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(local expert index clamped into [0, local), routing weight x valid), both [tokens, k].

        Intermediate split: the routed ids and weights as they are (every id is held here)."""
        if self.split == "intermediate":
            return top_k_index, top_k_weights.to(dtype)
        if self.baked_rank is not None:  # the bug again: rank 0's offset on every rank
            offset: int | torch.Tensor = self.baked_rank * self.local
        else:
            offset = self._rank() * self.local
        index = top_k_index - offset
        valid = (index >= 0) & (index < self.local)
        return index.clamp(0, self.local - 1), top_k_weights.to(dtype) * valid.to(dtype)

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.all_reduce is not None:
            return self.all_reduce(x)
        return self.down.collectives.all_reduce(x)

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        if self.form == "selective":
            return self._selective(hidden, top_k_index, top_k_weights)
        return self._dense(hidden, top_k_index, top_k_weights)

    def _dense(self, hidden, top_k_index, top_k_weights):
        n = hidden.shape[0]
        weights = torch.zeros(n, self.num_experts, dtype=top_k_weights.dtype, device=hidden.device)
        weights = weights.scatter(1, top_k_index, top_k_weights)
        local = self.local_weights(weights).to(hidden.dtype)  # [n, local]
        # parallel linears take [batch, seq, features] (NxD's contract): run the n tokens as one row
        gate_up = self.gate_up(hidden.unsqueeze(0))[0]
        gate, up = gate_up.view(n, self.local, 2 * self.intermediate).chunk(2, dim=-1)
        inner = self.act_fn(gate) * up * local.unsqueeze(-1)  # [n, local, I]
        return self.down(inner.reshape(1, n, self.local * self.intermediate))[0]

    def _selective(self, hidden, top_k_index, top_k_weights):
        index, scale = self.local_routes(top_k_index, top_k_weights, hidden.dtype)  # [n, k]
        # the shard's weights seen per local expert, without moving a byte: gate_up [local, 2I, H]
        # and down [H, local, I]. The down view is gathered along its expert dim (1): a permuted
        # view would make XLA transpose the whole shard every step before the gather.
        gate_up_w = self.gate_up.weight.view(self.local, 2 * self.intermediate, self.hidden)
        down_w = self.down.weight.view(self.hidden, self.local, self.intermediate)
        return self._reduce(gathered_experts(gate_up_w, down_w, hidden, index, scale, self.act_fn, down_expert_dim=1))
