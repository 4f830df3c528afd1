"""Decode ceilings at batch B: the weights are read once per step for all B rows, the K/V per row.

One batched decode step of B rows reads the device weights once and each row's K/V buffers, and
computes B tokens, so

    total tok/s <= min(B x bandwidth / bytes per step, B / (FLOPs per step / peak FLOP/s)).

Bytes per step at B (computed from shapes, `roofline.decode_bytes` for the batch-1 parts):
- weights: once, whatever B — except the MoE's selective experts, which this project's batched
  graph gathers **per row** (`experts.gathered_experts` with one token per row: B x k slices, a
  routed expert shared by two rows is read twice) until B x k reaches the experts a device (or
  rank) holds; from there the graph reads them densely, each once (`experts.read_form`, a static
  choice in the graph's key). So the expert bytes are min(B x k, E) slices: never more than dense.
- K/V: every row's buffers (B x the batch-1 K/V).

FLOPs per row: 2 x the weights a token multiplies by (the dense form: every expert), plus the
attention over each layer's slots (4 x slots x query heads x head_dim: scores and values).
Peak: `hardware.BF16_FLOPS_PER_CORE` x the recipe's cores. All of it computed, unverified on inf2.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gemma4lib.device.experts import read_form
from gemma4lib.device.kv_layout import KVLayout
from gemma4lib.inf2.hardware import BF16_FLOPS_PER_CORE, GB, INSTANCES
from gemma4lib.inf2.params import count_params, meta_model

from .roofline import decode_bytes, plan_split, read_fraction

# The field report's author, the same two-graph E2B design on an inf2.xlarge (DESIGN.md §3): total
# decode tok/s by batch size. Measured by them on inf2, not by this project.
FIELD_REPORT_E2B_BATCH_TOK_S = {1: 47.3, 4: 157.0, 16: 442.7}
BATCHES = (1, 2, 4, 8, 16, 32)


def batch_decode_bytes(
    model: Any,
    batch: int,
    *,
    context_length: int,
    ring: bool = True,
    experts: str = "dense",
    dtype_bytes: int | None = None,
    tp: int = 1,
    expert_split: str | None = None,
    experts_read: str | None = None,
) -> dict[str, float]:
    """Bytes one decode step of `batch` rows reads, as the batched graph reads them (module doc).
    `experts_read`: the form the graph runs (`DeviceGraph.experts_read`). `grouped` reads each
    routed expert once: counted at its static bound, min(B x k slices, every expert once)."""
    lm = meta_model(model) if isinstance(model, str) else getattr(model, "lm", model)
    one = decode_bytes(
        lm,
        context_length=context_length,
        ring=ring,
        experts=experts,
        dtype_bytes=dtype_bytes,
        tp=tp,
        expert_split=expert_split,
    )
    counts = count_params(lm)
    weights = one.weights
    if experts == "selective" and counts.num_experts and batch > 1:
        # k x s slices of E per row (s = tp under the expert split), all E once past the bound
        per_row = read_fraction(counts, "selective", tp, expert_split)
        read = {"selective": batch * per_row, "dense": 1.0}.get(experts_read or "", min(batch * per_row, 1.0))
        weights += (read - per_row) * counts.experts * one.dtype_bytes
    return {"weights": weights, "kv": one.kv * batch, "total": weights + one.kv * batch, "batch": float(batch)}


def batch_read_form(
    model: Any, batch: int, experts: str = "dense", tp: int = 1, expert_split: str | None = None
) -> str:
    """The expert form a batched decode graph of `batch` rows runs for the asked `experts` form
    (`experts.read_form`; batch 1 always runs the form asked for): "none" for a dense model."""
    lm = meta_model(model) if isinstance(model, str) else getattr(model, "lm", model)
    counts = count_params(lm)
    if not counts.num_experts:
        return "none"
    split = plan_split(counts, tp, expert_split)
    held = counts.num_experts // tp if split == "experts" else counts.num_experts
    return experts if batch == 1 else read_form(experts, batch, counts.top_k, held)


def decode_flops_per_row(model: Any, *, context_length: int, ring: bool = True, experts: str = "dense") -> float:
    """FLOPs of one row's decode token: its matmuls (module doc) and attention over every slot."""
    lm = meta_model(model) if isinstance(model, str) else getattr(model, "lm", model)
    counts = count_params(lm)
    layout = KVLayout.from_config(lm.config)
    expert_params = counts.experts * (counts.top_k / counts.num_experts if experts == "selective" else 1.0)
    matmul = 2.0 * (counts.other + counts.lm_head + (expert_params if counts.num_experts else 0))
    attention = sum(
        4.0 * layout.slots(layer.layer_type, context_length, ring) * layout.num_attention_heads * layer.head_dim
        for layer in layout.layers
    )
    return matmul + attention


def batch_ceilings(
    variant: Any,
    batches: Iterable[int] = BATCHES,
    *,
    context_length: int = 2048,
    ring: bool = True,
    experts: str | None = None,
    dtype_bytes: int = 2,
) -> list[dict[str, Any]]:
    """Per batch size: bytes per step (bf16 unless `dtype_bytes`), the memory and compute ceilings
    and their minimum, on the variant's recipe (its instance, its TP degree's cores). `experts`:
    default selective for a MoE."""
    from gemma4lib.models.variants import get_variant

    v = get_variant(variant) if isinstance(variant, str) else variant
    lm = meta_model(v)
    counts = count_params(lm)
    form = experts or ("selective" if counts.num_experts else "dense")
    tp, inst = v.tp_degree, INSTANCES[v.instance_type]
    bandwidth, peak = inst.bandwidth_bytes_s(tp), BF16_FLOPS_PER_CORE * tp
    flops = decode_flops_per_row(lm, context_length=context_length, ring=ring, experts=form)
    field = FIELD_REPORT_E2B_BATCH_TOK_S if v.name == "e2b" else {}
    rows = []
    for b in batches:
        shape = dict(context_length=context_length, ring=ring, dtype_bytes=dtype_bytes, tp=tp)
        steps = batch_decode_bytes(lm, b, experts=form, **shape)
        memory = b * bandwidth / steps["total"]
        compute = peak / flops  # b rows in b x flops: the compute ceiling does not move with b
        row = {
            "variant": v.name,
            "recipe": f"{v.instance_type} TP={tp}",
            "batch": b,
            "experts": form if counts.num_experts else "none",
            "experts_read": batch_read_form(lm, b, form, tp),
            "context_length": context_length,
            "kv": "ring" if ring else "full",
            "bytes_per_step_gb": steps["total"] / GB,
            "memory_ceiling_tok_s": memory,
            "compute_ceiling_tok_s": compute,
            "ceiling_tok_s": min(memory, compute),
            "bound": "memory" if memory <= compute else "compute",
            "field_report_tok_s": field.get(b),
            "basis": "computed from shapes and datasheet bandwidth/FLOPs; unverified on inf2",
        }
        if form == "selective":
            dense = batch_decode_bytes(lm, b, experts="dense", **shape)
            row["dense_bytes_per_step_gb"] = dense["total"] / GB
        rows.append(row)
    return rows
