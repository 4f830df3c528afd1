"""01_e2b's long-context lesson (§7b): which compiled graph each engine call ran, and the turns of a
conversation side by side (prompt, tokens reused from the row's kept K/V, prefill chunks, time to the
first token, the graphs that ran)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gemma4lab.notebook.display import Table
from gemma4lib.runtime import Engine


class StepLog:
    """Wraps `engine`'s steps so each call is logged as (graph, K/V slots it reads: its context bucket,
    or None for the whole context); `take()` returns and clears the calls since the last take."""

    def __init__(self, engine: Engine):
        self.calls: list[tuple[str, int | None]] = []
        steps = engine.steps
        steps.prefill = {b: self._wrap(f"prefill{b}", None, f) for b, f in steps.prefill.items()}
        steps.row_prefill = {b: self._wrap(f"row_prefill{b}", None, f) for b, f in steps.row_prefill.items()}
        for name in ("decode", "decode_ids", "verify"):
            if getattr(steps, name) is not None:
                setattr(steps, name, self._wrap(name, None, getattr(steps, name)))
        steps.contexts = {n: {c: self._wrap(n, c, f) for c, f in by.items()} for n, by in steps.contexts.items()}

    def _wrap(self, name: str, reads: int | None, step: Any) -> Any:
        return lambda *args: self.calls.append((name, reads)) or step(*args)

    def take(self) -> list[tuple[str, int | None]]:
        calls, self.calls = self.calls, []
        return calls


def graphs_ran(calls: Sequence[tuple[str, int | None]], context: int) -> str:
    """The calls in order, repeats counted: `prefill128 reading 128 slots ×1, decode reading 192 ×9`."""
    runs: list[list[Any]] = []
    for name, reads in calls:
        label = f"{name} reading {reads or context}"
        if runs and runs[-1][0] == label:
            runs[-1][1] += 1
        else:
            runs.append([label, 1])
    return ", ".join(f"{label} ×{n}" for label, n in runs)


def turns_table(turns: Mapping[str, Mapping[str, Any]], context: int) -> Table:
    rows = [
        [name, t["prompt"], t["reused"], t["chunks"], round(t["ttft_ms"], 1), graphs_ran(t["calls"], context)]
        for name, t in turns.items()
    ]
    columns = ["turn", "prompt tokens", "reused", "prefill chunks", "first token (ms)", "graphs (slots read)"]
    return Table(columns, rows, "The conversation's turns", f"the whole context is {context} slots")
