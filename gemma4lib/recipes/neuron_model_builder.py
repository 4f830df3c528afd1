"""The recipe of every variant (E2B TP=1, E4B TP=2, 12B TP=2, 31B TP=8, 26B-A4B TP=8; any supported
degree): NxD ModelBuilder (v1), compile one rank, load per-rank weights.

A key per prefill bucket (and context bucket) and `decode`, all over one set of K/V states; the rank graph
is the one the CPU gloo run executes, its layers NxD's (`NxDParallelFactory`). How the keys, the priority
model, PLE, the MoE's expert split, int8 and the checkpoint fit NxD v2.28.0: docs/NEURON.md, "The
ModelBuilder recipe". Lines that need the SDK are marked `# inf2-only`.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..device.build import device_graph
from ..device.context_key import ContextKey
from ..device.experts import EXPERT_FORMS
from ..device.graph import GraphShape
from ..device.quant import LINEAR_WEIGHT_NAME, check_weights, quantize
from ..device.row_join import RowJoin
from ..errors import UnknownNameError
from ..tp.draft_rank_graph import prefill_key_shapes
from ..tp.plan import TPPlan, make_plan
from ..tp.rank_graph import build_rank_graph
from ..tp.shard import nxd_full_checkpoint
from . import neuron_env
from .common import KVParamModule, key_inputs

RECIPE = "model_builder"
PURPOSE = "the ModelBuilder recipe (neuronx_distributed.trace.model_builder)"
GRAPH_PREFIX = "graph."  # KVParamModule holds the rank graph as `.graph`
SHARD_FILE = "tp{rank}_sharded_checkpoint.safetensors"
# Weight layout optimisation, per key phase: the decode key's only bucket (index 0) sets the layout; prefill follows.
PRIORITY = {"prefill": None, "decode": 0}
# weights="int8": the modules NxD's `convert` swaps for its quantized parallel layers (fnmatch
# patterns over the rank module's names; the same linears as `quant.target_linears`, not the experts).
INT8_INCLUDE = ("*.self_attn.[qkvo]_proj", "*.mlp.gate_proj", "*.mlp.up_proj", "*.mlp.down_proj")


class NxDParallelFactory:
    """The rank-local layers from NxD (twin of `tp.rank_graph.CpuParallelFactory`).

    Sizes are totals; NxD divides them by the tensor-parallel world size of `parallel_state`,
    which ModelBuilder / parallel_model_trace initialise before building the module.
    """

    def __init__(self, tp: int, dtype: torch.dtype = torch.bfloat16):
        layers = neuron_env.require("neuronx_distributed.parallel_layers.layers", PURPOSE)
        mappings = neuron_env.require("neuronx_distributed.parallel_layers.mappings", PURPOSE)
        self.tp, self.dtype, self._layers, self._mappings = tp, dtype, layers, mappings

    def column(self, in_features: int, out_features_total: int, gather: bool = False) -> nn.Module:
        return self._layers.ColumnParallelLinear(  # inf2-only
            in_features, out_features_total, bias=False, gather_output=gather, dtype=self.dtype
        )

    def row(self, in_features_total: int, out_features: int) -> nn.Module:
        return self._layers.RowParallelLinear(  # inf2-only
            in_features_total, out_features, bias=False, input_is_parallel=True, dtype=self.dtype
        )

    def replicated(self, in_features: int, out_features: int) -> nn.Module:
        linear = nn.Linear(in_features, out_features, bias=False, dtype=self.dtype)
        linear.weight.requires_grad_(False)
        return linear

    def rank_module(self) -> nn.Module:
        return self._layers.SPMDRank(world_size=self.tp)  # inf2-only

    def all_reduce(self, x: torch.Tensor, row: nn.Module) -> torch.Tensor:
        """The reduction `row` (a `RowParallelLinear`) applies to its partial outputs: sum over its
        tensor-parallel group in its `reduce_dtype` (the selective experts' sum over ranks)."""
        dtype = x.dtype
        out = self._mappings.reduce_from_tensor_model_parallel_region(  # inf2-only
            x.to(row.reduce_dtype), process_group=row.tensor_parallel_group
        )
        return out.to(dtype)


def rank_module(
    config: Any,
    plan: TPPlan,
    shape: GraphShape,
    dtype: torch.dtype,
    factory: Any = None,
    expert_form: str = "dense",
    weights: str = "bf16",
    join: int = 0,
    chooses: bool = False,
) -> KVParamModule:
    """The module one rank compiles: rank graph (NxD layers by default) + K/V parameters; with
    `weights="int8"` its attention and dense-MLP parallel linears become NxD's quantized ones;
    `join` > 0: a join key over a batch of `join` rows' K/V (`device.row_join`, same state names);
    a context bucket (`shape.reads`) takes its positions first (`device.context_key`)."""
    factory = factory or NxDParallelFactory(plan.tp, dtype)
    graph = build_rank_graph(
        config, plan, shape, factory=factory, dtype=dtype, inplace=False, expert_form=expert_form, chooses=chooses
    )
    graph = RowJoin(graph, join) if join else graph
    module = KVParamModule(ContextKey(graph) if shape.reads else graph).eval()
    if check_weights(weights) == "int8":
        quantize_nxd(module)
    return module


def quantize_nxd(module: nn.Module) -> nn.Module:
    """NxD's weight-only int8 (per-channel, symmetric) over the `INT8_INCLUDE` linears, in place;
    the quantized row-parallel layers then reduce in float32 (`reduce_rows_in_float32`)."""
    config = neuron_env.require("neuronx_distributed.quantization.quantization_config", PURPOSE)
    quantize_module = neuron_env.require("neuronx_distributed.quantization.quantize", PURPOSE)
    layers = neuron_env.require("neuronx_distributed.quantization.quantization_layers", PURPOSE)
    mappings = neuron_env.require("neuronx_distributed.parallel_layers.mappings", PURPOSE)
    q_config = config.get_default_per_channel_custom_qconfig_dict()  # inf2-only
    module = quantize_module.convert(module, q_config=q_config, inplace=True, include=list(INT8_INCLUDE))  # inf2-only
    reduce_rows_in_float32(module, layers.QuantizedRowParallel, mappings)
    return module


def reduce_rows_in_float32(module: nn.Module, row_cls: type, mappings: Any) -> int:
    """Make every `row_cls` layer (NxD's `QuantizedRowParallel`) sum its ranks' partial outputs in
    float32, as `RowParallelLinear` does (`reduce_dtype`, float32 by default), instead of in the
    activations' bf16 (NxD v2.28.0 `quantization/quantization_layers.py`: its forward calls
    `reduce_from_tensor_model_parallel_region(output_)` on the bf16 output). Then int8 at TP > 1
    rounds like the bf16 rank graph whose TP checks pass, and the host reference (HF on the
    int8-rounded weights) is checked with the same tolerance at every degree. The layer keeps its
    name (so the checkpoint's keys are unchanged); its own reduction is switched off and done
    around its forward. Returns how many layers changed."""
    changed = 0
    for layer in module.modules():
        if isinstance(layer, row_cls) and getattr(layer, "reduce_output", False):
            layer.reduce_output = False
            layer.forward = _float32_reduction(layer.forward, layer, mappings)
            changed += 1
    return changed


def _float32_reduction(forward: Any, layer: nn.Module, mappings: Any) -> Any:
    def reduced(x: torch.Tensor) -> torch.Tensor:
        partial = forward(x)
        total = mappings.reduce_from_tensor_model_parallel_region(  # inf2-only (a group of tp ranks)
            partial.to(torch.float32), process_group=layer.tensor_parallel_group
        )
        return total.to(partial.dtype)

    return reduced


def int8_checkpoint(checkpoint: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint NxD's quantized layers load: each `INT8_INCLUDE` weight as int8 and its
    `.scale` `[out, 1]` fp32 (`quant.quantize`, per output row of the full, NxD-arranged weight)."""
    out = dict(checkpoint)
    for key, tensor in checkpoint.items():
        if LINEAR_WEIGHT_NAME.search(key):
            q, scale = quantize(tensor)
            out[key] = q
            out[key[: -len("weight")] + "scale"] = scale.unsqueeze(-1)
    return out


def bucket_shapes(
    context_length: int, buckets: tuple[int, ...], ring: bool = False, batch: int = 1
) -> dict[str, GraphShape]:
    """The ModelBuilder keys' static shapes: one prefill key per bucket and decode, `batch` rows in
    each (start/length one per row). A one-token bucket has the decode key's input shapes, and NxD
    routes by shape: the decode key serves it."""
    prefill = prefill_key_shapes(context_length, tuple(buckets), ring, batch)
    return {**{n: s for n, s in prefill.items() if s.tokens > 1}, "decode": GraphShape(batch, 1, context_length, ring)}


def bucket_expert_forms(decode_experts: str = "dense") -> dict[str, str]:
    """The experts' form per key phase: prefill always dense (many tokens hit every expert anyway)."""
    if decode_experts not in EXPERT_FORMS:
        raise UnknownNameError("decode_experts form", decode_experts, EXPERT_FORMS)
    return {"prefill": "dense", "decode": decode_experts}


def nxd_checkpoint(loaded: Any, plan: TPPlan, dtype: torch.dtype, weights: str = "bf16") -> dict[str, torch.Tensor]:
    """The `checkpoint_loader` result: NxD-arranged full checkpoint, keyed like the compiled module
    (`weights="int8"`: the quantized linears as int8 + scales, `int8_checkpoint`)."""
    checkpoint = {GRAPH_PREFIX + k: v for k, v in nxd_full_checkpoint(loaded.lm, plan, dtype=dtype).items()}
    return int8_checkpoint(checkpoint) if check_weights(weights) == "int8" else checkpoint


def instance_class():
    """NxD's `model_builder` module and the `BaseModelInstance` subclass every key is built from
    (defined here because its base class comes from the SDK): it takes the zero-argument builder of
    its key's module and hands out that module's K/V aliases. The plain and the drafting recipes
    both use it."""
    model_builder = neuron_env.require("neuronx_distributed.trace.model_builder", PURPOSE)

    class KeyInstance(model_builder.BaseModelInstance):
        def __init__(self, build):
            super().__init__(module_cls=build, input_output_aliases={})

        def get(self, bucket_rank, **kwargs):
            return self.module, self.module.aliases()

    return model_builder, KeyInstance


def key_graphs(loaded: Any, shapes: dict[str, GraphShape]) -> dict[str, nn.Module]:
    """The functional device graph of each key (full precision, over the model's own modules: no
    copy). Its `example_inputs()` are what the key is traced with (`common.key_inputs`): the rank
    graph takes the same inputs (embeddings at full width, PLE, per-row start and length)."""
    return {key: device_graph(loaded, shape, "dense", inplace=False) for key, shape in shapes.items()}


def checkpoint_loader(loaded: Any, plan: TPPlan, dtype: torch.dtype, weights: str = "bf16"):
    """The lazy `checkpoint_loader` ModelBuilder takes: the NxD-arranged checkpoint is built only
    when NxD calls it, and nothing here keeps it afterwards.

    NxD v2.28.0 `trace/model_builder.py` calls the loader only in `shard_checkpoint` (and in
    `trace` when `initialize_model_weights=True`, which the recipes never pass), so the compile
    itself runs without a second whole copy of the weights on the host; the copy lives while
    `shard_checkpoint` cuts and writes the ranks' files, then goes."""
    return functools.partial(nxd_checkpoint, loaded, plan, dtype, weights)


def key_form(graph: nn.Module) -> tuple[int, bool]:
    """A key graph's join batch (0: no join; a join takes its row index first, after a context bucket's
    positions) and whether it chooses the tokens (`DeviceGraph.chooses`)."""
    base = graph.graph if isinstance(graph, ContextKey) else graph
    return (base.batch if isinstance(base, RowJoin) else 0), bool(getattr(graph, "chooses", False))


def compile_model_builder(
    loaded: Any,
    tp: int,
    out_dir: str | Path,
    *,
    context_length: int,
    buckets: tuple[int, ...],
    ring: bool = False,
    dtype: torch.dtype = torch.bfloat16,
    compiler_workdir: str | Path | None = None,
    decode_experts: str = "dense",
    expert_split: str | None = None,
    weights: str = "bf16",
    batch: int = 1,
    graphs: dict[str, nn.Module] | None = None,
) -> Path:
    """Compile a prefill key per bucket + decode for one rank (and the join keys `graphs` holds, each a
    `device.row_join.RowJoin`), save the model and the per-rank shards to `out_dir`.
    `decode_experts`: the decode graph's MoE expert form (`dense` | `selective`); prefill is dense.
    `expert_split`: how the ranks share the MoE experts (`intermediate` | `experts`; default: the
    plan's, the intermediate split where it divides).
    `weights`: "int8" quantizes the attention and dense-MLP linears with NxD's layers (docs/NEURON.md).
    `graphs`: `{key: graph}`, the device graphs the keys are compiled for (the backend's
    `device_graphs`: the settings' batch, buckets, context and ring); their shapes and example inputs
    are the keys'. Without them: `bucket_shapes(context_length, buckets, ring, batch)`'s keys."""
    model_builder, KeyInstance = instance_class()
    forms = bucket_expert_forms(decode_experts)
    plan = make_plan(loaded.config, tp, loaded.variant, expert_split=expert_split)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    workdir = Path(compiler_workdir or out / "compiler_workdir")  # ModelBuilder.trace() wipes it: never share
    graphs = graphs or key_graphs(loaded, bucket_shapes(context_length, buckets, ring, batch))
    # The builder's constructor and `add` are inf2-only too; tests drive them through a recording fake.
    builder = model_builder.ModelBuilder(  # inf2-only
        router=None,
        tp_degree=tp,
        checkpoint_loader=checkpoint_loader(loaded, plan, dtype, weights),
        compiler_workdir=str(workdir),
    )
    for key, graph in graphs.items():
        shape, (join, chooses) = graph.shape, key_form(graph)
        parts = {"expert_form": forms[shape.phase], "weights": weights}  # what every key's rank module takes
        parts.update({"chooses": True} if chooses else {}, **({"join": join} if join else {}))
        builder.add(  # inf2-only
            key=key,
            model_instance=KeyInstance(functools.partial(rank_module, loaded.config, plan, shape, dtype, **parts)),
            # decode_ids takes one input more (sampling) than decode, a join one more (the row) than its
            # prefill: NxD's router tells them apart by their input shapes
            example_inputs=[key_inputs(graph, None, dtype)],
            compiler_args=neuron_env.COMPILER_ARGS[shape.phase],
            # the whole-context decode key's layout (one key sets it)
            priority_model_idx=None if chooses or shape.reads else PRIORITY[shape.phase],
        )
    shapes = {key: graph.shape for key, graph in graphs.items()}
    traced = builder.trace(initialize_model_weights=False)  # inf2-only
    torch.jit.save(traced, str(out / "model.pt"))  # inf2-only
    del traced
    builder.shard_checkpoint(serialize_path=str(out / "weights"))  # inf2-only; its return value (every shard) dropped
    manifest = {
        "recipe": RECIPE,
        "variant": loaded.variant.name,
        "tp": tp,
        "context_length": shapes["decode"].context_length,
        "buckets": [s.tokens for k, s in shapes.items() if k.startswith("prefill") and not s.reads],
        "context_buckets": sorted({s.reads for s in shapes.values() if s.reads}),
        "ring": shapes["decode"].ring,
        "batch": shapes["decode"].batch,
        "dtype": str(dtype),
        "expert_forms": forms,
        "expert_split": plan.expert_split,
        "weights": weights,
        "plan": plan.describe(),
        "compiler_args": neuron_env.COMPILER_ARGS,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return out


def load_model_builder(out_dir: str | Path, tp: int | None = None, start_rank: int = 0):
    """`torch.jit.load` the compiled model and initialise it with the per-rank shards."""
    neuron_env.require("torch_neuronx", PURPOSE)
    neuron_env.require("neuronx_distributed", PURPOSE)
    from safetensors.torch import load_file

    out = Path(out_dir)
    tp = tp or json.loads((out / "manifest.json").read_text())["tp"]
    traced = torch.jit.load(str(out / "model.pt"))  # inf2-only
    weights = [load_file(str(out / "weights" / SHARD_FILE.format(rank=r))) for r in range(start_rank, start_rank + tp)]
    traced.nxd_model.initialize(weights, torch.tensor([start_rank], dtype=torch.int32))  # inf2-only
    return traced
