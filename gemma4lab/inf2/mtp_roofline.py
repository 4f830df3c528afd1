"""What drafting could do to inf2's batch-1 ceiling: computed from shapes, unverified.

Decode is bandwidth bound: a plain step reads the weights and the K/V once for one token. A
drafted round reads them once in the verify step (k + 1 tokens at once; MoE: the experts as the
verify graph reads them, `drafting.verify_expert_form`: the (k + 1) x top_k routed slices gathered
when that is less than all E experts, else all of them) plus k assistant steps, and emits
`accepted_per_step` tokens. The K/V are the drafted graphs' own (`drafting.RoomyLayout`: rings of
window + k + 1 slots). `tools.hlo_audit.audit_verify` checks the verify graph's HLO reads
`verify_bytes`.
So the drafted ceiling is `accepted_per_step * bandwidth / (verify bytes + k * assistant bytes)`,
and drafting pays off once `accepted_per_step` exceeds `break_even_accepted`.

No released assistant config is available offline, so the assistant's bytes come from a stated
assumption (`gemma4lib.inf2.mtp_roofline.ASSUMED_ASSISTANT`, which the per-core plan sizes the
assistant with too): its layers at the target's width with the target's attention and MLP shapes
but no K/V projections, ordered embeddings (2,048 centroids, top 32 scored), and the K/V of the
two target layers it reads. Graph-call overhead (k + 1 calls per round; 13 to
190 us each on inf2 depending on the SDK, DESIGN.md) and compute are left out. Every figure here
is computed, unverified on inf2.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gemma4lib.device.drafting import RoomyLayout, verify_expert_form
from gemma4lib.device.kv_layout import FULL, SLIDING, KVLayout
from gemma4lib.inf2.hardware import GB, INSTANCES
from gemma4lib.inf2.mtp_roofline import ASSUMED_ASSISTANT
from gemma4lib.inf2.params import count_params, meta_model
from gemma4lib.models.variants import VARIANTS, get_variant

from .roofline import decode_bytes

STATUS = "computed, unverified: assistant bytes from an assumed shape (ASSUMED_ASSISTANT), call overhead left out"


def assistant_bytes(lm: Any, context_length: int, ring: bool = True, dtype_bytes: int = 2, k: int = 4) -> float:
    """Bytes one assistant step reads under `ASSUMED_ASSISTANT` (see the module docstring); the K/V
    of the two layers it reads, in the drafted rings (window + k + 1 slots)."""
    cfg = lm.config
    hidden, vocab = int(cfg.hidden_size), int(cfg.vocab_size)
    layer = lm.model.layers[0]
    attn = layer.self_attn
    per_layer = attn.q_proj.weight.numel() + attn.o_proj.weight.numel() + sum(p.numel() for p in layer.mlp.parameters())
    layers = ASSUMED_ASSISTANT["layers"] * per_layer
    projections = 2 * hidden * hidden + hidden * hidden  # pre (2H -> H) and post (H -> H)
    per_centroid = vocab // ASSUMED_ASSISTANT["num_centroids"]
    embeddings = (ASSUMED_ASSISTANT["num_centroids"] + ASSUMED_ASSISTANT["centroid_top_k"] * per_centroid) * hidden
    layout = RoomyLayout.around(KVLayout.from_config(cfg), k + 1)
    read = {t: max(x.index for x in layout.producers if x.layer_type == t) for t in (SLIDING, FULL)}
    kv = 0
    for t, index in read.items():
        producer = layout.layers[index]
        kv += 2 * producer.kv_heads * producer.head_dim * layout.slots(t, context_length, ring)
    return float((layers + projections + embeddings + kv) * dtype_bytes)


def verify_bytes(
    lm: Any, context_length: int, k: int, ring: bool = True, dtype_bytes: int = 2, experts: str | None = None
) -> float:
    """Bytes of one target verify step over k + 1 tokens, as the verify graph reads them: the
    weights once, the K/V buffers once (rings of window + k + 1 slots); MoE experts in the form
    `drafting.verify_expert_form` picks (or `experts`): dense reads all E, selective gathers
    (k + 1) x top_k slices per layer, repeats included (more than dense once (k + 1) x top_k >= E,
    which is why the default then is dense)."""
    counts = count_params(lm)
    weights = counts.lm_head + counts.other
    kv = RoomyLayout.around(KVLayout.from_config(lm.config), k + 1).buffer_bytes(context_length, ring, dtype_bytes)
    if counts.num_experts:
        form = verify_expert_form(lm.config, k, experts)
        share = 1.0 if form == "dense" else (k + 1) * counts.top_k / counts.num_experts
        weights += share * counts.experts
    return float(weights * dtype_bytes + kv)


def draft_effect(
    variant: str, accepted_per_step: float | None, k: int = 4, context_length: int = 2048, ring: bool = True
) -> dict[str, Any]:
    """One variant's computed drafted ceiling on its recipe's instance, next to the plain one."""
    v = get_variant(variant)
    lm = meta_model(v)
    counts = count_params(lm)
    form = "selective" if counts.num_experts else "dense"
    plain = decode_bytes(lm, context_length=context_length, ring=ring, experts=form, dtype_bytes=2).total
    verify, draft = verify_bytes(lm, context_length, k, ring), assistant_bytes(lm, context_length, ring, k=k)
    round_bytes = verify + k * draft
    bandwidth = INSTANCES[v.instance_type].bandwidth_bytes_s(v.tp_degree)
    row: dict[str, Any] = {
        "variant": v.name,
        "status": STATUS,
        "recipe": f"{v.instance_type} TP={v.tp_degree}",
        "draft_tokens": k,
        "context_length": context_length,
        "plain_step_gb": plain / GB,
        "verify_step_gb": verify / GB,
        "verify_experts": verify_expert_form(lm.config, k) if counts.num_experts else None,
        "assistant_step_gb": draft / GB,
        "round_gb": round_bytes / GB,
        "plain_ceiling_tok_s": bandwidth / plain,
        "break_even_accepted": round_bytes / plain,
        "accepted_per_step": accepted_per_step,
    }
    if accepted_per_step:
        row["drafted_ceiling_tok_s"] = accepted_per_step * bandwidth / round_bytes
        row["computed_speedup"] = row["drafted_ceiling_tok_s"] / row["plain_ceiling_tok_s"]
    return row


def draft_table(accepted: dict[str, float | None], k: int = 4, variants: Iterable[str] | None = None) -> list[dict]:
    """`draft_effect` per variant, with each variant's measured acceptance where there is one."""
    return [draft_effect(name, accepted.get(name), k) for name in (variants or VARIANTS)]
