"""What the notebooks print and plot is written the way people write it: `64`, `2.6 ms`,
`2,110 tok/s`, tokens as text, no cut class names, no empty axes without a word of why."""

from __future__ import annotations

from pathlib import Path

import pytest

from gemma4lab import notebook as nb
from gemma4lab.notebook import formatting, plots
from gemma4lib.port import PortSettings

FIXTURE_TOKENIZER = Path(__file__).resolve().parents[1] / "gemma4lib" / "fixtures" / "tokenizer"


def _texts(fig) -> list[str]:
    return [t.get_text() for ax in fig.axes for t in ax.texts] + [
        t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()
    ]


@pytest.mark.parametrize(
    ("value", "written"),
    [(2110.3, "2,110"), (681.006, "681"), (16.814, "16.8"), (2.61, "2.6"), (0.12345, "0.123"), (0.0, "0"), (64, "64")],
)
def test_numbers_are_written_as_people_write_them(value, written):
    assert formatting.format_number(value) == written


def test_cells_write_tuples_none_and_floats_plainly():
    assert formatting.format_value((64,)) == "64"
    assert formatting.format_value((64, 128)) == "64, 128"
    assert formatting.format_value(None) == "—"
    assert formatting.format_value(0.123456) == "0.1235"
    assert formatting.format_value(123456.7) == "123,457"
    assert formatting.format_value(list(range(30))).endswith("… (30 items)")
    assert formatting.format_shape((1, 64, 32)) == "1×64×32"
    assert formatting.with_unit(2.61, "ms") == "2.6 ms" and formatting.with_unit(2110.0, "tok/s") == "2,110 tok/s"


def test_undecodable_bytes_are_marked_not_shown_as_replacement_characters():
    cell = nb.Table(["answer"], [["Athens\ufffd\ufffd Iran"]]).__str__()
    assert "\ufffd" not in cell and f"Athens{formatting.NOT_TEXT} Iran" in cell


def test_table_note_is_rendered_everywhere():
    table = nb.Table(["a"], [[1]], "t", note="nonsense by design")
    assert str(table).endswith("nonsense by design")
    assert "nonsense by design" in table._repr_html_() and "nonsense by design" in table.to_markdown()
    assert table.to_dict()["note"] == "nonsense by design"


@pytest.mark.parametrize(("variant", "moe"), [("e2b", False), ("26b-a4b", True)])
def test_settings_show_ring_kv_and_decode_experts_only_for_the_moe(variant, moe):
    table = nb.show_settings(PortSettings(variant=variant, backend="eager"))
    shown = {row[0]: table._cell(row[1]) for row in table.rows}
    assert "ring_kv" in shown
    assert ("decode_experts" in shown) is moe
    assert shown["prefill_buckets"] and "(" not in shown["prefill_buckets"]


def test_graphs_table_lists_every_graph_of_the_set_with_its_rows():
    from gemma4lib.device.build import device_graphs
    from gemma4lib.models.assistant import load_assistant
    from gemma4lib.port import load_model

    settings = PortSettings(variant="e2b", model="random", backend="eager", batch_size=2, draft="assistant")
    model = load_model(settings)
    table = nb.describe_graphs(device_graphs(model, settings, assistant=load_assistant(model, settings)))
    assert [(row[0], row[1], row[2]) for row in table.rows] == [("prefill64", 2, 64), ("verify", 2, 5), ("draft", 2, 1)]


def test_graphs_table_and_the_step_log_name_the_slots_each_graph_reads():
    """01_e2b §7b: a context bucket's graphs say how many K/V slots they read, and the step log names
    the graph and bucket of every engine call, repeats counted."""
    from gemma4lab.notebook.long_context import graphs_ran
    from gemma4lib.port import compile_graphs, load_model

    settings = PortSettings(
        variant="e2b", model="random", backend="eager", context_length=64, prefill_buckets=(16,), context_buckets=(32,)
    )
    model = load_model(settings)
    compiled = compile_graphs(model, settings)
    table = nb.describe_graphs(compiled.graphs)
    reads = {row[0]: row[table.columns.index("K/V slots read")] for row in table.rows}
    assert reads == {"prefill16": 64, "decode": 64, "prefill16@32": 32, "decode@32": 32}
    log = nb.StepLog(compiled.runtime)
    compiled.runtime.generate(list(range(5, 25)), 14)
    calls = log.take()
    assert calls[0] == ("prefill16", 32) and calls[-1] == ("decode", None) and log.take() == []
    assert graphs_ran(calls, 64).startswith("prefill16 reading 32 ×2, decode reading 32 ×")


def test_family_table_names_classes_in_full():
    table = nb.family_table()
    classes = [row[table.columns.index("class")] for row in table.rows]
    assert "Gemma4UnifiedForConditionalGeneration" in classes
    assert all("…" not in c and c.endswith("ForConditionalGeneration") for c in classes)


RESULT = {
    "variant": "e2b",
    "compiler": "cpu-aotinductor",
    "seq_match": True,
    "logits_match": True,
    "coherent": False,
    "checks_passed": False,
    "prefill_ms": 2.61,
    "decode_tok_s": 2110.3,
    "compile_s": 0.0,
    "cache_hits": [True, True],
    "tokens": [5, 6, 7],
    "reference_tokens": [5, 6, 8],
    "bench": {"prefill_ms_runs": [2.6, 2.7, 2.5], "decode_tok_s_runs": [2100.0, 2120.0, 2110.0]},
}


def test_record_summary_writes_units_checks_and_the_cache():
    shown = dict(nb.record_summary(RESULT).rows)
    assert shown["prefill_ms"] == "2.6 ms" and shown["decode_tok_s"] == "2,110 tok/s"
    assert shown["seq_match"] == "yes" and shown["coherent"] == "NO"
    assert shown["compile_s"] == "0 s (all 2 graphs cached)"
    compiled_now = nb.record_summary({**RESULT, "compile_s": 12.34, "cache_hits": [False, True]})
    assert dict(compiled_now.rows)["compile_s"] == "12.3 s"


def test_results_table_formats_timings_and_says_whose_records_it_reads():
    table = nb.results_table({"e2b": {**RESULT, "result_file": "/tmp/e2b.json"}})
    row = dict(zip(table.columns, table.rows[0], strict=True))
    assert row["prefill"] == "2.6 ms" and row["decode"] == "2,110 tok/s" and "cached" in row["compile, text graphs"]
    assert "records the variant notebooks wrote" in str(table) and "/tmp/e2b.json" in str(table)
    assert not nb.results_table({}).note


def test_bench_runs_has_integer_run_axes_and_legends_with_units():
    fig = plots.bench_runs(RESULT)
    for ax in fig.axes:
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks)
    legends = _texts(fig)
    assert "median 2.6 ms" in legends and "median 2,110 tok/s" in legends


def test_family_metrics_says_cached_instead_of_an_empty_compile_axis():
    fig = plots.family_metrics({"e2b": RESULT})
    compile_ax = fig.axes[2]
    assert any("cached" in t.get_text() for t in compile_ax.texts)
    compiled = plots.family_metrics({"e2b": {**RESULT, "compile_s": 3.0, "cache_hits": [False, False]}})
    assert not any("cached" in t.get_text() for t in compiled.axes[2].texts)


def test_ceiling_plot_says_why_a_row_has_no_measured_bar():
    rows = [
        {"label": "this run", "ceiling_tok_s": 2947.0, "measured_tok_s": 681.0, "roofline_fraction": 0.23},
        {"label": "released 26B-A4B", "ceiling_tok_s": 446.0, "measured_tok_s": None},
    ]
    texts = _texts(plots.measured_vs_ceiling(rows))
    assert any("computed ceiling only" in t for t in texts)
    assert " 681 tok/s (23%)" in texts and " 2,947 tok/s" in texts


@pytest.fixture(scope="module")
def tokenizer():
    from gemma4lib.models.tokenizer import load_tokenizer

    return load_tokenizer(FIXTURE_TOKENIZER)


def test_token_labels_are_text_with_specials_and_bytes_readable(tokenizer):
    paris = tokenizer.encode(" Paris", add_special_tokens=False)
    assert formatting.token_labels(tokenizer, paris) == ["Paris"]
    assert formatting.token_label(tokenizer, tokenizer.eos_token_id) == "<eos>"
    assert formatting.token_label(tokenizer, tokenizer.convert_tokens_to_ids("Ċ")) == "\\n"
    euro = tokenizer.encode("€", add_special_tokens=False)  # three bytes; pieces that are not text alone
    labels = formatting.token_labels(tokenizer, euro)
    assert "\ufffd" not in "".join(labels)
    if len(euro) > 1:
        assert all(label.startswith("⟨") for label in labels) and "E2" in labels[0]


def test_byte_level_pieces_map_back_to_their_bytes():
    assert formatting._piece_bytes("âĢ") == b"\xe2\x80"
    assert formatting._piece_bytes("<0xE2>") == b"\xe2"


def test_token_match_labels_boxes_with_token_text(tokenizer):
    ids = tokenizer.encode("The capital of France is Paris.", add_special_tokens=False)
    result = {"variant": "e2b", "seq_match": True, "tokens": ids, "reference_tokens": ids}
    with_text = _texts(plots.token_match(result, tokenizer))
    assert "Paris" in with_text and str(ids[-2]) not in with_text
    assert str(ids[-2]) in _texts(plots.token_match(result))


def test_the_notebook_record_of_a_generation_is_the_ports_record(ports, tmp_path):
    """`nb.record` over the engine's RowResult: the record `port()` writes, with the notebook's extras."""
    from gemma4lib import checks
    from gemma4lib.port import eos_ids
    from gemma4lib.reference import reference_greedy

    e2b = ports.get("e2b", model="auto", backend="eager")
    eos, n = eos_ids(e2b.model), e2b.settings.max_new_tokens
    generation = e2b.runtime.generate(e2b.ids, n, eos_token_ids=eos, keep_logits=True)
    reference = reference_greedy(e2b.model.lm, e2b.ids, n, eos)
    report = checks.evaluate(
        e2b.model.lm, e2b.model.tokenizer, e2b.ids, generation.tokens, reference, step_logits=generation.step_logits
    )
    path = tmp_path / "e2b.json"
    result = nb.record(e2b.settings, e2b.model, e2b.compiled, generation, reference, report, None, path, extra={"a": 1})
    assert result["checks_passed"] and result["tokens"] == reference and result["prompt_tokens"] == len(e2b.ids)
    assert result["prefill_logits_max_abs_diff"] < 1e-4 and result["a"] == 1 and "Paris" in result["answer"]
    assert nb.load_results(tmp_path)["e2b"]["tokens"] == reference


def test_the_status_box_counts_every_graph_the_run_compiled():
    """The box's compile line adds the image section's graphs and the witness's to the text graphs':
    a run whose text graphs all came from the cache but whose vision graph compiled does not read
    "every graph from the compile cache"."""
    from gemma4lab.notebook.status import compiled_graphs

    record = {
        "compile_s": 0.0,
        "cache_hits": [True, True],
        "demos": {"image": {"compile_s": 105.0, "cache_hits": [True, True, False]}},
        "witness": {"cache_hits": [True, True]},
    }
    figures = compiled_graphs(record)
    assert figures["compile_s"] == 105.0
    assert "6 of 7 graphs from the compile cache: text 2 of 2, image 2 of 3, witness 2 of 2" in figures["cached"]
    assert compiled_graphs({"compile_s": 3.0, "cache_hits": [False]}) == {
        "compile_s": 3.0,
        "cached": " (0 of 1 graphs from the compile cache: text 0 of 1)",
    }
