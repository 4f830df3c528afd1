"""Plots of drafted generation: what each verify step of the target kept of the assistant's drafts.

Kept apart from `plots.py` (one small module per idea); the same conventions: every function
returns a matplotlib `Figure` built without pyplot.
"""

from __future__ import annotations

from collections.abc import Sequence

from matplotlib.figure import Figure

from gemma4lab.notebook import plots  # noqa: F401  (importing plots makes IPython draw a returned Figure)


def drafts_accepted(
    accepted: Sequence[int],
    drafted: Sequence[int],
    emitted: Sequence[int] | None = None,
    title: str = "drafts accepted per verify step",
) -> Figure:
    """One bar per target verify step: the drafts proposed (outline), the drafts accepted (filled)
    and the tokens kept (accepted + the target's own next token, cut at eos or the budget).

    `accepted`, `drafted`, `emitted`: a drafted `runtime.RowResult`'s lists of the same names."""
    fig = Figure(figsize=(6.4, 3.6))
    ax = fig.subplots()
    steps = list(range(1, len(accepted) + 1))
    ax.bar(steps, drafted, color="none", edgecolor="#616161", label="drafts proposed")
    ax.bar(steps, accepted, color="#2e7d32", alpha=0.8, label="drafts accepted")
    if emitted is not None:
        ax.plot(steps, emitted, "o", color="#1565c0", label="tokens kept (accepted + the target's own)")
    mean = sum(emitted) / len(emitted) if emitted else None
    if mean is not None:
        ax.axhline(mean, color="#1565c0", linestyle=":", linewidth=1, label=f"mean tokens per verify step: {mean:.2f}")
    ax.set_xlabel("target verify step")
    ax.set_ylabel("tokens")
    ax.set_xticks(steps)
    ax.set_ylim(0, max([*drafted, *(emitted or [])], default=1) + 1.5)
    ax.set_title(title)
    ax.grid(True, axis="y", alpha=0.3)
    if steps:
        # below the axes, in a row of its own: over the bars it hid the tallest step's kept tokens
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
    fig.tight_layout()
    return fig


__all__ = ["drafts_accepted"]
