"""Plots for the notebooks and the headless runs. Every function returns a matplotlib `Figure`.

Figures are built with `matplotlib.figure.Figure` rather than pyplot, so nothing opens a window,
nothing is shown twice in a notebook (the returned figure is the cell's output), and a headless
run can call `save(fig, path)` without picking a backend first.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator

from gemma4lab.notebook.formatting import format_number, token_labels, with_unit
from gemma4lib.checks import failed_checks

OK, BAD, UNKNOWN = "#2e7d32", "#c62828", "#9e9e9e"
SLIDING_COLOUR, FULL_COLOUR = "#64b5f6", "#ef6c00"
METRIC_UNITS = {"prefill_ms": "ms", "decode_tok_s": "tok/s", "compile_s": "s", "peak_rss_mb": "MiB"}
METRIC_LABELS = {
    "prefill_ms": "prefill (ms, lower is better)",
    "decode_tok_s": "decode (tok/s, higher is better)",
    "compile_s": "compile (s)",
    "peak_rss_mb": "peak host RSS (MiB)",
}


NUMBER_TICKS = FuncFormatter(lambda value, _pos: format_number(float(value)))  # 2,500 rather than 2500


def show_figures_inline() -> bool:
    """Make IPython draw a returned `Figure` as a PNG. These plots build `Figure` objects directly
    (no pyplot, so no global state and nothing drawn twice); without this a notebook cell whose
    last value is a figure would show `<Figure size ...>` as text, since only pyplot's inline
    backend registers the formatter. True when an IPython shell is running and now draws them."""
    try:
        from IPython import get_ipython
        from IPython.core.pylabtools import print_figure
    except ImportError:
        return False
    shell = get_ipython()
    if shell is None:
        return False
    png = shell.display_formatter.formatters["image/png"]
    png.for_type(Figure, lambda fig: print_figure(fig, "png", bbox_inches="tight"))
    return True


show_figures_inline()


def save(fig: Figure, path: str | Path, dpi: int = 110) -> Path:
    """Write `fig` as an image (format from the suffix) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    return path


def _status_colour(value: Any) -> str:
    return OK if value is True else BAD if value is False else UNKNOWN


def _as_list(results: Mapping[str, Mapping[str, Any]] | Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return list(results.values()) if isinstance(results, Mapping) else list(results)


def _empty(message: str, size=(6, 1.2)) -> Figure:
    fig = Figure(figsize=size)
    ax = fig.add_subplot()
    ax.axis("off")
    ax.text(0.5, 0.5, message, ha="center", va="center")
    return fig


# ---- one run ----------------------------------------------------------------------------------


def token_match(result: Mapping[str, Any], tokenizer: Any = None, max_tokens: int = 40) -> Figure:
    """Device tokens over reference tokens, one box each: green where equal, red where not.

    With `tokenizer` (a `LoadedModel` or its `.tokenizer`) each box shows the token's text
    (`Paris`, `<eos>`, bytes as `⟨E2 80⟩`); without one, its id."""
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
    device = list(result.get("tokens") or [])[:max_tokens]
    reference = list(result.get("reference_tokens") or [])[:max_tokens]
    n = max(len(device), len(reference))
    if not n:
        return _empty("no tokens recorded")
    labels = {"device": token_labels(tokenizer, device), "reference": token_labels(tokenizer, reference)}
    longest = max(len(t) for ts in labels.values() for t in ts)
    vertical = longest > 4  # words do not fit a box side by side: write them upwards
    fig = Figure(figsize=(max(6.0, 0.36 * n), 1.9 + (0.07 * min(longest, 14) if vertical else 0)))
    ax = fig.add_subplot()
    for row, (label, tokens) in enumerate((("device", device), ("reference", reference))):
        other = reference if label == "device" else device
        for i in range(n):
            token = tokens[i] if i < len(tokens) else None
            same = token is not None and i < len(other) and other[i] == token
            ax.add_patch(_box(i, 1 - row, OK if same else BAD))
            ax.text(
                i + 0.5,
                1.5 - row,
                "" if token is None else labels[label][i],
                ha="center",
                va="center",
                fontsize=6,
                color="white",
                rotation=90 if vertical else 0,
            )
    ax.set_xlim(0, n)
    ax.set_ylim(0, 2)
    ax.set_yticks([0.5, 1.5], ["reference", "device"])
    step = max(1, n // 20)  # one index per box, thinned past 20 tokens
    ax.set_xticks([i + 0.5 for i in range(0, n, step)], [str(i) for i in range(0, n, step)], fontsize=7)
    ax.set_xlabel("generated token index" + ("" if tokenizer is not None else " (token ids)"))
    verdict = "SEQ_MATCH" if result.get("seq_match") else "MISMATCH"
    ax.set_title(f"{result.get('variant', '')}: {verdict} ({len(device)} device / {len(reference)} reference tokens)")
    return fig


def _box(x: float, y: float, colour: str):
    from matplotlib.patches import Rectangle

    return Rectangle((x + 0.04, y + 0.08), 0.92, 0.84, color=colour)


def bench_runs(result: Mapping[str, Any]) -> Figure:
    """Every timed prefill and decode run of a benchmark, with the median the record keeps."""
    bench = result.get("bench") or {}
    fig = Figure(figsize=(8, 2.8))
    for i, (key, runs_key, label) in enumerate(
        (
            ("prefill_ms", "prefill_ms_runs", METRIC_LABELS["prefill_ms"]),
            ("decode_tok_s", "decode_tok_s_runs", METRIC_LABELS["decode_tok_s"]),
        )
    ):
        ax = fig.add_subplot(1, 2, i + 1)
        runs = list(bench.get(runs_key) or [])
        ax.plot(range(1, len(runs) + 1), runs, "o", color=SLIDING_COLOUR, label="timed runs")
        median = result.get(key, bench.get(key))
        if median is not None:
            ax.axhline(median, color=FULL_COLOUR, label=f"median {with_unit(median, METRIC_UNITS[key])}")
        ax.set_title(label, fontsize=9)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_formatter(NUMBER_TICKS)
        ax.set_xlabel("run")
        ax.legend(fontsize=7)
    fig.suptitle(
        f"{result.get('variant', '')} benchmark ({bench.get('threads', '?')} thread(s), "
        f"{bench.get('warmup', '?')} warm-up)",
        fontsize=10,
    )
    fig.tight_layout()
    return fig


def kv_layout(layout: Any, title: str = "") -> Figure:
    """One column per decoder layer: attention type, KV heads, and an arc from every KV-sharing
    layer to the producer whose buffer it reads. Accepts a `KVLayout`."""
    layers = list(layout.layers)
    n = len(layers)
    fig = Figure(figsize=(max(6.0, 0.32 * n), 2.6))
    ax = fig.add_subplot()
    for layer in layers:
        colour = FULL_COLOUR if layer.layer_type == "full_attention" else SLIDING_COLOUR
        hatch = None if layer.owns_buffer else "//"
        from matplotlib.patches import Rectangle

        ax.add_patch(
            Rectangle(
                (layer.index + 0.05, 0),
                0.9,
                1,
                facecolor=colour if layer.owns_buffer else "white",
                edgecolor=colour,
                hatch=hatch,
                linewidth=1.2,
            )
        )
        ax.text(layer.index + 0.5, 0.5, str(layer.kv_heads), ha="center", va="center", fontsize=7)
        if not layer.owns_buffer:
            ax.annotate(
                "",
                xy=(layer.producer + 0.5, 1.02),
                xytext=(layer.index + 0.5, 1.02),
                arrowprops=dict(arrowstyle="->", color="#555555", connectionstyle="arc3,rad=0.3", linewidth=0.7),
            )
    ax.set_xlim(0, n)
    ax.set_ylim(-0.1, 2.2)
    ax.set_yticks([])
    ax.set_xticks([i + 0.5 for i in range(n)], [str(i) for i in range(n)], fontsize=6)
    ax.set_xlabel("layer (number = KV heads; filled = owns a K/V buffer; hatched = reads its producer's)")
    from matplotlib.patches import Patch

    ax.legend(
        handles=[Patch(color=SLIDING_COLOUR, label="sliding"), Patch(color=FULL_COLOUR, label="full")],
        loc="upper left",
        fontsize=7,
        ncol=2,
    )
    producers = sum(1 for layer in layers if layer.owns_buffer)
    ax.set_title(title or f"KV layout: {producers} of {n} layers own K/V buffers", fontsize=10)
    return fig


def measured_vs_ceiling(
    rows: Sequence[Mapping[str, Any]], title: str = "decode: measured vs bandwidth ceiling"
) -> Figure:
    """Decode tok/s against its roofline ceiling, one pair of bars per row.

    `rows`: `roofline.compare()` dicts (`label`, `ceiling_tok_s`, `measured_tok_s`, `roofline_fraction`).
    The axis is logarithmic: a tiny model on a CPU and a released model on inf2 differ by 100x."""
    rows = [r for r in rows if r.get("ceiling_tok_s")]
    if not rows:
        return _empty("no ceilings to show")
    fig = Figure(figsize=(9, 1.6 + 0.7 * len(rows)))
    ax = fig.add_subplot()
    ys = range(len(rows))
    ax.barh(
        [y + 0.2 for y in ys],
        [r["ceiling_tok_s"] for r in rows],
        height=0.4,
        color=UNKNOWN,
        label="ceiling: bandwidth / bytes per step",
    )
    measured = [r.get("measured_tok_s") or 0.0 for r in rows]
    ax.barh([y - 0.2 for y in ys], measured, height=0.4, color=SLIDING_COLOUR, label="measured")
    values = [v for r in rows for v in (r["ceiling_tok_s"], r.get("measured_tok_s")) if v]
    low = min(values) / 3
    for y, r, m in zip(ys, rows, measured, strict=True):
        ax.text(r["ceiling_tok_s"], y + 0.2, f" {with_unit(r['ceiling_tok_s'], 'tok/s')}", va="center", fontsize=7)
        if m:
            fraction = r.get("roofline_fraction") or m / r["ceiling_tok_s"]
            ax.text(m, y - 0.2, f" {with_unit(m, 'tok/s')} ({fraction:.0%})", va="center", fontsize=7)
        else:
            ax.text(low, y - 0.2, f" {r.get('note') or NOT_MEASURED}", va="center", fontsize=7, style="italic")
    ax.set_yticks(list(ys), [r.get("label", r.get("device", "")) for r in rows], fontsize=8)
    ax.invert_yaxis()  # first row on top
    ax.set_xscale("log")
    ax.set_xlim(low, max(values) * 4)  # room for the labels right of the bars
    ax.set_xlabel("decode tok/s (log scale)")
    ax.set_title(title, fontsize=10)
    # the legend in a row of its own under the axes, where no bar or label can sit
    fig.legend(*ax.get_legend_handles_labels(), fontsize=7, loc="lower center", ncol=2, frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    return fig


NOT_MEASURED = "no measured decode tok/s (no inf2 run here, none in the field report):\ncomputed ceiling only"


def memory_budget(rows: Sequence[Mapping[str, Any]], title: str = "bf16 weights per NeuronCore") -> Figure:
    """Per-core weight bytes of each variant at its TP degree against the 16 GiB a core has.

    `rows`: dicts with `variant`, `device_gb_per_core`, optional `host_gb` (e.g. the PLE table)
    and `capacity_gb` (default 16 GiB as GB)."""
    if not rows:
        return _empty("no variants")
    fig = Figure(figsize=(7, 3))
    ax = fig.add_subplot()
    names = [r["variant"] for r in rows]
    gib = 1.073741824  # GB per GiB: the plot is in GiB, the unit the tables give a core's HBM in
    device = [r["device_gb_per_core"] / gib for r in rows]
    host = [(r.get("host_gb") or 0.0) / gib for r in rows]
    ax.bar(names, device, color=SLIDING_COLOUR, label="on device, per core")
    ax.bar(
        names,
        host,
        bottom=device,
        color="white",
        edgecolor=FULL_COLOUR,
        hatch="//",
        label="kept on the host (PLE table)",
    )
    capacity = rows[0].get("capacity_gb", 16 * gib) / gib
    ax.axhline(capacity, color=BAD, linestyle="--", label=f"one core's HBM ({capacity:.0f} GiB)")
    ax.set_ylabel("GiB")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    return fig


# ---- a family of runs -------------------------------------------------------------------------


def record_label(record: Mapping[str, Any]) -> str:
    """A record's name on an axis: its variant, and the notebook kind when it is not a port's
    (06_serving's record is the E2B's too: `e2b serving`)."""
    return f"{record['variant']} {record['kind']}" if record.get("kind") else str(record["variant"])


def family_metrics(
    results: Mapping[str, Mapping[str, Any]] | Sequence[Mapping[str, Any]],
    metrics: Sequence[str] = ("prefill_ms", "decode_tok_s", "compile_s"),
) -> Figure:
    """One bar chart per metric, one bar per variant; bar colour = correctness (green: every check
    passed, red: a check failed, grey: not checked)."""
    rows = [r for r in _as_list(results) if r.get("variant")]
    if not rows:
        return _empty("no results yet: run the variant notebooks (or papermill_runs) first")
    fig = Figure(figsize=(4 * len(metrics), 3))
    names = [record_label(r) for r in rows]
    colours = [_status_colour(not failed_checks(r) if r.get("seq_match") is not None else None) for r in rows]
    for i, metric in enumerate(metrics):
        ax = fig.add_subplot(1, len(metrics), i + 1)
        values = [float(r.get(metric) or 0.0) for r in rows]
        ax.bar(names, values, color=colours)
        ax.yaxis.set_major_formatter(NUMBER_TICKS)
        ax.set_title(METRIC_LABELS.get(metric, metric), fontsize=9)
        ax.tick_params(axis="x", labelsize=8)
        for x, value in enumerate(values):
            if value:
                ax.text(x, value, format_number(value), ha="center", va="bottom", fontsize=7)
        if metric == "compile_s" and not any(values):
            cached = all(r.get("cache_hits") and all(r["cache_hits"]) for r in rows)
            ax.set_yticks([])
            ax.text(
                0.5,
                0.5,
                "cached: every graph came from\nthe artifact cache (0 s compile)"
                if cached
                else "no compile time recorded",
                ha="center",
                va="center",
                transform=ax.transAxes,
                fontsize=9,
            )
    profile = rows[0].get("profile", "")
    fig.suptitle(f"last run ({profile} profile): bar colour = every check passed", fontsize=10)
    fig.tight_layout()
    return fig


def checks_grid(results: Mapping[str, Mapping[str, Any]] | Sequence[Mapping[str, Any]]) -> Figure:
    """Variants × (SEQ_MATCH, LOGITS_MATCH, coherent, witness): the checks side by side, because
    none implies the others."""
    rows = [r for r in _as_list(results) if r.get("variant")]
    if not rows:
        return _empty("no results yet")
    checks = ("seq_match", "logits_match", "coherent", "witness")
    labels = ["SEQ_MATCH", "LOGITS_MATCH", "coherent", "witness"]
    fig = Figure(figsize=(1.2 * len(rows) + 2, 2.4))
    ax = fig.add_subplot()
    for x, r in enumerate(rows):
        for y, check in enumerate(checks):
            value = r.get(check)
            if check == "witness":  # its SEQ_MATCH and LOGITS_MATCH; n/a when it did not run
                value = None if not value else value.get("passed")
            ax.add_patch(_box(x, len(checks) - 1 - y, _status_colour(value)))
            ax.text(
                x + 0.5,
                len(checks) - 0.5 - y,
                {True: "yes", False: "NO"}.get(value, "n/a"),
                ha="center",
                va="center",
                color="white",
                fontsize=8,
            )
    ax.set_xlim(0, len(rows))
    ax.set_ylim(0, len(checks))
    ax.set_xticks([i + 0.5 for i in range(len(rows))], [record_label(r) for r in rows], fontsize=8)
    ax.set_yticks([i + 0.5 for i in range(len(checks))], list(reversed(labels)), fontsize=8)
    ax.set_title("device == reference, and the answer makes sense", fontsize=10)
    return fig


def baseline_comparison(rows: Sequence[Mapping[str, Any]], metric: str) -> Figure:
    """This run against the baseline for one metric. `rows`: dicts with variant, value, baseline,
    limit (the tolerance bound) and verdict."""
    rows = [r for r in rows if r.get("value") is not None]
    if not rows:
        return _empty(f"no {metric} values")
    fig = Figure(figsize=(1.4 * len(rows) + 2, 3))
    ax = fig.add_subplot()
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r.get("baseline") or 0.0 for r in rows], width=0.4, color=UNKNOWN, label="baseline")
    ax.bar(
        [x + 0.2 for x in xs],
        [r["value"] for r in rows],
        width=0.4,
        color=[BAD if r.get("verdict") == "regression" else OK for r in rows],
        label="this run",
    )
    for x, r in zip(xs, rows, strict=True):
        if r.get("limit") is not None:
            ax.plot([x - 0.4, x + 0.4], [r["limit"], r["limit"]], color=BAD, linestyle="--", linewidth=1)
    ax.set_xticks(list(xs), [r["variant"] for r in rows], fontsize=8)
    ax.set_title(f"{METRIC_LABELS.get(metric, metric)}: run vs baseline (dashed: tolerance limit)", fontsize=9)
    ax.legend(fontsize=7)
    return fig


def trend(history: Iterable[Mapping[str, Any]], metric: str) -> Figure:
    """A metric over the history of runs (one line per variant, oldest left).

    `history`: records with `variant`, `metric values at top level or under "metrics"`, and a
    timestamp `time`."""
    series: dict[str, list[float]] = {}
    for record in history:
        metrics = record.get("metrics") or record
        value = metrics.get(metric)
        if record.get("variant") and value is not None:
            series.setdefault(record["variant"], []).append(float(value))
    if not series:
        return _empty(f"no history for {metric} yet")
    fig = Figure(figsize=(7, 3))
    ax = fig.add_subplot()
    for name, values in sorted(series.items()):
        ax.plot(range(1, len(values) + 1), values, marker="o", label=name)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("run (oldest first)")
    ax.set_title(f"trend: {METRIC_LABELS.get(metric, metric)}", fontsize=10)
    ax.legend(fontsize=7, ncol=3)
    return fig
