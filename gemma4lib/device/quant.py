"""Weight-only int8: per-output-channel symmetric scales, dequantized inside the device graph.

Why weight-only: batch-1 decode reads every weight once per token, so its speed is bytes per
token (docs/ROOFLINE.md). Storing the linear layers' weights as int8 with one fp32 scale per
output channel roughly quarters them next to fp32 (halves them next to bf16); the activations,
the K/V buffers, the embeddings (tied LM head), the norms and the MoE router stay as they are.

What is quantized: the attention projections (`q/k/v/o_proj`), the dense MLP (`gate/up/down_proj`)
and the MoE experts (`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`). For every weight the
output channel is each row of its last dimension: `scale = max|row| / 127`,
`q = round(w / scale)`, clamped to [-127, 127].

How it runs: `Int8Linear` casts the int8 weight, multiplies, and applies the per-output-channel
scale to the output, the order NxD's `QuantizedColumnParallel` / `QuantizedRowParallel` use with
a per-channel config (`scale_dequantize` after the matmul). One token (decode) is written as a
multiply-and-sum over the weight rows rather than `linear`: Inductor fuses the cast into that
reduction and reads the int8 bytes once, while `linear(x, q.to(dtype))` makes it write a
dequantized copy of the weight first and hand that to the GEMM. Measured here (8 weights of
4096 x 2048, one thread, torch.compile): fp32 linear 21.7 ms, int8 `linear` 39.8 ms, int8
multiply-and-sum 3.7 ms. Prompts (many tokens, compute-bound) keep `linear`.

Checks: a quantized model's device graph is judged against *its own* host reference, the fp32 HF
model with every quantized weight replaced by `q * scale` (`round_model_weights`). Quantizing those
rounded weights again gives back the same int8 values (`quantize` is idempotent on its own output;
tested), so SEQ_MATCH stays exact. The error int8 adds against full precision is measured
separately (`benchmarks.suite`'s `int8` section, `tests/test_quant.py`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import GraphFormError, UnknownNameError
from ..settings import WEIGHT_FORMS

log = logging.getLogger(__name__)

# `settings.WEIGHT_FORMS`: "bf16" / "fp32", the full-precision default (the backend's own dtype: bf16
# on Neuron, fp32 on CPU); "int8": weight-only int8 of the linear layers.
QMAX = 127

# Child names of a decoder layer's linears that int8 applies to, by parent module.
ATTENTION_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
# The same linears' weights by state-dict name (any prefix): the roofline's counts and the NxD checkpoint.
LINEAR_WEIGHT_NAME = re.compile(r"\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")


def check_weights(weights: str) -> str:
    """`weights` if it names a weight form, else an error that lists them."""
    if weights not in WEIGHT_FORMS:
        raise UnknownNameError("weights form", weights, WEIGHT_FORMS)
    return weights


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one scale per row of the last dimension: (q int8, scale fp32 of shape
    `weight.shape[:-1]`). An all-zero row gets scale 1 (its q is 0 either way)."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    q = torch.round(w / scale.unsqueeze(-1)).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`q * scale` per row, as `dtype`."""
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)


def _param(tensor: torch.Tensor) -> nn.Parameter:
    # Parameters, not buffers: a compiled package takes them at load time (compile_cpu.load_weights)
    # instead of folding their values into the program and its cache key.
    return nn.Parameter(tensor, requires_grad=False)


class Int8Linear(nn.Module):
    """A bias-free linear with an int8 `weight [out, in]` and an fp32 `scale [out]`."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        if q.dtype != torch.int8 or q.dim() != 2 or scale.shape != q.shape[:1]:
            raise GraphFormError(
                f"Int8Linear needs int8 [out, in] and scale [out]; got {q.dtype} {tuple(q.shape)}: "
                "make them with quant.quantize"
            )
        self.weight = _param(q)
        self.scale = _param(scale.float())
        self.out_features, self.in_features = q.shape

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        if linear.bias is not None:
            raise GraphFormError(
                "Int8Linear covers bias-free linears (every Gemma-4 projection is one); "
                "keep this linear in full precision"
            )
        return cls(*quantize(linear.weight))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, scale = self.weight.to(x.dtype), self.scale.to(x.dtype)
        if x.numel() == x.shape[-1]:  # one token: a fused cast-multiply-reduce reads the int8 bytes once
            return (x.unsqueeze(-2) * weight).sum(-1) * scale
        return F.linear(x, weight) * scale


def target_linears(layer: nn.Module) -> Iterator[tuple[nn.Module, str]]:
    """(parent, child name) of every linear int8 applies to in one decoder layer."""
    for parent_name, names in (("self_attn", ATTENTION_LINEARS), ("mlp", MLP_LINEARS)):
        parent = getattr(layer, parent_name, None)
        for name in names:
            if parent is not None and isinstance(getattr(parent, name, None), nn.Linear):
                yield parent, name


def expert_weights(layer: nn.Module) -> Iterator[tuple[nn.Module, str]]:
    """(experts module, parameter name) of the fused expert weights of one decoder layer."""
    experts = getattr(layer, "experts", None)
    if experts is None:
        return
    for name in EXPERT_WEIGHTS:
        if isinstance(getattr(experts, name, None), torch.Tensor):
            yield experts, name


@torch.no_grad()
def round_model_weights(lm: nn.Module) -> dict[str, float]:
    """Replace, in place, every weight int8 applies to with its dequantized value `q * scale`.

    The result is the quantized model's host reference: the fp32 model whose greedy tokens the
    int8 device graph must reproduce exactly. Returns the largest relative error per weight kind
    (`max |w - q*s| / max |w|`) for the record."""
    worst: dict[str, float] = {}
    for layer in lm.model.layers:
        held = [(getattr(parent, name), name) for parent, name in target_linears(layer)]
        tensors = [(linear.weight, name) for linear, name in held]
        tensors += [(getattr(experts, name), f"experts.{name}") for experts, name in expert_weights(layer)]
        for weight, kind in tensors:
            rounded = dequantize(*quantize(weight), dtype=weight.dtype)
            error = float((weight - rounded).abs().max() / weight.abs().max().clamp_min(1e-30))
            worst[kind] = max(worst.get(kind, 0.0), error)
            weight.copy_(rounded)
    log.info("int8 rounding: largest relative weight error %s", worst)
    return worst
