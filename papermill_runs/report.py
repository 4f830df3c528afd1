"""What a run leaves behind: the summary table (Markdown, CSV, printed), the failure report, plots."""

from __future__ import annotations

import csv
import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gemma4lab.notebook import plots
from gemma4lib.cache.artifacts import atomic_write_text

from .baselines import Verdict

COLUMNS = (
    "notebook",
    "variant",
    "compiler",
    "TP",
    "seq_match",
    "logits_match",
    "logit err / tol",
    "coherent",
    "witness",
    "compile s",
    "prefill ms",
    "decode tok/s",
    "verdict",
)
PLOT_METRICS = ("prefill_ms", "decode_tok_s", "compile_s")


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 10**digits else f"{value:.0f}"
    return str(value)


def _witness(record: Mapping[str, Any]) -> str:
    """The witness's two checks in one cell ("—" when it did not run)."""
    w = record.get("witness")
    if not w:
        return "—"
    return "pass" if w.get("seq_match") and w.get("logits_match") is not False else "FAIL"


def summary_rows(results: Mapping[str, Mapping[str, Any] | None], verdicts: Mapping[str, Verdict]) -> list[list[str]]:
    rows = []
    for name, verdict in verdicts.items():
        r = results.get(name) or {}
        err = (
            "—"
            if r.get("logits_max_err") is None
            else f"{_fmt(r.get('logits_max_err'), 2)} / {_fmt(r.get('logits_tolerance'), 2)}"
        )
        rows.append(
            [
                verdict.notebook or "",
                name,
                _fmt(r.get("compiler")),
                _fmt(r.get("tp_degree")),
                _fmt(r.get("seq_match")),
                _fmt(r.get("logits_match")),
                err,
                _fmt(r.get("coherent")),
                _witness(r),
                _fmt(r.get("compile_s")),
                _fmt(r.get("prefill_ms")),
                _fmt(r.get("decode_tok_s")),
                verdict.status,
            ]
        )
    return rows


def text_table(rows: Sequence[Sequence[str]], columns: Sequence[str] = COLUMNS) -> str:
    widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(columns)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=False)).rstrip()  # noqa: E731
    return "\n".join([line(columns), line(["-" * w for w in widths])] + [line(r) for r in rows])


def markdown_table(rows: Sequence[Sequence[str]], columns: Sequence[str] = COLUMNS) -> str:
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    out += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
    return "\n".join(out)


def csv_text(rows: Sequence[Sequence[str]], verdicts: Mapping[str, Verdict], columns: Sequence[str] = COLUMNS) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow([*columns, "reasons"])
    for row, verdict in zip(rows, verdicts.values(), strict=True):
        writer.writerow([*row, " | ".join(verdict.reasons)])
    return buffer.getvalue()


def failure_report(
    verdicts: Mapping[str, Verdict],
    notebook_runs: Mapping[str, Mapping[str, Any]] | None = None,
    tolerated: Sequence[str] = (),
) -> str:
    """One paragraph per variant that did not pass: which notebook, which cell, what went wrong.
    Statuses in `tolerated` (e.g. "no-baseline" under --allow-missing-baseline) are left out."""
    lines = []
    for name, verdict in verdicts.items():
        if verdict.ok or verdict.status in tolerated:
            continue
        run = (notebook_runs or {}).get(name) or {}
        head = f"{verdict.status.upper()}: {verdict.notebook or name}"
        cell = run.get("failed_cell")
        if cell:
            head += (
                f", cell {cell.get('index')}"
                + (f" (In [{cell['exec_count']}])" if cell.get("exec_count") else "")
                + (" timed out" if cell.get("timed_out") else "")
            )
        lines.append(head)
        for reason in verdict.reasons:
            lines.append(f"    {reason}")
        if cell and cell.get("source"):
            snippet = "\n".join("      > " + s for s in str(cell["source"]).splitlines()[:6])
            lines.append("    cell source:\n" + snippet)
        for key in ("executed", "log"):
            if run.get(key):
                lines.append(f"    {key}: {run[key]}")
    return "\n".join(lines)


def summary_markdown(rows, verdicts: Mapping[str, Verdict], meta: Mapping[str, Any], failures: str) -> str:
    parts = [
        f"# papermill_runs: {meta.get('profile')} profile on {meta.get('machine_kind')}",
        "",
        f"- started: {meta.get('started')}",
        f"- wall time: {_fmt(meta.get('wall_s'), 4)} s",
        f"- baseline: `{meta.get('baseline_file')}` ({meta.get('baseline_state')})",
        f"- exit code: {meta.get('exit_code')}",
        "",
        markdown_table(rows),
        "",
    ]
    notes = [(n, v) for n, v in verdicts.items() if v.reasons]
    if notes:
        parts += ["## Details", ""] + [f"- **{n}** ({v.status}): " + "; ".join(v.reasons) for n, v in notes] + [""]
    if failures:
        parts += ["## Failures", "", "```", failures, "```", ""]
    return "\n".join(parts)


def write_summary(
    out: Path,
    results,
    verdicts: Mapping[str, Verdict],
    meta: Mapping[str, Any],
    notebook_runs=None,
    tolerated: Sequence[str] = (),
) -> tuple[str, str]:
    """Write summary.md and summary.csv into `out`; return (printed table, failure report)."""
    rows = summary_rows(results, verdicts)
    failures = failure_report(verdicts, notebook_runs, tolerated)
    atomic_write_text(out / "summary.md", summary_markdown(rows, verdicts, meta, failures))
    atomic_write_text(out / "summary.csv", csv_text(rows, verdicts))
    return text_table(rows), failures


def write_plots(
    out: Path,
    results: Mapping[str, Mapping[str, Any] | None],
    verdicts: Mapping[str, Verdict],
    history: Sequence[Mapping[str, Any]],
    metrics: Sequence[str] = PLOT_METRICS,
) -> list[Path]:
    """family_metrics.png, checks.png, baseline_<metric>.png and trend_<metric>.png."""
    present = {name: r for name, r in results.items() if r}
    written = [
        plots.save(plots.family_metrics(present), out / "family_metrics.png"),
        plots.save(plots.checks_grid(present), out / "checks.png"),
    ]
    for metric in metrics:
        rows = []
        for name, verdict in verdicts.items():
            check = next((c for c in verdict.metrics if c.metric == metric), None)
            value = (results.get(name) or {}).get(metric)
            rows.append(
                {
                    "variant": name,
                    "value": value,
                    "baseline": check.baseline if check else None,
                    "limit": check.limit if check else None,
                    "verdict": "regression" if check and check.status == "worse" and check.gate else "ok",
                }
            )
        written.append(plots.save(plots.baseline_comparison(rows, metric), out / f"baseline_{metric}.png"))
        written.append(plots.save(plots.trend(history, metric), out / f"trend_{metric}.png"))
    return written
