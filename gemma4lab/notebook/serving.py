"""Tables of 06_serving: the batch's rows and their checks, the batch and drafting ceilings on inf2
(computed), the sweep measured on this CPU; and 07_serve's: the endpoint under N concurrent clients.
Each turns a library result into a `Table`; nothing is computed here."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gemma4lab.notebook.display import Table
from gemma4lab.notebook.formatting import format_number


def batch_rows_table(rows: Sequence[Mapping[str, Any]]) -> Table:
    """`port.row_records` rows (a record's `rows`): each prompt, its answer and its three checks."""
    return Table(
        ["row", "prompt", "tokens in", "answer", "SEQ_MATCH", "LOGITS_MATCH", "logit err / tol", "coherent"],
        [
            [
                r["row"],
                r["prompt"],
                r["prompt_tokens"],
                r["answer"],
                r["seq_match"],
                r["logits_match"],
                (
                    f"{r['logits_max_err']:.2g} / {r['logits_tolerance']:.2g}"
                    if r.get("logits_max_err") is not None
                    else None
                ),
                r["coherent"],
            ]
            for r in rows
        ],
        "every row against its own batch-1 reference",
        "reference: transformers' greedy generate of that prompt alone, on the host (fp32)",
    )


def batch_ceilings_table(rows: Sequence[Mapping[str, Any]]) -> Table:
    """`batch_roofline.batch_ceilings` rows beside the field report's measured figures."""
    return Table(
        [
            "B",
            "GB per step",
            "memory ceiling tok/s",
            "compute ceiling tok/s",
            "ceiling (total)",
            "per row",
            "field report",
        ],
        [
            [
                r["batch"],
                format_number(r["bytes_per_step_gb"]),
                format_number(r["memory_ceiling_tok_s"]),
                format_number(r["compute_ceiling_tok_s"]),
                f"{format_number(r['ceiling_tok_s'])} ({r['bound']})",
                format_number(r["ceiling_tok_s"] / r["batch"]),
                format_number(r["field_report_tok_s"]) if r.get("field_report_tok_s") else "—",
            ]
            for r in rows
        ],
        (
            f"{rows[0]['variant']} on {rows[0]['recipe']}, {rows[0]['context_length']:,} context: "
            "total decode tok/s at batch B"
        )
        if rows
        else "",
        "ceilings computed from shapes and datasheet bandwidth/FLOPs, unverified on inf2; field report: measured "
        "on inf2 by its author (their E2B port: torch_neuronx.trace, device prefill and decode), not by this project",
    )


def batch_sweep_table(measured: Mapping[str, Any]) -> Table:
    """One model's `benchmarks.batch.bench_batch_model` sweep, as measured on this machine."""
    return Table(
        ["B", "total tok/s", "per row", "HF generate tok/s", "ours / HF", "rows = reference", "GB/s drawn"],
        [
            [
                r["batch"],
                format_number(r["gemma4lib_tok_s"]) if r.get("gemma4lib_tok_s") else None,
                format_number(r["gemma4lib_tok_s_per_row"]) if r.get("gemma4lib_tok_s_per_row") else None,
                format_number(r["hf_eager_tok_s"]) if r.get("hf_eager_tok_s") else None,
                f"{r['over_hf']:.2f}" if r.get("over_hf") else None,
                all(r["rows_match_reference"]),
                format_number(r["drawn_gb_s"]) if r.get("drawn_gb_s") else None,
            ]
            for r in measured["rows"]
        ],
        f"{measured['model']}, measured on this CPU ({measured['threads']} thread, {measured['new_tokens']} new "
        f"tokens per row, medians)",
        f"bandwidth (best of the before/after measurements): stream "
        f"{format_number(max(measured['bandwidth_before']['stream_gb_s'], measured['bandwidth_after']['stream_gb_s']))}"
        f" GB/s; moved between them: {measured['bandwidth_moved']}",
    )


def draft_effect_table(rows: Sequence[Mapping[str, Any]]) -> Table:
    """`mtp_roofline.draft_table` rows: plain and drafted batch-1 ceilings on inf2, computed."""
    return Table(
        [
            "variant",
            "recipe",
            "plain step GB",
            "verify step GB",
            "assistant step GB",
            "plain ceiling tok/s",
            "break-even tokens/step",
            "acceptance used",
            "drafted ceiling tok/s",
            "speed-up",
        ],
        [
            [
                r["variant"],
                r["recipe"],
                format_number(r["plain_step_gb"]),
                format_number(r["verify_step_gb"]),
                format_number(r["assistant_step_gb"]),
                format_number(r["plain_ceiling_tok_s"]),
                f"{r['break_even_accepted']:.2f}",
                f"{r['accepted_per_step']:.2f}" if r.get("accepted_per_step") else None,
                format_number(r["drafted_ceiling_tok_s"]) if r.get("drafted_ceiling_tok_s") else None,
                f"{r['computed_speedup']:.2f}x" if r.get("computed_speedup") else None,
            ]
            for r in rows
        ],
        f"drafting with k = {rows[0]['draft_tokens']} on inf2, {rows[0]['context_length']:,} context" if rows else "",
        rows[0]["status"] if rows else "",
    )


def _level_dict(level: Any) -> Mapping[str, Any]:
    return level if isinstance(level, Mapping) else level.as_dict()


def _ms(seconds: float | None) -> str:
    return "—" if seconds is None else format_number(seconds * 1000.0)


def load_levels_table(levels: Sequence[Any]) -> Table:
    """One row per concurrency level: requests, whether all were complete and unmixed, TTFT, tok/s."""
    rows = [_level_dict(level) for level in levels]
    one = next((r["tokens_per_s"] for r in rows if r["clients"] == 1), None)
    return Table(
        ["clients", "requests", "errors", "complete", "mixed", "TTFT p50 ms", "TTFT p99 ms", "tokens", "tok/s"]
        + ["x one"],
        [
            [
                r["clients"],
                r["requests"],
                r["errors"],
                r["complete"],
                r["mixed"],
                _ms(r["ttft_p50_s"]),
                _ms(r["ttft_p99_s"]),
                r["tokens"],
                format_number(r["tokens_per_s"]),
                f"{r['tokens_per_s'] / one:.2f}x" if one else "—",
            ]
            for r in rows
        ],
        "the endpoint under N concurrent streaming clients (greedy, each client's requests one after another)",
        "mixed: greedy replies that differ from the same prompt's reply sent alone (must be 0); "
        "x one: total tok/s over one client's, in this run",
    )


__all__ = ["batch_ceilings_table", "batch_rows_table", "batch_sweep_table", "draft_effect_table", "load_levels_table"]
