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

Ceilings: on CPU from this machine's measured single-thread bandwidth (`measure_bandwidth`); on
inf2 from HBM bandwidth (`hardware.INSTANCES`). `compare()` is what the notebooks' benchmark cells
call; `plots.measured_vs_ceiling()` draws its rows.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from ..device.experts import EXPERT_SPLITS, default_expert_split
from ..device.kv_layout import KVLayout
from ..device.quant import LINEAR_WEIGHT_NAME
from ..errors import UnknownNameError
from .hardware import GB, GIB, INSTANCES, Inf2Instance  # noqa: F401  (re-exported for callers)


# ---- bytes per decode step ----------------------------------------------------------------------
@dataclass
class ParamCounts:
    """Parameter counts by how a decode step reads them."""

    lm_head: int  # tied word embeddings: read whole by the LM head every step
    ple_table: int  # host-only tables: the PLE token table (and untied word embeddings)
    experts: int  # MoE expert weights (all experts)
    other: int  # everything else on the device (attention, dense MLP, norms, router, PLE projections)
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate: int = 0  # per expert
    linear: int = 0  # the part of `other` int8 applies to (attention and dense-MLP projections)
    linear_rows: int = 0  # their output channels: one int8 scale each
    expert_rows: int = 0  # output channels of all experts' weights (E * (2I + H) per layer)

    @property
    def total(self) -> int:
        return self.lm_head + self.ple_table + self.experts + self.other

    def read_fraction(self, experts: str = "dense", tp: int = 1, expert_split: str | None = None) -> float:
        """The share of the expert weights one decode step reads, summed over `tp` ranks
        (`device_params`): 1 for dense, k / E (or tp * k / E under the expert split) for selective."""
        if not self.experts:
            return 0.0
        return (self.device_params(experts, tp, expert_split) - self.lm_head - self.other) / self.experts

    def device_bytes(
        self,
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
        params = self.device_params(experts, tp, expert_split)
        if weight_format != "int8":
            return params * dtype_bytes
        share = self.read_fraction(experts, tp, expert_split)
        full = (self.lm_head + self.other - self.linear) * dtype_bytes
        return full + self.linear + 4 * self.linear_rows + share * (self.experts + 4 * self.expert_rows)

    def expert_split(self, tp: int = 1, expert_split: str | None = None) -> str | None:
        """The split a TP plan uses at `tp` (`experts.default_expert_split` unless given); None
        for a dense model."""
        if not self.num_experts:
            return None
        if expert_split is not None:
            if expert_split not in EXPERT_SPLITS:
                raise UnknownNameError("expert_split", expert_split, EXPERT_SPLITS)
            return expert_split
        return default_expert_split(self.num_experts, self.moe_intermediate, max(1, tp))

    def device_params(self, experts: str = "dense", tp: int = 1, expert_split: str | None = None) -> float:
        """Parameters read per decode step, summed over `tp` ranks (fractional for selective experts).

        Selective experts read `top_k / num_experts` of the expert weights on one device, and on
        TP ranks that each hold a 1/tp slice of every expert (`expert_split="intermediate"`, the
        default where it divides): each rank gathers k slices of 1/tp of an expert, k experts in
        all. On ranks that each hold `num_experts / tp` whole experts (`"experts"`), a static
        `top_k` slices are gathered on *every* rank, routed there or not
        (`tp.layers.ShardedExperts`), so the ranks together read `tp * top_k` expert slices:
        fewer bytes than dense only while `top_k < num_experts / tp`."""
        if experts not in ("dense", "selective"):
            raise UnknownNameError("experts form", experts, ("dense", "selective"))
        read_experts = self.experts
        if experts == "selective" and self.num_experts:
            split = self.expert_split(tp, expert_split)
            slices = self.top_k * (max(1, tp) if split == "experts" else 1)
            read_experts = self.experts * slices / self.num_experts  # repeats count, as gathers read
        return self.lm_head + self.other + read_experts


def count_params(lm: nn.Module) -> ParamCounts:
    """Classify the parameters of a `*ForCausalLM` (real, random or on the meta device)."""
    head = lm.lm_head.weight
    embed = lm.model.embed_tokens.weight
    lm_head = head.numel()
    ple = experts = other = linear = linear_rows = expert_rows = 0
    for name, param in lm.named_parameters():  # tied tensors appear once
        if param is head:
            continue
        if param is embed or "embed_tokens_per_layer" in name:  # untied embeddings: a host lookup too
            ple += param.numel()
        elif ".experts." in name:
            experts += param.numel()
            expert_rows += param.numel() // param.shape[-1]
        else:
            other += param.numel()
            if LINEAR_WEIGHT_NAME.search(name):
                linear += param.numel()
                linear_rows += param.shape[0]
    config = lm.config
    moe = bool(getattr(config, "enable_moe_block", False))
    return ParamCounts(
        lm_head,
        ple,
        experts,
        other,
        int(getattr(config, "num_experts", 0) or 0) if moe else 0,
        int(getattr(config, "top_k_experts", 0) or 0) if moe else 0,
        int(getattr(config, "moe_intermediate_size", 0) or 0) if moe else 0,
        linear,
        linear_rows,
        expert_rows,
    )


def meta_model(variant: Any, which: str = "real") -> nn.Module:
    """A variant's `*ForCausalLM` on the meta device: real shapes, no memory (cached per variant)."""
    from ..models.variants import get_variant

    variant = get_variant(variant) if isinstance(variant, str) else variant
    return _meta_model(variant.name, which)


@functools.lru_cache(maxsize=16)
def _meta_model(name: str, which: str) -> nn.Module:
    from ..models.loading import _text_classes, text_config
    from ..models.variants import get_variant

    variant = get_variant(name)
    config = text_config(variant, which)
    _, lm_cls = _text_classes(variant)
    with torch.device("meta"):
        return lm_cls(config)


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


# ---- this machine's bandwidth ------------------------------------------------------------------
def measure_bandwidth(size_mb: int = 512, repeats: int = 7, threads: int | None = 1) -> dict[str, Any]:
    """Single-thread read bandwidth of this machine, two ways, on a buffer far past the caches.

    - `gemv`: fp32 matrix-vector product (`torch.mv`), the kernel shape of a batch-1 decode;
    - `stream`: a plain sum over the same buffer.
    Medians after one warm-up. `bandwidth_bytes_s` is the larger of the two (the stricter ceiling).
    """
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        cols = 4096
        rows = max(1, size_mb * 2**20 // (4 * cols))
        matrix = torch.randn(rows, cols)
        vector = torch.randn(cols)
        nbytes = matrix.numel() * 4

        def timed(fn) -> float:
            fn()
            runs = []
            for _ in range(repeats):
                started = time.perf_counter()
                fn()
                runs.append(time.perf_counter() - started)
            return statistics.median(runs)

        with torch.no_grad():
            gemv_s = timed(lambda: torch.mv(matrix, vector))
            stream_s = timed(lambda: matrix.sum())
    finally:
        torch.set_num_threads(previous)
    gemv, stream = nbytes / gemv_s, nbytes / stream_s
    return {
        "gemv_gb_s": gemv / GB,
        "stream_gb_s": stream / GB,
        "bandwidth_bytes_s": max(gemv, stream),
        "basis": "gemv" if gemv >= stream else "stream",
        "buffer_mb": nbytes / 2**20,
        "threads": threads or previous,
        "repeats": repeats,
    }


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

    `device`: "cpu" (pass `bandwidth_bytes_s`, or this machine's is measured now) or an inf2
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
            bandwidth_bytes_s = measure_bandwidth()["bandwidth_bytes_s"]
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


def rows_from_report(report: dict[str, Any], path: str = "gemma4lib") -> list[dict[str, Any]]:
    """`compare()`-shaped rows for every model of a `benchmarks.suite.run_suite` report (one path)."""
    rows = []
    for model in report.get("models", []):
        measured = model["paths"].get(path, {}).get("decode_tok_s")
        rows.append(
            {
                "label": model["name"],
                "device": "cpu",
                "measured_tok_s": measured,
                "ceiling_tok_s": model["ceiling_tok_s"],
                "roofline_fraction": model["roofline_fraction"].get(path),
                "bandwidth_gb_s": model["bandwidth"]["gb_s"],
                "bytes_per_step": model["bytes_per_step"],
            }
        )
    return rows


# ---- the inf2 table (docs/ROOFLINE.md) ------------------------------------------------------------
def inf2_table(
    contexts: Iterable[int] = (2048, 8192), variants: Iterable[str] | None = None, dtype_bytes: int = 2
) -> list[dict[str, Any]]:
    """Per variant, per experts form and KV form: bf16 bytes/token and the tok/s ceiling on each
    instance (all its cores) and on the recipe's own instance at its TP degree; the recipe's
    bytes and ceiling again with weight-only int8 (`int8_recipe_*`; K/V stays bf16).

    MoE selective rows come once per expert split the recipe's TP degree allows, the plan's
    default first (the intermediate split for the 26B-A4B at TP=8) and the expert split after it
    for comparison; only the recipe columns differ between them (the rest is the ideal, k routed
    experts' bytes)."""
    from ..models.variants import VARIANTS, get_variant

    rows = []
    for name in variants or VARIANTS:
        variant = get_variant(name)
        lm = meta_model(variant)
        counts = count_params(lm)
        tp = variant.tp_degree
        forms: list[tuple[str, str | None]] = [("dense", counts.expert_split(tp))]
        if counts.num_experts:
            forms += [("selective", split) for split in _splits_at(counts, tp)]
        for context in contexts:
            for ring in (False, True):
                for form, split in forms:
                    shape = dict(context_length=context, ring=ring, experts=form, dtype_bytes=dtype_bytes)
                    steps = decode_bytes(lm, **shape)
                    on_ranks = decode_bytes(lm, **shape, tp=tp, expert_split=split)
                    int8_on_ranks = decode_bytes(lm, **shape, tp=tp, expert_split=split, weight_format="int8")
                    recipe_instance = INSTANCES[variant.instance_type]
                    row = {
                        "variant": variant.name,
                        "context_length": context,
                        "kv": "ring" if ring else "full",
                        "experts": steps.experts_form,
                        "expert_split": split,
                        "weights_gb": steps.weights / GB,
                        "kv_gb": steps.kv / GB,
                        "total_gb": steps.total / GB,
                        "recipe": f"{variant.instance_type} TP={tp}",
                        "recipe_gb": on_ranks.total / GB,
                        "recipe_ceiling_tok_s": ceiling_tok_s(on_ranks.total, recipe_instance.bandwidth_bytes_s(tp)),
                        # weight-only int8 (computed from shapes, unmeasured on inf2): same recipe and cores
                        "int8_recipe_gb": int8_on_ranks.total / GB,
                        "int8_recipe_ceiling_tok_s": ceiling_tok_s(
                            int8_on_ranks.total, recipe_instance.bandwidth_bytes_s(tp)
                        ),
                        "ceiling_tok_s": {},
                        "fits_hbm": {},
                    }
                    # resident: ALL weights (every expert) + KV, whatever the read form
                    resident = counts.device_params("dense") * dtype_bytes + steps.kv
                    for inst in INSTANCES.values():
                        row["ceiling_tok_s"][inst.name] = ceiling_tok_s(steps.total, inst.hbm_bytes_s)
                        row["fits_hbm"][inst.name] = resident <= inst.hbm_gib * GIB
                    rows.append(row)
    return rows


def _splits_at(counts: ParamCounts, tp: int) -> list[str]:
    """The expert splits possible at `tp`, the plan's default first."""
    default = counts.expert_split(tp)
    possible = [
        s for s, n in (("intermediate", counts.moe_intermediate), ("experts", counts.num_experts)) if n and n % tp == 0
    ]
    return [default] + [s for s in possible if s != default] if default else possible


_SPLIT_LABEL = {"experts": "expert", "intermediate": "intermediate"}


def format_inf2_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown for `inf2_table` rows."""
    names = list(INSTANCES)
    head = (
        "| variant | ctx | KV | experts | weights GB | KV GB | total GB | recipe reads GB | recipe ceiling tok/s | "
        "int8: recipe reads GB | int8: recipe ceiling tok/s | " + " | ".join(names) + " |"
    )
    lines = [head, "|" + "---|" * (11 + len(names))]
    for r in rows:
        cells = [f"{r['ceiling_tok_s'][n]:.0f}" if r["fits_hbm"][n] else "–" for n in names]
        experts = r["experts"]
        if experts == "selective" and r.get("expert_split"):
            experts += f" ({_SPLIT_LABEL.get(r['expert_split'], r['expert_split'])} split)"
        lines.append(
            f"| {r['variant']} | {r['context_length']} | {r['kv']} | {experts} | {r['weights_gb']:.2f} | "
            f"{r['kv_gb']:.3f} | {r['total_gb']:.2f} | {r['recipe_gb']:.2f} | "
            f"{r['recipe_ceiling_tok_s']:.0f} ({r['recipe']}) | {r['int8_recipe_gb']:.2f} | "
            f"{r['int8_recipe_ceiling_tok_s']:.0f} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


# ---- one prefill pass on inf2 (computed) --------------------------------------------------------
@dataclass
class PrefillEstimate:
    """The floor of one bucketed prefill call on inf2, from FLOP and byte counts (computed, never
    measured): the matmuls at the chip's datasheet bf16 peak, the weights and K/V read once at the
    cores' HBM bandwidth, whichever takes longer. Collectives, the host's embedding lookup and the
    call overhead are left out, so a measurement can only be slower."""

    variant: str
    tokens: int
    tp: int
    instance: str
    flops: float
    bytes: float
    compute_ms: float
    memory_ms: float
    stepwise_ms: float | None  # the same prompt as one-token decode steps at the field report's tok/s

    @property
    def expected_ms(self) -> float:
        return max(self.compute_ms, self.memory_ms)

    @property
    def bound(self) -> str:
        return "compute" if self.compute_ms >= self.memory_ms else "memory"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "expected_ms": self.expected_ms, "bound": self.bound}


def prefill_flops(lm: nn.Module, tokens: int, context_length: int, ring: bool = True) -> float:
    """FLOPs of one prefill call of `tokens` tokens (batch 1), as the prefill graph computes them:
    every device matmul for every token (MoE experts all, the prefill form is dense), the LM head for
    the last token only, and each layer's attention over its keys (the buffer's slots; a ring layer
    attends over its old slots plus the new chunk)."""
    counts = count_params(lm)
    layout = KVLayout.from_config(lm.config)
    heads = layout.num_attention_heads
    matmul = 2.0 * tokens * (counts.other + counts.experts) + 2.0 * counts.lm_head
    attention = 0.0
    for layer in layout.layers:
        slots = layout.slots(layer.layer_type, context_length, ring)
        keys = slots + tokens if slots < context_length else slots
        attention += 4.0 * tokens * keys * heads * layer.head_dim  # QK^T and AV
    return matmul + attention


def prefill_estimate(
    variant: Any,
    tokens: int = 128,
    *,
    tp: int | None = None,
    instance: str | None = None,
    context_length: int = 2048,
    ring: bool = True,
    dtype_bytes: int = 2,
) -> PrefillEstimate:
    """`PrefillEstimate` of `variant` (name or `Variant`; released config on the meta device) at its
    recipe's TP degree and instance unless given. Basis: `hardware.BF16_FLOPS_PER_CORE` (AWS's 190
    TFLOPS per chip over its 2 cores) and `Inf2Instance.bandwidth_bytes_s(tp)`; unverified on inf2."""
    from ..models.variants import get_variant
    from .hardware import BF16_FLOPS_PER_CORE

    v = get_variant(variant) if isinstance(variant, str) else variant
    tp = int(tp or v.tp_degree)
    inst = INSTANCES[instance or v.instance_type]
    lm = meta_model(v)
    flops = prefill_flops(lm, tokens, context_length, ring)
    steps = decode_bytes(lm, context_length=context_length, ring=ring, experts="dense", dtype_bytes=dtype_bytes)
    compute_s = flops / (BF16_FLOPS_PER_CORE * tp)
    memory_s = steps.total / inst.bandwidth_bytes_s(tp)
    decode = v.field_report.decode_tok_s
    return PrefillEstimate(
        v.name,
        int(tokens),
        tp,
        inst.name,
        flops,
        steps.total,
        compute_s * 1e3,
        memory_s * 1e3,
        tokens * 1e3 / decode if decode else None,
    )


def prefill_table(tokens: int = 128, context_length: int = 2048) -> list[dict[str, Any]]:
    """`prefill_estimate` of every variant at its recipe's TP, beside the field report's figures."""
    from ..models.variants import VARIANTS

    rows = []
    for v in VARIANTS.values():
        row = prefill_estimate(v, tokens, context_length=context_length).to_dict()
        row["field_report_prefill_ms"] = v.field_report.prefill_ms
        row["field_report_decode_tok_s"] = v.field_report.decode_tok_s
        rows.append(row)
    return rows


def format_prefill_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown for `prefill_table` rows."""
    lines = [
        "| variant | recipe | tokens | TFLOP | GB read | compute ms | memory ms | computed floor ms | "
        "field report | as decode steps (trace recipe) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        measured = f"prefill {r['field_report_prefill_ms']:.0f} ms" if r["field_report_prefill_ms"] else "–"
        if r["field_report_decode_tok_s"]:
            measured = f"decode {r['field_report_decode_tok_s']:.0f} tok/s" if measured == "–" else measured
        # the trace recipe (one core only) feeds the prompt through the decode graph, one step a token
        stepwise = f"{r['stepwise_ms']:,.0f} ms" if r["stepwise_ms"] and r["tp"] == 1 else "–"
        lines.append(
            f"| {r['variant']} | {r['instance']} TP={r['tp']} | {r['tokens']} | {r['flops'] / 1e12:.2f} | "
            f"{r['bytes'] / GB:.2f} | {r['compute_ms']:.1f} | {r['memory_ms']:.1f} | "
            f"{r['expected_ms']:.1f} ({r['bound']}) | {measured} | {stepwise} |"
        )
    return "\n".join(lines)
