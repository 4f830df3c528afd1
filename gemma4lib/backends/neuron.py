"""Backend `neuron`: the device graphs compiled for inf2 by the recipe `memory_plan.neuron_recipe`
picks (`recipes.neuron_model_builder` by default, TP=1 included; `recipes.neuron_trace` on one core
when `PortSettings.neuron_recipe="trace"`),
cached in the artifact cache, wrapped in the host runtime. Needs the Neuron SDK (checked before
any work); everything but the compiler calls runs on CPU in the tests.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..artifacts import ArtifactCache, make_key
from ..device.build import Graphs, device_graphs
from ..device.graph import GraphShape
from ..environment import versions
from ..inf2.doctor import warn_low_host_ram
from ..inf2.memory_plan import neuron_recipe
from ..recipes import neuron_env, neuron_model_builder, neuron_trace
from ..recipes.common import DeviceStep, StepwisePrefill
from ..runtime import HostRuntime
from .base import CompiledGraphs, refuse_graphs, runner
from .program_key import source_digest, weights_fingerprint

if TYPE_CHECKING:
    from ..models.loading import LoadedModel
    from ..settings import PortSettings


def neuron_cache_key(
    model: LoadedModel,
    recipe: str,
    tp: int,
    shapes: dict[str, GraphShape],
    compiler_args: dict[str, str],
    dtype: Any,
    decode_experts: str = "dense",
    weights: str = "bf16",
) -> tuple[str, dict]:
    """Cache key of a Neuron artifact: config, weights, recipe, TP degree, shapes, compiler
    arguments, the decode graph's expert form when not dense, the weight format when int8, the
    source of the library modules that shape the graph (the rank graph holds NxD layers, so its
    program cannot be exported here to be digested as the CPU key does) and versions (the pinned
    SDK set as found, torch, transformers)."""
    parts = {
        "recipe": f"neuron-{recipe}",
        "config": model.config.to_json_string(use_diff=False),
        "weights": weights_fingerprint(model.lm, "all"),  # trace inlines them; the others cache the shards
        "tp": tp,
        "shapes": {k: [v.batch, v.tokens, v.context_length, v.ring] for k, v in sorted(shapes.items())},
        "compiler_args": compiler_args,
        "dtype": str(dtype),
        "graph_source": source_digest(),
        "sdk": {r["package"]: r["found"] for r in neuron_env.check_versions()},
        "versions": versions(),
    }
    if decode_experts != "dense":  # only then: the keys of existing (dense) artifacts stay valid
        parts["decode_experts"] = decode_experts
    if weights == "int8":  # likewise: full-precision keys stay as they were
        parts["weight_format"] = weights
    return make_key(parts), parts


def compile(
    model: LoadedModel, settings: PortSettings, *, graphs: Graphs | None = None, progress: bool = False
) -> CompiledGraphs:
    """Compile with the recipe `neuron_recipe` picks for the variant and TP degree (or load the
    artifact from the cache when its key matches) and wrap it in the host runtime. Raises
    `NeuronSDKMissingError` without the SDK, before any work.

    `model_builder` (the default, every variant and TP degree): prefill + decode keys over one set
    of K/V states; the prompt is one device call per bucket. `trace` (TP=1, on request): the decode
    graph alone; the prompt is prefilled through it token by token. Artifacts live in the artifact
    cache (`settings.cache_dir`) keyed by `neuron_cache_key`.
    """
    refuse_graphs(graphs, "neuron")
    neuron_env.require("torch_neuronx", f"backend 'neuron' ({model.variant.name})")
    prefill, decode = device_graphs(model, settings, inplace=False)  # shapes and host K/V only
    tp = int(settings.tp_degree)
    recipe = neuron_recipe(model.variant, tp, getattr(settings, "neuron_recipe", None))
    context, ring, dtype = settings.context_length, settings.ring_kv, decode.dtype
    n_inputs = 4 if decode.has_ple else 3
    bucket = max(prefill)
    shapes = {"decode": GraphShape(1, 1, context, ring)}
    decode_experts = "dense"  # only the ModelBuilder recipe builds the rank graph, which takes the form
    if recipe == "model_builder":
        shapes["prefill"] = GraphShape(1, bucket, context, ring)
        if model.variant.is_moe:
            decode_experts = settings.decode_experts
    key, parts = neuron_cache_key(
        model,
        recipe,
        tp,
        shapes,
        neuron_env.COMPILER_ARGS,
        dtype,
        decode_experts=decode_experts,
        weights=settings.weights,
    )
    cache = ArtifactCache(settings.cache_dir)
    started = time.perf_counter()

    def build(folder: Path) -> dict[str, Any]:
        if settings.profile == "full":  # the estimate is the released model's; tiny smoke models fit anywhere
            warn_low_host_ram(model.variant, tp, recipe)  # before the compile the kernel might kill half an hour in
        workdir = tempfile.mkdtemp(prefix="gemma4lib-neuron-cc-")  # never inside the cache entry
        if recipe == "trace":
            neuron_trace.save(
                neuron_trace.compile_trace(model, context, ring=ring, compiler_workdir=workdir), folder / "model.pt"
            )
        else:
            neuron_model_builder.compile_model_builder(
                model,
                tp,
                folder,
                context_length=context,
                prefill_len=bucket,
                ring=ring,
                dtype=dtype,
                compiler_workdir=workdir,
                decode_experts=decode_experts,
                weights=settings.weights,
            )
        return {"recipe": recipe, "tp": tp}

    entry = cache.get_or_build(key, build, describe={k: v for k, v in parts.items() if k != "config"})
    compile_s = time.perf_counter() - started
    host_kv = decode.new_kv()
    if recipe == "trace":
        step = DeviceStep(neuron_trace.load(entry.file("model.pt")), n_inputs)
        steps = {b: StepwisePrefill(step, n_inputs) for b in prefill}
    else:
        step = DeviceStep(neuron_model_builder.load_model_builder(entry.path, tp), n_inputs)
        steps = {bucket: step}
    runtime = HostRuntime(model, steps, step, host_kv, context, dtype=dtype)
    return CompiledGraphs(
        runtime,
        0.0 if entry.hit else compile_s,
        [entry.hit],
        f"neuron-{recipe}",
        {"artifacts": str(entry.path), "tp_degree": tp, "decode_experts": decode_experts, "weights": settings.weights},
    )


run = runner(compile)  # inf2-only (through `compile`)
