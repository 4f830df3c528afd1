"""Plots of batched decode: total tok/s against batch size, measured on CPU and computed for inf2.

Kept apart from `plots.py` (one small module per idea); the same conventions: every function
returns a matplotlib `Figure` built without pyplot.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from matplotlib.figure import Figure

from .plots import NUMBER_TICKS


def tok_s_vs_batch(
    measured: Mapping[str, Any] | None = None,
    computed: Sequence[Mapping[str, Any]] | None = None,
    title: str = "decode throughput against batch size",
) -> Figure:
    """Total decode tok/s against B, log-log, with the per-row line `B x (tok/s at B=1)` for scale.

    `measured`: one model's entry of the bench's `batch` section (`benchmarks.batch.bench_batch_model`:
    this project's graphs and HF generate, measured on this CPU). `computed`: `batch_roofline.batch_ceilings`
    rows of one variant (the inf2 ceiling, computed, unverified) and the field report's figures they carry.
    """
    # CPU and inf2 differ by orders of magnitude and measure different things (a tiny model's call
    # overhead against a released model's bandwidth): each gets its own axes, never one shared scale.
    fig = Figure(figsize=(9.6, 3.8))
    cpu, inf2 = fig.subplots(1, 2)
    if measured:
        rows = [r for r in measured["rows"] if r.get("gemma4lib_tok_s")]
        bs = [r["batch"] for r in rows]
        cpu.plot(bs, [r["gemma4lib_tok_s"] for r in rows], "o-", label=f"gemma4lib ({measured['model']})")
        hf = [(r["batch"], r["hf_eager_tok_s"]) for r in rows if r.get("hf_eager_tok_s")]
        if hf:
            cpu.plot(*zip(*hf, strict=True), "s--", label="HF generate")
        if bs and rows[0]["batch"] == 1:
            cpu.plot(bs, [b * rows[0]["gemma4lib_tok_s"] for b in bs], ":", color="#9e9e9e", label="B x (B=1)")
    if computed:
        name = computed[0]["variant"]
        inf2.plot(
            [r["batch"] for r in computed],
            [r["ceiling_tok_s"] for r in computed],
            "^-",
            label=f"ceiling ({computed[0]['recipe']}, computed)",
        )
        field = [(r["batch"], r["field_report_tok_s"]) for r in computed if r.get("field_report_tok_s")]
        if field:
            inf2.plot(*zip(*field, strict=True), "D", color="#c62828", label="field report (measured)")
        inf2.set_title(f"released {name} on inf2", fontsize=9)
    cpu.set_title("tiny model, this CPU (measured)", fontsize=9)
    for ax in (cpu, inf2):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(NUMBER_TICKS)
        ax.set_xlabel("batch size B (rows decoded per step)")
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    cpu.set_ylabel("total decode tok/s")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


__all__ = ["tok_s_vs_batch"]
