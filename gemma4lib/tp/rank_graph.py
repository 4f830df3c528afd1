"""The rank graph: `DeviceGraph` with its linears swapped for rank-local shards.

One rank graph is built (and, on inf2, compiled) once and serves every rank: nothing in it depends
on which rank runs it except the weights it is loaded with and the int32 rank parameter
`spmd_rank.rank` that comes with them. It is built from the *config*, on the meta device, with
only the rank-local layers allocated at shard size, so building it never needs the full model in
memory (what a ModelBuilder `module_cls` must do for the 31B). Then a shard from
`shard.shard_state_dict` is loaded into it.

What changes relative to the reference, per decoder layer (on shallow clones; the HF modules are
never touched):
- attention: `q_proj`/`k_proj`/`v_proj` become column shards, `o_proj` a row shard (all-reduced),
  `num_key_value_groups` the rank-local Q-per-KV count. transformers' own attention forward runs
  unchanged: it reshapes with -1 heads.
- MLP: `gate_proj`/`up_proj` column, `down_proj` row.
- MoE experts: `layers.ShardedExperts`, cut by the plan's `expert_split`, in the graph's
  `expert_form` (`tp.plan`'s rules). The form belongs to the graph, not the module: `with_shape`
  graphs share their modules, so a dense prefill and a selective decode run over one set of
  weights (the rank graph sets the form each forward).
- `layer_scalar`: a buffer in transformers, a parameter here, so a compiled graph takes it from the
  checkpoint like any weight instead of freezing its init value.
- lm_head: column shard over the vocabulary, all-gathered.

`baked_rank=True` builds the deliberately broken variant from the field report (README): the MoE reads the
rank as a Python int while the graph is built (it is 0 then: the single compiled rank), so every
rank weights rank 0's experts (dense) or offsets the routed expert ids by rank 0's (selective).
Only the expert split reads the rank; asking for the bug under the intermediate split is an error.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from ..device.experts import EXPERT_FORMS
from ..device.graph import DeviceGraph, GraphShape, _shallow_clone
from ..errors import UnknownNameError
from .layers import Collectives, ColumnShard, RowShard, ShardedExperts, SPMDRankParam
from .plan import COLUMN, TPPlan


class CpuParallelFactory:
    """Makes the rank-local layers for CPU execution (ours). The Neuron recipe has an NxD twin.

    Sizes are the *total* (unsharded, or for replicated KV the expanded) feature counts, as NxD's
    parallel linears take them; each layer keeps 1/tp of them.
    """

    def __init__(self, tp: int, collectives: Collectives | None = None, dtype: torch.dtype = torch.float32):
        self.tp, self.dtype = tp, dtype
        self.collectives = collectives or Collectives()

    def column(self, in_features: int, out_features_total: int, gather: bool = False) -> nn.Module:
        return ColumnShard(
            in_features, out_features_total, self.tp, gather=gather, collectives=self.collectives, dtype=self.dtype
        )

    def row(self, in_features_total: int, out_features: int) -> nn.Module:
        return RowShard(in_features_total, out_features, self.tp, collectives=self.collectives, dtype=self.dtype)

    def replicated(self, in_features: int, out_features: int) -> nn.Module:
        linear = nn.Linear(in_features, out_features, bias=False, dtype=self.dtype)
        linear.weight.requires_grad_(False)
        return linear

    def rank_module(self) -> nn.Module:
        return SPMDRankParam(self.tp)

    def all_reduce(self, x: torch.Tensor, row: nn.Module) -> torch.Tensor:
        """The sum over ranks that `row` (a row-parallel layer this factory made) applies."""
        return row.collectives.all_reduce(x)


class _Recording:
    """Wraps a layer factory and remembers every module it made."""

    def __init__(self, factory: Any):
        self.factory, self.made = factory, []
        self.tp, self.dtype = factory.tp, factory.dtype

    def _keep(self, module: nn.Module) -> nn.Module:
        self.made.append(module)
        return module

    def column(self, *args, **kwargs):
        return self._keep(self.factory.column(*args, **kwargs))

    def row(self, *args, **kwargs):
        return self._keep(self.factory.row(*args, **kwargs))

    def replicated(self, *args, **kwargs):
        return self._keep(self.factory.replicated(*args, **kwargs))

    def rank_module(self):
        return self._keep(self.factory.rank_module())

    def all_reduce_for(self, row: nn.Module):
        """`x -> factory.all_reduce(x, row)`, or None for a factory without one (then the experts
        fall back to `row.collectives`)."""
        reduce = getattr(self.factory, "all_reduce", None)
        return None if reduce is None else (lambda x: reduce(x, row))


class RankGraph(DeviceGraph):
    """`DeviceGraph` for one rank of a `TPPlan`; same inputs and outputs, rank-local KV buffers."""

    def __init__(
        self,
        text_model: nn.Module,
        plan: TPPlan,
        shape: GraphShape,
        *,
        factory: Any,
        inplace: bool = False,
        baked_rank: bool = False,
        expert_form: str = "dense",
        chooses: bool = False,
    ):
        if expert_form not in EXPERT_FORMS:
            raise UnknownNameError("expert form", expert_form, EXPERT_FORMS)
        factory = _Recording(factory)
        hidden, vocab = plan.hidden, plan.vocab
        lm_head = (
            factory.column(hidden, vocab, gather=True) if plan.lm_head == COLUMN else factory.replicated(hidden, vocab)
        )
        layout = plan.rank_layout()
        super().__init__(text_model, lm_head, layout, shape, inplace=inplace, expert_form=expert_form, chooses=chooses)
        self.plan = plan
        self.spmd_rank = factory.rank_module()
        # The bug, when asked for: the rank read as a Python int while the graph is built.
        self.baked_rank = int(self.spmd_rank.get_rank().reshape(-1)[0]) if baked_rank else None
        self._rank_users: list[nn.Module] = []
        for layer, lp in zip(self.model.layers, plan.layers, strict=True):
            self._shard_attention(layer, lp, factory)
            self._shard_mlp(layer, lp, factory)
            if lp.moe is not None and getattr(layer, "experts", None) is not None:
                down = factory.row(lp.moe.num_experts * lp.moe.intermediate, hidden)
                experts = ShardedExperts(
                    lp.moe.num_experts,
                    hidden,
                    lp.moe.intermediate,
                    plan.tp,
                    layer.experts.act_fn,
                    gate_up=factory.column(hidden, lp.moe.num_experts * 2 * lp.moe.intermediate),
                    down=down,
                    baked_rank=self.baked_rank,
                    form=expert_form,
                    all_reduce=factory.all_reduce_for(down),
                    split=lp.moe.split,
                )
                layer.experts = experts
                self._rank_users.append(experts)
            scalar = layer._buffers.pop("layer_scalar", None)
            if scalar is not None:
                # init value (ones), as transformers' own init leaves it; the shard overwrites it
                layer.layer_scalar = nn.Parameter(torch.ones(scalar.shape, dtype=factory.dtype), requires_grad=False)
        self.dtype = factory.dtype
        moe = next((lp.moe for lp in plan.layers if lp.moe is not None), None)
        if moe is not None:  # a rank holds E/tp whole experts (expert split) or a slice of all E
            self.expert_routing = (moe.top_k, moe.experts_per_rank)
        # layers the factory made (at shard size, on the device the caller chose): `materialize`
        # leaves them alone, e.g. on the meta device while NxD only needs shapes to shard.
        self._factory_made: list[nn.Module] = factory.made

    def _shard_attention(self, layer: nn.Module, lp, factory) -> None:
        a = lp.attention
        attn = _shallow_clone(layer.self_attn)
        layer.self_attn = attn
        hidden, hd = self.plan.hidden, a.head_dim
        attn.q_proj = factory.column(hidden, a.q_heads * hd)
        attn.o_proj = factory.row(a.q_heads * hd, hidden)
        if getattr(attn, "k_proj", None) is not None:
            kv_total = a.kv_per_rank * a.tp * hd  # sharded: kv*hd; replicated: one head per rank
            attn.k_proj = factory.column(hidden, kv_total)
            if getattr(attn, "v_proj", None) is not None:
                attn.v_proj = factory.column(hidden, kv_total)
        attn.num_key_value_groups = a.kv_groups_per_rank

    def _shard_mlp(self, layer: nn.Module, lp, factory) -> None:
        mlp = _shallow_clone(layer.mlp)
        layer.mlp = mlp
        hidden = self.plan.hidden
        mlp.gate_proj = factory.column(hidden, lp.mlp_intermediate)
        mlp.up_proj = factory.column(hidden, lp.mlp_intermediate)
        mlp.down_proj = factory.row(lp.mlp_intermediate, hidden)

    def forward(self, inputs_embeds: torch.Tensor, *args: torch.Tensor):
        rank = self.spmd_rank.get_rank()  # a tensor (a loaded parameter), never a Python int
        for module in self._rank_users:
            module.current_rank = rank
            module.form = self.experts_read  # shared with `with_shape` siblings: this graph's form
        try:
            return super().forward(inputs_embeds, *args)
        finally:
            for module in self._rank_users:
                module.current_rank = None


def lm_class_for(config: Any):
    """The `*ForCausalLM` class that matches a Gemma-4 text config."""
    if "Unified" in type(config).__name__:
        from transformers.models.gemma4_unified import Gemma4UnifiedForCausalLM

        return Gemma4UnifiedForCausalLM
    from transformers import Gemma4ForCausalLM

    return Gemma4ForCausalLM


def materialize(graph: nn.Module, config: Any, dtype: torch.dtype) -> None:
    """Give every meta tensor of the skeleton (all but the factory's layers) real zero storage until a
    shard is loaded; rebuild the rotary tables from the config (non-persistent: in no checkpoint)."""
    skip = set()
    for made in getattr(graph, "_factory_made", ()):
        skip.update(id(m) for m in made.modules())
    for module in graph.modules():
        if id(module) in skip:
            continue
        for name, p in list(module._parameters.items()):
            if p is not None and p.is_meta:
                kind = dtype if p.is_floating_point() else p.dtype
                module._parameters[name] = nn.Parameter(torch.zeros(p.shape, dtype=kind), requires_grad=False)
        for name, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                module._buffers[name] = torch.zeros(b.shape, dtype=dtype if b.is_floating_point() else b.dtype)
    model = graph.model
    rotary = getattr(model, "rotary_emb", None)
    if rotary is not None:
        model.rotary_emb = type(rotary)(config)


def build_rank_graph(
    config: Any,
    plan: TPPlan,
    shape: GraphShape,
    *,
    factory: Any = None,
    collectives: Collectives | None = None,
    dtype: torch.dtype = torch.float32,
    inplace: bool = False,
    baked_rank: bool = False,
    expert_form: str = "dense",
    chooses: bool = False,
) -> RankGraph:
    """A rank graph skeleton from the config: rank-local layers at shard size, zeros elsewhere.

    Load a shard into it with `load_shard`. `factory` defaults to the CPU layers. `expert_form`:
    the MoE experts' form (`dense` | `selective`); the shard is the same for both. `chooses`: the
    decode that returns token ids (`DeviceGraph.chooses`; the all-gathered logits on every rank).
    """
    factory = factory or CpuParallelFactory(plan.tp, collectives, dtype)
    with torch.device("meta"):
        lm = lm_class_for(config)(config)
    graph = RankGraph(
        lm.model,
        plan,
        shape,
        factory=factory,
        inplace=inplace,
        baked_rank=baked_rank,
        expert_form=expert_form,
        chooses=chooses,
    )
    materialize(graph, config, dtype)
    for p in graph.parameters():
        p.requires_grad_(False)
    return graph.eval()


def load_shard(graph: nn.Module, shard: dict[str, torch.Tensor]) -> list[str]:
    """Load a rank's shard; return the keys the graph has but the shard lacks (left at init).

    Unexpected keys (a shard for another plan) are an error.
    """
    result = graph.load_state_dict(shard, strict=False)
    if result.unexpected_keys:
        raise KeyError(f"shard has keys the rank graph does not: {sorted(result.unexpected_keys)[:8]}")
    return sorted(result.missing_keys)


def with_shape(graph: RankGraph, shape: GraphShape, expert_form: str | None = None) -> RankGraph:
    """The same rank graph (shared weights) for other static shapes, e.g. decode next to prefill;
    `expert_form` (default: the graph's) lets the decode graph gather the top-k experts while the
    prefill graph stays dense."""
    if expert_form is not None and expert_form not in EXPERT_FORMS:
        raise UnknownNameError("expert form", expert_form, EXPERT_FORMS)
    other = copy.copy(graph)  # a new __dict__ sharing the submodule and parameter dicts
    other.shape = shape
    if expert_form is not None:
        other.expert_form = expert_form
    return other
