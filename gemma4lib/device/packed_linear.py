"""MKL-packed linears for batched decode graphs built to run on one CPU thread (`cpu`, `eager`).

Why: a decode step of B rows multiplies `[B, in]` by every `[out, in]` weight. From about four
rows on, one thread's small-M product of the plain layout stops being bound by bytes and runs at
25-37 GFLOP/s, a fifth of its GEMM rate (docs/ROOFLINE.md, "where a decode step's time goes").
MKL's packed sgemm (`mkl._mkl_reorder_linear_weight` once, `mkl._mkl_linear` per call; the ops
Inductor's own freezing pass emits) lays the weight out for its kernel ahead of time and measured
1.4-1.6x faster at B = 4-16 on a stack of 1024 x 3072 linears, compiled with AOTInductor (one
process, interleaved), and 0.9x at B = 1, where the packed copy's extra bytes (it is ~1.7x the
weight) cost more than the layout saves. So a graph packs its linears only where arithmetic, not
bytes, bounds the step: rows x 2 FLOP per weight element >= the thread's FLOPs per byte x the
element's bytes (the balance `experts.read_form` uses too). Batch-1 graphs never pack.

The packed tensor is derived from the weight, so it is recomputed from the model's current weight
whenever a compiled package is handed its weights (`compile_cpu.load_weights` calls `repack`):
one compile still serves every model of an architecture. Only fp32 weights pack (MKL's sgemm),
only on a torch built with MKL (x86); elsewhere the plain layout runs. The XLA and Neuron graphs
never pack: their compute balance is None (bytes decide).
"""

from __future__ import annotations

import torch
from torch import nn

FORM = "mkl-packed"


def available() -> bool:
    """Whether this torch has MKL's packed sgemm (x86 builds with MKL)."""
    return bool(torch.backends.mkl.is_available()) and hasattr(torch.ops.mkl, "_mkl_linear")


def packs(rows: int, dtype: torch.dtype, flop_per_byte: float | None) -> bool:
    """Whether a graph of `rows` tokens per call should pack its fp32 linears (module docstring)."""
    if flop_per_byte is None or dtype != torch.float32 or rows < 2 or not available():
        return False
    return 2.0 * rows >= flop_per_byte * torch.finfo(dtype).bits / 8


class PackedLinear(nn.Module):
    """A bias-free linear whose product runs on MKL's packed copy of `weight` for `rows` rows.

    `weight` is the model's own parameter (shared, not copied); `packed` is MKL's opaque packed
    copy, a parameter so that a compiled package takes it at load time instead of folding it into
    its program."""

    def __init__(self, linear: nn.Module, rows: int):
        super().__init__()
        if getattr(linear, "bias", None) is not None:
            raise ValueError("PackedLinear covers bias-free linears (every Gemma-4 projection is one)")
        self.weight = linear.weight
        self.rows = rows
        self.packed = nn.Parameter(self._pack(), requires_grad=False)

    def _pack(self) -> torch.Tensor:
        return torch.ops.mkl._mkl_reorder_linear_weight(self.weight.detach(), self.rows)

    @torch.no_grad()
    def repack(self) -> None:
        """Re-derive `packed` from the current `weight`. A new tensor, not a copy into the old one:
        the packed weight is an opaque (MKL-DNN) tensor, and `copy_` into it corrupts it."""
        self.packed = nn.Parameter(self._pack(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkl._mkl_linear(x, self.packed, self.weight, None, self.rows)


def repack_all(module: nn.Module) -> int:
    """Re-derive every `PackedLinear` in `module` from its current weight; how many there were."""
    packed = [m for m in module.modules() if isinstance(m, PackedLinear)]
    for m in packed:
        m.repack()
    return len(packed)
