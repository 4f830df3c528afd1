"""Plots of the endpoint under load: latency and throughput against concurrent clients (07_serve).

Kept apart from `plots.py` (one small module per idea); the same conventions: every function
returns a matplotlib `Figure` built without pyplot. A level is `gemma4lab.serving.load.Level` or its `as_dict()`
(what a run record keeps); nothing is measured here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from matplotlib.figure import Figure

from gemma4lab.notebook.plots import NUMBER_TICKS  # importing plots also makes IPython draw a returned Figure


def _as_dict(level: Any) -> Mapping[str, Any]:
    return level if isinstance(level, Mapping) else level.as_dict()


def latency_and_throughput(
    levels: Sequence[Any], title: str = "the endpoint against concurrent clients", batch_rows: int | None = None
) -> Figure:
    """Time to first token (p50 and p99, ms) and total tokens/s against the number of clients, side by
    side, with `min(N, batch_rows) x (one client's tok/s)` for scale: the line continuous batching climbs
    towards, flat from `batch_rows` clients on (more clients than rows wait for a row, they add no rows)."""
    rows = sorted((_as_dict(level) for level in levels), key=lambda r: r["clients"])
    fig = Figure(figsize=(9.6, 3.6))
    latency, throughput = fig.subplots(1, 2)
    clients = [r["clients"] for r in rows]
    for key, style, label in (("ttft_p50_s", "o-", "p50"), ("ttft_p99_s", "s--", "p99")):
        points = [(r["clients"], r[key] * 1000.0) for r in rows if r.get(key) is not None]
        if points:
            latency.plot(*zip(*points, strict=True), style, label=f"time to first token, {label}")
    latency.set_xlabel("concurrent clients")
    latency.set_ylabel("ms")
    latency.set_title("latency")
    throughput.plot(clients, [r["tokens_per_s"] for r in rows], "o-", label="measured, all clients")
    if rows and rows[0]["clients"] == 1:
        base = rows[0]["tokens_per_s"]
        ideal = [min(n, batch_rows or n) * base for n in clients]
        label = f"min(N, {batch_rows} rows) x one client" if batch_rows else "N x one client"
        throughput.plot(clients, ideal, ":", color="#9e9e9e", label=label)
    throughput.set_xlabel("concurrent clients")
    throughput.set_ylabel("total tokens/s")
    throughput.yaxis.set_major_formatter(NUMBER_TICKS)
    throughput.set_title("throughput")
    for ax in (latency, throughput):
        ax.set_xscale("log", base=2)
        ax.set_xticks(clients, [str(n) for n in clients])
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


__all__ = ["latency_and_throughput"]
