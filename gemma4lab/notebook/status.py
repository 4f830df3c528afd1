"""The status box at the top of each variant notebook: what ran here, what never ran, and where
every inf2 figure comes from.

Every figure in the box is formatted here from the library's own plans (`inf2.hardware`,
`inf2.memory_plan`, `inf2.compile_host`, `inf2.serving_host`, `inf2.roofline`) or quoted from the
field report with its source, so the notebook's prose carries no hand-typed number that could go
stale. The box is shown with a display id and filled in once more by the record cell with this
run's own measurements (the notebook's CPU run time among them): an executed copy shows what that
run measured, not what an earlier run did.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gemma4lab.inf2.context import compile_peak_at, context_plan, full_settings
from gemma4lab.inf2.roofline import compare
from gemma4lib.inf2.compile_host import compile_host_plan
from gemma4lib.inf2.hardware import GB, GIB, INSTANCES
from gemma4lib.inf2.memory_plan import DEFAULT_CONTEXT, plan_core_memory
from gemma4lib.inf2.serving_host import serving_host_plan
from gemma4lib.models.variants import get_variant
from gemma4lib.recipes.neuron_env import COMPILER_ARGS

# The field report: the earlier hands-on port to inf2 that this cookbook turns into notebooks
# (00_overview, appendix "The field report"). It is undated; its figures were quoted here on this day.
FIELD_REPORT_QUOTED = "2026-12-02"
FIELD_REPORT = f"field report, quoted {FIELD_REPORT_QUOTED}"
GLOSSARY = "00_overview.ipynb"  # the terms the box uses, defined in the overview's glossary
# What the field report measured beyond `Variant.field_report` (decode tok/s or prefill ms): only
# its 31B port states a compile time and a compile-host peak.
FIELD_REPORT_COMPILE = {"31b": {"compile_min": 39, "host_peak_gb": 182}}


def bandwidth_text(instance: str) -> str:
    """An instance's HBM bandwidth in both units, so "820" (GiB/s, AWS's figure) and "880" (GB/s,
    what the roofline tables divide by) are never mistaken for two different claims."""
    spec = INSTANCES[instance]
    return f"{spec.hbm_gib_s:,.0f} GiB/s (= {spec.hbm_bytes_s / GB:,.0f} GB/s)"


def _inf2_rows(name: str) -> list[tuple[str, str, str]]:
    """(what, the figure, its kind and source) for the released model on its inf2 instance."""
    v = get_variant(name)
    spec = INSTANCES[v.instance_type]
    core = plan_core_memory(v, v.tp_degree, instance=v.instance_type)
    compile_plan = compile_host_plan(v, v.tp_degree)
    serving = serving_host_plan(v, v.tp_degree, v.instance_type)
    # the decode graph's own form: a MoE's selective decode reads the routed experts, not all of them
    experts = "selective" if v.is_moe else "dense"
    step = compare(
        0.0, v.name, device=v.instance_type, cores=v.tp_degree, context_length=DEFAULT_CONTEXT, experts=experts
    )
    reported = FIELD_REPORT_COMPILE.get(v.name, {})
    fr = v.field_report
    measured = []
    if fr.decode_tok_s:
        measured.append(f"decode ~{fr.decode_tok_s:g} tok/s ({1000 / fr.decode_tok_s:.0f} ms a step)")
    if fr.prefill_ms:
        measured.append(f"prefill ~{fr.prefill_ms:g} ms")
    recipe = f" with its {fr.recipe} recipe" if fr.recipe else ""
    compile_host = core.compile_host or v.instance_type
    planned, full = context_plan(v, v.instance_type, v.tp_degree), full_settings(v)
    full_peak = compile_peak_at(v, v.tp_degree, full["context_length"])
    disk_gb = core.weights_gib * GIB / GB * v.tp_degree
    return [
        (
            "instance",
            f"`{spec.name}`: {spec.chips} chip(s), {spec.neuron_cores} NeuronCores, {spec.hbm_gib} GiB "
            f"[HBM]({GLOSSARY}#hbm), "
            f"{bandwidth_text(spec.name)}",
            "AWS's published inf2 specification (`inf2/hardware.py`)",
        ),
        ("recipe", f"NxD `{v.recipe}` at [TP]({GLOSSARY}#tp)={v.tp_degree}", "this cookbook's plan (`Variant.recipe`)"),
        (
            "compiler flags",
            "; ".join(f"{phase}: `{COMPILER_ARGS[phase]}`" for phase in ("prefill", "decode")),
            "the library's own list (`neuron_env.COMPILER_ARGS`), passed to every key of that phase",
        ),
        (
            "memory per NeuronCore",
            f"{core.weights_gib:.1f} GiB weights + {core.kv_gib:.2f} GiB K/V at {core.context_length:,} tokens, "
            f"{'sliding layers in a ring' if core.ring else 'full length (no ring)'} "
            "(this core's KV heads: a head replicated under TP counted on every rank that keeps a copy) + "
            f"{core.working_gib:.1f} GiB working = {core.total_gib:.1f} of {core.capacity_gib:.0f} GiB",
            "computed (`memory_plan`), unverified on inf2; the working memory is an allowance for the Neuron "
            "runtime, the program and its activations, not a measurement",
        ),
        (
            "compile host RAM",
            f"~{compile_plan.peak_gb:.0f} GB at its peak step ({compile_plan.peak_step}); compile on an "
            f"`{compile_host}`"
            + (
                f"; the field report's port, which held its checkpoint whole, peaked at {reported['host_peak_gb']} GB"
                if reported
                else ""
            ),
            "computed (`inf2.compile_host`; the compiler's own RAM unverified)"
            + (f"; {FIELD_REPORT}" if reported else ""),
        ),
        (
            "longest context",
            f"{planned.context:,} tokens at TP={v.tp_degree} (HBM alone: {planned.device_context:,}; bound: "
            f"{planned.binding}); the full profile compiles {full['context_length']:,} with prefill buckets "
            f"{full['prefill_buckets']} and context buckets {full['context_buckets']}: ~{full_peak:.0f} GB on the "
            f"compile host with the compiler's RAM",
            "computed (`gemma4lab.inf2.context.context_plan`); the compiler's RAM an assumed law calibrated on NxD "
            "Inference's 31B compiles (README, the family table's note), unverified on inf2",
        ),
        (
            "compile time",
            f"~{reported['compile_min']} min (the field report's port)" if reported else "not known",
            FIELD_REPORT
            if reported
            else "the field report states none for this variant; this project compiled nothing on inf2",
        ),
        (
            "disk for the compiled port",
            f"~{disk_gb:.1f} GB of sharded bf16 weights: {v.tp_degree} file(s), one per rank, each the "
            f"{core.weights_gib:.1f} GiB of weights per NeuronCore above (the tensors every rank keeps whole, "
            "such as norms and copied KV heads, counted in each file, so more than the model's weights); "
            "+ the compiled "
            f"[NEFFs]({GLOSSARY}#neff) (size unmeasured)",
            "computed from the rank plan (`memory_plan`)",
        ),
        ("serving host RAM", serving.summary().split(": ", 1)[1], "computed (`inf2.serving_host`), unverified on inf2"),
        (
            "decode step",
            f"≥ {1000 / step['ceiling_tok_s']:.1f} ms at {DEFAULT_CONTEXT:,} tokens: bytes per step (K/V: each KV head "
            "once)"
            + (" (selective experts: the routed ones)" if v.is_moe else "")
            + f" ÷ the bandwidth of the TP={v.tp_degree} cores "
            f"({step['bandwidth_gb_s']:,.0f} GB/s of the instance's {spec.hbm_bytes_s / GB:,.0f})",
            f"computed (`inf2.roofline`), a lower bound: the [ceiling]({GLOSSARY}#roofline)",
        ),
        (
            "measured on inf2",
            "; ".join(measured) + recipe if measured else "nothing",
            FIELD_REPORT if measured else "-",
        ),
        (
            "hourly cost",
            "not stated: no price with a source and date is kept in this repository",
            "see AWS's on-demand price list for your region",
        ),
    ]


def _markdown(name: str, finished: dict[str, Any] | None) -> str:
    v = get_variant(name)
    if finished:
        ran = (
            f"**Ran here** (this run, measured on this CPU, {finished['threads']} thread(s)): the cells took "
            f"{finished['elapsed_s']:.0f} s; compile {finished['compile_s']:.1f} s{finished['cached']}; prefill "
            f"{finished['prefill_ms']:.2f} ms; decode {finished['decode_tok_s']:,.0f} tok/s; checks: SEQ_MATCH "
            f"{finished['seq_match']}, LOGITS_MATCH {finished['logits_match']}, coherent {finished['coherent']}."
        )
    else:
        ran = "**Ran here**: filled in by the record cell (section 9) when this notebook has run."
    here = (
        f"this smoke run compiled `context_length={finished['context_length']}`"
        if finished and finished.get("context_length")
        else "this smoke run compiles the parameters cell's `context_length` (the record cell adds it here)"
    )
    contexts = (
        f"- **Contexts**: the inf2 figures below are planned at {DEFAULT_CONTEXT:,} tokens "
        "(`memory_plan.DEFAULT_CONTEXT`: the released model's K/V at that length, and the benchmark table's inf2 "
        "column), except the longest context's row; the full-profile command in the Parameters section compiles "
        f"the `context_length` it names, which holds the K/V of that length instead; {here}."
    )
    lines = [
        f"**Status of this notebook** ({v.name}, smoke profile)",
        "",
        f"- {ran}",
        "- **What ran here**: every cell, on a CPU, with a tiny trained model of this architecture compiled by "
        f"[AOTInductor]({GLOSSARY}#aotinductor).",
        "- **Never run**: every inf2 cell (guarded by `if on_inf2`, from the backend's facts). Here they print "
        "`skipped: backend=cpu`; no figure in this notebook was measured on inf2 by this project.",
        "- **Kinds of figure**: *measured* (this run, on this CPU), *computed* (from the released config and the "
        "plans in `gemma4lib/inf2/`, unverified on inf2), *field-reported* (measured on inf2 by the "
        "[field report](00_overview.ipynb#field-report)).",
        contexts,
        "",
        f"| released `{v.hf_id}` on inf2 | figure | kind and source |",
        "|---|---|---|",
    ]
    lines += [f"| {what} | {figure} | {source} |" for what, figure, source in _inf2_rows(name)]
    return "\n".join(lines)


@dataclass
class StatusBox:
    """The box, shown once at the top and updated in place by `finish` (same display id)."""

    variant: str
    started: float = field(default_factory=time.perf_counter)
    handle: Any = None
    finished: dict[str, Any] | None = None  # this run's figures, once the record cell has run

    def markdown(self, finished: dict[str, Any] | None = None) -> str:
        return _markdown(self.variant, finished)

    def show(self) -> StatusBox:
        from IPython.display import Markdown, display

        self.handle = display(Markdown(self.markdown()), display_id=True)
        return self

    def finish(self, record: dict[str, Any]) -> None:
        """Fill in this run's measurements from its record, in the box at the top (`markdown` gives the text)."""
        finished = {
            "elapsed_s": time.perf_counter() - self.started,
            "threads": (record.get("bench") or {}).get("threads", 1),
            **{k: record.get(k) for k in ("prefill_ms", "decode_tok_s")},
            **{k: record.get(k) for k in ("seq_match", "logits_match", "coherent")},
            "context_length": (record.get("parameters") or {}).get("context_length"),
            **compiled_graphs(record),
        }
        self.finished = finished
        if self.handle is not None:
            from IPython.display import Markdown

            self.handle.update(Markdown(self.markdown(finished)))


def compiled_graphs(record: Mapping[str, Any]) -> dict[str, Any]:
    """`compile_s` and `cached` for the box: every graph the run compiled or found in the cache, the
    text graphs' (the record's own), the image section's (`demos.image`) and the witness's (its
    compile time is not recorded, so the seconds are the text and image graphs')."""
    demos = record.get("demos") or {}
    parts = {"text": (record.get("compile_s"), record.get("cache_hits"))}
    parts["image"] = ((demos.get("image") or {}).get("compile_s"), (demos.get("image") or {}).get("cache_hits"))
    parts["witness"] = (None, (record.get("witness") or {}).get("cache_hits"))
    parts = {name: (s, list(hits)) for name, (s, hits) in parts.items() if hits}
    graphs = sum(len(hits) for _, hits in parts.values())
    cached = sum(sum(map(bool, hits)) for _, hits in parts.values())
    each = ", ".join(f"{name} {sum(map(bool, hits))} of {len(hits)}" for name, (_, hits) in parts.items())
    unmeasured = "; the witness's seconds not measured" if "witness" in parts else ""
    return {
        "compile_s": sum(s or 0.0 for s, _ in parts.values()),
        "cached": f" ({cached} of {graphs} graphs from the compile cache: {each}{unmeasured})",
    }


def status_box(variant: str) -> StatusBox:
    """Show the status box of `variant`'s notebook (call it in the notebook's first code cell)."""
    return StatusBox(variant).show()
