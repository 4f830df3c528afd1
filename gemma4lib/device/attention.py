"""The device graph's attention: transformers' eager math with the query heads grouped per K/V head.

transformers' eager attention repeats every K/V head for its group of query heads (`repeat_kv`),
so decode is a matrix-vector product per head, which Inductor on CPU fuses into one scalar C++ loop
(~4 GFLOP/s on one core; docs/ROOFLINE.md). Folding the group into the rows instead, `[kv_heads,
groups * tokens, d] x [kv_heads, d, slots]`, reads every K/V head once and gives a real matrix
product per K/V head, which Inductor hands to its GEMM library. Same numbers, same ops (reshape,
matmul, add, softmax): nothing a Neuron or XLA compiler cannot trace.

Query head `h` belongs to K/V head `h // groups`, the order `repeat_kv` uses. The group size comes
from the tensors, not the module, so a TP rank's shard (its own head counts) works unchanged.
Registered in transformers' `AttentionInterface` as `GROUPED`; `DeviceGraph` points its own clones
of the attention modules at it through `graph_config`, without touching the host model.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import AttentionInterface

from ..errors import GraphFormError, UnknownNameError

GROUPED = "gemma4lib_grouped"
EAGER = "eager"
FORMS = (GROUPED, EAGER)  # the first is the graphs' default


def grouped_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float | int = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`eager_attention_forward`'s contract and numbers, with each K/V head's query group as rows.

    query `[b, q_heads, t, d]`, key `[b, kv_heads, s, d]`, value `[b, kv_heads, s, dv]`, mask
    broadcastable to `[b, q_heads, t, s]`. Returns `([b, t, q_heads, dv], weights [b, q_heads, t, s])`.
    """
    if scaling is None:
        scaling = module.head_dim**-0.5
    b, q_heads, t, d = query.shape
    kv_heads, slots = key.shape[1], key.shape[2]
    if q_heads % kv_heads:
        raise GraphFormError(
            f"grouped attention needs query heads ({q_heads}) to be a multiple of K/V heads ({kv_heads}); "
            f"build the graph with attention={EAGER!r} for this layout"
        )
    groups = q_heads // kv_heads
    rows = query.reshape(b, kv_heads, groups * t, d)
    scores = torch.matmul(rows, key.transpose(2, 3)).view(b, q_heads, t, slots) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    out = torch.matmul(weights.reshape(b, kv_heads, groups * t, slots), value)
    out = out.view(b, q_heads, t, value.shape[-1]).transpose(1, 2).contiguous()
    return out, weights


AttentionInterface.register(GROUPED, grouped_attention_forward)


def graph_config(config, form: str):
    """A copy of `config` whose attention modules call attention `form`; `config` itself is untouched.

    Sets the private field, not the `_attn_implementation` property, whose setter would also
    rewrite sub-configs the copy still shares with the host model.
    """
    if form not in FORMS:
        raise UnknownNameError("attention form", form, FORMS)
    copied = copy.copy(config)
    copied._attn_implementation_internal = form
    return copied
