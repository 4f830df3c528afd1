"""One-line summaries of the library's inf2 plans, for the doctor and the tests.

The library builds its own refusal messages (`memory_plan.require_fit`); these lines only report a
plan, so they live beside the lab tools that print them.
"""

from __future__ import annotations

from gemma4lib.inf2.compile_host import CompileHostPlan
from gemma4lib.inf2.memory_plan import CoreMemoryPlan


def compile_elsewhere(plan: CoreMemoryPlan) -> str:
    """Where the compile runs when the run instance's RAM cannot hold it ("" when it can)."""
    if plan.compile_host in (None, plan.instance):
        return ""
    return f" (compile on an {plan.compile_host}, serve on the {plan.instance})"


def core_summary(plan: CoreMemoryPlan) -> str:
    """One line: per-core use against capacity, and the compile host's need."""
    verdict = "fits" if plan.fits else "does not fit: " + "; ".join(plan.problems)
    batch = f", batch {plan.batch}" if plan.batch > 1 else ""
    vision = (
        f" + {plan.vision_gib:.2f} GiB vision (on the core of rank 0; {plan.vision_placement})"
        if plan.vision_placement
        else ""
    )
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
