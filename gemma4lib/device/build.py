"""The device graphs a port compiles: prefill graphs (one per bucket) and the decode graph.

Built over the model's own modules, so every single-device backend (`cpu`, `eager`, `xla`,
`neuron`) and the benchmark suite take their graphs from here and nothing else decides their shapes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .experts import CPU_THREAD_FLOP_PER_BYTE
from .graph import DeviceGraph, GraphShape

if TYPE_CHECKING:  # type names only
    from ..models.loading import LoadedModel
    from ..settings import PortSettings

Graphs = tuple[dict[int, DeviceGraph], DeviceGraph]

# Prefill computes every expert (the dense form) whatever `decode_experts` says. Short CPU prompts
# measured faster selective, but the gathered slices grow with tokens x k, and the dense form is the
# one that shards over TP ranks (docs/ROOFLINE.md; the benchmark suite reports this as its recommendation).
PREFILL_EXPERTS = "dense"


def device_graph(
    model: LoadedModel,
    shape: GraphShape,
    expert_form: str,
    inplace: bool = True,
    weights: str = "bf16",
    compute_balance: float | None = None,
) -> DeviceGraph:
    """One device graph over the model's own modules (not copies: a compiled graph takes the model's
    current weights at load time; with `weights="int8"` it holds int8 copies of the linears, made
    now); `device_graphs` and the benchmark suite's graph cache build with it. `compute_balance`:
    the target's FLOPs per byte, for a batched MoE's expert form (`experts.read_form`)."""
    return DeviceGraph(
        model.text_model,
        model.lm_head,
        model.layout,
        shape,
        inplace=inplace,
        expert_form=expert_form,
        weights=weights,
        compute_balance=compute_balance,
    )


def cpu_balance(backend: str) -> float | None:
    """The compute balance a backend's graphs are built for: one CPU thread's for `cpu` and `eager`
    (they run here), None (bytes decide) for the rest, the stand-ins for inf2 included."""
    return CPU_THREAD_FLOP_PER_BYTE if backend in ("cpu", "eager") else None


def device_graphs(model: LoadedModel, settings: PortSettings, inplace: bool = True) -> Graphs:
    """Prefill graphs (one per bucket; MoE experts all-dense) and the decode graph (the settings'
    expert form), over the model's own modules: the graphs every single-device backend compiles."""
    weights = settings.weights
    batch = int(getattr(settings, "batch_size", 1))  # one graph set per batch size (batch_graph.py)
    prefill = {
        bucket: device_graph(
            model,
            GraphShape(batch, bucket, settings.context_length, settings.ring_kv),
            PREFILL_EXPERTS,
            inplace,
            weights,
        )
        for bucket in settings.prefill_buckets
    }
    decode = device_graph(
        model,
        GraphShape(batch, 1, settings.context_length, settings.ring_kv),
        settings.decode_experts,
        inplace,
        weights,
        cpu_balance(settings.backend),
    )
    return prefill, decode
