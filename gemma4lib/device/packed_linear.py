"""oneDNN-packed linears for batched decode graphs built to run on one CPU thread (`cpu`, `eager`).

Why: a decode step of B rows multiplies `[B, in]` by every `[out, in]` weight. From about four
rows on, one thread's small-M product of the plain layout stops being bound by bytes and runs at a
fifth of its GEMM rate; oneDNN's packed linear (`mkldnn._reorder_linear_weight` once,
`mkldnn._linear_pointwise` per call; the ops Inductor's own freezing pass emits) lays the weight out
in its kernel's blocked format ahead of time and measured 1.45-1.7x the plain layout's tok/s at
B = 4-16 (MKL's packed sgemm was slower at every B, and larger). So a graph packs its linears only
where arithmetic, not bytes, bounds the step: rows x 2 FLOP per weight element >= the thread's FLOPs
per byte x the element's bytes (the balance `experts.read_form` uses too). Batch-1 graphs never
pack, nor do weights below 2^18 elements (oneDNN's per-call cost outweighs the layout there, so the
tiny fixtures never pack), nor 2-3 rows (a batch-2 decode, a short verify: still bound by bytes).
The figures: docs/ROOFLINE.md ("CPU: where a decode step's time goes", "CPU: batch 2", "CPU: packed
linears").

At two and three rows, which product streams the weights once depends on the CPU: on the 2026-12-02
machine `x @ W.T` cost 1.09x / 1.18x an M = 1 pass at M = 2 / 3 (medium-dense's linears) and the
weight-left `(W @ x.T).T` 2.1x; on the 2026-12-06 one (AVX512) `x @ W.T` cost 1.8-2.1x / 2.6-3.1x and
weight-left 0.85x / 1.3x (one thread, 24 weights of 3072 x 1024 fp32; there main's B = 2 step ran
no faster than B = 1 while the weight-left code of 2026-12-02 ran it at 2x: docs/ROOFLINE.md "Batch
2"). So the form is measured
once per process (`left_is_faster`), and those graphs run weight-left (`WeightLeftLinear`) only where
it is clearly faster; the program, and its cache key, follow the form.

The cost is memory: a packed graph holds a second copy of its linears' weights. The packed tensor
is re-derived from the model's current weight whenever a compiled package is handed its weights
(`compile_cpu.load_weights` calls `repack_all`): one compile still serves every model of an
architecture. Only fp32 weights pack, only where this was measured (x86-64 with oneDNN). The XLA
and Neuron graphs never pack: their compute balance is None (bytes decide).
"""

from __future__ import annotations

import functools
import logging
import platform
import time

import torch
from torch import nn

log = logging.getLogger(__name__)

FORM = "onednn-packed"
LEFT = "weight-left"
MEASURED_ON = ("x86_64", "AMD64")
PACK_MIN_ELEMENTS = 1 << 18  # smaller weights run no faster packed (module docstring)


def available() -> bool:
    """Whether this machine runs oneDNN's packed linear where it was measured (x86-64)."""
    return (
        platform.machine() in MEASURED_ON
        and bool(torch.backends.mkldnn.is_available())
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def packs(rows: int, dtype: torch.dtype, flop_per_byte: float | None) -> bool:
    """Whether a graph of `rows` tokens per call should pack its fp32 linears (module docstring)."""
    if flop_per_byte is None or dtype != torch.float32 or rows < 2 or not available():
        return False
    return 2.0 * rows >= flop_per_byte * torch.finfo(dtype).bits / 8


@functools.cache
def left_is_faster(rows: int) -> bool:
    """Whether one thread here runs `(W @ x.T).T` in under 0.8x the time of `x @ W.T` at `rows` rows:
    timed once per process, best of five, over eight 3072 x 1024 fp32 weights (96 MiB, past the caches)."""
    weights, x, threads = [torch.randn(3072, 1024) for _ in range(8)], torch.randn(rows, 1024), torch.get_num_threads()

    def best(product) -> float:
        times = []
        for _ in range(5):
            started = time.perf_counter()
            for w in weights:
                product(w)
            times.append(time.perf_counter() - started)
        return min(times)

    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            plain, left = best(lambda w: x @ w.T), best(lambda w: (w @ x.T).T)
    finally:
        torch.set_num_threads(threads)
    log.info("%d rows on one thread: x @ W.T %.1f ms, (W @ x.T).T %.1f ms", rows, plain * 1e3, left * 1e3)
    return left < 0.8 * plain


def weight_left(rows: int, dtype: torch.dtype, flop_per_byte: float | None) -> bool:
    """Whether a graph of `rows` tokens per call runs its large fp32 linears weight-left: more than one
    row, still bound by bytes (not packed), on one CPU thread, and measured faster here (module docstring)."""
    if flop_per_byte is None or dtype != torch.float32 or rows < 2 or packs(rows, dtype, flop_per_byte):
        return False
    return left_is_faster(rows)


class WeightLeftLinear(nn.Module):
    """A bias-free linear computed as `(W @ x.T).T` over the model's own weight (registered under the
    same name, so a compiled package takes it at load time like the plain linear's)."""

    def __init__(self, linear: nn.Module):
        super().__init__()
        if getattr(linear, "bias", None) is not None:
            raise ValueError("WeightLeftLinear covers bias-free linears (every Gemma-4 projection is one)")
        self.weight = linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        return torch.mm(self.weight, flat.t()).t().reshape(*x.shape[:-1], self.weight.shape[0])


def maybe_weight_left(linear: nn.Module) -> nn.Module:
    """`linear` as a `WeightLeftLinear` when its weight is large enough to gain, else itself."""
    return WeightLeftLinear(linear) if linear.weight.numel() >= PACK_MIN_ELEMENTS else linear


class PackedLinear(nn.Module):
    """A bias-free linear whose product runs on oneDNN's packed copy of `weight` for `rows` rows.

    `packed` is oneDNN's opaque blocked copy, a parameter so that a compiled package takes it at
    load time instead of folding it into its program. `weight` is the model's own parameter, read
    only to re-derive `packed` from, and deliberately not registered here: a parameter the program
    never reads would count as folded into it (`compile_cpu.cache_package`), and its values would
    then key the artifact, one compile per model instead of one per architecture."""

    def __init__(self, linear: nn.Module, rows: int):
        super().__init__()
        if getattr(linear, "bias", None) is not None:
            raise ValueError("PackedLinear covers bias-free linears (every Gemma-4 projection is one)")
        object.__setattr__(self, "_source", linear)  # not a submodule (above)
        self.rows = rows
        self.packed = nn.Parameter(self._pack(), requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        """The model's own weight this linear packs."""
        return self._source.weight

    def _pack(self) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), self.rows)

    @torch.no_grad()
    def repack(self) -> None:
        """Re-derive `packed` from the current `weight`. A new tensor, not a copy into the old one:
        the packed weight is an opaque (oneDNN) tensor, which `copy_` into corrupts."""
        self.packed = nn.Parameter(self._pack(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


def maybe_pack(linear: nn.Module, rows: int) -> nn.Module:
    """`linear` as a `PackedLinear` for `rows` rows if its weight is large enough to gain, else itself."""
    if linear.weight.numel() < PACK_MIN_ELEMENTS:
        return linear
    return PackedLinear(linear, rows)


def repack_all(module: nn.Module) -> int:
    """Re-derive every `PackedLinear` in `module` from its current weight; how many there were."""
    packed = [m for m in module.modules() if isinstance(m, PackedLinear)]
    for m in packed:
        m.repack()
    return len(packed)
