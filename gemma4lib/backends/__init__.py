"""The backend layer: one contract, one module per compiler.

Every backend turns the named graphs of a port (`device.build.device_graphs`: prefill per bucket,
decode, or verify and draft when drafting) into `runtime.Steps` over one set of K/V, in the graph
form its compiler needs (in-place K/V for AOTInductor and eager, functional K/V for XLA and
Neuron); `registry.compile_graphs` puts the one generation engine on top.

| backend  | module             | compiler                                         | runs on        |
|----------|--------------------|--------------------------------------------------|----------------|
| `cpu`    | `backends.cpu`     | torch.export + AOTInductor, artifact cache       | any CPU        |
| `eager`  | `backends.eager`   | none: the same graphs, uncompiled                | any CPU        |
| `xla`    | `backends.xla`     | torch_xla (the front end torch-neuronx uses)     | CPU, `.venv-xla` |
| `neuron` | `backends.neuron`  | the inf2 recipes in `recipes/` (trace, ModelBuilder) | inf2       |
| `gloo`   | `backends.gloo`    | none: one CPU process per TP rank, gloo collectives | any CPU (TP > 1) |

The table is `registry.BACKENDS`, the one registry of `base.Backend` rows: each row is the backend's
facts (`facts.FACTS`: graph form, compute balance, warm-up, what it runs, plain flags that import
nothing) with its `compile` wired in. `preflight.preflight(settings)` checks
what needs a backend, a bundle, the SDK or an inf2 plan, once, before anything loads.
`backend_of(settings)` names the backend a setting selects (`cpu` at TP > 1 runs the TP plan's ranks
through `gloo`); `run_device(model, settings, requests)` runs it. `xla` and `neuron` import their
SDKs only when used. Importing this package loads nothing else: `backends.facts` stays a leaf that
`settings` can read; the names below load their modules on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "Backend": "base",
    "CompiledGraphs": "base",
    "DeviceRun": "base",
    "BACKENDS": "registry",
    "backend_of": "registry",
    "compile_graphs": "registry",
    "get_backend": "registry",
    "run_device": "registry",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)


__all__ = [
    "BACKENDS",
    "Backend",
    "CompiledGraphs",
    "DeviceRun",
    "backend_of",
    "compile_graphs",
    "get_backend",
    "run_device",
]
