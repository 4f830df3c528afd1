"""The suite's report as markdown (docs/ROOFLINE.md's CPU section is this output, pasted).

One renderer, `format_report`, for the whole report: the header line, then one section per part of
the suite that ran (models, ring KV, experts, prefill buckets, targets). A section whose part did
not run is left out, so a `--quick` report renders as the header, the models table and the targets.
It reads only the JSON (what `bench --json` prints), never the live objects, so a saved report
renders the same as a fresh one.
"""

from __future__ import annotations

from typing import Any


def _f(value: Any, digits: int = 2, suffix: str = "") -> str:
    """A figure for a table cell: "–" when not measured, yes/NO for a check."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    return f"{value:.{digits}f}{suffix}"


def format_report(report: dict[str, Any]) -> str:
    """The suite's figures as markdown: the run's conditions, then a table per section that ran."""
    # header: the conditions every figure below depends on, then the models table
    bw = report.get("bandwidth", {})
    lines = [
        f"Threads: {report.get('threads')}; bandwidth at start: GEMV {_f(bw.get('gemv_gb_s'))} GB/s, "
        f"stream {_f(bw.get('stream_gb_s'))} GB/s; load average {report.get('load_average_start')} → "
        f"{report.get('load_average_end')}.",
        "",
        "| model | params | gemma4lib tok/s | HF eager tok/s | HF static+compile tok/s | speedup vs eager "
        "| HF compile vs eager | bytes/step MB | bandwidth GB/s | ceiling tok/s | roofline fraction | tokens = HF "
        "| prefill logits Δ |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in report.get("models", []):
        p = m["paths"]
        compiled = p["hf_static_compile"]
        hf_compile = _f(compiled.get("decode_tok_s"), 1) if compiled.get("status") == "ok" else compiled.get("status")
        match = p["gemma4lib"].get("tokens_match_reference")
        lines.append(
            f"| {m['name']} | {m['params'] / 1e6:.1f}M | {_f(p['gemma4lib'].get('decode_tok_s'), 1)} | "
            f"{_f(p['hf_eager'].get('decode_tok_s'), 1)} | {hf_compile} | "
            f"{_f(m['speedup_vs_hf_eager'].get('gemma4lib'), 2, 'x')} | "
            f"{_f(m['speedup_vs_hf_eager'].get('hf_static_compile'), 2, 'x')} | "
            f"{m['bytes_per_step']['total'] / 1e6:.1f} | {_f(m['bandwidth']['gb_s'])} | {_f(m['ceiling_tok_s'], 1)} | "
            f"{_f(m['roofline_fraction'].get('gemma4lib'))} | {_f(match)} | "
            f"{_f(p['gemma4lib'].get('prefill_logits_max_abs_diff'), 6)} |"
        )
    # ring KV: full-length vs ring buffers per context
    ring = report.get("ring_kv")
    if ring:
        lines += [
            "",
            f"Ring KV ({ring['model']}, window {ring['sliding_window']}; decode steps at the end of the context):",
            "",
            "| context | full-length tok/s | ring tok/s | ring / full | KV MB full | KV MB ring |",
            "|---|---|---|---|---|---|",
        ]
        for ctx, row in ring["contexts"].items():
            lines.append(
                f"| {ctx} | {_f(row['full']['decode_tok_s'])} | {_f(row['ring']['decode_tok_s'])} | "
                f"{_f(row['ring_speedup'], 2, 'x')} | {row['full']['kv_bytes'] / 1e6:.1f} | "
                f"{row['ring']['kv_bytes'] / 1e6:.1f} |"
            )
        ratios = {k: v for k, v in ring.items() if k.endswith("_over_" + next(iter(ring["contexts"])))}
        lines += ["", ", ".join(f"{k} = {_f(v)}" for k, v in ratios.items())]
    # experts: dense vs selective, and the measured choice next to PortSettings' default
    experts = report.get("experts")
    if experts:
        d, pf = experts["decode"], experts["prefill"]
        lines += [
            "",
            f"Experts ({experts['model']}):",
            "",
            "| form | decode tok/s | bytes/step MB | tokens = HF | prefill ms (bucket "
            f"{experts['prefill_bucket']}) | first token = HF |",
            "|---|---|---|---|---|---|",
        ]
        for form in ("dense", "selective"):
            lines.append(
                f"| {form} | {_f(d[form]['decode_tok_s'])} | {d[form]['bytes_per_step'] / 1e6:.1f} | "
                f"{_f(d[form]['tokens_match_reference'])} | {_f(pf[form]['prefill_ms'], 1)} | "
                f"{_f(pf[form]['first_token_matches_reference'])} |"
            )
        rec = experts["recommendation"]
        lines += [
            "",
            f"selective / dense decode = {_f(experts['selective_over_dense_decode'])}x "
            f"(bytes dense / selective = {_f(experts['dense_over_selective_bytes'])}x); measured choice: "
            f"prefill {rec['prefill']}, decode {rec['decode']} (PortSettings default decode: "
            f"{rec['port_settings_default_decode']}).",
        ]
    # prefill buckets: ms per bucket, and which bucket prompts of other lengths took
    buckets = report.get("prefill_buckets")
    if buckets:
        lines += [
            "",
            f"Prefill buckets ({buckets['model']}, context {buckets['context_length']}):",
            "",
            "| bucket | prefill ms |",
            "|---|---|",
        ]
        lines += [f"| {b} | {_f(row['prefill_ms'], 1)} |" for b, row in buckets["buckets"].items()]
        lines += ["", "| prompt tokens | bucket used | smallest that fits | tokens = HF |", "|---|---|---|---|"]
        lines += [
            f"| {p['prompt_tokens']} | {p['bucket']} | {p['smallest_fitting']} | {_f(p['tokens_match_reference'])} |"
            for p in buckets["placement"]
        ]
    # int8: weight-only int8 against the same model's full-precision graphs
    if report.get("int8"):
        lines += [
            "",
            "Weight-only int8 vs full precision (same run, interleaved):",
            "",
            "| model | full tok/s | int8 tok/s | int8 / full | bytes/step MB full -> int8 | max logit error vs full "
            "| vs own reference | tokens = own reference | tokens = full reference |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for row in report["int8"]:
            full, int8 = row["full"], row["int8"]
            lines.append(
                f"| {row['model']} | {_f(full['decode_tok_s'])} | {_f(int8['decode_tok_s'])} | "
                f"{_f(row['int8_over_full_decode'], 2, 'x')} | {full['bytes_per_step'] / 1e6:.1f} -> "
                f"{int8['bytes_per_step'] / 1e6:.1f} | {row['logits_max_abs_error_vs_full']:.3g} | "
                f"{row['logits_max_abs_diff_vs_own_reference']:.2g} | {_f(int8['tokens_match_own_reference'])} | "
                f"{_f(row['int8_tokens_equal_full_reference'])} |"
            )
    # targets: the figures, met or not
    if report.get("targets"):
        lines += ["", "| target | value | met |", "|---|---|---|"]
        lines += [f"| {t['target']} | {_f(t['value'])} | {_f(t['met'])} |" for t in report["targets"]]
    return "\n".join(lines)
