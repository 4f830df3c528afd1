"""Tensor parallelism, hardware-agnostic: sharding plans, per-rank checkpoints, the rank graph,
and a CPU run of every rank with real collectives (gloo)."""

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
    "run_tp_port",
    "shard_shapes",
    "shard_state_dict",
    "tp_problems",
    "valid_tp_degrees",
    "with_shape",
]


def run_tp_port(*args, **kwargs):
    """See `gemma4lib.tp.cpu_gloo.run_tp_port` (imported lazily: it pulls in multiprocessing)."""
    from .cpu_gloo import run_tp_port as _run

    return _run(*args, **kwargs)
