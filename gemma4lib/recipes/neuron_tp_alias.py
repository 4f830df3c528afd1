"""Recipe 2 (E4B, TP=2 on one inf2 chip): hand-driven tensor parallelism with aliased on-device
K/V buffers and a CPU-seeded prefill.

- Sharding: `tp.make_plan` (E4B at TP=2: 4 of 8 Q heads and 1 of 2 KV heads per rank; PLE tables
  on the host, PLE projections replicated); per-rank checkpoints from `tp.shard_state_dict`, saved
  as `tp{rank}.safetensors`.
- Compile: `neuronx_distributed.trace.parallel_model_trace(func, example_inputs, tp_degree=2, ...)`
  traces and compiles every rank in its own process (non-SPMD: fine for two ranks; this is the
  tracer that runs out of memory at 31B, where `neuron_model_builder` takes over). `func` builds
  the rank graph with NxD parallel layers, loads that rank's shard, and returns the
  `KVParamModule` with its `{kv_param: output_index}` aliases. `parallel_model_save` /
  `parallel_model_load` store and reload the per-rank TorchScript modules.
- Prefill on CPU, decode on device: the unsharded model prefills the prompt on the host
  (`cpu_prefill`), its K/V are cut into each rank's KV heads (`tp.shard.shard_kv`) and written into
  the ranks' device buffers (`seed_device_kv`, via `torch_neuronx.replace_weights` on the
  weight-separated rank modules), then every step is one device decode. `seed="decode-steps"`
  prefills through the device decode graph instead.

The whole data path (shards, CPU prefill, K/V slicing, rank-local decode with all-reduces) runs on
CPU in `cpu_check` through the gloo runner. Lines that need the SDK are marked `# inf2-only`.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any, Sequence

import torch

from ..graph import GraphShape
from ..tp.cpu_gloo import host_prefill as cpu_prefill
from ..tp.plan import TPPlan, make_plan
from ..tp.rank_graph import build_rank_graph, load_shard
from ..tp.shard import iter_shards
from . import neuron_env
from .common import HostEmbedder, KVParamModule, graph_example_inputs, greedy_generate

log = logging.getLogger(__name__)

RECIPE = "tp_alias"
PURPOSE = "the E4B hand-driven TP recipe (neuronx_distributed parallel_model_trace)"
SHARD_FILE = "tp{rank}.safetensors"


def save_rank_shards(loaded: Any, plan: TPPlan, folder: str | Path, dtype: torch.dtype | None = None) -> list[Path]:
    """Write one safetensors file per rank (weights, `layer_scalar`, the rank tensor)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for rank, shard in enumerate(iter_shards(loaded.lm, plan, dtype=dtype)):
        path = folder / SHARD_FILE.format(rank=rank)
        save_file(shard, str(path))
        paths.append(path)
    return paths


def _rank_module(config: Any, plan: TPPlan, shape: GraphShape, shard_folder: str, dtype: torch.dtype):
    """`func` for parallel_model_trace; runs inside each rank's process (parallel_state is set up)."""
    from safetensors.torch import load_file

    from .neuron_model_builder import NxDParallelFactory

    parallel_state = neuron_env.require("neuronx_distributed.parallel_layers.parallel_state", PURPOSE)
    # The Python rank only picks the shard *file*; the graph reads its rank from the shard's tensor.
    rank = parallel_state.get_tensor_model_parallel_rank()  # inf2-only
    graph = build_rank_graph(config, plan, shape, factory=NxDParallelFactory(plan.tp, dtype), dtype=dtype)
    load_shard(graph, load_file(str(Path(shard_folder) / SHARD_FILE.format(rank=rank))))
    module = KVParamModule(graph).eval()
    return module, module.aliases()


def compile_tp_alias(loaded: Any, out_dir: str | Path, *, tp: int = 2, context_length: int, ring: bool = False,
                     dtype: torch.dtype = torch.bfloat16, compiler_workdir: str | Path | None = None) -> Path:
    """Shard, trace and compile the decode graph on every rank; save with `parallel_model_save`."""
    nxd_trace = neuron_env.require("neuronx_distributed.trace", PURPOSE)
    plan = make_plan(loaded.config, tp, loaded.variant)
    out = Path(out_dir)
    shards = out / "shards"
    save_rank_shards(loaded, plan, shards, dtype)
    shape = GraphShape(1, 1, context_length, ring)
    func = functools.partial(_rank_module, loaded.config, plan, shape, str(shards), dtype)
    model = nxd_trace.parallel_model_trace(  # inf2-only
        func, graph_example_inputs(loaded.config, shape, dtype), tp_degree=tp,
        compiler_workdir=str(compiler_workdir or out / "compiler_workdir"),
        compiler_args=neuron_env.compiler_args("decode"), inline_weights_to_neff=False)
    nxd_trace.parallel_model_save(model, str(out / "model"))  # inf2-only
    return out


def load_tp_alias(out_dir: str | Path):
    nxd_trace = neuron_env.require("neuronx_distributed.trace", PURPOSE)
    return nxd_trace.parallel_model_load(str(Path(out_dir) / "model"))  # inf2-only


def seed_device_kv(tp_model: Any, shard_folder: str | Path, per_rank_kv: list[list[torch.Tensor]]) -> None:
    """Write each rank's K/V slice into its device buffers (weight-separated rank modules)."""
    torch_neuronx = neuron_env.require("torch_neuronx", PURPOSE)
    from safetensors.torch import load_file

    for rank, (module, kv) in enumerate(zip(tp_model.models, per_rank_kv)):
        weights = {"graph." + k: v for k, v in load_file(str(Path(shard_folder) / SHARD_FILE.format(rank=rank))).items()}
        weights.update({f"kv.{i}": t for i, t in enumerate(kv)})
        torch_neuronx.replace_weights(module, weights)  # inf2-only


class CpuSeededPrefill:
    """A `runtime.HostRuntime` prefill step for this recipe: the unsharded model prefills on CPU
    (same inputs the runtime would send to a device prefill graph), the K/V are cut per rank and
    written into the device buffers by `seed` (default: `seed_device_kv` on `tp_model`)."""

    def __init__(self, loaded: Any, plan: TPPlan, bucket: int, context_length: int, *, ring: bool = False,
                 tp_model: Any = None, shard_folder: str | Path | None = None, seed=None):
        from ..graph import DeviceGraph

        self.plan = plan
        self.graph = DeviceGraph(loaded.text_model, loaded.lm_head, loaded.layout,
                                 GraphShape(1, bucket, context_length, ring), inplace=True)
        self.seed = seed or (lambda per_rank: seed_device_kv(tp_model, shard_folder, per_rank))

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        from ..tp.shard import shard_kv

        n = 4 if self.graph.has_ple else 3
        kv = self.graph.new_kv()
        with torch.no_grad():
            logits = self.graph(*args[:n], *kv)
        self.seed([shard_kv(kv, self.plan, r) for r in range(self.plan.tp)])
        return logits


def generate(tp_model: Any, loaded: Any, prompt: Sequence[int], max_new_tokens: int, *, context_length: int,
             prefill_len: int, out_dir: str | Path, tp: int = 2, ring: bool = False,
             seed: str = "cpu") -> dict[str, Any]:
    """Greedy tokens: CPU-seeded prefill (default), or the prompt through the device decode graph."""
    host = HostEmbedder.from_text_model(loaded.text_model)
    if seed == "cpu":
        plan = make_plan(loaded.config, tp, loaded.variant)
        logits, per_rank = cpu_prefill(loaded, plan, prompt, context_length, prefill_len, ring)
        neuron_env.require("torch_neuronx", PURPOSE)
        try:
            seed_device_kv(tp_model, Path(out_dir) / "shards", per_rank)
        except Exception as exc:  # noqa: BLE001 - fall back to a prefill that needs no state writes
            log.warning("seeding the device K/V failed (%s); prefilling through the decode graph", exc)
        else:
            return greedy_generate(tp_model, host, prompt, max_new_tokens, seeded_logits=logits)
    return greedy_generate(tp_model, host, prompt, max_new_tokens)


def cpu_check(loaded: Any, prompt: Sequence[int], max_new_tokens: int, *, tp: int = 2, context_length: int,
              prefill_len: int, **kwargs: Any) -> dict[str, Any]:
    """The recipe's data path on CPU: CPU prefill, K/V cut per rank, rank-local decode over gloo."""
    from ..tp.cpu_gloo import run_tp_port

    return run_tp_port(loaded, tp, prompt, max_new_tokens, context_length, prefill_len,
                       prefill="cpu-seeded", **kwargs)
