"""Tensor parallelism in the notebooks: the plan, KV heads per rank, and the TP ranks run on CPU
(gloo) with their tokens and answers side by side, the field report's baked-rank bug included."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..models.loading import LoadedModel
from ..models.variants import Variant, get_variant
from .display import Table, answer_text, until_stop
from .family import BF16_BYTES, real_config

if TYPE_CHECKING:  # type names only
    from ..settings import PortSettings


def tp_plan(variant: Variant | str, tp: int | None = None, config: Any = None) -> Any:
    """The sharding plan of the released config (or `config`) at `tp` (default: the variant's)."""
    from ..tp import make_plan

    v = variant if isinstance(variant, Variant) else get_variant(variant)
    return make_plan(config if config is not None else real_config(v), tp or v.tp_degree, v)


def kv_heads_under_tp(
    variant: Variant | str, tp: int | None = None, config: Any = None, context_length: int = 2048
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


def tp_cpu_run(model: LoadedModel, ids: Sequence[int], settings: PortSettings, **options: Any) -> dict[str, Any]:
    """Every rank of the settings' TP plan run on CPU with real collectives (gloo), decoding without
    stopping (every token is compared), checked against the reference; the answers are cut at the
    first end-of-turn token. `options`: the gloo run's (`prefill`, `baked_rank`, ...)."""
    from ..backends import gloo
    from ..checks import first_mismatch
    from ..port import eos_ids
    from ..reference import reference_greedy
    from ..runtime import Request

    run = gloo.run(model, settings, [Request(list(ids), settings.max_new_tokens)], bench=False, **options)
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
