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
  ranks that each hold whole experts (the expert split), see `ParamCounts.device_params`.
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

from gemma4lib.device.kv_layout import KVLayout
from gemma4lib.errors import SettingsError, UnknownNameError
from gemma4lib.inf2.hardware import GB, GIB, INSTANCES, Inf2Instance  # noqa: F401  (re-exported for callers)
from gemma4lib.inf2.params import count_params, meta_model

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
    `weight_format="int8"`: weight-only int8 (`ParamCounts.device_bytes`); K/V at `dtype_bytes`.

    `tp`: the ranks the step is sharded over. Only selective experts depend on it, and only under
    the expert split (`expert_split`, default: the TP plan's; see `ParamCounts.device_params`);
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
    params = counts.device_params(experts, tp, expert_split)
    return DecodeBytes(
        weights=float(counts.device_bytes(experts, tp, expert_split, dtype_bytes, weight_format)),
        kv=float(layout.buffer_bytes(context_length, ring, dtype_bytes, batch)),
        experts_form=experts if counts.num_experts else "none",
        ring=ring,
        context_length=context_length,
        dtype_bytes=dtype_bytes,
        params_read=params,
        kv_full_length=float(layout.buffer_bytes(context_length, False, dtype_bytes, batch)),
        tp=tp,
        expert_split=counts.expert_split(tp, expert_split),
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
