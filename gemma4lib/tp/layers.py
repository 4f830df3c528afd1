"""The rank-local building blocks of a tensor-parallel graph.

Each is the smallest thing that matches its NxD counterpart, so the Neuron recipe can swap them
one for one:

- `ColumnShard`  ~ `ColumnParallelLinear`: holds this rank's output rows; optional all-gather.
- `RowShard`     ~ `RowParallelLinear(input_is_parallel=True)`: holds this rank's input columns;
  the partial outputs are all-reduced.
- `SPMDRankParam` ~ `SPMDRank`: the rank as an int32 *parameter* loaded from the rank's shard, so
  one compiled graph serves every rank.
- `ShardedExperts`: the MoE experts as all-experts-dense math over this rank's experts, built from
  one `ColumnShard` and one `RowShard`; the routing-weight columns of the local experts are picked
  with the runtime rank tensor. `baked_rank=<int>` reproduces the field report's bug: the rank read
  as a Python int when the graph was built, i.e. rank 0's slice on every rank.

Collectives are a small object (`Collectives`): identity for one process, `torch.distributed`
for the CPU gloo run. Modules keep it as a plain attribute, not a submodule.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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

    def __init__(self, in_features: int, out_features_total: int, tp: int, *, gather: bool = False,
                 collectives: Collectives | None = None, dtype: torch.dtype = torch.float32):
        if out_features_total % tp:
            raise ValueError(f"{out_features_total} output features do not split over {tp} ranks")
        super().__init__(in_features, out_features_total // tp, bias=False, dtype=dtype)
        self.weight.requires_grad_(False)
        self.tp, self.gather = tp, gather
        self.collectives = collectives or Collectives()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        return self.collectives.all_gather(y, -1) if self.gather else y


class RowShard(nn.Linear):
    """`in_features_total / tp` input columns of a linear; the partial outputs are all-reduced."""

    def __init__(self, in_features_total: int, out_features: int, tp: int, *,
                 collectives: Collectives | None = None, dtype: torch.dtype = torch.float32):
        if in_features_total % tp:
            raise ValueError(f"{in_features_total} input features do not split over {tp} ranks")
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

    y = sum_e w_e * down_e(act(gate_e x) * up_e x)  =  down_local( [w_e * act(gate_e x) * up_e x]_e )
    summed over ranks: the routing weight is folded in before the down projection, so the whole
    expert block is one column-parallel and one row-parallel linear.
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int, tp: int, act_fn, *,
                 gate_up: nn.Module, down: nn.Module, baked_rank: int | None = None):
        super().__init__()
        if num_experts % tp:
            raise ValueError(f"{num_experts} experts do not split over {tp} ranks")
        self.num_experts, self.tp, self.local = num_experts, tp, num_experts // tp
        self.hidden, self.intermediate = hidden, intermediate
        self.act_fn = act_fn
        self.gate_up = gate_up  # [local * 2I, H] rows: expert-major, gate then up
        self.down = down  # [H, local * I] columns: expert-major
        self.baked_rank = baked_rank
        self.current_rank: torch.Tensor | None = None  # set by the rank graph for each forward

    def local_weights(self, weights: torch.Tensor) -> torch.Tensor:
        """This rank's columns of the [tokens, experts] routing weights."""
        if self.baked_rank is not None:  # the bug: a Python int frozen into the graph
            start = self.baked_rank * self.local
            return weights[:, start:start + self.local]
        if self.current_rank is None:
            raise RuntimeError("ShardedExperts ran outside a rank graph: no rank tensor was provided")
        n = weights.shape[0]
        rank = self.current_rank.reshape(1).to(torch.long)
        return weights.view(n, self.tp, self.local).index_select(1, rank).reshape(n, self.local)

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        n = hidden.shape[0]
        weights = torch.zeros(n, self.num_experts, dtype=top_k_weights.dtype, device=hidden.device)
        weights = weights.scatter(1, top_k_index, top_k_weights)
        local = self.local_weights(weights).to(hidden.dtype)  # [n, local]
        # parallel linears take [batch, seq, features] (NxD's contract): run the n tokens as one row
        gate_up = self.gate_up(hidden.unsqueeze(0))[0]
        gate, up = gate_up.view(n, self.local, 2 * self.intermediate).chunk(2, dim=-1)
        inner = self.act_fn(gate) * up * local.unsqueeze(-1)  # [n, local, I]
        return self.down(inner.reshape(1, n, self.local * self.intermediate))[0]
