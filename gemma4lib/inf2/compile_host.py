"""Will the compile host's RAM hold the compile? The plan of the machine that runs the recipe's
trace and writes the per-rank shards (it needs no NeuronCore, so it may be a larger inf2 than the
one that serves: `memory_plan.plan_core_memory(...).compile_host`).

The ModelBuilder recipe, step by step (from NxD v2.28.0's `trace/model_builder.py`):

1. the host model, loaded and read once (the cache key digests it): `model_gb`;
2. `trace(initialize_model_weights=False)`: each key's module (one rank's weights at shard size plus
   its K/V states, `keys x rank_gb`) is built and kept, then traced and compiled;
3. `shard_checkpoint`: the lazy loader builds the NxD-arranged checkpoint once (`checkpoint_gb`) and
   writes each rank's file in turn: NxD's cut is a view, copied only where a row-parallel weight is
   cut along its columns (`o_proj`, `down_proj`, the experts' `down`).

peak = process base + model + max(keys x rank, checkpoint + rank (the remaining key) + the copied cuts).

The sizes are computed from the released configs (meta device); the host side of steps 1-3 is
measured on real-width E2B at reduced depth (`docs/measurements/compile_host_e2b.json`). Not counted,
unverified on inf2: neuronx-cc's own RAM (its own process; users report a 16k-token compile
exhausting a 128 GB host) and torch-neuronx's HLO generation. The trace recipe
(`inline_weights_to_neff=False`): the host model plus one copy of the device weights.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import Any

from ..models.variants import Variant, get_variant
from .hardware import GB

KEYS = 2  # the ModelBuilder recipe's keys with one prefill bucket: prefill and decode
COMPILE_CONTEXT = 2048  # the K/V states the modules hold (memory_plan.DEFAULT_CONTEXT)


@dataclass(frozen=True)
class CompileHostPlan:
    """What the compile host holds (GB) for one variant, TP degree and recipe."""

    variant: str
    tp: int
    recipe: str
    base_gb: float
    model_gb: float
    rank_gb: float  # one rank's weights and K/V states at shard size (a key's module)
    written_gb: float  # what writing one rank's file copies: its column-cut (row-parallel) tensors
    checkpoint_gb: float  # the NxD-arranged checkpoint the loader returns
    device_gb: float  # the trace recipe: the device weights separated from the graph
    keys: int = KEYS

    @property
    def steps(self) -> dict[str, float]:
        if self.recipe != "model_builder":
            return {"trace (device weights separated)": self.device_gb}
        return {
            "trace (the keys' modules)": self.keys * self.rank_gb,
            "shard_checkpoint": self.checkpoint_gb + (self.keys - 1) * self.rank_gb + self.written_gb,
        }

    @property
    def peak_step(self) -> str:
        return max(self.steps, key=self.steps.get)

    @property
    def peak_gb(self) -> float:
        return self.base_gb + self.model_gb + self.steps[self.peak_step]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "steps": self.steps, "peak_step": self.peak_step, "peak_gb": self.peak_gb}

    def basis(self) -> str:
        step = self.steps[self.peak_step]
        return (
            f"{self.base_gb:.1f} process + {self.model_gb:.1f} host model + {step:.1f} at {self.peak_step} "
            "(computed; measured on CPU at reduced depth; the compiler's own RAM not counted, unverified)"
        )

    def summary(self) -> str:
        return (
            f"compile host: {self.variant} ({self.recipe}, TP={self.tp}): ~{self.peak_gb:.0f} GB peak = {self.basis()}"
        )


@functools.lru_cache(maxsize=64)
def _counts(name: str, tp: int, overrides_key: tuple, context_length: int) -> dict[str, int]:
    """Element counts (meta device) of the host model, a rank's shard, the NxD checkpoint and a
    rank's K/V states at `context_length` (ring K/V)."""

    from ..tp.plan import REPLICATE, ROW, make_plan
    from ..tp.shard import RANK_KEY, shard_state_dict
    from .params import count_params, meta_model

    variant = get_variant(name)
    lm = meta_model(variant, overrides=overrides_key)
    counts = count_params(lm)
    plan = make_plan(lm.config, tp, variant)
    shard = {k: t.numel() for k, t in shard_state_dict(lm, plan, 0).items() if k != RANK_KEY}
    checkpoint = sum(n if plan.rule(k).kind == REPLICATE else n * tp for k, n in shard.items())
    copied = sum(n for k, n in shard.items() if tp > 1 and plan.rule(k).kind == ROW)
    kv = int(plan.rank_layout().buffer_bytes(context_length, True, 1, 1))
    return {
        "model": counts.total + sum(b.numel() for b in lm.buffers()),
        "shard": sum(shard.values()),
        "checkpoint": checkpoint,
        "copied": copied,
        "kv": kv,
        "device": int(counts.lm_head + counts.other + counts.experts),
    }


def compile_host_plan(
    variant: Variant | str,
    tp: int | None = None,
    recipe: str | None = None,
    *,
    dtype_bytes: int = 2,
    context_length: int = COMPILE_CONTEXT,
    layer_overrides: dict[str, Any] | None = None,
    keys: int = KEYS,
) -> CompileHostPlan:
    """The compile host's plan of `variant` at `tp` (default: its recipe's) with `recipe` (default:
    the variant's) and `keys` ModelBuilder keys (a prefill key per bucket + decode); `layer_overrides`
    plans a reduced-depth model (how the plan is checked against a measurement on a machine that
    cannot hold the released one)."""
    from .serving_host import PROCESS_BASE_GB

    v = get_variant(variant) if isinstance(variant, str) else variant
    tp = int(tp or v.tp_degree)
    recipe = recipe or v.recipe
    key = tuple(sorted((k, tuple(x) if isinstance(x, list) else x) for k, x in (layer_overrides or {}).items()))
    c = _counts(v.name, tp, key, int(context_length))
    return CompileHostPlan(
        v.name,
        tp,
        recipe,
        PROCESS_BASE_GB,
        c["model"] * dtype_bytes / GB,
        (c["shard"] + c["kv"]) * dtype_bytes / GB,
        c["copied"] * dtype_bytes / GB,
        c["checkpoint"] * dtype_bytes / GB,
        c["device"] * dtype_bytes / GB,
        int(keys),
    )
