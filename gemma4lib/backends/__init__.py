"""The backend layer: one contract, one module per compiler.

Every backend turns a loaded model and the port's settings into `CompiledGraphs`: a host runtime
over compiled prefill and decode steps, plus what the compile cost and produced. Each builds the
graph forms its compiler needs (in-place K/V for AOTInductor and eager, functional K/V for XLA and
Neuron), so a caller never hands a backend graphs it would ignore or rebuild.

| backend  | module             | compiler                                         | runs on        |
|----------|--------------------|--------------------------------------------------|----------------|
| `cpu`    | `backends.cpu`     | torch.export + AOTInductor, artifact cache       | any CPU        |
| `eager`  | `backends.eager`   | none: the same graphs, uncompiled                | any CPU        |
| `xla`    | `backends.xla`     | torch_xla (the front end torch-neuronx uses)     | CPU, `.venv-xla` |
| `neuron` | `backends.neuron`  | the inf2 recipes in `recipes/` (trace, ModelBuilder) | inf2       |
| `gloo`   | `backends.gloo`    | none: one CPU process per TP rank, gloo collectives | any CPU (TP > 1) |

The table is `base.BACKENDS`, the one registry (`settings.BACKENDS` is its selectable part).
`backend_for(settings)` names the module a setting selects (`cpu` at TP > 1 runs the TP plan's
ranks through `gloo`); `run_device(model, settings, ids, eos)` runs it: every backend has a `run`
returning a `DeviceRun`. Modules are imported only when selected: `xla` and `neuron` need their own
environments.
"""

from .base import (
    BACKENDS,
    Backend,
    CompiledGraphs,
    DeviceRun,
    backend_for,
    compile_graphs,
    device_run_of,
    get_backend,
    run_device,
)

__all__ = [
    "BACKENDS",
    "Backend",
    "CompiledGraphs",
    "DeviceRun",
    "backend_for",
    "compile_graphs",
    "device_run_of",
    "get_backend",
    "run_device",
]
