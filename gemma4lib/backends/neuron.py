"""Backend `neuron`: the device graphs compiled for inf2 by the recipe `memory_plan.neuron_recipe`
picks (`recipes.neuron_model_builder` by default, TP=1 included; `recipes.neuron_trace` on one core
when `PortSettings.neuron_recipe="trace"`),
cached in the artifact cache, wrapped in the host runtime. With images or clips, each media tower (vision,
audio) is its own artifact (`recipes.neuron_vision`: `torch_neuronx.trace` on one NeuronCore, rank 0's,
under its own key `tower_cache_key`). Needs the Neuron SDK (checked before any work);
everything but the compiler calls runs on CPU in the tests.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..cache.artifacts import make_key
from ..cache.bundle import cache_for
from ..device.context_key import ContextKey
from ..device.embedder import HostEmbedder
from ..device.graph import GraphShape
from ..device.row_join import row_step
from ..environment import program_versions
from ..errors import SettingsError
from ..inf2.compile_ram import warn_low_host_ram
from ..inf2.memory_plan import neuron_recipe
from ..models.weights_identity import weights_identity
from ..recipes import cores, neuron_env, neuron_model_builder, neuron_trace, neuron_vision
from ..recipes.common import DeviceStep, check_host_tables, index_dtype, key_inputs
from ..runtime import Steps
from .base import CompiledGraphs
from .engine import named_steps
from .program_key import source_digest

if TYPE_CHECKING:
    from ..device.audio import AudioGraph
    from ..device.build import GraphSet
    from ..device.vision import VisionGraph

    MediaTower = VisionGraph | AudioGraph
    from ..models.assistant import LoadedAssistant
    from ..models.loading import LoadedModel
    from ..settings import PortSettings


log = logging.getLogger(__name__)


@contextlib.contextmanager
def compiler_workdir() -> Iterator[str]:
    """A fresh compiler work directory (ModelBuilder wipes its own: never share one), removed when
    the compile succeeds; kept, and its path logged, when it fails (the compiler's logs are there)."""
    workdir = tempfile.mkdtemp(prefix="gemma4lib-neuron-cc-")
    try:
        yield workdir
    except BaseException:
        log.error("compile failed: the compiler's work directory is kept for inspection at %s", workdir)
        raise
    shutil.rmtree(workdir, ignore_errors=True)


@contextlib.contextmanager
def own_directory() -> Iterator[str]:
    """Run the compile in a fresh current directory, removed afterwards: NxD v2.28.0
    `trace/model_builder.py` writes `{key}_{rank}.hlo` and `{key}_{rank}_optimized.hlo` by relative
    path while it applies the decode key's weight layout to the prefill key, so a read-only current
    directory, or two compiles sharing one, would break it."""
    with tempfile.TemporaryDirectory(prefix="gemma4lib-neuron-cwd-") as scratch, contextlib.chdir(scratch):
        yield scratch


def toolchain_parts() -> dict[str, Any]:
    """What every Neuron artifact's key holds of the code and tools that built it: the source of the
    library modules that shape the graphs, the pinned SDK set as found, and the versions."""
    return {
        "graph_source": source_digest(),
        "sdk": {r["package"]: r["found"] for r in neuron_env.check_versions()},
        "versions": program_versions(),
    }


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
        # trace inlines them, the others cache the shards: the loader's declared identity (the
        # checkpoint's file digests) while the weights are as loaded, never a float32 pass over all
        "weights": weights_identity(model.lm),
        "tp": tp,
        "shapes": {k: [v.batch, v.tokens, v.context_length, v.ring] for k, v in sorted(shapes.items())},
        "compiler_args": compiler_args,
        "dtype": str(dtype),
        **toolchain_parts(),
    }
    if decode_experts != "dense":  # only then: the keys of existing (dense) artifacts stay valid
        parts["decode_experts"] = decode_experts
    if weights == "int8":  # likewise: full-precision keys stay as they were
        parts["weight_format"] = weights
    return make_key(parts), parts


def tower_cache_key(model: LoadedModel, graph: MediaTower, compiler_args: str) -> tuple[str, dict]:
    """Cache key of a media tower's artifact (vision, audio), apart from the decoder's (a new prompt, TP degree,
    batch or context reuses it; only what is in its NEFF moves it): the multimodal config (its tower's config
    included), the identity of the weights the NEFF inlines (the encoder's and the embedder's, the loader's
    declaration or their bytes hashed once), the graph's shape and form, the compiler arguments, the graph
    source and versions, as `neuron_cache_key`."""
    name = graph.shape.phase
    tower = getattr(graph.model, f"{name}_tower")
    parts = {
        "recipe": f"neuron-{neuron_vision.names(name)[0]}",
        "config": model.multimodal.config.to_json_string(use_diff=False),
        "weights": {
            f"{name}_tower": weights_identity(tower) if tower is not None else None,
            f"embed_{name}": weights_identity(getattr(graph.model, f"embed_{name}")),
        },
        "shape": list(graph.shape.key.values()),
        "graph": graph.key_parts(),
        "compiler_args": compiler_args,
        "dtype": str(graph.dtype),
        **toolchain_parts(),
    }
    return make_key(parts), parts


def compile_towers(graphs: GraphSet, model: LoadedModel, settings: PortSettings, tp: int) -> dict[str, tuple]:
    """The set's media towers (vision, audio) each traced for one NeuronCore (or found in the artifact cache)
    and loaded onto rank 0's core (`neuron_vision.vision_core`), by name: (loaded module, cache entry,
    compile seconds). Called after the decoder's cores (rank 0's among them) were found free and before the
    decoder loads, so a busy core is refused before anything goes to the device."""
    out = {}
    for name, graph in (("vision", graphs.vision), ("audio", graphs.audio)):
        if graph is None:
            continue
        key, parts = tower_cache_key(model, graph, neuron_vision.COMPILER_ARGS)
        recipe, file = neuron_vision.names(name)
        started = time.perf_counter()

        def build(folder: Path, graph=graph, file=file, recipe=recipe) -> dict[str, Any]:
            with compiler_workdir() as workdir, own_directory():
                neuron_vision.save(neuron_vision.compile_vision(graph, compiler_workdir=workdir), folder / file)
            return {"recipe": recipe, "core": neuron_vision.vision_core(tp)}

        need = sum(p.numel() * p.element_size() for p in graph.parameters())  # the NEFF inlines them
        entry = cache_for(settings, model).get_or_build(
            key, build, describe={k: v for k, v in parts.items() if k != "config"}, need_bytes=need
        )
        compile_s = 0.0 if entry.hit else time.perf_counter() - started
        core = neuron_vision.vision_core(tp)
        label = f"{model.variant.name} {name} graph (one core) from {entry.path}"
        out[name] = (cores.claim(neuron_vision.load(entry.file(file), core), core, 1, label), entry, compile_s)
        log.info("%s graph on NeuronCore %d (%s)", name, core, "cached" if entry.hit else f"built in {compile_s:.1f} s")
    return out


def with_towers(compiled: CompiledGraphs, towers: dict[str, tuple]) -> CompiledGraphs:
    """`compiled` with each loaded media tower as its step (`steps.vision`, `steps.audio`: they read no K/V;
    the engine calls them at admission), their cache hits and artifacts recorded."""
    for name, (loaded, entry, compile_s) in towers.items():
        setattr(compiled.steps, name, loaded)
        compiled.compile_s += compile_s
        compiled.cache_hits.append(entry.hit)
        artifacts = compiled.info.get("artifacts")
        named = artifacts if isinstance(artifacts, dict) else {"decoder": artifacts}
        compiled.info["artifacts"] = {**named, name: str(entry.path)}
    return compiled


def compile(graphs: GraphSet, model: LoadedModel, settings: PortSettings, progress: bool = False) -> CompiledGraphs:
    """Compile with the recipe `neuron_recipe` picks for the variant and TP degree (or load the
    artifact from the cache when its key matches): the engine's steps. Raises `NeuronSDKMissingError`
    without the SDK, before any work. `model_builder` (the default): a prefill key per bucket, with
    `row_prefill` a join key per bucket (`device.row_join`), and decode, over one set of K/V states;
    `trace` (TP=1, on request): the decode graph alone, the prompt fed through it token by token. With
    a drafter: prefill, verify and draft keys (`recipes.neuron_drafting`). The shapes are those of
    `graphs` (the settings'); artifacts live in the artifact cache, keyed by `neuron_cache_key`."""
    neuron_env.require("torch_neuronx", f"backend 'neuron' ({model.variant.name})")
    if graphs.verify is not None:
        return compile_drafting(graphs, model, settings)
    # The graphs every backend compiles (`device_graphs`): batch, buckets, context and ring come from
    # the settings (full precision: NxD quantizes its own layers, `Backend.quantizes_itself`).
    decode, prefill = graphs.target, graphs.prefill
    context, ring, batch = decode.shape.context_length, decode.shape.ring, decode.shape.batch
    tp = int(settings.tp_degree)
    recipe = neuron_recipe(model.variant, tp, getattr(settings, "neuron_recipe", None))
    dtype = decode.dtype
    n_inputs = decode.num_inputs
    buckets = tuple(sorted(prefill))
    key_graphs = {"decode": decode}
    decode_experts = "dense"  # only the ModelBuilder recipe builds the rank graph, which takes the form
    if recipe == "model_builder":  # a key per bucket: a prompt runs the smallest that holds it
        names = neuron_model_builder.bucket_shapes(context, buckets, ring, batch)
        key_graphs = {n: decode if s.tokens == 1 else prefill[s.tokens] for n, s in names.items()}
        key_graphs.update({f"row_prefill{b}": join for b, join in graphs.row_prefill.items()})  # the joins
        if graphs.decode_ids is not None:  # a decode key that returns token ids (NxD routes by its sampling input)
            key_graphs["decode_ids"] = graphs.decode_ids
        key_graphs.update({n: ContextKey(g) for n, g in graphs.contexts.items()})  # routed by their positions
        if model.variant.is_moe:
            decode_experts = settings.decode_experts
    shapes = {name: graph.shape for name, graph in key_graphs.items()}
    # the K/V states each compiled module aliases (what may follow its logits) and the index dtype it
    # takes, from the graph's own example inputs
    states = len(decode.layout.buffer_shapes(batch, context, ring))
    indices = index_dtype(key_inputs(decode, n_inputs))
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
    cache = cache_for(settings, model)  # with settings.artifacts: the bundle's NEFFs and shards, never a compile
    started = time.perf_counter()

    def build(folder: Path) -> dict[str, Any]:
        if settings.profile == "full":  # the estimate is the released model's; tiny smoke models fit anywhere
            shapes = {k: getattr(settings, k) for k in ("context_length", "prefill_buckets", "context_buckets")}
            warn_low_host_ram(model.variant, tp, recipe, len(key_graphs), **shapes)  # before a kernel kill
        with compiler_workdir() as workdir, own_directory():  # workdir never inside the cache entry
            _compile(folder, workdir)
        return {"recipe": recipe, "tp": tp}

    def _compile(folder: Path, workdir: str) -> None:
        if recipe == "trace":
            neuron_trace.save(
                neuron_trace.compile_trace(model, context, ring=ring, compiler_workdir=workdir, graph=decode),
                folder / "model.pt",
            )
        else:
            neuron_model_builder.compile_model_builder(
                model,
                tp,
                folder,
                context_length=context,
                buckets=buckets,
                ring=ring,
                dtype=dtype,
                compiler_workdir=workdir,
                decode_experts=decode_experts,
                weights=settings.weights,
                graphs=key_graphs,
            )

    # the entry holds the weights (the shards, or a NEFF with them inlined): the free-space check's estimate
    shard_bytes = model.param_count() * torch.empty((), dtype=dtype).element_size()
    entry = cache.get_or_build(
        key, build, describe={k: v for k, v in parts.items() if k != "config"}, need_bytes=shard_bytes
    )
    compile_s = time.perf_counter() - started
    vocab = int(model.config.vocab_size)
    label = f"{model.variant.name} ({recipe}, TP={tp}) from {entry.path}"
    cores.check_free(0, tp, label)  # a model an earlier call loaded and still referenced: refuse, before the device
    # with media: each tower on rank 0's core, from its own cache entry (checked free with the decoder's)
    towers = compile_towers(graphs, model, settings, tp)
    if recipe == "trace":
        loaded = neuron_trace.load(entry.file("model.pt"))
        step = DeviceStep(cores.claim(loaded, 0, tp, label), n_inputs, vocab, aliases=states, index_dtype=indices)
        steps = Steps(decode=step)  # no prefill graph: the engine feeds the prompt token by token
    else:
        loaded = neuron_model_builder.load_model_builder(entry.path, tp)
        module = cores.claim(loaded, 0, tp, label)
        step = DeviceStep(module, n_inputs, vocab, aliases=states, index_dtype=indices)
        # NxD routes each call by its shapes; a join, and the decode that returns ids, take one input more
        # than the saved executor was traced with, so they go to `nxd_model.forward` (`NxDKeyStep`)
        keyed = lambda *inputs: loaded.nxd_model.forward(list(inputs))  # noqa: E731  # inf2-only
        join = DeviceStep(keyed, n_inputs + 1, vocab, aliases=states, index_dtype=indices)
        rows = {b: row_step(join) for b in graphs.row_prefill}
        steps = Steps(prefill={b: step for b in buckets}, decode=step, row_prefill=rows)
        if "decode_ids" in key_graphs:
            steps.decode_ids = DeviceStep(keyed, n_inputs + 1, aliases=states, index_dtype=indices, chooses=True)
        steps.contexts = named_steps(
            {n: context_step(keyed, n, key_graphs[n], vocab, states, indices) for n in graphs.contexts}
        ).contexts
    check_host_tables(HostEmbedder.from_text_model(model.text_model))  # the compile left the host tables whole
    # no host K/V: the device steps keep theirs as aliased state and never read host buffers
    compiled = CompiledGraphs(
        steps,
        0.0 if entry.hit else compile_s,
        [entry.hit],
        f"neuron-{recipe}",
        {"artifacts": str(entry.path), "tp_degree": tp, "decode_experts": decode_experts, "weights": settings.weights},
    )
    return with_towers(compiled, towers)


def context_step(keyed: Any, name: str, key: ContextKey, vocab: int, states: int, indices: torch.dtype) -> Any:
    """The engine's step of bucket key `name` over `keyed` (the call NxD routes by shape): the read
    positions `[C]` first, then a join's row index (`row_step`), then the graph's inputs."""
    positions = torch.arange(key.shape.reads, dtype=indices)
    n = key.num_inputs - 1  # what the engine passes after a join's row: the positions are ours
    call = lambda *inputs: keyed(positions, *inputs)  # noqa: E731
    step = DeviceStep(call, n, vocab, aliases=states, index_dtype=indices, chooses=key.chooses)
    return row_step(step) if name.startswith("row_") else step


def assistant_digest(assistant: LoadedAssistant) -> str:
    """sha256 over the assistant's tensors (names, shapes, bytes): part of the Neuron cache key."""
    import hashlib

    digest = hashlib.sha256()
    for name, tensor in sorted(assistant.model.state_dict().items()):
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        digest.update(tensor.detach().float().contiguous().numpy().tobytes())
    return digest.hexdigest()


def compile_drafting(graphs: GraphSet, model: LoadedModel, settings: PortSettings) -> CompiledGraphs:
    """The ModelBuilder drafting keys (prefill per bucket, verify, draft over one set of device K/V
    states): compiled, or found in the artifact cache, loaded on the cores (inf2-only through the
    recipe's SDK calls)."""
    from ..recipes import neuron_drafting

    assistant = graphs.assistant  # loaded once, with the graphs (`registry.compile_graphs`)
    if assistant is None:
        raise SettingsError(
            "the drafting keys compile the assistant beside the target: build the graphs with it "
            "(device_graphs(..., assistant=load_assistant(model, settings)), as compile_graphs does)"
        )
    tp, k = int(settings.tp_degree), int(graphs.draft_tokens)
    buckets = tuple(sorted(graphs.prefill))
    dtype = model.lm_head.weight.dtype
    joins = bool(graphs.row_prefill)  # `PortSettings.builds_row_prefill`: a join key per bucket
    chooses = settings.builds_decode_ids  # the ids keys: the verify's verdict, the draft's argmax
    contexts = {name: graph.shape for name, graph in graphs.contexts.items()}  # "verify@64": read positions first
    shapes = neuron_drafting.drafting_shapes(
        settings.context_length, buckets, k, settings.ring_kv, graphs.batch, joins, chooses, contexts
    )
    _, parts = neuron_cache_key(model, neuron_drafting.RECIPE, tp, shapes, neuron_env.COMPILER_ARGS, dtype)
    parts["assistant"] = {"config": assistant.model.config.to_json_string(use_diff=False)}
    parts["assistant"]["digest"] = assistant_digest(assistant)
    key = make_key(parts)
    started = time.perf_counter()

    def build(folder):
        with compiler_workdir() as workdir, own_directory():
            neuron_drafting.compile_drafting(
                model,
                assistant,
                tp,
                folder,
                context_length=settings.context_length,
                buckets=buckets,
                draft_tokens=k,
                ring=settings.ring_kv,
                dtype=dtype,
                compiler_workdir=workdir,
                batch=graphs.batch,
                joins=joins,
                chooses=chooses,
                contexts=contexts,
            )
        return {"recipe": neuron_drafting.RECIPE, "tp": tp}

    need = (model.param_count() + sum(p.numel() for p in assistant.model.parameters())) * dtype.itemsize
    entry = cache_for(settings, model).get_or_build(
        key, build, describe={n: v for n, v in parts.items() if n != "config"}, need_bytes=need
    )
    compile_s = 0.0 if entry.hit else time.perf_counter() - started
    label = f"{model.variant.name} (drafting keys, TP={tp}) from {entry.path}"
    cores.check_free(0, tp, label)
    towers = compile_towers(graphs, model, settings, tp)
    traced = cores.claim(neuron_model_builder.load_model_builder(entry.path, tp), 0, tp, label)
    steps = drafting_steps(traced, buckets, graphs.target.has_ple, joins, chooses, contexts)
    compiled = CompiledGraphs(
        steps, compile_s, [entry.hit], f"neuron-{neuron_drafting.RECIPE}", {"artifacts": {"drafting": str(entry.path)}}
    )
    return with_towers(compiled, towers)


def drafting_steps(
    traced: Any,
    buckets: tuple[int, ...],
    has_ple: bool,
    joins: bool = False,
    chooses: bool = False,
    contexts: dict[str, GraphShape] | None = None,
) -> Steps:
    """The engine's `Steps` of a loaded drafting model: prefill per bucket, verify and draft (and a
    join per bucket; with `chooses`, the greedy verdict's verify and the draft's argmax in place of its
    logits; a context bucket's keys, its read positions passed first), each a key of the one NxD model
    (`recipes.neuron_drafting.NxDKeyStep`; the K/V are device states)."""
    from ..recipes.neuron_drafting import NxDKeyStep

    n = 4 if has_ple else 3
    keys = {f"prefill{int(b)}": NxDKeyStep(traced, n) for b in buckets}
    keys["verify"] = NxDKeyStep(traced, n)
    if chooses:
        keys.update(verify_ids=NxDKeyStep(traced, n + 1, ids=True), draft_ids=NxDKeyStep(traced, 2, ids=True))
    else:
        keys["draft"] = NxDKeyStep(traced, 2)
    for name, shape in (contexts or {}).items():
        kind = name.partition("@")[0]
        inputs = 2 if kind.startswith("draft") else n + (kind == "verify_ids") + kind.startswith("row_")
        step = NxDKeyStep(traced, inputs + 1, ids=kind.endswith("_ids"))
        keyed = functools.partial(step, torch.arange(shape.reads, dtype=torch.int32))  # the positions first
        keys[name] = row_step(keyed) if kind.startswith("row_") else keyed
    steps = named_steps(keys)
    steps.row_prefill = {int(b): row_step(NxDKeyStep(traced, n + 1)) for b in buckets} if joins else {}
    return steps
