"""Static-shape forms of the Gemma-4 MoE expert block.

transformers' eager experts loop over the experts a batch happens to hit: a data-dependent
Python loop that no tracer can capture. Static replacements, same parameters, same math:

- `dense`: every token through every expert, weighted by the routed top-k weights (zero for the
  others). Reads all expert weights every step; the expert dimension splits cleanly across ranks.
- `selective`: gather the k routed experts' weight slices per token, then batched matmuls. Reads
  only k experts' weights: the decode form.

A batch of B rows gathers B x k slices, a routed expert that two rows share read twice; from B x k
= the experts held on, `read_form` picks a form that reads each expert at most once (the graph's
`experts_read`, in its cache key): `grouped` on a CPU target (the rows sorted by expert, each routed
expert read once for its rows; torch.export traces the per-expert counts as unbacked sizes, which
AOTInductor runs), `dense` on static-shape targets (xla, neuron).
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import GraphFormError, UnknownNameError
from ..settings import EXPERT_FORMS

# How tensor-parallel ranks share the experts (`tp.plan.MoEPlan`):
# - "experts": rank r holds E/tp whole experts. Static shapes make every rank gather k slices per
#   token, routed to it or not, so the ranks together read tp * k experts' bytes.
# - "intermediate": rank r holds a 1/tp slice (along the expert's intermediate dimension) of
#   every expert. The k slices a rank gathers are exactly its share of the k routed experts, so
#   the ranks together read k experts' bytes, and no rank needs to know which rank it is.
EXPERT_SPLITS = ("experts", "intermediate")


# One CPU thread's FLOPs per byte of read bandwidth, for `packed_linear`: its small-M matmuls run
# ~20-35 GFLOP/s against ~15 GB/s stream on the shared 2-core machine
# (docs/measurements/profile_decode_medium-dense.json, `small_m`). Measured, rounded, and fixed: it
# picks a program, so it must not move from run to run.
CPU_THREAD_FLOP_PER_BYTE = 2.0
# the forms a graph runs: the ones asked for, and `grouped`, which `read_form` alone picks
READ_FORMS = (*EXPERT_FORMS, "grouped")


def read_form(form: str, rows: int, top_k: int, experts_held: int, grouped: bool = False) -> str:
    """The form a graph of `rows` tokens per call runs when `form` is asked for (module doc): below
    rows x k = `experts_held` `selective`'s rows x k slices are the static bound on distinct experts,
    and `grouped`'s loop over every held expert cost more than it saved (medium-moe, one thread, B = 2
    and 4: 1.15x and 1.17x HF against 1.39x and 1.33x per row); from there each expert once, `grouped`
    where the target runs data-dependent sizes, else `dense`."""
    if form != "selective" or rows < 2 or not experts_held or rows * top_k < experts_held:
        return form  # not experts_held: a dense model
    return "grouped" if grouped else "dense"


def default_expert_split(num_experts: int, intermediate: int, tp: int) -> str | None:
    """The split a plan uses when none is asked for: "intermediate" when the expert intermediate
    size divides by `tp` (the selective decode then reads k experts' bytes over all ranks, not
    tp * k), else "experts" when the expert count does, else None (no even split)."""
    if tp >= 1 and intermediate and intermediate % tp == 0:
        return "intermediate"
    if tp >= 1 and num_experts and num_experts % tp == 0:
        return "experts"
    return None


class StaticExperts(nn.Module):
    """Drop-in for `Gemma4TextExperts.forward(hidden, top_k_index, top_k_weights)`.

    `int8=True` holds the expert weights as int8 with one scale per output channel
    (`quant.quantize`: `gate_up_scale [E, 2I]`, `down_scale [E, H]`), applied after each product."""

    def __init__(self, experts: nn.Module, form: str = "dense", int8: bool = False):
        super().__init__()
        if form not in READ_FORMS:
            raise UnknownNameError("expert form", form, READ_FORMS)
        self.form = form
        self.num_experts = experts.num_experts
        self.act_fn = experts.act_fn
        self.gate_up_scale: torch.Tensor | None = None
        self.down_scale: torch.Tensor | None = None
        if int8:
            from .quant import quantize

            for name in ("gate_up_proj", "down_proj"):
                q, scale = quantize(getattr(experts, name))
                setattr(self, name, nn.Parameter(q, requires_grad=False))
                setattr(self, name.replace("_proj", "_scale"), nn.Parameter(scale, requires_grad=False))
        else:
            self.gate_up_proj = experts.gate_up_proj  # [E, 2I, H], shared with the HF module
            self.down_proj = experts.down_proj  # [E, H, I]

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        if self.form == "dense":
            return self._dense(hidden, top_k_index, top_k_weights)
        if self.form == "grouped":
            weights = (self.gate_up_proj, self.down_proj)
            scales = {"gate_up_scale": self.gate_up_scale, "down_scale": self.down_scale}
            return grouped_experts(*weights, hidden, top_k_index, top_k_weights, self.act_fn, **scales)
        return self._selective(hidden, top_k_index, top_k_weights)

    def _dense(self, hidden, top_k_index, top_k_weights):
        # routing weight per (token, expert), zero where the expert was not chosen
        weights = torch.zeros(hidden.shape[0], self.num_experts, dtype=top_k_weights.dtype, device=hidden.device)
        weights = weights.scatter(1, top_k_index, top_k_weights)
        gate_up = torch.einsum("nh,eih->nei", hidden, _as(self.gate_up_proj, hidden.dtype))
        if self.gate_up_scale is not None:
            gate_up = gate_up * self.gate_up_scale.to(gate_up.dtype)
        gate, up = gate_up.chunk(2, dim=-1)
        out = torch.einsum("nei,ehi->neh", self.act_fn(gate) * up, _as(self.down_proj, hidden.dtype))
        if self.down_scale is not None:
            out = out * self.down_scale.to(out.dtype)
        return torch.einsum("neh,ne->nh", out, weights.to(out.dtype))

    def _selective(self, hidden, top_k_index, top_k_weights):
        return gathered_experts(
            self.gate_up_proj,
            self.down_proj,
            hidden,
            top_k_index,
            top_k_weights,
            self.act_fn,
            gate_up_scale=self.gate_up_scale,
            down_scale=self.down_scale,
        )


def gathered_experts(
    gate_up: torch.Tensor,
    down: torch.Tensor,
    hidden: torch.Tensor,
    index: torch.Tensor,
    weights: torch.Tensor,
    act_fn,
    *,
    down_expert_dim: int = 0,
    gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """sum_j weights[:, j] * expert_{index[:, j]}(hidden): only the k routed experts' slices are read.

    `gate_up` [E, 2I, H]; `down` [E, H, I], or with `down_expert_dim=1` [H, E, I] (a tensor-parallel
    rank's row-parallel shard [H, E*I] viewed per expert without moving it); `index`, `weights`
    [tokens, k]. One token (decode) takes a gather-multiply-reduce, which a compiler fuses into one
    pass over the k routed slices (AOTInductor reads each once; index_select + bmm reads them ~3x;
    measured ~1.4x faster on the MoE medium config's expert block).

    Every gather indexes the *leading* dimension of the stored weight (or of a reshape of it, which
    moves no bytes), so each gathered slice is contiguous memory. Anything else costs a copy of the
    whole weight per step under XLA: a permuted view lowers to a transpose before the gather, and
    XLA's gather canonicalisation transposes the whole operand of a gather along an inner
    dimension (seen in XLA:CPU's optimised HLO). `tools.hlo_audit` flags both.

    int8 weights (`quant`): pass their per-output-channel scales, `gate_up_scale [E, 2I]` and
    `down_scale [E, H]` (`down_expert_dim=0` only); the k routed experts' scales are gathered with
    their weights and applied after each product."""
    if down_expert_dim not in (0, 1):
        raise UnknownNameError("down_expert_dim", down_expert_dim, ("0 ([E, H, I])", "1 ([H, E, I])"))
    if down_scale is not None and down_expert_dim != 0:
        raise GraphFormError("int8 expert scales are supported for the [E, H, I] down layout: pass down_expert_dim=0")
    n, k = index.shape
    flat = index.reshape(-1)
    dtype = hidden.dtype
    if down_expert_dim == 1:
        down_slices = _gather_inner_experts(down, flat)  # [n*k, H, I]
    if n == 1:
        x = hidden[0]
        gate_up_k = (_as(gate_up[flat], dtype) * x).sum(-1)  # [k, 2I]
        if gate_up_scale is not None:
            gate_up_k = gate_up_k * gate_up_scale[flat].to(dtype)
        gate, up = gate_up_k.chunk(2, dim=-1)  # [k, I] each
        inner = act_fn(gate) * up
        down_k = down[flat] if down_expert_dim == 0 else down_slices  # [k, H, I]
        out = (_as(down_k, dtype) * inner.unsqueeze(1)).sum(-1)  # [k, H]
        if down_scale is not None:
            out = out * down_scale[flat].to(dtype)
        return (out * weights[0].to(out.dtype).unsqueeze(-1)).sum(0, keepdim=True)
    gate_up_w = _as(gate_up.index_select(0, flat), dtype)  # [n*k, 2I, H]
    down_w = _as(down.index_select(0, flat) if down_expert_dim == 0 else down_slices, dtype)  # [n*k, H, I]
    x = hidden.repeat_interleave(k, dim=0).unsqueeze(-1)  # [n*k, H, 1]
    gate_up_nk = torch.bmm(gate_up_w, x).squeeze(-1)  # [n*k, 2I]
    if gate_up_scale is not None:
        gate_up_nk = gate_up_nk * gate_up_scale.index_select(0, flat).to(dtype)
    gate, up = gate_up_nk.chunk(2, dim=-1)
    out = torch.bmm(down_w, (act_fn(gate) * up).unsqueeze(-1)).squeeze(-1)  # [n*k, H]
    if down_scale is not None:
        out = out * down_scale.index_select(0, flat).to(dtype)
    out = out.view(n, k, -1) * weights.to(out.dtype).unsqueeze(-1)
    return out.sum(dim=1)


def grouped_experts(
    gate_up: torch.Tensor,
    down: torch.Tensor,
    hidden: torch.Tensor,
    index: torch.Tensor,
    weights: torch.Tensor,
    act_fn,
    *,
    gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`gathered_experts`' sum with each routed expert's weights read once: the (token, slot) pairs
    sorted by expert, one product per expert over the rows routed to it. The per-expert counts are
    data: torch.export traces them as unbacked sizes (a CPU target's form, never a static one's).
    Experts nobody routed to run a zero-row product, which reads nothing."""
    n, k = index.shape
    flat = index.reshape(-1)
    order = flat.argsort(stable=True)
    tokens = order // k  # the token of each pair, expert-major
    x, dtype = hidden.index_select(0, tokens), hidden.dtype
    pair_weights = weights.reshape(-1)[order].to(dtype).unsqueeze(-1)
    # counts per expert, [E] whatever the data (bincount's length is max(id) + 1)
    counts = (flat.unsqueeze(1) == torch.arange(gate_up.shape[0], device=flat.device)).sum(0).tolist()
    # each expert adds into the output itself: no tensor is sized by a sum of counts (AOTInductor's
    # wrapper then referenced a count before declaring it). The products are weight-left, (W @ x.T).T:
    # x @ W.T re-reads W per row at 2-4 rows (an expert's usual count), ~2x slower on one thread
    out, start = torch.zeros_like(hidden), 0
    for e, count in enumerate(counts):
        torch._check(count >= 0)
        torch._check(start + count <= n * k)
        gate_up_e = (_as(gate_up[e], dtype) @ x.narrow(0, start, count).T).T  # [count, 2I]
        if gate_up_scale is not None:
            gate_up_e = gate_up_e * gate_up_scale[e].to(dtype)
        gate, up = gate_up_e.chunk(2, dim=-1)
        routed = (_as(down[e], dtype) @ (act_fn(gate) * up).T).T  # [count, H]
        if down_scale is not None:
            routed = routed * down_scale[e].to(dtype)
        out = out.index_add(0, tokens.narrow(0, start, count), routed * pair_weights.narrow(0, start, count))
        start = start + count
    return out


def _as(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`tensor` cast to `dtype` (int8 weights), with no cast op at all when it already is: the
    full-precision graphs keep the exact program (and cache key) they had before int8."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


def _gather_inner_experts(weight: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Slices `weight[:, e, :]` for each id in `experts` from a [H, E, I] weight: [len, H, I].

    Read as rows of its [H*E, I] reshape (row h*E + e holds weight[h, e, :]): one gather along the
    leading dimension of contiguous I-element rows, H rows per expert, no transpose of the weight.
    """
    rows_per_h, experts_total, width = weight.shape
    h = torch.arange(rows_per_h, device=weight.device) * experts_total  # [H]
    rows = (experts.unsqueeze(1) + h.unsqueeze(0)).reshape(-1)  # [len*H]: expert-major
    picked = weight.reshape(rows_per_h * experts_total, width).index_select(0, rows)
    return picked.view(experts.shape[0], rows_per_h, width)
