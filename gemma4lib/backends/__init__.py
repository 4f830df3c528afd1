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

The table is `registry.BACKENDS`, the one registry of `base.Backend` rows: each row carries the
backend's facts (graph form, compute balance, warm-up, what it runs) and its `compile` (or, for
gloo, `run`). `backend_of(settings)` names the backend a setting selects (`cpu` at TP > 1 runs the
TP plan's ranks through `gloo`); `run_device(model, settings, requests)` runs it. `xla` and
`neuron` import their SDKs only when used.
"""

from .base import Backend, CompiledGraphs, DeviceRun
from .registry import BACKENDS, backend_of, compile_graphs, get_backend, run_device

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
