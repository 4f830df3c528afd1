"""Tensor-parallel sharding plans: which weight goes where, for a config and a TP degree.

Hardware-agnostic: the same plan drives the CPU gloo ranks and the ModelBuilder build, read only from
the transformers config (through `KVLayout`), never from a device. The rules (Megatron-style, one
all-reduce after attention and one after the feed-forward):

- Attention: `q_proj` column-sharded by Q head, `o_proj` row-sharded over the same heads. `k_proj`/
  `v_proj` column-sharded by KV head when `kv_heads % tp == 0`; with fewer KV heads than ranks (31B
  full layers: 4 at TP=8; 12B: 1) *replicated*: each rank gets the KV head its Q heads read (GQA).
  `q_norm`/`k_norm` are replicated; k_eq_v layers have no `v_proj`; KV-shared layers own no K/V
  projections, and their Q heads read the producer's rank-local K/V, which the same rule puts there.
- MLP (and the MoE block's dense MLP): `gate_proj`/`up_proj` column, `down_proj` row.
- MoE experts: the fused `gate_up` column-sharded and `down` row-sharded; the router replicated, so
  every rank routes identically. Two splits (`expert_split`), each a rank holding 1/tp of the bytes:
  * `"intermediate"` (the default wherever `moe_intermediate_size % tp == 0`; 26B-A4B at TP=8: 704 /
    8 = 88): rank r holds columns [r*i, (r+1)*i) of every expert; `selective` gathers the same k
    routed ids on every rank, so the ranks together read k experts' bytes per token.
  * `"experts"` (the recipe's first form; kept and tested): rank r owns experts [r*e, (r+1)*e).
    `dense` picks the rank's routing-weight columns with the *runtime* rank tensor; `selective`
    masks the routed ids to the rank's own, so with static shapes every rank reads k slices whether
    routed there or not: tp * k in total (64 of 128 experts per token on the 26B-A4B at TP=8).
- PLE gate/projection and `per_layer_model_projection`: replicated (small); the embedding and PLE
  tables stay on the host.
- lm_head (tied to the embedding, the biggest matrix: 1.4 B parameters on the 31B): column-sharded
  over the vocabulary and all-gathered; replicated only when the vocabulary does not divide by tp.
- Norms, router, `layer_scalar`: replicated. `layer_scalar` is a buffer; the sharder carries it
  (NxD's loader shards only parameters of parallel layers), and the rank graph holds it as a
  parameter so a compiled graph loads it with the weights instead of baking its init value in.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..device.experts import EXPERT_SPLITS, default_expert_split
from ..device.kv_layout import FULL, SLIDING, KVLayout
from ..errors import TensorParallelError
from ..inf2.hardware import NEURON_TP_DEGREES

# The degrees worth offering: those the Neuron runtime supports on inf2 (the CPU gloo runner could
# run others, but a plan nobody can deploy teaches nothing).
CANDIDATE_TP = NEURON_TP_DEGREES

COLUMN, ROW, REPLICATE, RANK = "column", "row", "replicate", "rank"


@dataclass(frozen=True)
class AttentionPlan:
    layer: int
    layer_type: str
    head_dim: int
    q_heads: int
    kv_heads: int
    tp: int
    kv_mode: str  # "shard" | "replicate"
    producer: int  # the layer whose K/V this one reads (itself unless KV-shared)
    k_eq_v: bool

    @property
    def owns_kv(self) -> bool:
        return self.producer == self.layer

    @property
    def q_per_rank(self) -> int:
        return self.q_heads // self.tp

    @property
    def kv_per_rank(self) -> int:
        return self.kv_heads // self.tp if self.kv_mode == "shard" else 1

    @property
    def kv_groups_per_rank(self) -> int:
        """`num_key_value_groups` of the rank-local attention (Q heads per local KV head)."""
        return self.q_per_rank // self.kv_per_rank

    def q_heads_of(self, rank: int) -> list[int]:
        return list(range(rank * self.q_per_rank, (rank + 1) * self.q_per_rank))

    def kv_heads_of(self, rank: int) -> list[int]:
        if self.kv_mode == "shard":
            return list(range(rank * self.kv_per_rank, (rank + 1) * self.kv_per_rank))
        group = self.q_heads // self.kv_heads
        return sorted({q // group for q in self.q_heads_of(rank)})


@dataclass(frozen=True)
class MoEPlan:
    """How one MoE layer's experts are cut over `tp` ranks (`split`: see the module docstring)."""

    num_experts: int
    top_k: int
    intermediate: int  # per expert, unsharded
    tp: int
    split: str = "experts"  # "experts" | "intermediate"

    @property
    def experts_per_rank(self) -> int:
        """Experts a rank holds (a slice of each for the intermediate split)."""
        return self.num_experts if self.split == "intermediate" else self.num_experts // self.tp

    @property
    def intermediate_per_rank(self) -> int:
        """Intermediate width a rank holds of each of its experts."""
        return self.intermediate // self.tp if self.split == "intermediate" else self.intermediate

    def experts_of(self, rank: int) -> list[int]:
        if self.split == "intermediate":
            return list(range(self.num_experts))
        e = self.experts_per_rank
        return list(range(rank * e, (rank + 1) * e))

    def intermediate_of(self, rank: int) -> tuple[int, int]:
        """[start, stop) of the intermediate columns a rank holds of each of its experts."""
        i = self.intermediate_per_rank
        return (rank * i, (rank + 1) * i) if self.split == "intermediate" else (0, i)

    def weights_read_per_rank(self, hidden: int) -> dict[str, dict[str, int]]:
        """Expert weights one rank reads per layer and step, per form (elements; x dtype size for
        bytes). `experts`: how many expert slices, each `3 * intermediate_per_rank * hidden`.

        dense: all it holds, whatever the token count; selective: k slices per token (on the
        expert split clamped, so k even when fewer of the routed experts are this rank's).
        """
        one = 3 * self.intermediate_per_rank * hidden
        return {
            "dense": {"experts": self.experts_per_rank, "params": self.experts_per_rank * one},
            "selective_per_token": {"experts": self.top_k, "params": self.top_k * one},
        }


@dataclass(frozen=True)
class LayerPlan:
    index: int
    attention: AttentionPlan
    mlp_intermediate: int
    moe: MoEPlan | None
    ple: bool

    @property
    def mlp_per_rank(self) -> int:
        return self.mlp_intermediate // self.attention.tp


@dataclass(frozen=True)
class ShardRule:
    """How one checkpoint tensor is cut for a rank: `kind` and the dimension it is cut along."""

    kind: str  # column | row | replicate | rank
    dim: int | None = None


@dataclass(frozen=True)
class TPPlan:
    tp: int
    variant: str | None
    hidden: int
    vocab: int
    layers: tuple[LayerPlan, ...]
    layout: KVLayout
    lm_head: str  # "column" | "replicate"
    ple_on_host: bool

    # ---- per-rank views -------------------------------------------------------------------
    def rank_layout(self) -> KVLayout:
        """The KV layout one rank sees: the same producers, with the rank-local KV-head counts."""
        layers = tuple(
            replace(lay, kv_heads=self.layers[lay.index].attention.kv_per_rank) for lay in self.layout.layers
        )
        return replace(self.layout, layers=layers, num_attention_heads=self.layout.num_attention_heads // self.tp)

    def attention(self, layer: int) -> AttentionPlan:
        return self.layers[layer].attention

    @property
    def moe(self) -> MoEPlan | None:
        """The MoE layers' plan (all MoE layers share one), None for a dense model."""
        return next((lp.moe for lp in self.layers if lp.moe), None)

    @property
    def expert_split(self) -> str | None:
        """ "experts" | "intermediate" for an MoE model, None for a dense one."""
        moe = self.moe
        return None if moe is None else moe.split

    def rule(self, key: str) -> ShardRule:
        """The sharding rule for a key of the rank graph's state dict."""
        if key == "spmd_rank.rank":
            return ShardRule(RANK, 0)
        if key == "lm_head.weight":
            return ShardRule(COLUMN, 0) if self.lm_head == COLUMN else ShardRule(REPLICATE)
        parts = key.split(".")
        if len(parts) >= 4 and parts[0] == "model" and parts[1] == "layers":
            sub = ".".join(parts[3:])
            if sub in (
                "self_attn.q_proj.weight",
                "self_attn.k_proj.weight",
                "self_attn.v_proj.weight",
                "mlp.gate_proj.weight",
                "mlp.up_proj.weight",
                "experts.gate_up.weight",
            ):
                return ShardRule(COLUMN, 0)
            if sub in ("self_attn.o_proj.weight", "mlp.down_proj.weight", "experts.down.weight"):
                return ShardRule(ROW, 1)
        return ShardRule(REPLICATE)

    # ---- summaries ------------------------------------------------------------------------
    def kv_modes(self) -> dict[str, str]:
        out = {}
        for lp in self.layers:
            out.setdefault(lp.attention.layer_type, lp.attention.kv_mode)
        return out

    def describe(self) -> dict[str, Any]:
        """JSON-friendly: what each rank holds (heads, experts) and how each weight kind is cut."""
        by_type: dict[str, Any] = {}
        for lp in self.layers:
            a = lp.attention
            if a.layer_type in by_type:
                continue
            by_type[a.layer_type] = {
                "q_heads": a.q_heads,
                "kv_heads": a.kv_heads,
                "head_dim": a.head_dim,
                "q_heads_per_rank": a.q_per_rank,
                "kv_heads_per_rank": a.kv_per_rank,
                "kv_mode": a.kv_mode,
                "k_eq_v": a.k_eq_v,
                "kv_heads_by_rank": [a.kv_heads_of(r) for r in range(self.tp)],
            }
        moe = self.moe
        return {
            "tp": self.tp,
            "variant": self.variant,
            "attention": by_type,
            "mlp": {
                "gate_proj/up_proj": COLUMN,
                "down_proj": ROW,
                "intermediate_per_rank": sorted({lp.mlp_per_rank for lp in self.layers}),
            },
            "moe": None
            if moe is None
            else {
                "num_experts": moe.num_experts,
                "top_k": moe.top_k,
                "split": moe.split,
                "experts_per_rank": moe.experts_per_rank,
                "intermediate_per_rank": moe.intermediate_per_rank,
                "experts_by_rank": [[moe.experts_of(r)[0], moe.experts_of(r)[-1]] for r in range(self.tp)],
                "intermediate_by_rank": [list(moe.intermediate_of(r)) for r in range(self.tp)],
                "form": _SPLIT_FORMS[moe.split],
                "weights_read_per_rank_per_layer": moe.weights_read_per_rank(self.hidden),
                "rank_source": (
                    "not read: every rank runs the same expert math on its slices"
                    if moe.split == "intermediate"
                    else "runtime int32 tensor (spmd_rank.rank), never a trace-time int"
                ),
            },
            "lm_head": self.lm_head + (" (all-gathered over the vocabulary)" if self.lm_head == COLUMN else ""),
            "host_side": ["embed_tokens"] + (["embed_tokens_per_layer (PLE)"] if self.ple_on_host else []),
            "replicated": [
                "norms",
                "router",
                "layer_scalar (buffer, carried by the sharder)",
                "per-layer-input gate/projection (PLE)",
            ],
        }


_SPLIT_FORMS = {
    "experts": "each rank holds E/tp whole experts: gate_up column + down row over the expert dim; "
    "dense: all local experts, masked to top-k with the runtime rank; selective: the "
    "routed top-k gathered from the local shard, masked to its ids (k slices per rank)",
    "intermediate": "each rank holds a 1/tp slice of every expert's intermediate dim: gate/up "
    "column-sharded and down row-sharded per expert, one all-reduce; dense: all "
    "experts' local slices weighted by the routing weights; selective: the k routed "
    "experts' local slices (the same k ids on every rank, no masking)",
}


# ---- building and validating -------------------------------------------------------------


def _config_ints(config: Any) -> dict[str, Any]:
    get = lambda name, default=0: getattr(config, name, default) or default  # noqa: E731
    return dict(
        hidden=int(config.hidden_size),
        q_heads=int(config.num_attention_heads),
        intermediate=int(config.intermediate_size),
        vocab=int(config.vocab_size),
        double_wide=bool(get("use_double_wide_mlp", False)),
        moe=bool(get("enable_moe_block", False)),
        num_experts=int(get("num_experts", 0)),
        top_k=int(get("top_k_experts", 0)),
        moe_intermediate=int(get("moe_intermediate_size", 0)),
        ple=int(get("hidden_size_per_layer_input", 0)),
    )


def tp_problems(config: Any, tp: int, layout: KVLayout | None = None, expert_split: str | None = None) -> list[str]:
    """Why `tp` cannot shard this config (empty when it can). `expert_split` None: either
    split of the MoE experts will do."""
    if tp < 1:
        return [f"TP degree must be >= 1, got {tp}"]
    c = _config_ints(config)
    layout = layout or KVLayout.from_config(config)
    problems = []
    if c["q_heads"] % tp:
        problems.append(f"{c['q_heads']} query heads do not split into {tp} equal parts")
    for layer_type in (SLIDING, FULL):
        kvs = sorted({lay.kv_heads for lay in layout.layers if lay.layer_type == layer_type})
        for kv in kvs:
            if kv % tp and tp % kv:
                problems.append(
                    f"{layer_type} layers have {kv} KV heads: neither shardable nor replicable "
                    f"over {tp} ranks (need kv % tp == 0 or tp % kv == 0)"
                )
    widths = {c["intermediate"] * (2 if c["double_wide"] and not lay.owns_buffer else 1) for lay in layout.layers}
    for width in sorted(widths):
        if width % tp:
            problems.append(f"MLP intermediate size {width} does not split into {tp}")
    if c["moe"]:
        problems += _expert_split_problems(c, tp, expert_split)
    return problems


def _expert_split_problems(c: dict[str, Any], tp: int, expert_split: str | None) -> list[str]:
    experts = f"{c['num_experts']} experts do not split into {tp} equal groups"
    inner = f"the experts' intermediate size {c['moe_intermediate']} does not split into {tp}"
    if expert_split is None:
        ok = default_expert_split(c["num_experts"], c["moe_intermediate"], tp) is not None
        return [] if ok else [f"{experts} and {inner}"]
    if expert_split not in EXPERT_SPLITS:
        return [f"unknown expert_split {expert_split!r}; choose one of {', '.join(EXPERT_SPLITS)}"]
    if expert_split == "experts" and c["num_experts"] % tp:
        return [experts]
    if expert_split == "intermediate" and c["moe_intermediate"] % tp:
        return [inner]
    return []


def make_plan(config: Any, tp: int, variant: Any = None, expert_split: str | None = None) -> TPPlan:
    """The sharding plan for `config` at TP degree `tp`; raises `TensorParallelError` (naming the degrees
    that work) if it can't, or with a `variant` if `tp` is not one its recipe supports on inf2.
    `expert_split` (MoE only): "intermediate" | "experts"; None: `default_expert_split`."""
    name = getattr(variant, "name", None)
    layout = KVLayout.from_config(config)
    c = _config_ints(config)
    if not c["moe"]:
        expert_split = None
    problems = tp_problems(config, tp, layout, expert_split)
    supported = tuple(getattr(variant, "supported_tp", ()) or ())
    if variant is not None and tp not in supported and not problems:
        problems.append(f"the {name} recipe supports TP degrees {', '.join(map(str, supported))} on inf2")
    if problems:
        ok = [t for t in (supported or CANDIDATE_TP) if not tp_problems(config, t, layout, expert_split)]
        label = name or "this model"
        raise TensorParallelError(
            f"{label} cannot use TP={tp}: {'; '.join(problems)}; use one of {', '.join(map(str, ok))}"
        )
    split = expert_split or default_expert_split(c["num_experts"], c["moe_intermediate"], tp)
    layers = []
    for lay in layout.layers:
        kv_mode = "shard" if (lay.kv_heads % tp == 0 and lay.kv_heads >= tp) else "replicate"
        attention = AttentionPlan(
            lay.index, lay.layer_type, lay.head_dim, c["q_heads"], lay.kv_heads, tp, kv_mode, lay.producer, lay.k_eq_v
        )
        width = c["intermediate"] * (2 if c["double_wide"] and not lay.owns_buffer else 1)
        moe = MoEPlan(c["num_experts"], c["top_k"], c["moe_intermediate"], tp, split) if c["moe"] else None
        layers.append(LayerPlan(lay.index, attention, width, moe, bool(c["ple"])))
    lm_head = COLUMN if c["vocab"] % tp == 0 else REPLICATE
    return TPPlan(tp, name, c["hidden"], c["vocab"], tuple(layers), layout, lm_head, bool(c["ple"]))
