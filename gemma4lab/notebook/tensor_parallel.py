"""Tensor parallelism in the notebooks: the plan, KV heads per rank, and the TP ranks run on CPU
(gloo) with their tokens and answers side by side, the field report's baked-rank bug included."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from gemma4lab.notebook.display import Table, answer_text, until_stop
from gemma4lab.notebook.family import BF16_BYTES, real_config
from gemma4lib.inf2.memory_plan import DEFAULT_CONTEXT
from gemma4lib.models.loading import LoadedModel
from gemma4lib.models.variants import Variant, get_variant

if TYPE_CHECKING:  # type names only
    from gemma4lib.settings import PortSettings


def tp_plan(variant: Variant | str, tp: int | None = None, config: Any = None) -> Any:
    """The sharding plan of the released config (or `config`) at `tp` (default: the variant's)."""
    from gemma4lib.tp.plan import make_plan

    v = variant if isinstance(variant, Variant) else get_variant(variant)
    return make_plan(config if config is not None else real_config(v), tp or v.tp_degree, v)


def kv_heads_under_tp(
    variant: Variant | str, tp: int | None = None, config: Any = None, context_length: int = DEFAULT_CONTEXT
) -> Table:
    """Per attention type: how Q and KV heads land on ranks, and what each rank's K/V cache costs at
    full length (every slot of the context; a ring keeps a sliding layer to its window, which the
    notebooks' K/V totals use: the column says so, so the two are not read as one figure).

    When a layer has fewer KV heads than ranks the heads cannot be split; each rank instead keeps a
    copy of the one KV head its Q heads read (GQA: KV head = Q head // (Q heads / KV heads))."""
    plan = tp_plan(variant, tp, config)
    rows = []
    for kind, a in plan.describe()["attention"].items():
        group = a["q_heads"] // a["kv_heads"]
        copies = plan.tp * a["kv_heads_per_rank"] / a["kv_heads"]
        per_token = 2 * a["kv_heads_per_rank"] * a["head_dim"] * BF16_BYTES
        kv = per_token * context_length
        kv_text = f"{kv / 2**20:.1f} MiB" if kv >= 2**20 else f"{kv / 2**10:.1f} KiB"
        rows.append(
            [
                kind.replace("_attention", ""),
                a["q_heads"],
                a["kv_heads"],
                group,
                f"{a['q_heads']} / {plan.tp} = {a['q_heads_per_rank']}",
                a["kv_mode"],
                a["kv_heads_per_rank"],
                f"{copies:g}×",
                str(a["kv_heads_by_rank"]),
                kv_text,
            ]
        )
    return Table(
        [
            "layers",
            "Q heads",
            "KV heads",
            "Q per KV",
            "Q heads per rank",
            "KV mode",
            "KV heads per rank",
            "copies of each KV head",
            "KV head(s) on rank 0..N-1",
            f"K/V per layer per rank @{context_length} (full length, no ring)",
        ],
        rows,
        f"{plan.variant or 'model'} at TP={plan.tp}",
    )


def sharded_attention_by_hand(text_model: Any, inputs_embeds: Any, tp: int, layer_index: int | None = None) -> dict:
    """One full-attention layer's TP done by hand, for the notebooks (03's k_eq_v layer, 04's 31B):
    rank `r` takes its Q heads (a column shard of `q_proj`), keeps a whole copy of the KV head they
    read where a layer has fewer KV heads than ranks, attends, and multiplies by its columns of
    `o_proj` (a row shard); the ranks' partials summed (the all-reduce) must equal transformers' own
    attention module, which the caller asserts with the returned tensors.

    Where V comes from is the layer's: a k_eq_v layer (no `v_proj`) takes the values from `k_proj`
    through the unscaled `v_norm`, any other layer from `v_proj`. `layer_index`: default the first
    full-attention layer. Returns the two outputs, the heads and which ranks hold each KV head."""
    import torch
    import torch.nn.functional as F
    from transformers.models.gemma4.modeling_gemma4 import apply_rotary_pos_emb

    if layer_index is None:
        layer_index = text_model.config.layer_types.index("full_attention")
    layer = text_model.layers[layer_index]
    attn = layer.self_attn
    with torch.no_grad():
        x = layer.input_layernorm(inputs_embeds)  # [1, T, hidden]: what the attention reads
        T, shape = x.shape[1], (1, x.shape[1], -1, attn.head_dim)
        cos, sin = text_model.rotary_emb(x, torch.arange(T)[None], "full_attention")
        causal = torch.full((T, T), float("-inf")).triu(1).to(x.dtype)
        q = apply_rotary_pos_emb(attn.q_norm(attn.q_proj(x).view(shape)), cos, sin, unsqueeze_dim=2).transpose(1, 2)
        raw = attn.k_proj(x).view(shape)
        k = apply_rotary_pos_emb(attn.k_norm(raw), cos, sin, unsqueeze_dim=2).transpose(1, 2)  # [1, KV heads, T, d]
        k_eq_v = getattr(attn, "v_proj", None) is None  # k_eq_v: the values come from the same projection
        v = attn.v_norm(raw if k_eq_v else attn.v_proj(x).view(shape)).transpose(1, 2)
        q_per_rank, q_per_kv = q.shape[1] // tp, q.shape[1] // k.shape[1]
        partials, copies = [], {}
        for rank in range(tp):
            heads = list(range(rank * q_per_rank, (rank + 1) * q_per_rank))  # this rank's Q heads (a column shard)
            kvs = sorted({h // q_per_kv for h in heads})  # the KV head(s) they read: this rank keeps whole copies
            for kv in kvs:
                copies.setdefault(kv, []).append(rank)
            group = [kvs.index(h // q_per_kv) for h in heads]  # which of the rank's KV heads each Q head reads
            k_r, v_r = k[:, kvs][:, group], v[:, kvs][:, group]
            scores = torch.softmax(q[:, heads] @ k_r.transpose(-1, -2) * attn.scaling + causal, dim=-1)
            out = (scores @ v_r).transpose(1, 2).reshape(1, T, -1)  # [1, T, this rank's heads × d]
            columns = slice(heads[0] * attn.head_dim, (heads[-1] + 1) * attn.head_dim)
            partials.append(F.linear(out, attn.o_proj.weight[:, columns]))  # row shard of o_proj: a partial sum
        attn_tp = torch.stack(partials).sum(0)  # the all-reduce
        attn_hf = attn(x, (cos, sin), causal[None, None], {})[0]  # transformers' own attention module
    return {
        "tp": tp,
        "layer": layer_index,
        "values_from": "k_proj (k_eq_v)" if k_eq_v else "v_proj",
        "q_heads": q.shape[1],
        "kv_heads": k.shape[1],
        "copies": copies,
        "attn_tp": attn_tp,
        "attn_hf": attn_hf,
    }


def tp_cpu_run(model: LoadedModel, ids: Sequence[int], settings: PortSettings, **options: Any) -> dict[str, Any]:
    """Every rank of the settings' TP plan run on CPU with real collectives (gloo), decoding without
    stopping (every token is compared), checked against the reference; the answers are cut at the
    first end-of-turn token. `options`: the gloo graph form's (`gloo.rank_graphs`: `prefill`, `baked_rank`, ...)."""
    from gemma4lib.backends import gloo, registry
    from gemma4lib.checks import first_mismatch
    from gemma4lib.port import eos_ids
    from gemma4lib.reference import reference_greedy
    from gemma4lib.runtime import Request

    graphs = gloo.rank_graphs(model, settings, **options)
    requests = [Request(list(ids), settings.max_new_tokens)]
    run = registry.run_device(model, settings, requests, graphs=graphs, bench=False)
    reference = reference_greedy(model.lm, ids, settings.max_new_tokens)
    stop = set(eos_ids(model))
    return {
        "tp": settings.tp_degree,
        "tokens": run.tokens,
        "seq_match": run.tokens == reference,
        "ranks_agree": run.details["ranks_agree"],
        "first_divergence": first_mismatch(run.tokens, reference),
        "answer": answer_text(model, until_stop(run.tokens, stop)),
        "reference_answer": answer_text(model, until_stop(reference, stop)),
    }


def tp_demo(
    model: LoadedModel,
    ids: Sequence[int],
    settings: PortSettings,
    tp: int,
    prefill: str = "graph",
    with_baked_rank: bool = False,
) -> Table:
    """The sharded model run on CPU at `tp` ranks (and, with `with_baked_rank`, the same run with the
    rank read at trace time, the 26B's bug), as one table."""
    from dataclasses import replace

    single = dict(batch_size=1, prompts=None, expects=None, draft=None, draft_tokens=None, verify_experts=None)
    sharded = replace(settings, tp_degree=tp, **single)
    runs = {
        "sharded" + (" (CPU-seeded prefill)" if prefill == "cpu-seeded" else ""): tp_cpu_run(
            model, ids, sharded, prefill=prefill
        )
    }
    if with_baked_rank:
        runs["rank baked in at trace time"] = tp_cpu_run(model, ids, sharded, prefill=prefill, baked_rank=True)
    return tp_runs_table(runs, settings.expect)


def tp_runs_table(runs: Mapping[str, Mapping[str, Any]], expect: str | None = "Paris") -> Table:
    rows = []
    for name, r in runs.items():
        coherent = None if r.get("answer") is None or not expect else expect.lower() in r["answer"].lower()
        rows.append(
            [
                name,
                r.get("tp"),
                r.get("seq_match"),
                r.get("ranks_agree"),
                coherent,
                r.get("first_divergence"),
                r.get("answer"),
            ]
        )
    return Table(
        ["run", "TP", "SEQ_MATCH", "ranks agree", "coherent", "first divergence", "answer"],
        rows,
        "tensor-parallel runs on CPU (one process per rank, gloo collectives)",
    )
