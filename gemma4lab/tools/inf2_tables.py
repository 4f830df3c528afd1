"""The docs' inf2 tables (docs/ROOFLINE.md): every variant's decode ceilings, prefill floors and
batched ceilings as markdown, and a benchmark report's rows for `plots.measured_vs_ceiling`.

Computed from shapes by the planners in `gemma4lib.inf2`; this module only lays their rows out.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from gemma4lab.inf2.batch_roofline import BATCHES, batch_ceilings
from gemma4lib.inf2.hardware import GB, GIB, INSTANCES
from gemma4lib.inf2.params import ParamCounts, count_params, meta_model
from gemma4lib.inf2.prefill import prefill_estimate
from gemma4lib.inf2.roofline import ceiling_tok_s, decode_bytes
from gemma4lib.models.variants import VARIANTS, get_variant


def rows_from_report(report: dict[str, Any], path: str = "gemma4lib") -> list[dict[str, Any]]:
    """`compare()`-shaped rows for every model of a `benchmarks.suite.run_suite` report (one path)."""
    rows = []
    for model in report.get("models", []):
        measured = model["paths"].get(path, {}).get("decode_tok_s")
        rows.append(
            {
                "label": model["name"],
                "device": "cpu",
                "measured_tok_s": measured,
                "ceiling_tok_s": model["ceiling_tok_s"],
                "roofline_fraction": model["roofline_fraction"].get(path),
                "bandwidth_gb_s": model["bandwidth"]["gb_s"],
                "bytes_per_step": model["bytes_per_step"],
            }
        )
    return rows


def inf2_table(
    contexts: Iterable[int] = (2048, 8192), variants: Iterable[str] | None = None, dtype_bytes: int = 2
) -> list[dict[str, Any]]:
    """Per variant, per experts form and KV form: bf16 bytes/token and the tok/s ceiling on each
    instance (all its cores) and on the recipe's own instance at its TP degree; the recipe's
    bytes and ceiling again with weight-only int8 (`int8_recipe_*`; K/V stays bf16).

    MoE selective rows come once per expert split the recipe's TP degree allows, the plan's
    default first (the intermediate split for the 26B-A4B at TP=8) and the expert split after it
    for comparison; only the recipe columns differ between them (the rest is the ideal, k routed
    experts' bytes)."""
    rows = []
    for name in variants or VARIANTS:
        variant = get_variant(name)
        lm = meta_model(variant)
        counts = count_params(lm)
        tp = variant.tp_degree
        forms: list[tuple[str, str | None]] = [("dense", counts.expert_split(tp))]
        if counts.num_experts:
            forms += [("selective", split) for split in _splits_at(counts, tp)]
        for context in contexts:
            for ring in (False, True):
                for form, split in forms:
                    shape = dict(context_length=context, ring=ring, experts=form, dtype_bytes=dtype_bytes)
                    steps = decode_bytes(lm, **shape)
                    on_ranks = decode_bytes(lm, **shape, tp=tp, expert_split=split)
                    int8_on_ranks = decode_bytes(lm, **shape, tp=tp, expert_split=split, weight_format="int8")
                    recipe_instance = INSTANCES[variant.instance_type]
                    row = {
                        "variant": variant.name,
                        "context_length": context,
                        "kv": "ring" if ring else "full",
                        "experts": steps.experts_form,
                        "expert_split": split,
                        "weights_gb": steps.weights / GB,
                        "kv_gb": steps.kv / GB,
                        "total_gb": steps.total / GB,
                        "recipe": f"{variant.instance_type} TP={tp}",
                        "recipe_gb": on_ranks.total / GB,
                        "recipe_ceiling_tok_s": ceiling_tok_s(on_ranks.total, recipe_instance.bandwidth_bytes_s(tp)),
                        # weight-only int8 (computed from shapes, unmeasured on inf2): same recipe and cores
                        "int8_recipe_gb": int8_on_ranks.total / GB,
                        "int8_recipe_ceiling_tok_s": ceiling_tok_s(
                            int8_on_ranks.total, recipe_instance.bandwidth_bytes_s(tp)
                        ),
                        "ceiling_tok_s": {},
                        "fits_hbm": {},
                    }
                    # resident: ALL weights (every expert) + KV, whatever the read form
                    resident = counts.device_params("dense") * dtype_bytes + steps.kv
                    for inst in INSTANCES.values():
                        row["ceiling_tok_s"][inst.name] = ceiling_tok_s(steps.total, inst.hbm_bytes_s)
                        row["fits_hbm"][inst.name] = resident <= inst.hbm_gib * GIB
                    rows.append(row)
    return rows


def _splits_at(counts: ParamCounts, tp: int) -> list[str]:
    """The expert splits possible at `tp`, the plan's default first."""
    default = counts.expert_split(tp)
    possible = [
        s for s, n in (("intermediate", counts.moe_intermediate), ("experts", counts.num_experts)) if n and n % tp == 0
    ]
    return [default] + [s for s in possible if s != default] if default else possible


_SPLIT_LABEL = {"experts": "expert", "intermediate": "intermediate"}


def format_inf2_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown for `inf2_table` rows."""
    names = list(INSTANCES)
    head = (
        "| variant | ctx | KV | experts | weights GB | KV GB | total GB | recipe reads GB | recipe ceiling tok/s | "
        "int8: recipe reads GB | int8: recipe ceiling tok/s | " + " | ".join(names) + " |"
    )
    lines = [head, "|" + "---|" * (11 + len(names))]
    for r in rows:
        cells = [f"{r['ceiling_tok_s'][n]:.0f}" if r["fits_hbm"][n] else "–" for n in names]
        experts = r["experts"]
        if experts == "selective" and r.get("expert_split"):
            experts += f" ({_SPLIT_LABEL.get(r['expert_split'], r['expert_split'])} split)"
        lines.append(
            f"| {r['variant']} | {r['context_length']} | {r['kv']} | {experts} | {r['weights_gb']:.2f} | "
            f"{r['kv_gb']:.3f} | {r['total_gb']:.2f} | {r['recipe_gb']:.2f} | "
            f"{r['recipe_ceiling_tok_s']:.0f} ({r['recipe']}) | {r['int8_recipe_gb']:.2f} | "
            f"{r['int8_recipe_ceiling_tok_s']:.0f} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


def prefill_table(tokens: int = 128, context_length: int = 2048) -> list[dict[str, Any]]:
    """`prefill_estimate` of every variant at its recipe's TP, beside the field report's figures."""
    rows = []
    for v in VARIANTS.values():
        row = prefill_estimate(v, tokens, context_length=context_length).to_dict()
        row["field_report_prefill_ms"] = v.field_report.prefill_ms
        row["field_report_decode_tok_s"] = v.field_report.decode_tok_s
        rows.append(row)
    return rows


def format_prefill_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown for `prefill_table` rows."""
    lines = [
        "| variant | recipe | tokens | TFLOP | GB read | compute ms | memory ms | computed floor ms | "
        "field report | as decode steps (trace recipe) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        measured = f"prefill {r['field_report_prefill_ms']:.0f} ms" if r["field_report_prefill_ms"] else "–"
        if r["field_report_decode_tok_s"]:
            measured = f"decode {r['field_report_decode_tok_s']:.0f} tok/s" if measured == "–" else measured
        # the trace recipe (one core only) feeds the prompt through the decode graph, one step a token
        stepwise = f"{r['stepwise_ms']:,.0f} ms" if r["stepwise_ms"] and r["tp"] == 1 else "–"
        lines.append(
            f"| {r['variant']} | {r['instance']} TP={r['tp']} | {r['tokens']} | {r['flops'] / 1e12:.2f} | "
            f"{r['bytes'] / GB:.2f} | {r['compute_ms']:.1f} | {r['memory_ms']:.1f} | "
            f"{r['expected_ms']:.1f} ({r['bound']}) | {measured} | {stepwise} |"
        )
    return "\n".join(lines)


def batch_table(
    variants: Iterable[str] | None = None, batches: Iterable[int] = BATCHES, context_length: int = 2048
) -> list[dict[str, Any]]:
    """`batch_ceilings` of every variant (ring K/V), one row per (variant, batch)."""
    return [
        row for name in variants or VARIANTS for row in batch_ceilings(name, batches, context_length=context_length)
    ]


def format_batch_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown for `batch_table` rows."""
    lines = [
        "| variant | recipe | B | experts | GB/step | memory ceiling tok/s | compute ceiling tok/s | "
        "ceiling (total) tok/s | per row | field report (measured) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        field = f"{r['field_report_tok_s']:g}" if r.get("field_report_tok_s") else "–"
        gb = f"{r['bytes_per_step_gb']:.2f}"
        experts = r["experts"]
        if r.get("experts_read") not in (None, experts):
            experts += f" (reads {r['experts_read']})"
        if r.get("dense_bytes_per_step_gb") is not None and r["dense_bytes_per_step_gb"] < r["bytes_per_step_gb"]:
            gb += f" (dense {r['dense_bytes_per_step_gb']:.2f})"
        lines.append(
            f"| {r['variant']} | {r['recipe']} | {r['batch']} | {experts} | {gb} | "
            f"{r['memory_ceiling_tok_s']:,.0f} | {r['compute_ceiling_tok_s']:,.0f} | {r['ceiling_tok_s']:,.0f} "
            f"({r['bound']}) | {r['ceiling_tok_s'] / r['batch']:,.0f} | {field} |"
        )
    return "\n".join(lines)
