"""One prefill pass on inf2, computed: FLOPs of a prompt pass and the time the NeuronCores' peak allows.

Prefill is compute-bound where decode is memory-bound; these figures are computed from shapes and
the hardware table (`hardware.INSTANCES`), never measured here, and say so where they are shown
(docs/ROOFLINE.md).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from torch import nn

from gemma4lib.device.kv_layout import KVLayout
from gemma4lib.inf2.hardware import BF16_FLOPS_PER_CORE, INSTANCES
from gemma4lib.inf2.params import count_params, meta_model
from gemma4lib.models.variants import get_variant

from .roofline import decode_bytes


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
