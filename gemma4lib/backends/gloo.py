"""Backend `gloo`: the TP plan's ranks as CPU processes, one per rank, talking through gloo.

What `cpu` and `eager` select at TP > 1. Each rank builds the rank graphs from the config, loads
only its own shard, and runs the one generation engine (`runtime.Engine`) over them with real
collectives, as a NeuronCore does in the ModelBuilder recipe (`tp.cpu_gloo`). A generation lives
inside the rank processes, so this backend has no engine to hand back: its `run` is the whole
device run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import SettingsError
from .base import DeviceRun

if TYPE_CHECKING:
    from ..models.loading import LoadedModel
    from ..runtime import Request
    from ..settings import PortSettings

COMPILER = "cpu-gloo-tp"


def run(
    model: LoadedModel,
    settings: PortSettings,
    requests: list[Request],
    *,
    graphs: Any = None,
    progress: bool = False,
    bench: bool = True,
    **options: Any,
) -> DeviceRun:
    """Every request over all ranks: a row each (tokens, per-step logits), rank 0's timings, the plan
    and the shard shapes (the ranks time their own prefill and steps). `options`: `tp.cpu_gloo.run_tp`'s
    (the fault lab's `baked_rank` and `include_buffers=False`, `prefill="cpu-seeded"`, `expert_split`)."""
    from ..tp.cpu_gloo import run_tp

    if graphs is not None:
        raise SettingsError(
            "the gloo ranks build their rank graphs from the config; prebuilt graphs (graph edits) run at tp_degree 1"
        )
    return DeviceRun(**run_tp(model, settings, requests, bench=bench, **options))
