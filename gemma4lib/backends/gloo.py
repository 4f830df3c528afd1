"""Backend `gloo`: the TP plan's ranks as CPU processes, one per rank, talking through gloo.

What `cpu` and `eager` select at TP > 1. Each rank builds the rank graph from the config, loads
only its own shard, and runs prefill and the decode loop with real collectives, as a NeuronCore
does in the ModelBuilder recipe (`tp.cpu_gloo`). A generation lives inside the rank processes, so
this backend has no host runtime to hand back: its `run` is the whole device run, and it has no
`compile`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import TensorParallelError
from .base import DeviceRun, refuse_graphs

if TYPE_CHECKING:
    from ..device.build import Graphs
    from ..models.loading import LoadedModel
    from ..settings import PortSettings


def run(
    model: LoadedModel,
    settings: PortSettings,
    ids: list[int],
    eos: list[int],
    *,
    graphs: Graphs | None = None,
    progress: bool = False,
    bench: bool = True,
) -> DeviceRun:
    """One generation over all ranks: tokens, per-step logits, rank 0's timings, the plan and the
    shard shapes (the ranks time their own prefill and decode; `bench` has nothing to add)."""
    from ..tp.cpu_gloo import run_tp_port

    refuse_graphs(graphs, "gloo")
    return DeviceRun.from_fields(run_tp_port(model, settings, ids, eos))  # plan, shards, timings: details


def compile(model: Any, settings: Any, *, graphs: Any = None, progress: bool = False) -> Any:
    raise TensorParallelError(
        "at tp_degree > 1 the cpu and eager backends run the ranks as processes (backend gloo), which "
        "hand no runtime back to compile; run the port with port.run_device (or port.port), or set tp_degree=1"
    )
