"""The lab's inf2 tables: every variant's decode ceilings, prefill floors and batched ceilings as
markdown (docs/ROOFLINE.md), a benchmark report's rows for `plots.measured_vs_ceiling`, and the
family tables `python -m gemma4lab plan` prints (`family_report`): the per-core memory plan of every
variant, the planned contexts per inf2 size (`context_table`), the serving host of each, and the vision
part's tables and image prefill floor.

Computed from shapes by the planners in `gemma4lib.inf2` (one variant at a time: what the port's
preflight and `python -m gemma4lab doctor --variant V` check) and `gemma4lab.inf2`; this module only
runs them over the family and lays their rows out.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict
from typing import Any

from gemma4lab.inf2.batch_roofline import BATCHES, batch_ceilings
from gemma4lab.inf2.context import context_plan, largest_context
from gemma4lab.inf2.image_prefill import format_image_prefill_table, image_prefill_table
from gemma4lab.inf2.plans import compile_elsewhere, plan_dict
from gemma4lab.inf2.prefill import prefill_estimate
from gemma4lab.inf2.roofline import ceiling_tok_s, decode_bytes, device_params, plan_split
from gemma4lib.inf2.audio_plan import AUDIO_SOURCE, audio_plan
from gemma4lib.inf2.hardware import GB, GIB, INSTANCES, NEURON_TP_DEGREES
from gemma4lib.inf2.memory_plan import DEFAULT_CONTEXT, CoreMemoryPlan, plan_core_memory
from gemma4lib.inf2.params import ParamCounts, count_params, meta_model
from gemma4lib.inf2.serving_host import ServingHostPlan, serving_host_plan
from gemma4lib.inf2.vision_plan import PLACEMENT, SOURCE, VisionPlan, vision_plan
from gemma4lib.models.audio import HEARING_VARIANTS
from gemma4lib.models.variants import REPORTED_VISION as REPORTED
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
        forms: list[tuple[str, str | None]] = [("dense", plan_split(counts, tp))]
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
                    resident = device_params(counts) * dtype_bytes + steps.kv
                    for inst in INSTANCES.values():
                        row["ceiling_tok_s"][inst.name] = ceiling_tok_s(steps.total, inst.hbm_bytes_s)
                        row["fits_hbm"][inst.name] = resident <= inst.hbm_gib * GIB
                    rows.append(row)
    return rows


def _splits_at(counts: ParamCounts, tp: int) -> list[str]:
    """The expert splits possible at `tp`, the plan's default first."""
    default = plan_split(counts, tp)
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


# ---- the family tables (`python -m gemma4lab plan`) ----------------------------------------------


def plan_table(
    context_length: int = DEFAULT_CONTEXT, ring: bool = True, vision: bool = False, audio: bool = False
) -> list[CoreMemoryPlan]:
    """Each variant at its recipe's TP on its instance, plus the next smaller TP (to show why not);
    `vision` / `audio`: with that media tower on rank 0's core (`plan_core_memory`;
    audio: the variants that hear only)."""
    plans = []
    for v in VARIANTS.values():
        if audio and v.name not in HEARING_VARIANTS:
            continue
        degrees = [t for t in v.supported_tp if t in NEURON_TP_DEGREES and t <= v.tp_degree]
        for tp in sorted({v.tp_degree, *degrees[-2:]}):
            plans.append(plan_core_memory(v, tp, context_length=context_length, ring=ring, vision=vision, audio=audio))
    return plans


def format_plan_table(plans: list[CoreMemoryPlan]) -> str:
    """Markdown rows of `plan_table` (GiB per NeuronCore; compile host RAM in GB); a vision (audio) column
    when a plan carries the vision (audio) part."""
    towers = [name for name in ("vision", "audio") if any(getattr(p, f"{name}_gib") for p in plans)]
    extra = "".join(f" {name} (rank 0's core) |" for name in towers)
    lines = [
        "| variant | recipe | TP | instance | weights/core | K/V/core | working |" + extra + " total / 16 GiB | "
        "compile host | fits |",
        "|---|---|---|---|---|---|---|" + "---|" * len(towers) + "---|---|---|",
    ]
    for p in plans:
        cell = "".join(f" {getattr(p, f'{name}_gib'):.2f} GiB |" for name in towers)
        lines.append(
            f"| {p.variant} | {p.recipe} | {p.tp} | {p.instance} | {p.weights_gib:.1f} GiB | "
            f"{p.kv_gib:.2f} GiB | {p.working_gib:.0f} GiB |{cell} {p.total_gib:.1f} GiB | "
            f"~{p.compile_peak_gb:.0f} GB / {p.host_ram_gib} GiB{compile_elsewhere(p)} | "
            f"{'yes' if p.fits else 'no: ' + '; '.join(p.problems)} |"
        )
    return "\n".join(lines)


def format_serving_host(plans: list[ServingHostPlan]) -> str:
    """Markdown rows for a notebook's "Runs on" block or the README (GB; the host's RAM in GiB)."""
    lines = [
        "| serving host | TP | model | host tables | host K/V | peak step | peak | available | fits |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in plans:
        lines.append(
            f"| {p.variant} on {p.instance} | {p.tp} | {p.model_gb:.1f} GB | {p.host_tables_gb:.1f} GB | "
            f"{p.host_kv_gb:.2f} GB | {p.peak_step} | {p.peak_gb:.1f} GB | {p.available_gb:.1f} GB | "
            f"{'yes' if p.fits else 'no'} |"
        )
    return "\n".join(lines)


TARGETS = (8192, 32768, 131072)  # issue 48 item 4's contexts, then each variant's released maximum


def context_table() -> list[dict[str, Any]]:
    """Per variant and inf2 size it runs on: the longest planned context (`largest_context`), both bounds,
    and for 8K / 32K / 128K / the released maximum whether it fits, else the bound it breaks."""
    rows = []
    for v in VARIANTS.values():
        for instance in INSTANCES:
            context, tp = largest_context(v, instance)
            if not context:
                continue
            plan = context_plan(v, instance, tp)
            targets = [
                (t, "fits" if t <= context else "HBM" if t > plan.device_context else "compile RAM")
                for t in (*TARGETS, v.released_context)
            ]
            hopeful = context_plan(v, instance, tp, least=True).context  # the compiler at its least
            rows.append(
                {**asdict(plan), "context": context, "binding": plan.binding, "targets": targets, "hopeful": hopeful}
            )
    return rows


def format_context_table(rows: list[dict[str, Any]]) -> str:
    """Markdown rows of `context_table`."""
    lines = [
        "| variant | instance | TP | HBM bound | compile bound (host) | planned | 8K | 32K | 128K | released max | "
        "planned at the least compiler RAM |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        marks = " | ".join(f"{m} ({t:,})" if i == 3 else m for i, (t, m) in enumerate(r["targets"]))
        lines.append(
            f"| {r['variant']} | {r['instance']} | {r['tp']} | {r['device_context']:,} | "
            f"{r['compile_context']:,} ({r['compile_host']}, ~{r['compile_peak_gb']:.0f} GB at the planned) | "
            f"{r['context']:,} ({r['binding']}) | {marks} | {r['hopeful']:,} |"
        )
    return "\n".join(lines)


def serving_host_table() -> list[ServingHostPlan]:
    """Each variant at its recipe's TP on its recommended instance."""
    return [serving_host_plan(v) for v in VARIANTS.values()]


def vision_table(source: str = "defaults") -> list[VisionPlan]:
    """Every variant's vision plan; with `source="reported"` only the variants a report exists for."""
    names = [n for n in VARIANTS if source == "defaults" or n in REPORTED]
    return [vision_plan(n, source) for n in names]


def format_vision_table(plans: list[VisionPlan]) -> str:
    """Markdown rows of `vision_table` (GiB on the one core that runs the vision graph)."""
    lines = [
        "| variant | vision part | params | weights | activations (eager, one image) | patches -> soft tokens | "
        "on inf2 |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in plans:
        kind = "encoder-free projection" if p.encoder_free else f"encoder, {p.layers} layers"
        lines.append(
            f"| {p.variant} | {kind} | {p.params / 1e6:,.1f}M | {p.weights_gib:.2f} GiB | "
            f"{p.activations_gib:.2f} GiB | {p.patches:,} -> {p.soft_tokens} | one core, no TP |"
        )
    return "\n".join(lines)


def audio_table() -> list[VisionPlan]:
    """The audio part of every variant that hears (`audio_plan.audio_plan`: one 30 s clip)."""
    return [audio_plan(n) for n in HEARING_VARIANTS]


def format_audio_table(plans: list[VisionPlan]) -> str:
    """Markdown rows of `audio_table` (GiB on rank 0's core, beside the vision graph)."""
    lines = [
        "| variant | audio part | params (tower + embedder) | weights | activations (eager, 30 s) | "
        "frames -> soft tokens | on inf2 |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in plans:
        kind = "encoder-free frame embedder" if p.encoder_free else f"conformer, {p.layers} layers"
        lines.append(
            f"| {p.variant} | {kind} | {p.params / 1e6:,.1f}M ({p.tower_params / 1e6:,.1f}M + "
            f"{p.embedder_params / 1e6:,.1f}M) | {p.weights_gib:.3f} GiB | {p.activations_gib:.3f} GiB | "
            f"{p.patches:,} -> {p.soft_tokens} | rank 0's core, no TP, no extra core |"
        )
    return "\n".join(lines)


def audio_report(context_length: int = DEFAULT_CONTEXT) -> dict[str, Any]:
    """The audio section of `family_report`: each hearing variant's audio part and its per-core plans with
    vision and audio both on rank 0's core (computed, unverified; `audio_plan.AUDIO_SOURCE`)."""
    parts, plans = audio_table(), plan_table(context_length, vision=True, audio=True)
    return {
        "source": AUDIO_SOURCE,
        "placement": PLACEMENT,
        "parts": [plan_dict(p) for p in parts],
        "table": format_audio_table(parts),
        "plans": [plan_dict(p) for p in plans],
        "plan_table": format_plan_table(plans),
    }


def vision_report(context_length: int = DEFAULT_CONTEXT) -> dict[str, Any]:
    """The vision section of `family_report`: every variant's vision part, the per-core plans with it, and the
    image prefill floor (computed, unverified; `vision_plan.SOURCE`), with the third-party widths
    reported for the 31B's and the 26B-A4B's towers beside them."""
    parts, reported = vision_table(), vision_table("reported")
    plans = plan_table(context_length, vision=True)
    prefill = image_prefill_table()
    return {
        "source": SOURCE,
        "placement": PLACEMENT,
        "parts": [plan_dict(p) for p in parts],
        "table": format_vision_table(parts),
        "reported": {
            "parts": [plan_dict(p) for p in reported],
            "table": format_vision_table(reported),
            "sources": {name: r["source"] for name, r in REPORTED.items()},
        },
        "plans": [plan_dict(p) for p in plans],
        "plan_table": format_plan_table(plans),
        "image_prefill": prefill,
        "image_prefill_table": format_image_prefill_table(prefill),
    }


def family_report(context_length: int = DEFAULT_CONTEXT) -> dict[str, Any]:
    """The family tables as one JSON-friendly report: every variant's per-core memory plan, each
    variant's serving host, and the vision section (`vision_report`)."""
    plans = plan_table(context_length)
    return {
        "memory_plan": {
            "context_length": context_length,
            "plans": [plan_dict(p) for p in plans],
            "table": format_plan_table(plans),
        },
        "context_table": format_context_table(context_table()),
        "serving_host_table": format_serving_host(serving_host_table()),
        "vision": vision_report(context_length),
        "audio": audio_report(context_length),
    }


def format_family(report: dict[str, Any]) -> str:
    """`family_report` as text: each table under the line that says what it counts."""
    m = report["memory_plan"]
    lines = [
        f"memory plan per NeuronCore (bf16, context {m['context_length']}, ring K/V; working memory is "
        f"an allowance, unverified on inf2):"
    ]
    lines += ["  " + row for row in m["table"].splitlines()]
    lines.append(
        "planned contexts per inf2 size (the least of the HBM bound and the compile host's, whose compiler RAM is "
        "an assumed law calibrated on NxD Inference's 31B compiles: python -m gemma4lab doctor; computed, "
        "unverified on inf2):"
    )
    lines += ["  " + row for row in report["context_table"].splitlines()]
    lines.append(
        "serving host per variant (bf16, prompt 128 + 64 new tokens; computed from the configs, the process "
        "base measured on CPU, unverified on inf2):"
    )
    lines += ["  " + row for row in report["serving_host_table"].splitlines()]
    vision = report["vision"]
    lines.append(f"vision part per variant ({vision['source']}; {vision['placement']}):")
    lines += ["  " + row for row in vision["table"].splitlines()]
    lines.append("  reported by third parties (not the released config.json), for comparison:")
    lines += ["  " + row for row in vision["reported"]["table"].splitlines()]
    lines.append(f"memory plan per NeuronCore with the vision part (context {m['context_length']}):")
    lines += ["  " + row for row in vision["plan_table"].splitlines()]
    lines.append(
        "image prefill floor on inf2 (one image at the processor's budget, 32 text tokens; vision graph at "
        "190 TFLOPS bf16 per chip, one core's share; computed, unverified on inf2):"
    )
    lines += ["  " + row for row in vision["image_prefill_table"].splitlines()]
    audio = report["audio"]
    lines.append(f"audio part per variant that hears ({audio['source']}; {audio['placement']}):")
    lines += ["  " + row for row in audio["table"].splitlines()]
    lines.append(f"memory plan per NeuronCore with the vision and audio parts (context {m['context_length']}):")
    lines += ["  " + row for row in audio["plan_table"].splitlines()]
    return "\n".join(lines)
