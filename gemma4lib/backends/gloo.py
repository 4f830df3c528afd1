"""Backend `gloo`: the TP plan's ranks as CPU processes, one per rank, talking through gloo.

What `cpu` and `eager` select at TP > 1. Each rank builds the rank graph from the config, loads
only its own shard, and runs prefill and the decode loop with real collectives, as a NeuronCore
does in the ModelBuilder recipe (`tp.cpu_gloo`). A generation lives inside the rank processes, so
this backend has no host runtime to hand back: it runs a whole device run (`run_device`) instead
of `compile`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..device.build import Graphs
from .base import CompiledGraphs

if TYPE_CHECKING:
    from ..models.loading import LoadedModel
    from ..settings import PortSettings


def run_device(
    model: LoadedModel, settings: PortSettings, ids: list[int], eos: list[int], *, baked_rank: bool = False
) -> dict[str, Any]:
    """One generation over all ranks; the record's device run (tokens, per-step logits, timings,
    the plan and the shard shapes). `baked_rank` reads the rank at trace time (a fault lab bug)."""
    from ..tp.cpu_gloo import run_tp_port

    return run_tp_port(model, settings, ids, eos, baked_rank=baked_rank)


def compile(
    model: LoadedModel, settings: PortSettings, *, graphs: Graphs | None = None, progress: bool = False
) -> CompiledGraphs:
    raise TypeError(
        "the gloo backend runs generations inside its rank processes and has no host runtime to "
        "compile; call backends.gloo.run_device (port.run_device does) instead"
    )
