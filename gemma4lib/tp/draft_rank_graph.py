"""Drafting on the tensor-parallel rank graph: the target's rank graph returning its hidden states
(prefill and verify) and the assistant's forward over the rank's own shard of the target's K/V.

Why the assistant is split like this. Under TP a rank holds only some of the target's K/V heads
(`TPPlan.rank_layout`): the KV heads of the Q heads it owns, sharded or, where there are fewer KV
heads than ranks, replicated. The assistant reads those buffers, so each rank must run exactly the
assistant Q heads that attend over the KV heads it holds. With the assistant's Q heads cut into
`tp` contiguous blocks (its `q_proj` column-parallel, `o_proj` row-parallel + all-reduce) rank r's
block reads KV head `q // (Qa / Kt)`, the same head the target plan gives rank r, whenever the
assistant's Q-head count divides by `tp` (checked: `assistant_attention_plans`). The assistant's MLP
is cut like the target's (gate/up column, down row); its lm_head is column-parallel over the
vocabulary and all-gathered like the target's (replicated when it scores ordered embeddings, which
index the whole table); `pre_projection`, `post_projection`, norms and `layer_scalar` are
replicated. Every layer comes from the same factory the target rank graph uses (`CpuParallelFactory`
on the gloo ranks, `NxDParallelFactory` on inf2), so one build serves both.

`DraftingRankModule` is one module for every key of a drafted run (prefill, verify, draft): the
target rank graph (returning its hidden states, of every position for the verify), the assistant's
(reading the rank's K/V, never writing them) and the K/V as parameters. Every key has the same
parameter names: NxD ModelBuilder v1 shards the checkpoint with the *first* key's module and drops
keys that module lacks (v2.28.0 `trace/trace.py` `preprocess_checkpoint`), so every key must hold
the assistant too; the draft key returns the K/V it was given, so its aliases are the other keys'.

Rings: as at TP 1, `RoomyLayout` with room k + 1 (see `device.drafting`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..device.context_key import ContextKey
from ..device.drafting import DraftGraph, RoomyLayout
from ..device.graph import GraphShape
from ..device.row_join import RowJoin
from ..errors import TensorParallelError, UnknownNameError
from .plan import COLUMN, REPLICATE, AttentionPlan, TPPlan
from .rank_graph import CpuParallelFactory, RankGraph, _Recording, build_rank_graph, materialize, with_shape

DRAFT_MODES = ("prefill", "verify", "draft", "join")
ASSISTANT_PREFIX, TARGET_PREFIX = "assistant.", "target."


def build_target_rank_graph(
    config: Any,
    plan: TPPlan,
    shape: GraphShape,
    room: int,
    *,
    factory: Any = None,
    dtype: torch.dtype = torch.float32,
    baked_rank: bool = False,
) -> RankGraph:
    """`rank_graph.build_rank_graph` for drafting (functional K/V, experts dense: the prefill form),
    its rings with `room` extra slots and its hidden states returned."""
    graph = build_rank_graph(config, plan, shape, factory=factory, dtype=dtype, baked_rank=baked_rank)
    graph.layout = RoomyLayout.around(graph.layout, room)
    graph.returns_hidden = True
    return graph


def verify_of(graph: RankGraph, shape: GraphShape, chooses: bool = False) -> RankGraph:
    """The verify graph over the same weights at `shape` (k + 1 tokens at each row's offset; a context
    bucket's `reads`), every position (`chooses`: its greedy verdict, `DeviceGraph.chooses`)."""
    other = with_shape(graph, shape)
    other.every_position, other.chooses = True, chooses
    return other


def assistant_attention_plans(assistant_config: Any, plan: TPPlan, read_layers: dict[str, int]) -> list[AttentionPlan]:
    """Per assistant layer: its Q heads cut over the ranks so that each rank's block reads the KV
    heads the target plan put on that rank (module docstring); a `TensorParallelError` if none can."""
    text = assistant_config.get_text_config()
    q_heads = int(text.num_attention_heads)
    plans = []
    for i, layer_type in enumerate(text.layer_types):
        target = plan.attention(read_layers[layer_type])
        mine = AttentionPlan(
            i,
            layer_type,
            int(text.per_layer_config[i].head_dim),
            q_heads,
            target.kv_heads,
            plan.tp,
            target.kv_mode,
            read_layers[layer_type],
            target.k_eq_v,
        )
        ok = q_heads % plan.tp == 0 and mine.q_per_rank % mine.kv_per_rank == 0
        ok = ok and all(mine.kv_heads_of(r) == target.kv_heads_of(r) for r in range(plan.tp))
        if not ok:
            raise TensorParallelError(
                f"the assistant's {q_heads} query heads cannot be cut over {plan.tp} ranks so that each rank "
                f"reads the {layer_type} K/V heads it holds ({[target.kv_heads_of(r) for r in range(plan.tp)]}); "
                f"use a TP degree that divides {q_heads}, or draft=None"
            )
        plans.append(mine)
    return plans


def _assistant_skeleton(assistant_config: Any):
    from ..models.assistant import _classes, fully_shared_construction
    from ..models.variants import get_variant

    name = "12b" if "Unified" in type(assistant_config).__name__ else "e2b"  # only the class matters here
    _, model_cls = _classes(get_variant(name))
    with torch.device("meta"), fully_shared_construction():
        return model_cls(assistant_config)


def lm_head_rule(assistant_config: Any, plan: TPPlan) -> str:
    """Column over the vocabulary like the target's, unless ordered embeddings index the whole table."""
    ordered = bool(getattr(assistant_config, "use_ordered_embeddings", False))
    return REPLICATE if ordered or plan.lm_head != COLUMN else COLUMN


def build_assistant_rank_graph(
    assistant_config: Any,
    plan: TPPlan,
    layout: RoomyLayout,
    shape: GraphShape,
    read_layers: dict[str, int],
    *,
    factory: Any = None,
    dtype: torch.dtype = torch.float32,
    chooses: bool = False,
) -> DraftGraph:
    """The assistant's draft graph for one rank: shard-size factory layers, zeros elsewhere until
    `assistant_shard` is loaded. `layout` is the rank's (roomy) K/V layout; `chooses`: its argmax."""
    factory = _Recording(factory or CpuParallelFactory(plan.tp, dtype=dtype))
    plans = assistant_attention_plans(assistant_config, plan, read_layers)
    skeleton = _assistant_skeleton(assistant_config)
    hidden = skeleton.config.get_text_config().hidden_size
    for layer, a in zip(skeleton.model.layers, plans, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        attn.q_proj = factory.column(hidden, a.q_heads * a.head_dim)
        attn.o_proj = factory.row(a.q_heads * a.head_dim, hidden)
        attn.num_key_value_groups = a.kv_groups_per_rank
        width = mlp.gate_proj.out_features
        mlp.gate_proj, mlp.up_proj = factory.column(hidden, width), factory.column(hidden, width)
        mlp.down_proj = factory.row(width, hidden)
        scalar = layer._buffers.pop("layer_scalar", None)
        if scalar is not None:  # a weight from the shard, never a traced-in init value
            layer.layer_scalar = nn.Parameter(torch.ones(scalar.shape, dtype=dtype), requires_grad=False)
    vocab = skeleton.lm_head.out_features
    if lm_head_rule(assistant_config, plan) == COLUMN:
        skeleton.lm_head = factory.column(hidden, vocab, gather=True)
    else:
        skeleton.lm_head = factory.replicated(hidden, vocab)
    skeleton.pre_projection = factory.replicated(*reversed(skeleton.pre_projection.weight.shape))
    skeleton.post_projection = factory.replicated(*reversed(skeleton.post_projection.weight.shape))
    graph = DraftGraph(skeleton, layout, shape, read_layers, chooses=chooses)
    graph._factory_made = factory.made
    materialize(graph, assistant_config.get_text_config(), dtype)
    for p in graph.parameters():
        p.requires_grad_(False)
    return graph.eval()


def assistant_shard(
    assistant: nn.Module, plan: TPPlan, rank: int, *, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """One rank's assistant checkpoint, keyed like `build_assistant_rank_graph`'s graph: Q heads and
    MLP rows column-cut, `o_proj`/`down_proj` columns row-cut (contiguous blocks, the plan's rules),
    lm_head by `lm_head_rule`, the rest (and `layer_scalar`) whole. The word embedding is not in it
    (the draft's input is the projected target embedding)."""
    head = lm_head_rule(assistant.config, plan)
    out = {}
    for key, tensor in assistant.state_dict().items():
        if key == "model.embed_tokens.weight":
            continue
        rule = plan.rule(key)
        kind = head if key == "lm_head.weight" else rule.kind
        value = tensor.chunk(plan.tp, dim=rule.dim)[rank] if kind != REPLICATE else tensor
        value = value.detach()
        if dtype is not None and value.is_floating_point():
            value = value.to(dtype)
        out[key] = value.contiguous().clone()
    return out


def assistant_nxd_full(
    assistant: nn.Module, plan: TPPlan, *, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """The assistant's part of a ModelBuilder `checkpoint_loader` result: cut tensors as every rank's
    block concatenated along the cut dimension, so NxD's contiguous split gives back
    `assistant_shard(..., rank)` (here that is the HF tensor itself: the blocks are contiguous)."""
    shards = [assistant_shard(assistant, plan, r, dtype=dtype) for r in range(plan.tp)]
    head = lm_head_rule(assistant.config, plan)
    full = {}
    for key, first in shards[0].items():
        rule = plan.rule(key)
        kind = head if key == "lm_head.weight" else rule.kind
        full[key] = first if kind == REPLICATE else torch.cat([s[key] for s in shards], dim=rule.dim).contiguous()
    return full


class DraftingRankModule(nn.Module):
    """One key of a drafted run over one rank: `mode` picks the forward (see the module docstring).

    prefill/verify: `forward(embeds, [ple,] start, length)` -> `(logits, hidden, *updated kv)`;
    join: the same with a row index `[1]` first (a batch-1 prefill on that row: `device.row_join`);
    draft: `forward(inputs_embeds [B, 1, 2H], position [B])` -> `(logits, hidden, *kv unchanged)`."""

    def __init__(self, target: RankGraph, assistant: DraftGraph, mode: str, kv: nn.ParameterList | None = None):
        super().__init__()
        if mode not in DRAFT_MODES:
            raise UnknownNameError("drafting key mode", mode, DRAFT_MODES)
        self.target, self.assistant, self.mode = target, assistant, mode
        if kv is None:
            kv = nn.ParameterList([nn.Parameter(t, requires_grad=False) for t in target.new_kv()])
        self.kv = kv

    @property
    def num_inputs(self) -> int:
        # a join's counts its row index, a bucket key's its positions
        return self.assistant.num_inputs if self.mode == "draft" else self.target.num_inputs

    def forward(self, *inputs: torch.Tensor):
        if self.mode == "draft":
            logits, hidden = self.assistant(*inputs, *self.kv)
            return (logits, hidden, *self.kv)  # read, never written: the states come back as they were
        return self.target(*inputs, *self.kv)

    def aliases(self) -> dict[nn.Parameter, int]:
        """`{kv_param: output_index}`: outputs 0 and 1 are the logits and hidden states."""
        return {p: 2 + i for i, p in enumerate(self.kv)}

    def sharing(self, target: RankGraph, mode: str) -> DraftingRankModule:
        """Another key over the same weights and K/V parameters."""
        return DraftingRankModule(target, self.assistant, mode, self.kv)


class KVDraftStep:
    """Calls a `DraftingRankModule` on CPU the way the device runs the compiled key: the updated K/V
    are written back into its parameters (aliasing), `(logits, hidden)` returned."""

    def __init__(self, module: DraftingRankModule):
        self.module = module

    def __call__(self, *inputs: torch.Tensor):
        with torch.no_grad():
            out = self.module(*inputs[: self.module.num_inputs])
            for param, new in zip(self.module.kv, out[2:], strict=True):
                if new is not param:
                    param.copy_(new)
        return out[0], out[1]


def prefill_key_shapes(
    context_length: int, buckets: tuple[int, ...], ring: bool, batch: int = 1
) -> dict[str, GraphShape]:
    """One ModelBuilder key per prefill bucket, `prefill<tokens>` (the plain and the drafting recipe:
    NxD routes a call to its key by the input shapes, so a prompt runs the bucket it fits)."""
    return {f"prefill{int(b)}": GraphShape(batch, int(b), context_length, ring) for b in buckets}


def draft_key_shapes(
    context_length: int,
    buckets: tuple[int, ...],
    k: int,
    ring: bool,
    batch: int = 1,
    joins: bool = False,
    chooses: bool = False,
) -> dict[str, GraphShape]:
    """The drafted run's keys: one prefill per bucket, verify (k + 1 tokens), draft (one token), and
    with `joins` (a batch for a row to join) a one-row prefill per bucket, `row_prefill<tokens>`;
    with `chooses` (token ids where the logits would cross a bus), `verify_ids` beside verify (its drafts,
    one input more, route it) and `draft_ids` for draft (the rank-graph backends draft greedily only:
    `BackendFacts.samples_drafts`)."""
    shapes = prefill_key_shapes(context_length, buckets, ring, batch)
    shapes["verify"] = GraphShape(batch, k + 1, context_length, ring)
    if chooses:
        shapes["verify_ids"] = shapes["verify"]
    shapes["draft_ids" if chooses else "draft"] = GraphShape(batch, 1, context_length, ring)
    if joins and batch > 1:
        shapes.update({f"row_prefill{int(b)}": GraphShape(1, int(b), context_length, ring) for b in buckets})
    return shapes


def build_drafting_modules(
    config: Any,
    assistant_config: Any,
    plan: TPPlan,
    read_layers: dict[str, int],
    shapes: dict[str, GraphShape],
    k: int,
    *,
    factory: Any = None,
    dtype: torch.dtype = torch.float32,
    baked_rank: bool = False,
    keyed: bool = False,
) -> dict[str, DraftingRankModule]:
    """Every key's module over one set of weights and K/V parameters (gloo ranks and tests; the
    ModelBuilder recipe builds one per key with NxD's factory the same way). A context bucket's
    ("verify@64": `GraphShape.reads`) reads the first slots only; `keyed` (NxD keys, routed by their
    inputs' shapes) wraps it in `ContextKey`, its read positions its first input."""
    factory = factory or CpuParallelFactory(plan.tp, dtype=dtype)
    prefill = {name: s for name, s in shapes.items() if name.startswith("prefill") and not s.reads}
    widest = max(prefill.values(), key=lambda s: s.tokens)
    base = build_target_rank_graph(config, plan, widest, k + 1, factory=factory, dtype=dtype, baked_rank=baked_rank)
    name = "draft_ids" if "draft_ids" in shapes else "draft"
    draft = build_assistant_rank_graph(
        assistant_config,
        plan,
        base.layout,
        shapes[name],
        read_layers,
        factory=factory,
        dtype=dtype,
        chooses=name != "draft",
    )
    first = DraftingRankModule(base, draft, "prefill")
    modules = {}
    for name, shape in shapes.items():
        kind = name.partition("@")[0]
        if kind.startswith("draft"):  # a bucket's reads the first slots (`DraftGraph.at`)
            assistant = draft.at(shape) if shape.reads else draft
            assistant = ContextKey(assistant) if keyed and shape.reads else assistant
            modules[name] = DraftingRankModule(base, assistant, "draft", first.kv)
            continue
        if kind.startswith("verify"):
            target, mode = verify_of(base, shape, chooses=kind != "verify"), "verify"
        elif kind.startswith("row_"):  # a join: the batch-1 prefill on one row of the batch's K/V
            target, mode = RowJoin(with_shape(base, shape), base.shape.batch), "join"
        else:
            target, mode = (with_shape(base, shape) if shape != base.shape else base), "prefill"
        modules[name] = first.sharing(ContextKey(target) if keyed and shape.reads else target, mode)
    return modules
