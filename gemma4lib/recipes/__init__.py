"""The Neuron recipes: thin adapters that hand the device graph to a Neuron compiler.

| recipe          | module                  | variants                    | compiler API                        |
|-----------------|-------------------------|-----------------------------|-------------------------------------|
| `trace`         | `neuron_trace`          | E2B (TP=1)                  | `torch_neuronx.trace` + K/V aliases |
| `model_builder` | `neuron_model_builder`  | E4B, 12B, 31B, 26B-A4B; any variant at TP > 1 | NxD `ModelBuilder` v1, `SPMDRank` |

`memory_plan.neuron_recipe(variant, tp)` picks one. NxD's `parallel_model_trace` (one process per
rank) is unsupported since SDK 2.27, so no recipe uses it: ModelBuilder compiles one rank in one
process at every TP degree. Hand-driven TP stays what the E4B notebook teaches on CPU (gloo ranks).

Importing any of them never imports the Neuron SDK (targets SDK 2.28, see `neuron_env`); calling
a Neuron-only entry point without it raises `NeuronSDKMissingError` saying what to install. The
host loops, the modules handed to the compilers and the sharded data paths all run on CPU.
"""

RECIPE_MODULES = {
    "trace": "gemma4lib.recipes.neuron_trace",
    "model_builder": "gemma4lib.recipes.neuron_model_builder",
}

# Neuron-only entry points per module (each raises NeuronSDKMissingError without the SDK)
NEURON_ENTRY_POINTS = {
    "gemma4lib.recipes.neuron_trace": ("compile_trace", "load"),
    "gemma4lib.recipes.neuron_model_builder": ("compile_model_builder", "load_model_builder", "NxDParallelFactory"),
}


def recipe_module(recipe: str):
    """The module of an inf2 recipe by name (`trace`, `model_builder`); importing it never
    imports the Neuron SDK."""
    import importlib

    if recipe not in RECIPE_MODULES:
        from ..errors import UnknownNameError
        raise UnknownNameError("recipe", recipe, RECIPE_MODULES)
    return importlib.import_module(RECIPE_MODULES[recipe])


def neuron_cache_key(model, recipe: str, tp: int, shapes: dict, compiler_args: dict, dtype,
                     decode_experts: str = "dense") -> tuple[str, dict]:
    """Cache key of a Neuron artifact: config, weights, recipe, TP degree, shapes, compiler
    arguments, the decode graph's expert form when not dense, the source of the library modules that
    shape the graph (the rank graph holds NxD layers, so its program cannot be exported here to be
    digested as the CPU key does) and versions (the pinned SDK set as found, torch, transformers)."""
    from ..artifacts import make_key
    from ..program_key import source_digest, weights_fingerprint
    from ..environment import versions
    from . import neuron_env

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
    return make_key(parts), parts


def compile_graphs_neuron(model, prefill, decode, settings):
    """`port.compile_graphs` for `backend="neuron"`: compile with the recipe `neuron_recipe` picks
    for the variant and TP degree (or load the artifact from the cache when its key matches) and
    wrap it in the host runtime. Raises `NeuronSDKMissingError` without the SDK, before any work.

    `trace` (E2B, TP=1): the decode graph; the prompt is prefilled through it token by token.
    `model_builder` (every other variant, and any TP > 1): prefill + decode keys over one set of
    K/V states. Artifacts live in the artifact cache (`settings.cache_dir`) keyed by
    `neuron_cache_key`.
    """
    import tempfile
    import time

    from ..artifacts import ArtifactCache
    from ..graph import GraphShape
    from ..memory_plan import neuron_recipe
    from ..port import CompiledGraphs
    from ..runtime import HostRuntime
    from . import neuron_env
    from .common import DeviceStep, StepwisePrefill

    neuron_env.require("torch_neuronx", f"backend 'neuron' ({model.variant.name})")
    tp = int(settings.tp_degree)
    recipe = neuron_recipe(model.variant, tp)
    context, ring, dtype = settings.context_length, settings.ring_kv, decode.dtype
    n_inputs = 4 if decode.has_ple else 3
    bucket = max(prefill)
    shapes = {"decode": GraphShape(1, 1, context, ring)}
    decode_experts = "dense"  # only the ModelBuilder recipe builds the rank graph, which takes the form
    if recipe == "model_builder":
        shapes["prefill"] = GraphShape(1, bucket, context, ring)
        if model.variant.is_moe:
            decode_experts = settings.decode_experts
    key, parts = neuron_cache_key(model, recipe, tp, shapes, neuron_env.COMPILER_ARGS, dtype,
                                  decode_experts=decode_experts)
    cache = ArtifactCache(settings.cache_dir)
    started = time.perf_counter()

    def build(folder):
        if settings.profile == "full":  # the estimate is the released model's; tiny smoke models fit anywhere
            from ..doctor import warn_low_host_ram
            warn_low_host_ram(model.variant, tp)  # before the compile the kernel might kill half an hour in
        workdir = tempfile.mkdtemp(prefix="gemma4lib-neuron-cc-")  # never inside the cache entry
        if recipe == "trace":
            from . import neuron_trace
            neuron_trace.save(neuron_trace.compile_trace(model, context, ring=ring, compiler_workdir=workdir),
                              folder / "model.pt")
        else:
            from . import neuron_model_builder
            neuron_model_builder.compile_model_builder(model, tp, folder, context_length=context,
                                                       prefill_len=bucket, ring=ring, dtype=dtype,
                                                       compiler_workdir=workdir, decode_experts=decode_experts)
        return {"recipe": recipe, "tp": tp}

    entry = cache.get_or_build(key, build, describe={k: v for k, v in parts.items() if k != "config"})
    compile_s = time.perf_counter() - started
    host_kv = decode.new_kv()
    if recipe == "trace":
        from . import neuron_trace
        step = DeviceStep(neuron_trace.load(entry.file("model.pt")), n_inputs)
        steps = {b: StepwisePrefill(step, n_inputs) for b in prefill}
    else:
        from . import neuron_model_builder
        step = DeviceStep(neuron_model_builder.load_model_builder(entry.path, tp), n_inputs)
        steps = {bucket: step}
    runtime = HostRuntime(model, steps, step, host_kv, context, dtype=dtype)
    return CompiledGraphs(runtime, 0.0 if entry.hit else compile_s, [entry.hit], f"neuron-{recipe}",
                          {"artifacts": str(entry.path), "tp_degree": tp, "decode_experts": decode_experts})
