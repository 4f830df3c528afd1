"""How long a context each variant can have on inf2: the least of the HBM bound (weights + ring K/V
per core, `memory_plan`) and the compile-host bound (`compile_host`), and the full profile's shapes that
follow from it. Computed, unverified on inf2.

The library refuses what does not fit (`memory_plan.require_fit`) and never searches for a context; the
doctor, the family tables, the notebooks' context tables and the tests do, so the search lives here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gemma4lib.errors import DeviceMemoryError
from gemma4lib.inf2.compile_host import compile_host_plan
from gemma4lib.inf2.hardware import GB, GIB, HBM_PER_CORE_GIB, INSTANCES
from gemma4lib.inf2.memory_plan import (
    WORKING_ALLOWANCE_GIB,
    plan_core_memory,
    rank_kv_elements,
    rank_weight_bytes,
    serving_host_plan,
)
from gemma4lib.models.variants import Variant, get_variant

PREFILL_CHUNKS = (128, 512)  # planned prefill buckets: a long prompt runs in chunks of the largest
CONTEXT_BUCKET_BASE = 2048  # planned context buckets: 2K x 4^i below the context (decode reads the nearest)


def planned_buckets(context: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(prefill buckets, context buckets) the plan compiles at `context`: a few chunk sizes, and a
    geometric series of contexts (x4) so a short conversation's decode reads little of the K/V."""
    sizes, c = [], CONTEXT_BUCKET_BASE
    while c < context:
        sizes.append(c)
        c *= 4
    return tuple(b for b in PREFILL_CHUNKS if b <= context), tuple(sizes)


@dataclass(frozen=True)
class ContextPlan:
    """The longest context on one instance at one TP degree: the least of the HBM bound (weights + ring
    K/V per core) and the compile-host bound (`compile_host` module docstring: its compiler RAM is assumed)."""

    variant: str
    instance: str
    tp: int
    device_context: int
    compile_context: int
    compile_host: str | None
    compile_peak_gb: float  # at `context`, with `planned_buckets(context)`

    @property
    def context(self) -> int:
        return min(self.device_context, self.compile_context)

    @property
    def binding(self) -> str:
        released = get_variant(self.variant).released_context
        if self.context >= released:
            return "released maximum"
        return "HBM" if self.device_context <= self.compile_context else f"compile RAM on {self.compile_host}"


def _bisect(fits, high: int, step: int) -> int:
    low, high = 0, high // step  # the need grows with the context: bisect
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle * step) else (low, middle - 1)
    return low * step


def compile_peak_at(v: Variant, tp: int, context: int, least: bool = False) -> float:
    """Planned compile-host peak (GB) of the ModelBuilder recipe at `context` with its planned buckets
    (`least`: the compiler's RAM at the least its calibration allows)."""
    prefill, sizes = planned_buckets(context)
    return compile_host_plan(
        v, tp, "model_builder", context_length=context, prefill_buckets=prefill, context_buckets=sizes, least=least
    ).peak_gb


def context_plan(
    variant: Variant | str, instance: str, tp: int, *, ring: bool = True, step: int = 1024, least: bool = False
) -> ContextPlan:
    """The longest context (a multiple of `step`, up to the released maximum) of `variant` at `tp` on
    `instance`: its K/V fits a core beside the weights and its compile fits the compile host (the
    instance, or the smallest inf2 whose RAM holds the compile at all: `plan_core_memory`; `least`: the
    compiler's RAM at the least its calibration allows, the hopeful end). Computed, unverified on inf2."""
    v = get_variant(variant) if isinstance(variant, str) else variant
    room = HBM_PER_CORE_GIB - WORKING_ALLOWANCE_GIB - rank_weight_bytes(v, tp) / GIB  # what K/V may take
    device = _bisect(lambda c: rank_kv_elements(v.name, tp, c, ring) * 2 / GIB <= room, v.released_context, step)
    host = plan_core_memory(v, tp, instance=instance, recipe="model_builder").compile_host
    ram = INSTANCES[host].host_ram_gib * GIB / GB if host else 0.0
    compiled = _bisect(lambda c: compile_peak_at(v, tp, c, least) <= ram, device, step) if host else 0
    context = min(device, compiled)
    return ContextPlan(
        v.name, instance, tp, device, compiled, host, compile_peak_at(v, tp, context, least) if context else 0.0
    )


def largest_context(variant: Variant | str, instance: str, *, ring: bool = True, step: int = 1024) -> tuple[int, int]:
    """(context, TP): the longest `context_plan` over the TP degrees `instance` has the cores and host
    RAM for, the fewest cores first ((0, 0): none)."""
    v = get_variant(variant) if isinstance(variant, str) else variant
    best = (0, 0)
    cores = INSTANCES[instance].neuron_cores  # and the instance's RAM must hold the host side at that TP
    for tp in (t for t in v.supported_tp if t <= cores and serving_host_plan(v, t, instance).fits):
        context = context_plan(v, instance, tp, ring=ring, step=step).context
        if context > best[0]:
            best = (context, tp)
    return best


def full_settings(variant: Variant | str) -> dict[str, Any]:
    """The full profile's shapes for `variant` on its own instance at its own TP: the planned context
    rounded down to a power of two, and its planned buckets (`papermill_runs/profiles.json` holds them)."""
    v = get_variant(variant) if isinstance(variant, str) else variant
    planned = context_plan(v, v.instance_type, v.tp_degree)
    if not planned.context:
        raise DeviceMemoryError(
            f"{v.name} at TP={v.tp_degree} fits no context on {v.instance_type}; `python -m gemma4lab doctor "
            f"--variant {v.name}` names the instances where one fits"
        )
    context = 1 << (planned.context.bit_length() - 1)
    prefill, sizes = planned_buckets(context)
    return {"context_length": context, "prefill_buckets": list(prefill), "context_buckets": list(sizes)}
