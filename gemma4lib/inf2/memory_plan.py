"""Will a port fit on inf2? A plan per NeuronCore and for the compile host, computed from shapes.

On inf2 every tensor-parallel rank is one NeuronCore with 16 GiB of HBM. What a rank holds is known
before anything loads: its shard of the weights (the cut `tp.shard` makes, counted on a meta-device
model of the released config), its K/V buffers at the compiled context (KV heads replicated where a
layer has fewer than the TP degree), and working memory. So a configuration that cannot fit is
refused before anything loads (`backends.preflight`), not half an hour into a compile. MoE experts
count 1/tp of their bytes per rank whichever way the plan splits them (same shard shapes).

Computed exactly from the released configs: weights and K/V per core, bf16 (`weights="int8"`: the
linears NxD quantizes at 1 byte plus an fp32 scale per output row). Assumed: working memory per
core, `WORKING_ALLOWANCE_GIB` (the runtime's reservation, instructions, activations, scratch;
unverified on inf2). The compile host's RAM: `compile_host`.

The compile needs no NeuronCore, so it may run on a larger host than the one that serves: a plan
names `compile_host`, the run instance when its RAM holds the estimate, else the smallest inf2 size
that does (same chip, so its artifacts load on the run instance). E2B's ModelBuilder compile is the
case: compile on an inf2.8xlarge and serve on the inf2.xlarge, or pick the trace recipe, whose
compile fits the inf2.xlarge (`neuron_recipe`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from ..device.quant import LINEAR_WEIGHT_NAME
from ..errors import DeviceMemoryError, TensorParallelError, UnknownNameError
from ..models.variants import Variant, get_variant
from ..recipes import RECIPE_MODULES
from .compile_host import KEYS
from .hardware import GB, GIB, HBM_PER_CORE_GIB, INSTANCES, NEURON_TP_DEGREES, smallest_instance
from .serving_host import ServingHostPlan, serving_host_plan  # noqa: F401  (re-exported)

WORKING_ALLOWANCE_GIB = 2.0
# The field report's measured compile peak, with its own port's eager checkpoint (three copies of the
# weights); kept as the reference the old estimate matched, not as this library's compile.
COMPILE_CALIBRATION = {"variant": "31b", "tp": 8, "measured_peak_gb": 182.0, "source": "field report (eager port)"}
HOST_HEADROOM = 1.2  # a compile host should have 20 % more RAM than the estimated peak
DEFAULT_CONTEXT = 2048


NEURON_RECIPES = tuple(RECIPE_MODULES)


def neuron_recipe(variant: Variant, tp: int, requested: str | None = None) -> str:
    """The Neuron recipe for `variant` at `tp`: the variant's own (`Variant.recipe`: ModelBuilder, the
    supported path at every degree since SDK 2.27) unless `requested` says otherwise. `trace` stays
    selectable at TP=1 (`recipes`): its compile fits an inf2.xlarge's 16 GiB of host RAM
    (ModelBuilder's does not, `compile_peak_gb`), at the cost of a prompt fed one token per step."""
    if requested is None:
        return variant.recipe
    if requested not in NEURON_RECIPES:
        raise UnknownNameError("neuron recipe", requested, NEURON_RECIPES)
    if requested == "trace" and tp != 1:
        raise TensorParallelError(
            f"the trace recipe compiles one NeuronCore; {variant.name} at TP={tp} needs "
            f"neuron_recipe='model_builder' (or tp_degree=1)"
        )
    return requested


@functools.lru_cache(maxsize=64)
def _rank_tensors(name: str, tp: int) -> dict[str, tuple[int, int]]:
    """(elements, rows) of every tensor in one rank's shard (meta device), host tables excluded."""
    from ..tp.plan import make_plan
    from ..tp.shard import RANK_KEY, shard_state_dict
    from .params import meta_model

    variant = get_variant(name)
    lm = meta_model(variant)
    shard = shard_state_dict(lm, make_plan(lm.config, tp, variant), 0)
    return {k: (t.numel(), t.shape[0] if t.dim() else 1) for k, t in shard.items() if k != RANK_KEY}


def rank_weight_bytes(variant: Variant | str, tp: int, weights: str = "bf16", dtype_bytes: int = 2) -> int:
    """Bytes of one rank's weights. `weights="int8"`: the attention and dense-MLP linears NxD's
    `convert` quantizes (`recipes.neuron_model_builder.INT8_INCLUDE`, the same names as
    `quant.LINEAR_WEIGHT_NAME`) at 1 byte per element plus one fp32 scale per output row of the
    rank's shard (a column-parallel scale is cut with its rows, a row-parallel one is replicated:
    `[out, 1]` either way); everything else (norms, the LM head, MoE experts) at `dtype_bytes`."""
    v = get_variant(variant) if isinstance(variant, str) else variant
    tensors = _rank_tensors(v.name, tp)
    if weights != "int8":
        return sum(n for n, _ in tensors.values()) * dtype_bytes
    return sum(n + 4 * rows if LINEAR_WEIGHT_NAME.search(k) else n * dtype_bytes for k, (n, rows) in tensors.items())


@functools.lru_cache(maxsize=64)
def rank_kv_elements(name: str, tp: int, context_length: int, ring: bool) -> int:
    from ..tp.plan import make_plan
    from .params import meta_model

    variant = get_variant(name)
    plan = make_plan(meta_model(variant).config, tp, variant)
    return int(plan.rank_layout().buffer_bytes(context_length, ring, 1, 1))


def compile_peak_gb(
    variant: Variant, recipe: str, dtype_bytes: int = 2, tp: int | None = None, keys: int = KEYS, **shapes: Any
) -> tuple[float, str]:
    """Planned peak host RAM (GB) of compiling `variant` with `recipe` at `tp` (default: its own) and
    `keys` ModelBuilder keys (`shapes`: context_length and the buckets, which count the compiler's RAM),
    and what it is made of (`compile_host.compile_host_plan`)."""
    from .compile_host import compile_host_plan

    plan = compile_host_plan(variant, tp, recipe, dtype_bytes=dtype_bytes, keys=keys, **shapes)
    return plan.peak_gb, plan.basis()


def structural_problems(variant: Variant, tp: int, instance: str | None) -> list[str]:
    """Why `tp` cannot run on inf2 whatever the memory: not a runtime degree, heads or experts that
    do not split, or more ranks than `instance` has NeuronCores (unknown instances: not checked)."""
    problems = []
    if tp not in NEURON_TP_DEGREES:
        problems.append(
            f"TP={tp} is not a degree the Neuron runtime supports on inf2 ({', '.join(map(str, NEURON_TP_DEGREES))})"
        )
    if tp not in variant.supported_tp:
        problems.append(f"the {variant.name} recipe supports TP in {variant.supported_tp} only")
    inst = INSTANCES.get(instance or "")
    if inst is not None and tp > inst.neuron_cores:
        problems.append(f"TP={tp} needs {tp} NeuronCores and an {instance} has {inst.neuron_cores}")
    return problems


def _hint(options: list[CoreMemoryPlan]) -> str:
    return ", ".join(f"TP={p.tp} on {p.instance}" for p in options[:4]) if options else "a shorter context_length"


def require_neuron_tp(variant: Variant | str, tp: int, instance: str | None = None) -> None:
    """Raise `TensorParallelError` when `tp` cannot run on inf2 (see `structural_problems`)."""
    v = get_variant(variant) if isinstance(variant, str) else variant
    problems = structural_problems(v, tp, instance)
    if problems:
        ok = [t for t in v.supported_tp if not structural_problems(v, t, instance)]
        raise TensorParallelError(
            f"{v.name} cannot run at TP={tp} on inf2: {'; '.join(problems)}; use tp_degree "
            f"{' or '.join(map(str, ok))}" + (f" on {instance}" if instance else "")
        )


@dataclass(frozen=True)
class CoreMemoryPlan:
    """What one NeuronCore holds for a port, and what the compile host needs."""

    variant: str
    recipe: str
    tp: int
    instance: str
    context_length: int
    ring: bool
    weights_gib: float
    kv_gib: float
    working_gib: float
    capacity_gib: float
    compile_peak_gb: float
    compile_basis: str
    host_ram_gib: int
    problems: tuple[str, ...] = field(default_factory=tuple)
    compile_host: str | None = None  # where the compile fits: the run instance, or a larger inf2 size
    weight_format: str = "bf16"  # "int8": the quantized linears counted at 1 byte + a scale per row
    batch: int = 1  # rows served at once: K/V is held per row, `kv_gib` counts all of them
    assistant_gib: float = 0.0  # with draft_tokens: the MTP assistant's weights on this core (assumed shape)
    # with vision: the vision part's weights + its graph's activations on the one core that runs it
    # (`vision_plan`: computed from transformers 5.23.0 config defaults, unverified against the release)
    vision_gib: float = 0.0
    vision_placement: str | None = None  # the media graphs' (vision, audio: their 30 s graph, `audio_plan`)
    audio_gib: float = 0.0

    @property
    def total_gib(self) -> float:
        return self.weights_gib + self.kv_gib + self.working_gib + self.assistant_gib + self.vision_gib + self.audio_gib

    @property
    def fits(self) -> bool:
        return not self.problems


def plan_core_memory(
    variant: Variant | str,
    tp: int | None = None,
    *,
    instance: str | None = None,
    context_length: int = DEFAULT_CONTEXT,
    ring: bool = True,
    dtype_bytes: int = 2,
    recipe: str | None = None,
    weights: str = "bf16",
    batch: int = 1,
    draft_tokens: int | None = None,
    vision: bool = False,
    audio: bool = False,
) -> CoreMemoryPlan:
    """The per-core memory plan of `variant` at `tp` (default: its recipe's) on `instance`
    (default: the variant's recommended instance) with `recipe` (default: `neuron_recipe`'s),
    serving `batch` rows (K/V x batch); `weights="int8"` counts the quantized linears at their
    int8 bytes (`rank_weight_bytes`); `draft_tokens` adds the MTP assistant's weights per core
    (`mtp_roofline`, an assumed shape) and the rings' k + 1 extra slots; `vision` adds the vision part
    (`vision_plan`), `audio` the audio part (`audio_plan`: one 30 s clip's graph), on rank 0's core, the one that runs
    them. Problems are listed, never raised here."""
    v = get_variant(variant) if isinstance(variant, str) else variant
    tp = int(tp or v.tp_degree)
    instance = instance or v.instance_type
    if instance not in INSTANCES:
        raise UnknownNameError("inf2 instance", instance, INSTANCES)
    inst = INSTANCES[instance]
    recipe = neuron_recipe(v, tp, recipe)
    problems = structural_problems(v, tp, instance)
    if problems and tp not in v.supported_tp:  # no plan can be cut: report what we know
        weights_gib = kv = 0.0
    else:
        weights_gib = rank_weight_bytes(v, tp, weights, dtype_bytes) / GIB
        kv = rank_kv_elements(v.name, tp, int(context_length), bool(ring)) * dtype_bytes * int(batch) / GIB
    assistant_gib = 0.0
    if draft_tokens and weights_gib:  # the assistant's weights, and the rings' k + 1 extra slots per row
        assistant_gib, extra = _draft_extra_gib(v, tp, int(context_length), bool(ring), int(draft_tokens), dtype_bytes)
        kv += extra * int(batch)
    vision_gib, audio_gib, placement = 0.0, 0.0, None
    if vision or audio:
        from .audio_plan import audio_plan
        from .vision_plan import PLACEMENT, vision_plan

        vision_gib, placement = vision_plan(v, dtype_bytes=dtype_bytes).total_gib if vision else 0.0, PLACEMENT
        audio_gib = audio_plan(v.name, dtype_bytes).total_gib if audio else 0.0
    capacity = float(HBM_PER_CORE_GIB)
    if weights_gib + kv + WORKING_ALLOWANCE_GIB + assistant_gib + vision_gib + audio_gib > capacity:
        problems.append(
            f"{weights_gib:.1f} GiB of {'int8 ' if weights == 'int8' else ''}weights + {kv:.2f} GiB of K/V + "
            f"{f'{assistant_gib:.2f} GiB of assistant weights + ' if assistant_gib else ''}"
            f"{f'{vision_gib:.2f} GiB of vision weights and activations + ' if vision else ''}"
            f"{f'{audio_gib:.2f} GiB of audio weights and activations + ' if audio else ''}"
            f"{WORKING_ALLOWANCE_GIB:.0f} GiB working memory exceed a NeuronCore's {capacity:.0f} GiB"
        )
    peak, basis = compile_peak_gb(v, recipe, dtype_bytes, tp)
    compile_host: str | None = instance
    if inst.host_ram_gib * GIB < peak * GB:  # the compile needs no NeuronCore: a larger inf2 can do it
        larger = smallest_instance(1, peak * HOST_HEADROOM)
        compile_host = larger.name if larger else None
        if larger is None:
            problems.append(f"the compile needs ~{peak:.0f} GB of host RAM, more than any inf2 size has")
    return CoreMemoryPlan(
        v.name,
        recipe,
        tp,
        instance,
        int(context_length),
        bool(ring),
        weights_gib,
        kv,
        WORKING_ALLOWANCE_GIB,
        capacity,
        peak,
        basis,
        inst.host_ram_gib,
        tuple(problems),
        compile_host,
        weights,
        int(batch),
        assistant_gib,
        vision_gib,
        placement,
        audio_gib,
    )


def _draft_extra_gib(v: Variant, tp: int, context: int, ring: bool, k: int, dtype_bytes: int) -> tuple[float, float]:
    """(assistant weights, extra K/V of the roomy rings) per core in GiB, for k draft tokens."""
    from ..device.drafting import RoomyLayout
    from ..tp.plan import make_plan
    from .mtp_roofline import assistant_rank_bytes
    from .params import meta_model

    lm = meta_model(v)
    layout = make_plan(lm.config, tp, v).rank_layout()
    extra = RoomyLayout.around(layout, k + 1).buffer_bytes(context, ring, 1) - layout.buffer_bytes(context, ring, 1)
    return assistant_rank_bytes(lm, tp, dtype_bytes) / GIB, extra * dtype_bytes / GIB


def fitting_options(
    variant: Variant | str,
    context_length: int = DEFAULT_CONTEXT,
    ring: bool = True,
    weights: str = "bf16",
    batch: int = 1,
) -> list[CoreMemoryPlan]:
    """Every (TP degree, instance) that fits: those that also compile on the instance first, then
    those whose compile needs a larger host; smallest instance and degree first within each."""
    v = get_variant(variant) if isinstance(variant, str) else variant
    plans = [
        plan_core_memory(v, tp, instance=name, context_length=context_length, ring=ring, weights=weights, batch=batch)
        for name in INSTANCES
        for tp in v.supported_tp
        if tp in NEURON_TP_DEGREES
    ]
    fitting = [p for p in plans if p.fits]
    return sorted(fitting, key=lambda p: p.compile_host != p.instance)  # stable: size order kept


def require_fit(variant: Variant | str, tp: int, *, instance: str | None, **shapes: Any) -> CoreMemoryPlan:
    """Raise when the released model cannot run at `tp` on `instance` (default: the variant's):
    `TensorParallelError` for a degree inf2 cannot run, `DeviceMemoryError` for one that does not fit a
    core or the compile host; `shapes` are `plan_core_memory`'s (with `draft_tokens`: the assistant's
    weights too; with `vision`: the vision part on rank 0's core); the message names configurations
    that fit."""
    v = get_variant(variant) if isinstance(variant, str) else variant
    require_neuron_tp(v, tp, instance)
    plan = plan_core_memory(v, tp, instance=instance, **shapes)
    if not plan.fits:
        batch, weights = shapes.get("batch", 1), shapes.get("weights", "bf16")
        at = f" with batch {batch}" if batch > 1 else ""
        options = fitting_options(v, shapes["context_length"], shapes["ring"], weights, batch)
        raise DeviceMemoryError(
            f"{v.name} at TP={tp} on {plan.instance}{at} does not fit: {'; '.join(plan.problems)}; use {_hint(options)}"
        )
    return plan
