"""What the notebooks show: `Table` (HTML in Jupyter, aligned text in logs) and the tables of
settings, prompts, graphs, compile results, the three checks side by side, benchmarks and records."""

from __future__ import annotations

import html
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gemma4lab.notebook.formatting import format_shape, format_value, headline, with_unit
from gemma4lib import checks
from gemma4lib.models.loading import LoadedModel
from gemma4lib.timing import BenchFigures

if TYPE_CHECKING:  # type names only
    from gemma4lib.device.build import GraphSet
    from gemma4lib.settings import PortSettings


@dataclass
class Table:
    """Rows of cells with a header; renders as HTML in Jupyter and as aligned text elsewhere."""

    columns: list[str]
    rows: list[list[Any]]
    title: str = ""
    note: str = ""  # one line under the table (what to read into it, or why a cell is odd)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], title: str = "", key: str = "", value: str = "") -> Table:
        return cls([key or "", value or ""], [[k, v] for k, v in data.items()], title)

    @staticmethod
    def _cell(value: Any) -> str:
        return format_value(value)

    def __str__(self) -> str:
        cells = [[self._cell(c) for c in row] for row in self.rows]
        widths = [max([len(str(h))] + [len(r[i]) for r in cells]) for i, h in enumerate(self.columns)]
        line = lambda row: "  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=False)).rstrip()  # noqa: E731
        out = ([self.title] if self.title else []) + [line(self.columns), line(["-" * w for w in widths])]
        return "\n".join(out + [line(r) for r in cells] + ([self.note] if self.note else []))

    __repr__ = __str__

    def _repr_html_(self) -> str:
        head = "".join(f"<th style='text-align:left'>{html.escape(str(c))}</th>" for c in self.columns)
        body = "".join(
            "<tr>" + "".join(f"<td style='text-align:left'>{html.escape(self._cell(c))}</td>" for c in row) + "</tr>"
            for row in self.rows
        )
        caption = f"<caption style='text-align:left'><b>{html.escape(self.title)}</b></caption>" if self.title else ""
        note = f"<p style='text-align:left'><i>{html.escape(self.note)}</i></p>" if self.note else ""
        return f"<table>{caption}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>{note}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (what a result record keeps of a demonstration)."""
        return {
            "title": self.title,
            **({"note": self.note} if self.note else {}),
            "columns": list(self.columns),
            "rows": [
                [c if isinstance(c, (bool, int, float, str, type(None))) else self._cell(c) for c in row]
                for row in self.rows
            ],
        }

    def to_markdown(self) -> str:
        lines = ["| " + " | ".join(map(str, self.columns)) + " |", "|" + "---|" * len(self.columns)]
        lines += ["| " + " | ".join(self._cell(c).replace("|", "\\|") for c in row) + " |" for row in self.rows]
        return "\n".join(lines + (["", self.note] if self.note else []))


def show_settings(settings: PortSettings, fields: Sequence[str] | None = None) -> Table:
    """The settings a port depends on; `decode_experts` only for the MoE, where it means something.
    `fields`: only these (a notebook that uses a few of the settings shows just those)."""
    params = settings.parameters()
    if fields is not None:
        return Table.from_dict({k: params.get(k) for k in fields}, "port settings", "setting", "value")
    keep = [
        "variant",
        "profile",
        "model_source",
        "checkpoint",
        "backend",
        "tp_degree",
        "prompt",
        "expect",
        "max_new_tokens",
        "context_length",
        "prefill_buckets",
        "ring_kv",
        "decode_experts",
        "warmup",
        "iters",
        "seed",
    ]
    if not settings.variant_spec.is_moe:
        keep.remove("decode_experts")
    return Table.from_dict({k: params.get(k) for k in keep}, "port settings", "setting", "value")


def _tables_to_dicts(value: Any) -> Any:
    if isinstance(value, Table):
        return value.to_dict()
    if isinstance(value, Mapping):
        return {k: _tables_to_dicts(v) for k, v in value.items()}
    return value


def show_prompt(model: LoadedModel, ids: Sequence[int]) -> Table:
    rendered = model.tokenizer.decode(list(ids)) if model.tokenizer is not None else None
    return Table.from_dict(
        {"tokens": len(ids), "ids": list(ids), "rendered": rendered},
        "the prompt, through the tokenizer's own chat template",
        "",
        "",
    )


def describe_graphs(graphs: GraphSet) -> Table:
    """The graphs the compiler gets (`device.build.GraphSet`, by name): their static shapes, their
    inputs, and the K/V buffers they share."""
    rows = []
    for name, graph in graphs:
        inputs = graph.example_inputs()
        n_kv = 2 * len(graph.layout.producers)
        head = ", ".join(format_shape(t.shape) for t in inputs[: len(inputs) - n_kv])
        kv_bytes = sum(t.numel() * t.element_size() for t in inputs[len(inputs) - n_kv :])
        rows.append(
            [
                name,
                graph.shape.batch,
                graph.shape.tokens,
                graph.shape.context_length,
                getattr(graph.shape, "reads", None) or graph.shape.context_length,
                head,
                n_kv,
                f"{kv_bytes / 2**10:.1f} KiB",
                getattr(graph, "expert_form", "—")
                if any(getattr(lay, "experts", None) is not None for lay in graph.model.layers)
                else "—",
                getattr(graph.model, "embed_tokens_per_layer", None) is None,
            ]
        )
    return Table(
        [
            "graph",
            "rows",
            "tokens",
            "context",
            "K/V slots read",
            "inputs (embeds, [PLE], start, length; the draft: embeds, position)",
            "K/V tensors",
            "K/V bytes",
            "experts",
            "no embedding tables inside",
        ],
        rows,
        "the device graphs (static shapes)",
    )


def describe_compile(compiled: Any) -> Table:
    hits = list(compiled.cache_hits or [])
    artifacts = compiled.info.get("artifacts")
    return Table.from_dict(
        {
            "compiler": compiled.compiler,
            "compile time (this call)": headline(
                {"compile_s": float(compiled.compile_s), "cache_hits": hits}, ["compile_s"]
            )["compile_s"],
            "graphs loaded from the artifact cache": f"{sum(hits)} of {len(hits)}" if hits else "—",
            "artifacts": "; ".join(f"{k}: {v}" for k, v in artifacts.items())
            if isinstance(artifacts, Mapping)
            else format_value(artifacts),
        },
        "compile",
        "",
        "",
    )


def _logits_cells(logits: checks.LogitsCheck | None) -> list[str]:
    if logits is None:
        return ["not checked (no per-step logits: generate with keep_logits=True)", ""]
    worst = "prefill" if logits.worst_position == 0 else f"decode step {logits.worst_position}"
    return [
        f"{logits.passed}: max |Δ| {logits.max_err:.3g} (at {worst}) "
        f"{'<=' if logits.passed else '>'} {logits.tolerance:.3g}",
        f"tolerance = max({logits.factor:g} × the reference's own spread {logits.spread:.3g} "
        f"[vs a {logits.precise_dtype} copy], {logits.floor:g})",
    ]


def side_by_side(report: checks.CheckReport, device_tokens: Any = (), reference_tokens: Sequence[int] = ()) -> Table:
    """The three checks in one table: the device's answer next to the reference's, SEQ_MATCH,
    LOGITS_MATCH (every generated position, with the tolerance it was held to) and coherence."""
    rows = [
        ["answer", report.answer, report.reference_answer],
        ["tokens", _tokens(device_tokens), list(reference_tokens)],
        [
            "SEQ_MATCH (tokens equal)",
            report.seq_match,
            "" if report.first_mismatch is None else f"first mismatch at token {report.first_mismatch}",
        ],
        ["LOGITS_MATCH (logits at every position)", *_logits_cells(report.logits)],
        [
            "coherent" + (f" ({report.coherence_rule})" if report.coherence_rule else ""),
            "not checked (random weights)" if report.coherent is None else report.coherent,
            "",
        ],
    ]
    return Table(
        ["", "device", "reference (host: fp32 smoke, bf16 on inf2)"],
        rows,
        "PASS"
        if report.passed and report.coherent is not None
        else "PASS (equality only)"
        if report.passed
        else "FAIL",
    )


def _tolerance_vs_margin(witness: Mapping[str, Any]) -> list[Any]:
    """The witness's LOGITS_MATCH tolerance against its smallest top-1 − top-2 gap: which check a
    small logit error can trip. Swapping the two closest logits takes some logit moving by at least
    half their gap: a tolerance under that fails every such error, a wider one lets some through to
    SEQ_MATCH."""
    tolerance, margin = witness.get("logits_tolerance"), witness.get("reference_min_margin")
    label = "LOGITS_MATCH tolerance against half that margin"
    if tolerance is None or not margin:
        return [label, "—", ""]
    if tolerance >= margin / 2:
        return [
            label,
            f"wider: {tolerance:.3g} = {tolerance / (margin / 2):.3g} × {margin / 2:.3g}",
            "the tolerance, set by the reference's own spread, lets through an error that can flip the closest "
            "near-tie: SEQ_MATCH is the check that catches it",
        ]
    return [
        label,
        f"narrower: {tolerance:.3g} < {margin / 2:.3g}",
        "an error that flips the closest near-tie also fails LOGITS_MATCH",
    ]


def _programs_note(witness: Mapping[str, Any]) -> str:
    if witness.get("same_programs") is False:  # weights folded into the programs as constants
        return "the compiler folded the tiny weights in: the witness compiled its own, by the same calls"
    return "the trained run's programs, loaded with the witness's weights" if witness.get("same_programs") else ""


def witness_table(witness: Mapping[str, Any] | None) -> Table:
    """The witness's checks: a random model has near-ties where the trained one has margins of
    several logits, so a logit error the trained run absorbs changes the witness's tokens."""
    if not witness:
        return Table(
            ["note"], [["no witness for this run (it runs in smoke runs of a trained fixture)"]], "witness: skipped"
        )
    rows = [
        [
            "model",
            witness.get("model_source"),
            f"seed {witness.get('seed')}, {witness.get('prompt_tokens')} prompt tokens, "
            f"{witness.get('new_tokens')} generated",
        ],
        [
            "smallest top-1 − top-2 reference margin",
            f"{witness.get('reference_min_margin') or 0:.3g}",
            "a logit error over half this gap can flip the witness's token",
        ],
        [
            "SEQ_MATCH",
            witness.get("seq_match"),
            "" if witness.get("first_mismatch") is None else f"first mismatch at token {witness.get('first_mismatch')}",
        ],
        ["LOGITS_MATCH", witness.get("logits_match"), witness.get("logits_explain") or ""],
        ["same compiled programs as the trained run", witness.get("same_programs", "—"), _programs_note(witness)],
        _tolerance_vs_margin(witness),
    ]
    return Table(["", "witness", ""], rows, "witness: PASS" if witness.get("passed") else "witness: FAIL")


def bench_table(figures: BenchFigures, settings: PortSettings, ceiling: Mapping[str, Any]) -> Table:
    """Median timings next to the bandwidth ceiling here and, for the released model, on inf2."""
    v = settings.variant_spec
    released = ceiling["released_inf2"]

    def roof(row: Mapping[str, Any], source: str, kv_note: str = "") -> str:
        b = row["bytes_per_step"]
        return (
            f"{with_unit(row['ceiling_tok_s'], 'tok/s')} = {with_unit(row['bandwidth_gb_s'], 'GB/s')} ({source}) / "
            f"{with_unit(b['total'] / 1e6, 'MB')} per step "
            f"({with_unit(b['weights'] / 1e6, 'MB')} weights + {with_unit(b['kv'] / 1e6, 'MB')} K/V"
            f"{', sliding layers in a ring' if b.get('ring') else ', full length (no ring)'}{kv_note})"
        )

    rows = [
        [
            "prefill (median)",
            with_unit(figures.prefill_ms, "ms"),
            # the report states no prompt length or context for it: not the column's context
            f"~{v.field_report.prefill_ms:.0f} ms (field report; its prompt length not stated)"
            if v.field_report.prefill_ms
            else "—",
        ],
        [
            "decode (median)",
            with_unit(figures.decode_tok_s, "tok/s"),
            f"~{v.field_report.decode_tok_s:.0f} tok/s (field report)" if v.field_report.decode_tok_s else "—",
        ],
        [
            "decode ceiling (bandwidth / bytes per step)",
            roof(ceiling, "HBM of the cores in use" if settings.backend_row.device_bound else "measured now"),
            roof(released, "HBM", ", each KV head once"),  # the status box counts a replicated head per core
        ],
        [
            "decode / ceiling",
            f"{ceiling['roofline_fraction']:.0%} (this run / its ceiling)",
            # the field report's speed came from its own recipe; the ceiling is this plan's
            f"{released['roofline_fraction']:.0%} = field report's speed / this plan's ceiling (computed; "
            "its recipe was not this plan's)"
            if released["roofline_fraction"]
            else "—",
        ],
        ["timed runs / warm-up / threads", f"{figures.iters} / {figures.warmup} / {figures.threads}", ""],
    ]
    title = (
        "benchmark"
        if settings.profile != "smoke"
        else "benchmark (a tiny model on a CPU: compare with earlier smoke runs, not with inf2)"
    )
    return Table(
        [
            "",
            f"this run ({settings.profile}, {settings.backend})",
            f"released model on {v.instance_type}, TP={v.tp_degree}, "
            f"ceilings at {released['bytes_per_step']['context_length']:,} context (the plan's, not this run's)",
        ],
        rows,
        title,
    )


def results_table(results: Mapping[str, Mapping[str, Any]]) -> Table:
    rows = [
        [
            r.get("variant"),
            r.get("compiler"),
            r.get("tp_degree"),
            r.get("seq_match"),
            r.get("logits_match"),
            r.get("coherent"),
            (r.get("witness") or {}).get("passed"),
            *_timings(r),
            r.get("answer"),
        ]
        for r in results.values()
    ]
    return Table(
        [
            "variant",
            "compiler",
            "TP",
            "seq_match",
            "logits_match",
            "coherent",
            "witness",
            "compile, text graphs",  # each notebook's status box adds the image and witness graphs
            "prefill",
            "decode",
            "answer",
        ],
        rows,
        "the last recorded run of each variant"
        if rows
        else "no results recorded yet: run the variant notebooks (or `python -m papermill_runs run`) first",
        _records_note(results),
    )


def _records_note(results: Mapping[str, Mapping[str, Any]]) -> str:
    """Where the rows come from: the records the variant notebooks wrote, not this notebook's runs."""
    files = [str(r["result_file"]) for r in results.values() if r.get("result_file")]
    if not results:
        return ""
    where = f": {', '.join(files)}" if files else ""
    return f"read from the records the variant notebooks wrote (nothing here ran them){where}"


def _timings(result: Mapping[str, Any]) -> list[str]:
    return list(headline(result, ["compile_s", "prefill_ms", "decode_tok_s"]).values())


RECORD_HEADLINE = (
    "variant",
    "compiler",
    "seq_match",
    "logits_match",
    "coherent",
    "checks_passed",
    "prefill_ms",
    "decode_tok_s",
    "compile_s",
)


def record_summary(result: Mapping[str, Any], keys: Sequence[str] = RECORD_HEADLINE) -> Table:
    """A run record's headline keys as people read them (`2.6 ms`, `2,110 tok/s`, `yes`/`NO`);
    the record itself keeps the raw figures, and `result_file` says where it was written."""
    rows = [[k, v] for k, v in headline(result, keys).items()]
    where = result.get("result_file")
    return Table(["key", "value"], rows, "the run record (headline keys)", f"written to {where}" if where else "")


def answer_text(model: LoadedModel, tokens: Sequence[int]) -> str | None:
    return checks.answer_text(model.tokenizer, tokens)


def _tokens(device: Any) -> list[int]:
    """Tokens of a `runtime.RowResult` or a plain token list."""
    return list(getattr(device, "tokens", device))


def until_stop(tokens: Sequence[int], stop: Iterable[int]) -> list[int]:
    """`tokens` up to and including the first stop token."""
    stop = set(stop)
    out = []
    for token in tokens:
        out.append(token)
        if token in stop:
            break
    return out
