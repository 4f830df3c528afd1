"""The simplest recipe (one NeuronCore, on request): `torch_neuronx.trace` of the decode graph with
on-device K/V (`KVParamModule`: the K/V are the traced module's parameters, aliased to its outputs), the
prompt prefilled token by token; it fits an inf2.xlarge's compile host. Why each choice (aliasing, weights
not inlined, one graph per trace call): docs/NEURON.md, "The trace recipe". Only the lines marked
`# inf2-only` need the Neuron SDK; on CPU `common.AliasEmulator` stands in for the device aliasing.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..device.graph import DeviceGraph, GraphShape
from . import neuron_env
from .common import KVParamModule

RECIPE = "trace"
PURPOSE = "the one-core trace recipe (torch_neuronx.trace)"


def build_kv_module(loaded: Any, context_length: int, *, ring: bool = False, batch: int = 1) -> KVParamModule:
    """The module that gets traced: the one-token decode graph with its K/V as parameters
    (`batch` rows: one token per row, each at its own position)."""
    graph = DeviceGraph(
        loaded.text_model, loaded.lm_head, loaded.layout, GraphShape(batch, 1, context_length, ring), inplace=False
    )
    return KVParamModule(graph).eval()


def compile_trace(
    loaded: Any,
    context_length: int,
    *,
    ring: bool = False,
    compiler_workdir: str | None = None,
    compiler_args: Sequence[str] | None = None,
    batch: int = 1,
    graph: DeviceGraph | None = None,
):
    """Trace and compile the decode graph for one NeuronCore; returns the TorchScript module.

    `graph`: the functional decode graph to trace (the backend's, from `device_graphs`: its batch,
    context and ring are the settings'); by default one is built from `context_length`, `ring`
    and `batch`. The example inputs are the graph's own (`KVParamModule.example_inputs`)."""
    torch_neuronx = neuron_env.require("torch_neuronx", PURPOSE)
    if graph is None:
        module = build_kv_module(loaded, context_length, ring=ring, batch=batch)
    else:
        module = KVParamModule(graph).eval()
    return torch_neuronx.trace(  # inf2-only
        module,
        module.example_inputs(),
        input_output_aliases=module.aliases(),
        inline_weights_to_neff=False,
        compiler_workdir=compiler_workdir,
        compiler_args=list(compiler_args or neuron_env.compiler_args("decode")),
    )


def save(traced: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.jit.save(traced, str(path))
    return path


def load(path: str | Path, core: int = 0):
    """Load a saved trace onto NeuronCore `core`, weights included (importing torch_neuronx first
    registers the Neuron ops the artifact holds). The load runs inside the placement context, so the
    graph lands on `core` itself, never on whichever core the runtime would pick (the vision core)."""
    torch_neuronx = neuron_env.require("torch_neuronx", PURPOSE)
    with torch_neuronx.neuron_cores_context(start_nc=int(core), nc_count=1):  # inf2-only
        traced = torch.jit.load(str(path))  # inf2-only (the artifact holds a NEFF)
    torch_neuronx.move_trace_to_device(traced, core)  # inf2-only: separated weights go to HBM once
    return traced
