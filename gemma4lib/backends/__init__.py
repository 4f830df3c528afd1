"""The backend layer: one contract, one module per compiler (cpu, eager, xla, neuron, gloo).

Each backend turns the named graphs of a port (`device.build.device_graphs`) into `runtime.Steps`
over one set of K/V, in the graph form its compiler needs; `registry.compile_graphs` puts the one
generation engine on top. The table of backends is `registry.BACKENDS`: each row's plain facts
(`facts.FACTS`) with its `compile` wired in; `preflight.preflight(settings)` checks what needs a
bundle, the SDK or an inf2 plan, once, before anything loads. Importing this package loads nothing
else (`facts` stays a leaf that `settings` reads); the names below load their modules on first use.
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


__all__ = sorted(_WHERE)
