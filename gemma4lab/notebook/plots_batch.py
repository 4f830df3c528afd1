"""Plots of batched decode: total tok/s against batch size, measured on CPU and computed for inf2.

Kept apart from `plots.py` (one small module per idea); the same conventions: every function
returns a matplotlib `Figure` built without pyplot.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from matplotlib.figure import Figure

from gemma4lab.notebook.plots import NUMBER_TICKS  # importing plots also makes IPython draw a returned Figure


def tok_s_vs_batch(
    measured: Mapping[str, Any] | None = None,
    computed: Sequence[Mapping[str, Any]] | None = None,
    title: str = "decode throughput against batch size",
) -> Figure:
    """Total decode tok/s against B, each line normalised to its own B = 1 (linear y), with the line
    `B` (B rows for the cost of one) for scale; each line's tok/s at B = 1 is in its label.

    `measured`: one model's entry of the bench's `batch` section (`benchmarks.batch.bench_batch_model`:
    this project's graphs and HF generate, measured on this CPU). `computed`: `batch_roofline.batch_ceilings`
    rows of one variant (the inf2 ceiling, computed, unverified) and the field report's figures they carry.
    """
    # CPU and inf2 differ by orders of magnitude and measure different things (a tiny model's call
    # overhead against a released model's bandwidth): each gets its own axes, and each line is read
    # against its own B = 1, so a log scale never has to squeeze them together.
    fig = Figure(figsize=(9.6, 4.0))
    cpu, inf2 = fig.subplots(1, 2)

    def line(ax: Any, points: Sequence[tuple[int, float]], style: str, label: str, **kw: Any) -> None:
        base = dict(points).get(1)
        if not base:  # no B = 1 point to normalise to: leave the line out rather than guess
            return
        bs, ys = zip(*points, strict=True)
        ax.plot(bs, [y / base for y in ys], style, label=f"{label}; B = 1: {base:,.0f} tok/s", **kw)

    def ideal(ax: Any, bs: Sequence[int]) -> None:
        ax.plot(bs, bs, ":", color="#9e9e9e", label="B x (B = 1): B rows for the cost of one")

    if measured:
        rows = [r for r in measured["rows"] if r.get("gemma4lib_tok_s")]
        line(cpu, [(r["batch"], r["gemma4lib_tok_s"]) for r in rows], "o-", f"gemma4lib ({measured['model']})")
        hf = [(r["batch"], r["hf_eager_tok_s"]) for r in rows if r.get("hf_eager_tok_s")]
        if hf:
            line(cpu, hf, "s--", "HF generate")
        if rows:
            ideal(cpu, [r["batch"] for r in rows])
    if computed:
        name = computed[0]["variant"]
        points = [(r["batch"], r["ceiling_tok_s"]) for r in computed]
        line(inf2, points, "^-", f"ceiling ({computed[0]['recipe']}, computed)")
        field = [(r["batch"], r["field_report_tok_s"]) for r in computed if r.get("field_report_tok_s")]
        if field:
            line(inf2, field, "D", "field report (measured)", color="#c62828")
        ideal(inf2, [b for b, _ in points])
        inf2.set_title(f"released {name} on inf2", fontsize=9)
    cpu.set_title("tiny model, this CPU (measured)", fontsize=9)
    for ax in (cpu, inf2):
        ax.set_xscale("log", base=2)
        bs = sorted({float(b) for ln in ax.get_lines() for b in ln.get_xdata()})
        ax.set_xticks(bs, [f"{b:g}" for b in bs])
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.yaxis.set_major_formatter(NUMBER_TICKS)
        ax.set_xlabel("batch size B (rows decoded per step)")
        ax.set_ylabel("total tok/s ÷ its tok/s at B = 1")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper left", frameon=True, framealpha=0.9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


__all__ = ["tok_s_vs_batch"]
