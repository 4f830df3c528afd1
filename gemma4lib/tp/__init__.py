"""Tensor parallelism, hardware-agnostic: sharding plans, per-rank checkpoints and the rank graph
(every rank run on CPU with real collectives is the `gloo` backend)."""

from .plan import TPPlan, make_plan, tp_problems, valid_tp_degrees
from .rank_graph import CpuParallelFactory, RankGraph, build_rank_graph, load_shard, with_shape
from .shard import nxd_full_checkpoint, shard_shapes, shard_state_dict

__all__ = [
    "CpuParallelFactory",
    "RankGraph",
    "TPPlan",
    "build_rank_graph",
    "load_shard",
    "make_plan",
    "nxd_full_checkpoint",
    "shard_shapes",
    "shard_state_dict",
    "tp_problems",
    "valid_tp_degrees",
    "with_shape",
]
