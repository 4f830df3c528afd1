"""Will a port fit on inf2? A plan per NeuronCore and for the compile host, computed from shapes.

On inf2 every tensor-parallel rank is one NeuronCore with 16 GiB of HBM. What a rank holds is
known before anything is loaded: its shard of the weights (the same cut `tp.shard` makes, counted
on a meta-device model of the released config), its K/V buffers at the compiled context (KV heads
replicated where a layer has fewer than the TP degree), and working memory. A configuration that
cannot fit is refused when the settings are made, not half an hour into a compile. MoE experts
count 1/tp of their bytes per rank whichever way the plan splits them (whole experts, or a slice
of every expert: the plan's default): the shards have the same shapes.

What is computed and what is assumed:

- weights and K/V per core: computed exactly from the released configs, bf16;
- working memory per core: `WORKING_ALLOWANCE_GIB`, an allowance, not a measurement (the Neuron
  runtime's reservation, the program's instructions, activations and scratch). Unverified on inf2;
- host RAM for the compile: an estimate from the weights alone. ModelBuilder holds three copies of
  the text weights at its peak (the module it builds, the checkpoint the loader returns and the
  per-rank shards it writes); 3 x 61.4 GB = 184 GB for the 31B against the field report's measured
  182 GB (the earlier inf2 port; README, "The family at a glance"). The trace recipe compiles with
  `inline_weights_to_neff=False`, so it holds the host model plus one copy of the device weights (no
  weights baked into the HLO or the NEFF). Unverified on inf2 except the 31B calibration.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import DeviceMemoryError, TensorParallelError
from .hardware import GB, GIB, HBM_PER_CORE_GIB, INSTANCES, NEURON_TP_DEGREES
from .variants import Variant, get_variant

WORKING_ALLOWANCE_GIB = 2.0
MODEL_BUILDER_COPIES = 3  # module + loader checkpoint + per-rank shards at the compile's peak
COMPILE_CALIBRATION = {"variant": "31b", "tp": 8, "measured_peak_gb": 182.0, "source": "field report"}
HOST_HEADROOM = 1.2  # a compile host should have 20 % more RAM than the estimated peak
DEFAULT_CONTEXT = 2048


def neuron_recipe(variant: Variant, tp: int) -> str:
    """The Neuron recipe a variant uses at a TP degree: `trace` for a single core where the
    variant's recipe is the trace (E2B), ModelBuilder everywhere else (the supported path at every
    degree since SDK 2.27)."""
    return "trace" if tp == 1 and variant.recipe == "trace" else "model_builder"


@functools.lru_cache(maxsize=64)
def _rank_params(name: str, tp: int) -> int:
    """Parameter elements one rank holds (its shard), counted on the meta device; host tables excluded."""
    from .roofline import meta_model
    from .tp.plan import make_plan
    from .tp.shard import RANK_KEY, shard_state_dict

    variant = get_variant(name)
    lm = meta_model(variant)
    plan = make_plan(lm.config, tp, variant)
    shard = shard_state_dict(lm, plan, 0)
    return sum(t.numel() for k, t in shard.items() if k != RANK_KEY)


@functools.lru_cache(maxsize=64)
def _rank_kv_elements(name: str, tp: int, context_length: int, ring: bool) -> int:
    from .roofline import meta_model
    from .tp.plan import make_plan

    variant = get_variant(name)
    plan = make_plan(meta_model(variant).config, tp, variant)
    return int(plan.rank_layout().buffer_bytes(context_length, ring, 1, 1))


def compile_peak_gb(variant: Variant, recipe: str, dtype_bytes: int = 2) -> tuple[float, str]:
    """Estimated peak host RAM (GB) of compiling `variant` with `recipe`, and how it was reckoned."""
    from .roofline import count_params, meta_model

    counts = count_params(meta_model(variant))
    model_gb = counts.total * dtype_bytes / GB
    device_gb = counts.device_params("dense") * dtype_bytes / GB
    if recipe == "model_builder":
        return MODEL_BUILDER_COPIES * model_gb, f"{MODEL_BUILDER_COPIES} x text weights (module + checkpoint + shards)"
    return model_gb + device_gb, "host model + one copy of the device weights (weights not inlined into the NEFF)"


def structural_problems(variant: Variant, tp: int, instance: str | None) -> list[str]:
    """Why `tp` cannot run on inf2 whatever the memory: not a runtime degree, heads or experts that
    do not split, or more ranks than `instance` has NeuronCores (unknown instances: not checked)."""
    problems = []
    if tp not in NEURON_TP_DEGREES:
        problems.append(
            f"TP={tp} is not a degree the Neuron runtime supports on inf2 ({', '.join(map(str, NEURON_TP_DEGREES))})"
        )
    if tp not in variant.supported_tp:
        problems.append(f"the {variant.name}'s heads and experts split evenly only for TP in {variant.supported_tp}")
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

    @property
    def total_gib(self) -> float:
        return self.weights_gib + self.kv_gib + self.working_gib

    @property
    def fits(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "problems": list(self.problems), "total_gib": self.total_gib, "fits": self.fits}

    def summary(self) -> str:
        """One line: per-core use against capacity, and the compile host's need."""
        verdict = "fits" if self.fits else "does not fit: " + "; ".join(self.problems)
        return (
            f"{self.variant} {self.recipe} TP={self.tp} on {self.instance}, context {self.context_length}"
            f"{' (ring)' if self.ring else ''}: per core {self.weights_gib:.1f} GiB weights + "
            f"{self.kv_gib:.2f} GiB K/V + {self.working_gib:.1f} GiB working = {self.total_gib:.1f} of "
            f"{self.capacity_gib:.0f} GiB; compile host ~{self.compile_peak_gb:.0f} GB of "
            f"{self.host_ram_gib} GiB — {verdict}"
        )


def plan_core_memory(
    variant: Variant | str,
    tp: int | None = None,
    *,
    instance: str | None = None,
    context_length: int = DEFAULT_CONTEXT,
    ring: bool = True,
    dtype_bytes: int = 2,
) -> CoreMemoryPlan:
    """The per-core memory plan of `variant` at `tp` (default: its recipe's) on `instance`
    (default: the variant's recommended instance). Problems are listed, never raised here."""
    v = get_variant(variant) if isinstance(variant, str) else variant
    tp = int(tp or v.tp_degree)
    instance = instance or v.instance_type
    if instance not in INSTANCES:
        from .errors import UnknownNameError

        raise UnknownNameError("inf2 instance", instance, INSTANCES)
    inst = INSTANCES[instance]
    recipe = neuron_recipe(v, tp)
    problems = structural_problems(v, tp, instance)
    if problems and tp not in v.supported_tp:  # no plan can be cut: report what we know
        weights = kv = 0.0
    else:
        params = _rank_params(v.name, tp)
        weights = params * dtype_bytes / GIB
        kv = _rank_kv_elements(v.name, tp, int(context_length), bool(ring)) * dtype_bytes / GIB
    capacity = float(HBM_PER_CORE_GIB)
    if weights + kv + WORKING_ALLOWANCE_GIB > capacity:
        problems.append(
            f"{weights:.1f} GiB of weights + {kv:.2f} GiB of K/V + {WORKING_ALLOWANCE_GIB:.0f} GiB working "
            f"memory exceed a NeuronCore's {capacity:.0f} GiB"
        )
    peak, basis = compile_peak_gb(v, recipe, dtype_bytes)
    if inst.host_ram_gib * GIB < peak * GB:
        problems.append(f"the compile needs ~{peak:.0f} GB of host RAM and an {instance} has {inst.host_ram_gib} GiB")
    return CoreMemoryPlan(
        v.name,
        recipe,
        tp,
        instance,
        int(context_length),
        bool(ring),
        weights,
        kv,
        WORKING_ALLOWANCE_GIB,
        capacity,
        peak,
        basis,
        inst.host_ram_gib,
        tuple(problems),
    )


def fitting_options(
    variant: Variant | str, context_length: int = DEFAULT_CONTEXT, ring: bool = True
) -> list[CoreMemoryPlan]:
    """Every (TP degree, instance) that fits, smallest instance and degree first."""
    v = get_variant(variant) if isinstance(variant, str) else variant
    plans = [
        plan_core_memory(v, tp, instance=name, context_length=context_length, ring=ring)
        for name in INSTANCES
        for tp in v.supported_tp
        if tp in NEURON_TP_DEGREES
    ]
    return [p for p in plans if p.fits]


def require_fit(
    variant: Variant | str, tp: int, *, instance: str | None, context_length: int, ring: bool
) -> CoreMemoryPlan:
    """Raise when the released model cannot run at `tp` on `instance` (default: the variant's):
    `TensorParallelError` for a degree inf2 cannot run, `DeviceMemoryError` for one that does not
    fit a core or the compile host; the message names configurations that fit."""
    v = get_variant(variant) if isinstance(variant, str) else variant
    require_neuron_tp(v, tp, instance)
    plan = plan_core_memory(v, tp, instance=instance, context_length=context_length, ring=ring)
    if not plan.fits:
        raise DeviceMemoryError(
            f"{v.name} at TP={tp} on {plan.instance} does not fit: {'; '.join(plan.problems)}; "
            f"use {_hint(fitting_options(v, context_length, ring))}"
        )
    return plan


def plan_table(context_length: int = DEFAULT_CONTEXT, ring: bool = True) -> list[CoreMemoryPlan]:
    """Each variant at its recipe's TP on its instance, plus the next smaller TP (to show why not)."""
    from .variants import VARIANTS

    plans = []
    for v in VARIANTS.values():
        degrees = [t for t in v.supported_tp if t in NEURON_TP_DEGREES and t <= v.tp_degree]
        for tp in sorted({v.tp_degree, *degrees[-2:]}):
            plans.append(plan_core_memory(v, tp, context_length=context_length, ring=ring))
    return plans


def format_plan_table(plans: list[CoreMemoryPlan]) -> str:
    """Markdown rows of `plan_table` (GiB per NeuronCore; compile host RAM in GB)."""
    lines = [
        "| variant | recipe | TP | instance | weights/core | K/V/core | working | total / 16 GiB | "
        "compile host | fits |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in plans:
        lines.append(
            f"| {p.variant} | {p.recipe} | {p.tp} | {p.instance} | {p.weights_gib:.1f} GiB | "
            f"{p.kv_gib:.2f} GiB | {p.working_gib:.0f} GiB | {p.total_gib:.1f} GiB | "
            f"~{p.compile_peak_gb:.0f} GB / {p.host_ram_gib} GiB | "
            f"{'yes' if p.fits else 'no: ' + '; '.join(p.problems)} |"
        )
    return "\n".join(lines)


__all__ = [
    "COMPILE_CALIBRATION",
    "CoreMemoryPlan",
    "DEFAULT_CONTEXT",
    "WORKING_ALLOWANCE_GIB",
    "compile_peak_gb",
    "fitting_options",
    "format_plan_table",
    "neuron_recipe",
    "plan_core_memory",
    "plan_table",
    "require_fit",
    "require_neuron_tp",
    "structural_problems",
]
