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
measured on real-width E2B at reduced depth (`docs/measurements/compile_host_e2b.json`). The trace recipe
(`inline_weights_to_neff=False`): the host model plus one copy of the device weights.

The compiler's own RAM (`compiler_gb`, planned when the buckets are given): neuronx-cc runs one process per
key, and NxD's `trace` compiles the priority key (decode) first, then every other key at once in a thread
pool, so its peak is max(priority, sum of the rest). Assumed, as no measurement pins a law: a key's compiler
RAM is proportional to its attention multiply-accumulates per rank (query rows x K/V slots read x head_dim,
summed over layers: the part of a graph that grows with the context). The one sourced fact calibrates it
(`COMPILER_CALIBRATION`): NxD Inference's open 31B port compiles 8,192 on an inf2.48xlarge (TP = 16, 768 GiB)
and runs out of host RAM at 16K, its context encoding attending a whole bucket in every layer (no chunked
prefill in NxDI 2.28). The coefficient is the largest that lets 8K fit (all 768 GiB taken by the compiler);
the 16K failure says only that it is at least a quarter of that. Computed, unverified on inf2; torch-neuronx's
HLO generation is not counted.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from ..device.kv_layout import SLIDING, KVLayout
from ..models.variants import Variant, get_variant
from .hardware import GB, GIB, INSTANCES

KEYS = 2  # the ModelBuilder recipe's keys with one prefill bucket: prefill and decode
COMPILE_CONTEXT = 2048  # the K/V states the modules hold (memory_plan.DEFAULT_CONTEXT)
COMPILER_CALIBRATION = {
    "variant": "31b",
    "tp": 16,
    "fits": 8192,
    "fails": 16384,
    "instance": "inf2.48xlarge",
    "source": "NxD Inference's open 31B port reaches seq_len 8,192 on an inf2.48xlarge (TP = 16) and runs out "
    "of host RAM compiling 16K (issue 48; DESIGN.md section 3)",
}


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
    compiler_gb: float = 0.0  # neuronx-cc's processes while the keys compile (planned with buckets only)

    @property
    def steps(self) -> dict[str, float]:
        if self.recipe != "model_builder":
            return {"trace (device weights separated)": self.device_gb}
        return {
            "trace (the keys' modules" + (" + neuronx-cc)" if self.compiler_gb else ")"): self.keys * self.rank_gb
            + self.compiler_gb,
            "shard_checkpoint": self.checkpoint_gb + (self.keys - 1) * self.rank_gb + self.written_gb,
        }

    @property
    def peak_step(self) -> str:
        return max(self.steps, key=self.steps.get)

    @property
    def peak_gb(self) -> float:
        return self.base_gb + self.model_gb + self.steps[self.peak_step]

    def basis(self) -> str:
        step = self.steps[self.peak_step]
        return f"{self.base_gb:.1f} process + {self.model_gb:.1f} host model + {step:.1f} at {self.peak_step} " + (
            f"(of which {self.compiler_gb:.1f} neuronx-cc: assumed proportional to attention work, "
            "calibrated on NxD Inference's 31B compiles; unverified)"
            if self.compiler_gb
            else "(computed; measured on CPU at reduced depth; the compiler's own RAM not counted, unverified)"
        )


@functools.lru_cache(maxsize=64)
def _counts(name: str, tp: int, overrides_key: tuple) -> tuple[dict[str, int], KVLayout]:
    """Element counts (meta device) of the host model, a rank's shard and the NxD checkpoint, and a
    rank's K/V layout."""

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
    return {
        "model": counts.total + sum(b.numel() for b in lm.buffers()),
        "shard": sum(shard.values()),
        "checkpoint": checkpoint,
        "copied": copied,
        "device": int(counts.lm_head + counts.other + counts.experts),
    }, plan.rank_layout()


@functools.lru_cache(maxsize=16)
def _layout(name: str) -> KVLayout:
    from .params import meta_model

    return KVLayout.from_config(meta_model(name).config)


def attention_macs(variant: Variant | str, tp: int, tokens: int, reads: int, ring: bool = True) -> int:
    """Attention multiply-accumulates (Q K^T) of one rank's graph: `tokens` query rows over `reads` K/V
    slots in every global layer, the window and the rows themselves in a sliding one when `ring`."""
    layout = _layout(get_variant(variant).name if isinstance(variant, str) else variant.name)
    heads, window = layout.num_attention_heads // tp, layout.sliding_window
    return sum(
        heads * tokens * (min(reads, window + tokens) if ring and lay.layer_type == SLIDING else reads) * lay.head_dim
        for lay in layout.layers
    )


def compiler_bytes_per_mac(least: bool = False) -> float:
    """Host bytes of neuronx-cc per attention MAC of a key: the largest `COMPILER_CALIBRATION` allows
    (`least`: the least, the RAM over the failed compile's work)."""
    c = COMPILER_CALIBRATION
    length = c["fails" if least else "fits"]
    return INSTANCES[c["instance"]].host_ram_gib * GIB / attention_macs(c["variant"], c["tp"], length, length, False)


def compile_keys(context: int, prefill_buckets: tuple[int, ...], context_buckets: tuple[int, ...] = ()) -> list:
    """(tokens, K/V slots read) of every ModelBuilder key, the priority decode key first: decode and
    each prefill bucket at `context`, and again at each smaller context bucket a bucket fits (`device.build`)."""
    reads = [context, *(c for c in context_buckets if c < context)]
    return [(1, c) for c in reads] + [(b, c) for c in reads for b in prefill_buckets if b <= c]


def compiler_gb(variant: Variant | str, tp: int, keys: list, ring: bool = True, least: bool = False) -> float:
    """neuronx-cc's planned peak host RAM (GB) compiling `keys` (`compile_keys`): module docstring."""
    macs = [attention_macs(variant, tp, tokens, reads, ring) for tokens, reads in keys]
    return compiler_bytes_per_mac(least) * max(macs[0], sum(macs[1:])) / GB


def compile_host_plan(
    variant: Variant | str,
    tp: int | None = None,
    recipe: str | None = None,
    *,
    dtype_bytes: int = 2,
    context_length: int = COMPILE_CONTEXT,
    layer_overrides: dict[str, Any] | None = None,
    keys: int = KEYS,
    prefill_buckets: tuple[int, ...] = (),
    context_buckets: tuple[int, ...] = (),
    least: bool = False,
) -> CompileHostPlan:
    """The compile host's plan of `variant` at `tp` (default: its recipe's) with `recipe` (default:
    the variant's) and `keys` ModelBuilder keys (a prefill key per bucket + decode); `layer_overrides`
    plans a reduced-depth model (how the plan is checked against a measurement on a machine that
    cannot hold the released one); with `prefill_buckets` the keys are those of the buckets (`compile_keys`)
    and the compiler's own RAM is planned (`compiler_gb`; `least`: at the least coefficient its source allows)."""
    from .serving_host import PROCESS_BASE_GB

    v = get_variant(variant) if isinstance(variant, str) else variant
    tp = int(tp or v.tp_degree)
    recipe = recipe or v.recipe
    key = tuple(sorted((k, tuple(x) if isinstance(x, list) else x) for k, x in (layer_overrides or {}).items()))
    c, layout = _counts(v.name, tp, key)
    kv = layout.buffer_bytes(int(context_length), True, 1)
    listed = compile_keys(int(context_length), tuple(prefill_buckets), tuple(context_buckets))
    compiler = compiler_gb(v, tp, listed, least=least) if prefill_buckets and recipe == "model_builder" else 0.0
    return CompileHostPlan(
        v.name,
        tp,
        recipe,
        PROCESS_BASE_GB,
        c["model"] * dtype_bytes / GB,
        (c["shard"] + kv) * dtype_bytes / GB,
        c["copied"] * dtype_bytes / GB,
        c["checkpoint"] * dtype_bytes / GB,
        c["device"] * dtype_bytes / GB,
        max(len(listed), int(keys)) if prefill_buckets else int(keys),
        compiler,
    )
