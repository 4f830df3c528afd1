"""The MTP assistant's weights per NeuronCore, for the per-core plan (`memory_plan`) of a drafted port.

No released assistant config is available offline, so its bytes come from a stated assumption
(`ASSUMED_ASSISTANT`): its layers at the target's width with the target's attention and MLP shapes
but no K/V projections, and ordered embeddings (2,048 centroids, top 32 scored). Computed, unverified
on inf2. What drafting does to the ceiling (the draft table) is the lab's
`gemma4lab.inf2.mtp_roofline`.
"""

from __future__ import annotations

from typing import Any

ASSUMED_ASSISTANT = {"layers": 4, "num_centroids": 2048, "centroid_top_k": 32}


def assistant_rank_bytes(lm: Any, tp: int, dtype_bytes: int = 2) -> float:
    """Bytes of the assistant's weights one NeuronCore holds under `ASSUMED_ASSISTANT`, cut as
    `tp.draft_rank_graph` cuts it: q/o projections and the MLP 1/tp a rank; pre/post projections,
    norms and, with ordered embeddings (assumed), the whole scoring table and centroids replicated
    (`ordered_logits` indexes any row). Computed, unverified."""
    cfg = lm.config
    hidden, vocab = int(cfg.hidden_size), int(cfg.vocab_size)
    layer = lm.model.layers[0]
    attn = layer.self_attn
    per_layer = attn.q_proj.weight.numel() + attn.o_proj.weight.numel() + sum(p.numel() for p in layer.mlp.parameters())
    split = ASSUMED_ASSISTANT["layers"] * per_layer / tp
    replicated = 2 * hidden * hidden + hidden * hidden + (vocab + ASSUMED_ASSISTANT["num_centroids"]) * hidden
    return float((split + replicated) * dtype_bytes)
