"""Weight-only int8: per-output-channel symmetric scales, dequantized inside the device graph.

Why weight-only: batch-1 decode reads every weight once per token, so its speed is bytes per
token. The linear layers' weights (attention projections, dense MLP, MoE experts) are stored as
int8 with `scale = max|row| / 127` per output channel (each row of the last dimension), clamped to
[-127, 127]; activations, K/V, embeddings (tied LM head), norms and the router stay as they are.

`Int8Linear` casts, multiplies, then scales the output, the order NxD's quantized layers use. One
token (decode) is a multiply-and-sum over the weight rows, not `linear`: Inductor fuses the cast
into that reduction and reads the int8 bytes once, where `linear(x, q.to(dtype))` writes a
dequantized copy first (measured 10x slower). Prompts (compute-bound) keep `linear`.

Checks: a quantized graph is judged against *its own* host reference, the HF model with every
quantized weight replaced by `q * scale` (`round_model_weights`); quantizing those again gives the
same int8 values, so SEQ_MATCH stays exact. Figures and the error against full precision:
docs/ROOFLINE.md, "int8 weights".
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
