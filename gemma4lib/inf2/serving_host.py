"""Will the serving host's RAM hold a port? The plan of the machine that serves and checks.

On an inf2.xlarge (16 GiB) the serving host, not the cores, is the tight one: it holds the text
model in its load dtype (the host reference and the embedder's host tables), and for a while one of:
the per-rank shards read for `nxd_model.initialize`; the reference's greedy `generate`; or the logit
check's spread (`reference.logits_spread`: the reference rows in float64, every position's logits
in float32 twice and one widened LM-head block).

peak = process base + model + max(shards, reference, spread). No host K/V: the neuron backend's
device steps keep theirs on the cores (`host_kv_gb` stays in the plan, 0, for the tables' column).

Computed from the released configs (meta device): the model, the shards and the spread's tensors;
the model counts whole, since the Neuron backend reads every weight before the compile (its cache
key). Measured on the CPU lane, unverified on inf2: `PROCESS_BASE_GB` (`gemma4lab.benchmarks.host_rss
serving`). Unverified: `OS_RESERVE_GIB`, and whether the runtime drops its host copy of the shards
after `initialize` (if not, they stay on top of the model).
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import DeviceMemoryError, UnknownNameError
from ..models.variants import Variant, get_variant
from .hardware import GB, GIB, INSTANCES

# Measured on the CPU lane (python 3.11, torch 2.13, transformers 5.23, 2026-12-01): RSS after the
# checkpoint's load call with its weights still unread: 0.43-0.44 GB (benchmarks/host_rss.py).
PROCESS_BASE_GB = 0.45
OS_RESERVE_GIB = 1.0  # the OS, the Neuron runtime's host side, a shell: an allowance, unverified
PROMPT_TOKENS = 128  # the full profile's prefill bucket: the longest prompt the reference sees
NEW_TOKENS = 64  # the full profile's max_new_tokens


@dataclass(frozen=True)
class ServingHostPlan:
    """What the serving host holds for one port (GB), and whether `instance` has the RAM."""

    variant: str
    tp: int
    instance: str
    dtype_bytes: int
    layers: int
    base_gb: float
    model_gb: float
    host_tables_gb: float  # of model_gb: embeddings (+ PLE) the host embedder reads
    host_kv_gb: float
    shards_gb: float
    reference_gb: float
    spread_gb: float
    host_ram_gib: int
    os_reserve_gib: float = OS_RESERVE_GIB
    problems: tuple[str, ...] = field(default_factory=tuple)
    # of model_gb: the vision and audio parts the host's multimodal reference holds (`vision_plan`,
    # `audio_plan`; computed from transformers 5.23.0 config defaults, unverified against the released config.json)
    vision_gb: float = 0.0
    audio_gb: float = 0.0

    @property
    def transient_gb(self) -> float:
        """The largest working set on top of the model (the step that sets the peak)."""
        return self.host_kv_gb + max(self.shards_gb, self.reference_gb, self.spread_gb)

    @property
    def peak_gb(self) -> float:
        return self.base_gb + self.model_gb + self.transient_gb

    @property
    def available_gb(self) -> float:
        return (self.host_ram_gib - self.os_reserve_gib) * GIB / GB

    @property
    def fits(self) -> bool:
        return not self.problems and self.peak_gb <= self.available_gb

    @property
    def peak_step(self) -> str:
        steps = {
            "weight shards for initialize": self.shards_gb,
            "host reference": self.reference_gb,
            "logit spread": self.spread_gb,
        }
        return max(steps, key=steps.get)

    def summary(self) -> str:
        """One line, under the words "serving host"."""
        verdict = "fits" if self.fits else "does not fit"
        return (
            f"serving host: {self.variant} TP={self.tp} on {self.instance}: ~{self.peak_gb:.1f} GB peak of "
            f"{self.available_gb:.1f} GB ({self.host_ram_gib} GiB less {self.os_reserve_gib:g} GiB for the OS) = "
            f"{self.base_gb:.1f} process + {self.model_gb:.1f} model (host tables {self.host_tables_gb:.1f}"
            f"{f', vision {self.vision_gb:.2f}' if self.vision_gb else ''}"
            f"{f', audio {self.audio_gb:.2f}' if self.audio_gb else ''}) + "
            f"{self.transient_gb:.1f} at its peak step ({self.peak_step}) — {verdict}"
        )


@functools.lru_cache(maxsize=64)
def _counts(name: str, tp: int, overrides_key: tuple) -> dict[str, int]:
    """Element counts of a (possibly reduced-depth) released text model, on the meta device."""
    import torch

    from ..device.kv_layout import KVLayout
    from ..device.quant import LINEAR_WEIGHT_NAME
    from ..models.upcast import LINEAR_BLOCK_ROWS, widest_module_bytes
    from ..tp.plan import make_plan
    from ..tp.shard import RANK_KEY, shard_state_dict
    from .params import count_params, meta_model

    variant = get_variant(name)
    lm = meta_model(variant, overrides=overrides_key)
    counts = count_params(lm)
    buffers = sum(b.numel() for b in lm.buffers())
    plan = make_plan(lm.config, tp, variant)
    tensors = {k: t for k, t in shard_state_dict(lm, plan, 0).items() if k != RANK_KEY}
    shard = sum(t.numel() for t in tensors.values())
    # int8 (NxD's quantized linears): 1 byte per element + an fp32 scale per row, in bytes
    int8_linears = {k: t for k, t in tensors.items() if LINEAR_WEIGHT_NAME.search(k)}
    linear_elements = sum(t.numel() for t in int8_linears.values())
    int8_saving = linear_elements, sum(t.shape[0] for t in int8_linears.values())
    layout = KVLayout.from_config(lm.config)
    # per-token K/V elements of every producer layer at full width (HF's dynamic cache)
    kv_per_token = sum(2 * layer.kv_heads * layer.head_dim for layer in layout.producers)
    return {
        "params": counts.total,
        "buffers": buffers,
        "tables": counts.lm_head + counts.ple_table,  # token embeddings (the tied head) + PLE
        "shard": shard,
        "shard_linear": int8_saving[0],
        "shard_linear_rows": int8_saving[1],
        "kv_per_token": kv_per_token,
        "vocab": int(lm.config.vocab_size),
        "hidden": int(lm.config.hidden_size),
        "block": min(LINEAR_BLOCK_ROWS, int(lm.config.vocab_size)) * int(lm.config.hidden_size),
        "widest_fp32": widest_module_bytes(lm, torch.float32),
        "layers": int(lm.config.num_hidden_layers),
    }


def serving_host_plan(
    variant: Variant | str,
    tp: int | None = None,
    instance: str | None = None,
    *,
    context_length: int = 1024,
    ring: bool = True,
    prompt_tokens: int = PROMPT_TOKENS,
    new_tokens: int = NEW_TOKENS,
    dtype_bytes: int = 2,
    weights: str = "bf16",
    layer_overrides: dict[str, Any] | None = None,
    vision: bool = False,
    audio: bool = False,
) -> ServingHostPlan:
    """The serving host's plan for `variant` at `tp` (default: its recipe's) on `instance`
    (default: the variant's), for the full profile's shapes. `layer_overrides` (e.g.
    `num_hidden_layers`, `layer_types`) plans a reduced-depth model: how the plan is checked
    against a measurement on a machine that cannot hold the released one. `weights="int8"`: the
    shards hold the quantized linears at 1 byte plus a scale per row; the host model stays in its
    load dtype (the int8-rounded weights, `quant.round_model_weights`). `vision`: the host model is
    the multimodal one (the image reference), its vision part at the load dtype too; `audio`: its audio part."""
    v = get_variant(variant) if isinstance(variant, str) else variant
    tp = int(tp or v.tp_degree)
    instance = instance or v.instance_type
    if instance not in INSTANCES:
        raise UnknownNameError("inf2 instance", instance, INSTANCES)
    key = tuple(sorted((k, tuple(x) if isinstance(x, list) else x) for k, x in (layer_overrides or {}).items()))
    c = _counts(v.name, tp, key)
    kv = 0  # no host K/V on neuron (the module docstring)
    tokens = int(prompt_tokens) + int(new_tokens)
    from .audio_plan import audio_plan
    from .vision_plan import vision_plan

    vision_bytes = vision_plan(v, dtype_bytes=dtype_bytes).weights_gib * GIB if vision else 0.0
    audio_bytes = audio_plan(v.name, dtype_bytes).weights_gib * GIB if audio else 0.0
    model = (c["params"] + c["buffers"]) * dtype_bytes + vision_bytes + audio_bytes
    shard_bytes = c["shard"] * dtype_bytes
    if weights == "int8":
        shard_bytes += c["shard_linear"] * (1 - dtype_bytes) + 4 * c["shard_linear_rows"]
    # generate: its dynamic cache over every token, the prompt's logits (bf16, and their float32
    # copy: measured 0.21 GB at a 128-token prompt) and a few [vocab] rows per step
    reference = c["kv_per_token"] * tokens * dtype_bytes + int(prompt_tokens) * c["vocab"] * 6 + 4 * c["vocab"] * 4
    # spread: the reference rows in float64, every position's logits in float32 twice (the LM-head
    # blocks and their concatenation) and the widest of one widened LM-head block or module
    spread = (
        int(new_tokens) * c["vocab"] * 8 + 2 * (tokens - 1) * c["vocab"] * 4 + max(c["block"] * 4, c["widest_fp32"])
    )
    problems: list[str] = []
    plan = ServingHostPlan(
        v.name,
        tp,
        instance,
        dtype_bytes,
        c["layers"],
        PROCESS_BASE_GB,
        model / GB,
        c["tables"] * dtype_bytes / GB,
        kv * dtype_bytes / GB,
        shard_bytes * tp / GB,
        reference / GB,
        spread / GB,
        INSTANCES[instance].host_ram_gib,
        vision_gb=vision_bytes / GB,
        audio_gb=audio_bytes / GB,
    )
    if plan.peak_gb > plan.available_gb:
        problems.append(
            f"the serving host needs ~{plan.peak_gb:.1f} GB at its peak ({plan.peak_step}) and an {instance} "
            f"leaves {plan.available_gb:.1f} GB"
        )
    return ServingHostPlan(**{**asdict(plan), "problems": tuple(problems)})


def serving_host_options(variant: Variant | str, tp: int | None = None, **kwargs: Any) -> list[ServingHostPlan]:
    """Every inf2 size (smallest first) whose host holds the port at `tp`, and has its cores."""
    v = get_variant(variant) if isinstance(variant, str) else variant
    tp = int(tp or v.tp_degree)
    plans = [serving_host_plan(v, tp, name, **kwargs) for name, inst in INSTANCES.items() if inst.neuron_cores >= tp]
    return [p for p in plans if p.fits]


def require_serving_host(variant: Variant | str, tp: int, instance: str | None, **kwargs: Any) -> ServingHostPlan:
    """Raise `DeviceMemoryError` when the serving host cannot hold the port; the message names an
    instance that can."""
    plan = serving_host_plan(variant, tp, instance, **kwargs)
    if not plan.fits:
        options = serving_host_options(variant, tp, **kwargs)
        hint = f"serve on an {options[0].instance}" if options else "no inf2 size holds it at this TP"
        raise DeviceMemoryError(f"{plan.summary()}; {'; '.join(plan.problems)}; {hint}")
    return plan
