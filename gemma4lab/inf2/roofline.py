"""The memory roofline of batch-1 decode: bytes read per token, and the tok/s ceiling they allow.

A batch-1 decode step reads every weight it uses once and the K/V buffers it attends over; it does
almost no arithmetic per byte, so its speed is capped at

    tok/s <= memory bandwidth / bytes read per step.

Bytes per step are computed from shapes, never measured:

- weights: every parameter that lives on the device. The word-embedding table counts once, as the
  tied LM head that reads all of it (the host only looks up one row); the PLE token table stays on
  the host and is not counted. MoE experts: all of them for the `dense` form, only the routed
  top-k for the `selective` form: k / num_experts of the expert weights on one device and on TP
  ranks that each hold a slice of every expert (the intermediate split); k slices *per rank* on
  ranks that each hold whole experts (the expert split), see `device_params`.
- KV: every K/V buffer as allocated — a full-length buffer is read whole each step, masked or not;
  a ring buffer of a sliding layer holds `sliding_window` slots.
- `weight_format="int8"` (`quant.py`): the attention and dense-MLP linears and the experts at one
  byte per weight plus one fp32 scale per output channel; the tied LM head, norms, router and PLE
  projections stay at `dtype_bytes`. The K/V stays at `dtype_bytes` too.

Ceilings: on CPU from the bandwidth the caller measured (the lab's `gemma4lab.inf2.bandwidth`);
on inf2 from HBM bandwidth (`hardware.INSTANCES`). Parameter counts are `params`, one prefill pass
on inf2 (computed FLOPs) is `prefill`. `compare()` is what the notebooks' benchmark cells
call; `plots.measured_vs_ceiling()` draws its rows.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from gemma4lib.device.experts import EXPERT_SPLITS, default_expert_split
from gemma4lib.device.kv_layout import KVLayout
from gemma4lib.errors import SettingsError, UnknownNameError
from gemma4lib.inf2.hardware import GB, GIB, INSTANCES, Inf2Instance  # noqa: F401  (re-exported for callers)
from gemma4lib.inf2.params import ParamCounts, count_params, meta_model

# ---- what a decode step reads of a model's parameters (`params.ParamCounts`) ---------------------


def plan_split(counts: ParamCounts, tp: int = 1, expert_split: str | None = None) -> str | None:
    """The expert split a TP plan uses at `tp` (`experts.default_expert_split` unless given); None
    for a dense model."""
    if not counts.num_experts:
        return None
    if expert_split is not None:
        if expert_split not in EXPERT_SPLITS:
            raise UnknownNameError("expert_split", expert_split, EXPERT_SPLITS)
        return expert_split
    return default_expert_split(counts.num_experts, counts.moe_intermediate, max(1, tp))


def device_params(counts: ParamCounts, experts: str = "dense", tp: int = 1, expert_split: str | None = None) -> float:
    """Parameters read per decode step, summed over `tp` ranks (fractional for selective experts:
    `top_k / num_experts` of the expert weights on one device or under the intermediate split,
    `tp * top_k` whole-expert slices under the expert split; `tp.plan`'s rules)."""
    if experts not in ("dense", "selective"):
        raise UnknownNameError("experts form", experts, ("dense", "selective"))
    read_experts = counts.experts
    if experts == "selective" and counts.num_experts:
        split = plan_split(counts, tp, expert_split)
        slices = counts.top_k * (max(1, tp) if split == "experts" else 1)
        read_experts = counts.experts * slices / counts.num_experts  # repeats count, as gathers read
    return counts.lm_head + counts.other + read_experts


def read_fraction(counts: ParamCounts, experts: str = "dense", tp: int = 1, expert_split: str | None = None) -> float:
    """The share of the expert weights one decode step reads, summed over `tp` ranks
    (`device_params`): 1 for dense, k / E (or tp * k / E under the expert split) for selective."""
    if not counts.experts:
        return 0.0
    return (device_params(counts, experts, tp, expert_split) - counts.lm_head - counts.other) / counts.experts


def weight_bytes(
    counts: ParamCounts,
    experts: str = "dense",
    tp: int = 1,
    expert_split: str | None = None,
    dtype_bytes: int = 2,
    weight_format: str = "bf16",
) -> float:
    """Weight bytes read per decode step, summed over `tp` ranks. `weight_format="int8"`: the
    quantized weights at one byte each plus a 4-byte scale per output channel (`quant.py`).
    Scales are counted once: on TP ranks a row-parallel weight's scales (o_proj, down_proj)
    are replicated per rank, which this leaves out (under 5 % of those weights' bytes even for
    the 26B-A4B's 88-wide expert slices at TP=8, under 2 % of a step)."""
    params = device_params(counts, experts, tp, expert_split)
    if weight_format != "int8":
        return params * dtype_bytes
    share = read_fraction(counts, experts, tp, expert_split)
    full = (counts.lm_head + counts.other - counts.linear) * dtype_bytes
    return full + counts.linear + 4 * counts.linear_rows + share * (counts.experts + 4 * counts.expert_rows)


# ---- bytes per decode step ----------------------------------------------------------------------


@dataclass
class DecodeBytes:
    """Bytes one batch-1 decode step reads."""

    weights: float
    kv: float
    experts_form: str
    ring: bool
    context_length: int
    dtype_bytes: int
    params_read: float
    kv_full_length: float  # the same buffers at full length, for comparison
    tp: int = 1
    expert_split: str | None = None  # MoE on TP ranks: "intermediate" | "experts"
    weight_format: str = "bf16"  # "int8": quantized linears and experts (quant.py)

    @property
    def total(self) -> float:
        return self.weights + self.kv

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total": self.total}


def decode_bytes(
    model: Any,
    *,
    context_length: int,
    ring: bool = True,
    experts: str = "dense",
    dtype_bytes: int | None = None,
    batch: int = 1,
    tp: int = 1,
    expert_split: str | None = None,
    weight_format: str = "bf16",
) -> DecodeBytes:
    """Bytes per decode step of `model`: a `LoadedModel`, a `*ForCausalLM`, or a variant name
    (its released config, counted on the meta device; bf16 unless `dtype_bytes` says otherwise).
    `weight_format="int8"`: weight-only int8 (`weight_bytes`); K/V at `dtype_bytes`.

    `tp`: the ranks the step is sharded over. Only selective experts depend on it, and only under
    the expert split (`expert_split`, default: the TP plan's; see `device_params`);
    K/V heads replicated across ranks are not counted twice."""
    if isinstance(model, str):
        lm = meta_model(model)
        dtype_bytes = dtype_bytes or 2
    else:
        lm = getattr(model, "lm", model)
        if dtype_bytes is None:
            dtype_bytes = next(lm.parameters()).element_size()
    counts = count_params(lm)
    layout = KVLayout.from_config(lm.config)
    params = device_params(counts, experts, tp, expert_split)
    return DecodeBytes(
        weights=float(weight_bytes(counts, experts, tp, expert_split, dtype_bytes, weight_format)),
        kv=float(layout.buffer_bytes(context_length, ring, dtype_bytes, batch)),
        experts_form=experts if counts.num_experts else "none",
        ring=ring,
        context_length=context_length,
        dtype_bytes=dtype_bytes,
        params_read=params,
        kv_full_length=float(layout.buffer_bytes(context_length, False, dtype_bytes, batch)),
        tp=tp,
        expert_split=plan_split(counts, tp, expert_split),
        weight_format=weight_format,
    )


def ceiling_tok_s(bytes_per_step: float, bandwidth_bytes_s: float) -> float:
    return bandwidth_bytes_s / bytes_per_step


# ---- measured vs ceiling (notebooks) -------------------------------------------------------------
def compare(
    measured_tok_s: float,
    model: Any,
    *,
    device: str = "cpu",
    bandwidth_bytes_s: float | None = None,
    context_length: int = 2048,
    ring: bool = True,
    experts: str = "dense",
    cores: int | None = None,
    dtype_bytes: int | None = None,
    expert_split: str | None = None,
) -> dict[str, Any]:
    """Measured decode tok/s next to its roofline ceiling.

    `device`: "cpu" (with `bandwidth_bytes_s`, this machine's as measured) or an inf2
    instance name (HBM bandwidth of `cores` NeuronCores, all when None). `expert_split`: the TP
    plan's MoE split on those cores (default: the plan's default).
    """
    tp = 1 if device == "cpu" or cores is None else int(cores)
    steps = decode_bytes(
        model,
        context_length=context_length,
        ring=ring,
        experts=experts,
        dtype_bytes=dtype_bytes,
        tp=tp,
        expert_split=expert_split,
    )
    if device == "cpu":
        if bandwidth_bytes_s is None:
            raise SettingsError(
                "compare(device='cpu') needs bandwidth_bytes_s: measure it with "
                "gemma4lab.inf2.bandwidth.measure_bandwidth()['bandwidth_bytes_s']"
            )
    else:
        if device not in INSTANCES:
            raise UnknownNameError("device", device, ["cpu", *sorted(INSTANCES)])
        bandwidth_bytes_s = bandwidth_bytes_s or INSTANCES[device].bandwidth_bytes_s(cores)
    ceiling = ceiling_tok_s(steps.total, bandwidth_bytes_s)
    return {
        "device": device,
        "measured_tok_s": measured_tok_s,
        "ceiling_tok_s": ceiling,
        "roofline_fraction": (measured_tok_s / ceiling) if measured_tok_s else None,
        "bandwidth_gb_s": bandwidth_bytes_s / GB,
        "bytes_per_step": steps.to_dict(),
    }
