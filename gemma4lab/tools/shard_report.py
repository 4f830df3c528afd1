"""What each tensor-parallel rank holds, as a report: one representative layer's tensor shapes per
kind, each rank's KV heads, experts, parameters and bytes. The TP demos' tests and lab tools print it;
the gloo backend builds the shards themselves (`gemma4lib.tp.shard`), so the summary lives here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gemma4lib.errors import SettingsError
from gemma4lib.tp.plan import TPPlan
from gemma4lib.tp.shard import RANK_KEY, iter_shards, layer_key


def shard_shapes(
    plan: TPPlan, shards: list[dict[str, torch.Tensor]] | None = None, lm: nn.Module | None = None
) -> dict[str, Any]:
    """JSON-friendly per-rank summary: tensor shapes (one representative layer per kind), what
    each rank holds (KV heads, experts), parameter counts and bytes per rank."""
    if shards is None:
        if lm is None:
            raise SettingsError("pass the shards or the reference model (lm=...) to compare against")
        shards = list(iter_shards(lm, plan))
    first = shards[0]
    # one representative layer per (layer type, owns KV) kind
    reps: dict[str, int] = {}
    for lp in plan.layers:
        kind = lp.attention.layer_type + ("" if lp.attention.owns_kv else " (kv-shared)")
        reps.setdefault(kind, lp.index)
    shapes: dict[str, Any] = {}
    for key, value in first.items():
        located = layer_key(key)
        if located is None:
            shapes[key] = list(value.shape)
            continue
        i, sub = located
        for kind, index in reps.items():
            if index == i:
                shapes.setdefault(f"layers[{kind}].{sub}", list(value.shape))
    identical = all(
        set(s) == set(first) and all(tuple(s[k].shape) == tuple(first[k].shape) for k in first) for s in shards
    )
    ranks = []
    for r, s in enumerate(shards):
        entry: dict[str, Any] = {
            "rank": r,
            "rank_tensor": s[RANK_KEY].tolist() if RANK_KEY in s else None,
            "tensors": len(s),
            "params": int(sum(v.numel() for k, v in s.items() if k != RANK_KEY)),
            "bytes": int(sum(v.numel() * v.element_size() for v in s.values())),
            "kv_heads": {lp.attention.layer_type: lp.attention.kv_heads_of(r) for lp in plan.layers},
        }
        moe = plan.moe
        if moe is not None:
            entry["experts"] = [moe.experts_of(r)[0], moe.experts_of(r)[-1]]
            entry["expert_intermediate"] = list(moe.intermediate_of(r))  # [start, stop)
        entry["has_layer_scalar"] = any(k.endswith(".layer_scalar") for k in s)
        ranks.append(entry)
    return {
        "tp": plan.tp,
        "identical_shapes_across_ranks": identical,
        "shapes": shapes,
        "ranks": ranks,
        "kv_modes": plan.kv_modes(),
        "lm_head": plan.lm_head,
        "expert_split": plan.expert_split,
    }
