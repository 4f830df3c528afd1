"""The library's inf2 plans as reports: JSON-friendly data and one-line summaries, for the doctor,
the family tables, the host-RSS benchmarks and the tests.

The library builds its own refusal messages (`memory_plan.require_fit`, `serving_host.require_serving_host`)
and never writes a plan out; these only report one, so they live beside the lab tools that print them.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from gemma4lib.inf2.compile_host import CompileHostPlan
from gemma4lib.inf2.memory_plan import CoreMemoryPlan
from gemma4lib.inf2.serving_host import ServingHostPlan
from gemma4lib.inf2.vision_plan import VisionPlan

# each plan's derived figures (properties), written out beside its fields
DERIVED: dict[type, tuple[str, ...]] = {
    CoreMemoryPlan: ("total_gib", "fits"),
    CompileHostPlan: ("steps", "peak_step", "peak_gb"),
    ServingHostPlan: ("peak_gb", "available_gb", "peak_step", "fits"),
    VisionPlan: ("embedder_params", "weights_gib", "activations_gib", "total_gib"),
}


def plan_dict(plan: CoreMemoryPlan | CompileHostPlan | ServingHostPlan | VisionPlan) -> dict[str, Any]:
    """A plan's fields and derived figures as JSON-friendly data (`problems` a list)."""
    out = asdict(plan)
    if "problems" in out:
        out["problems"] = list(plan.problems)
    return {**out, **{name: getattr(plan, name) for name in DERIVED[type(plan)]}}


def compile_elsewhere(plan: CoreMemoryPlan) -> str:
    """Where the compile runs when the run instance's RAM cannot hold it ("" when it can)."""
    if plan.compile_host in (None, plan.instance):
        return ""
    return f" (compile on an {plan.compile_host}, serve on the {plan.instance})"


def core_summary(plan: CoreMemoryPlan) -> str:
    """One line: per-core use against capacity, and the compile host's need."""
    verdict = "fits" if plan.fits else "does not fit: " + "; ".join(plan.problems)
    batch = f", batch {plan.batch}" if plan.batch > 1 else ""
    towers = (("vision", plan.vision_gib), ("audio", plan.audio_gib))
    media = " + ".join(f"{gib:.2f} GiB {name}" for name, gib in towers if gib)
    vision = f" + {media} (on the core of rank 0; {plan.vision_placement})" if plan.vision_placement else ""
    return (
        f"{plan.variant} {plan.recipe} TP={plan.tp} on {plan.instance}, context {plan.context_length}"
        f"{' (ring)' if plan.ring else ''}{batch}: per core {plan.weights_gib:.1f} GiB "
        f"{'int8 ' if plan.weight_format == 'int8' else ''}weights + "
        f"{plan.kv_gib:.2f} GiB K/V + {plan.working_gib:.1f} GiB working{vision} = "
        f"{plan.total_gib:.1f} of {plan.capacity_gib:.0f} GiB; compile host ~{plan.compile_peak_gb:.0f} GB of "
        f"{plan.host_ram_gib} GiB{compile_elsewhere(plan)} — {verdict}"
    )


def compile_summary(plan: CompileHostPlan) -> str:
    """One line, under the words "compile host"."""
    return f"compile host: {plan.variant} ({plan.recipe}, TP={plan.tp}): ~{plan.peak_gb:.0f} GB peak = {plan.basis()}"
