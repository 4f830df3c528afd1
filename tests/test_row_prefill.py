"""One-row prefill: a request that joins running rows alone prefills its own row, not the batch.

The engine with `row_prefill` must produce what the batch-shaped prefill produces: the same tokens
for every row, first logits within float noise, and the other rows' K/V untouched, whether a row
joins alone or rows join together, plain or drafted. Eager graphs (the same modules the cpu backend
compiles) keep this free of compiles; the served engine in test_server_engine runs it through
AOTInductor.
"""

from __future__ import annotations

import pytest
import torch

from gemma4lib.cache.bundle import graph_names
from gemma4lib.cli import serving_defaults
from gemma4lib.errors import SettingsError
from gemma4lib.port import PortSettings, compile_graphs, eos_ids, load_model
from gemma4lib.runtime import Request, encode_prompt

QUESTIONS = ["France", "Japan", "Kenya", "Peru"]


def _engine(row_prefill: bool, **kwargs):
    settings = PortSettings(variant="e2b", backend="eager", batch_size=4, row_prefill=row_prefill, **kwargs)
    model = load_model(settings)
    compiled = compile_graphs(model, settings)
    return model, compiled


def _requests(model, new_tokens: int = 10) -> list[Request]:
    eos = tuple(eos_ids(model))
    return [
        Request(encode_prompt(model.tokenizer, f"What is the capital of {c}?"), new_tokens, eos_token_ids=eos)
        for c in QUESTIONS
    ]


def _staggered(compiled, requests) -> tuple[dict, list[str]]:
    """Rows 0 and 1 join together, decode two steps, row 2 joins alone, one more step, row 3 joins
    alone; then every row runs to its end. Each row's result, and how each admission prefilled."""
    engine = compiled.runtime
    paths, calls = [], []

    def counted(step):
        def run(row, *inputs):
            calls.append(row)
            return step(row, *inputs)

        return run

    engine.steps.row_prefill = {b: counted(step) for b, step in engine.steps.row_prefill.items()}

    def admit(rows):
        before = len(calls)
        engine.admit({r: requests[r] for r in rows}, keep_logits=True)
        assert calls[before:] in ([], list(rows))
        paths.append("row" if calls[before:] else "batch")

    admit([0, 1])
    engine.step()
    engine.step()
    admit([2])
    engine.step()
    admit([3])
    while engine.live_rows():
        engine.step()
    return {r: engine.release(r) for r in range(4)}, paths


@pytest.mark.parametrize("draft", [None, "prompt_lookup", "assistant"])
def test_rows_that_join_alone_get_what_the_batch_prefill_gives(draft):
    kwargs = {"draft": draft} if draft else {}
    model, batch_prefill = _engine(False, **kwargs)
    _, by_row = _engine(True, **kwargs)
    assert set(by_row.runtime.steps.row_prefill) == set(batch_prefill.runtime.steps.prefill)
    requests = _requests(model)
    want, want_paths = _staggered(batch_prefill, requests)
    got, got_paths = _staggered(by_row, requests)
    assert want_paths == ["batch"] * 3 and got_paths == ["row"] * 3
    for r in range(4):
        assert got[r].tokens == want[r].tokens, r
        torch.testing.assert_close(got[r].first_logits, want[r].first_logits, atol=1e-4, rtol=1e-4)
    assert "Paris" in model.tokenizer.decode(got[0].tokens)  # the trained fixture still answers


def test_a_row_prefill_writes_its_row_and_no_other():
    model, compiled = _engine(True)
    engine, kv = compiled.runtime, compiled.kv
    before = [buffer.clone() for buffer in kv]
    engine.admit({2: _requests(model)[0]})
    for old, new in zip(before, kv, strict=True):
        assert torch.equal(old[[0, 1, 3]], new[[0, 1, 3]])
    assert any(not torch.equal(old[2], new[2]) for old, new in zip(before, kv, strict=True))


def test_many_rows_joining_together_take_the_batch_shaped_prefill():
    _, compiled = _engine(True)
    engine = compiled.runtime
    assert [engine.joins_by_row(n) for n in range(1, 5)] == [True, True, False, False]  # at most half of 4


def test_the_bundle_knows_the_row_graphs():
    names = graph_names(PortSettings(variant="e2b", batch_size=4, row_prefill=True, prefill_buckets=(16, 64)))
    assert names == ["prefill16", "prefill64", "row_prefill16", "row_prefill64", "decode"]
    assert "row_prefill64" not in graph_names(PortSettings(variant="e2b", batch_size=1, row_prefill=True))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"backend": "cpu", "tp_degree": 2},
        {"backend": "cpu", "row_prefill": "sometimes"},
    ],
)
def test_row_prefill_is_refused_where_it_cannot_run(kwargs):
    settings = {"variant": "e4b", "batch_size": 4, "row_prefill": True, **kwargs}
    with pytest.raises(SettingsError, match="row_prefill"):
        PortSettings(**settings)


def test_a_server_prefills_rows_alone_unless_told_otherwise():
    assert serving_defaults({"variant": "e2b", "batch_size": 4})["row_prefill"] is True
    assert serving_defaults({"variant": "e2b", "batch_size": 1})["row_prefill"] is False
    for backend in ("xla", "neuron"):  # joins through the join graph (`device.row_join`): the same default
        assert serving_defaults({"variant": "e2b", "batch_size": 4, "backend": backend})["row_prefill"] is True
    drafted = {"variant": "e2b", "batch_size": 4, "backend": "neuron", "draft": "assistant"}
    assert serving_defaults(drafted)["row_prefill"] is True  # the drafting keys have their joins too
    assert serving_defaults({"variant": "e2b", "batch_size": 4, "row_prefill": False})["row_prefill"] is False
    assert PortSettings(variant="e2b", batch_size=4, row_prefill="true").row_prefill is True  # `serve run` key=value
