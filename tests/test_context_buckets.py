"""Decode context buckets (issue 48 item 2) and a prefill from position 0 that reads only the slots it
writes (issue 46 item 1): with `context_buckets` (32, 64) in a 128-token context, decode, verify and
the prefill graphs also exist reading only the first C slots of every full-length K/V buffer, and the
engine runs the smallest that covers the call's rows. Every case crosses a bucket boundary and must
equal HF's greedy tokens, its teacher-forced logits within the reference's spread; a recorder says
which bucket each call ran, and K/V past the bucket filled with NaN show they are neither read nor
written. The XLA lane's counterpart is in test_xla_lane (`context_buckets`).
"""

from __future__ import annotations

import pytest
import torch
from conftest import SMOKE_SHAPES
from test_long_prompts import assert_rows_exact

from gemma4lib.errors import SettingsError
from gemma4lib.port import PortSettings, compile_graphs, load_model
from gemma4lib.reference import random_prompt
from gemma4lib.runtime import Request

CONTEXT, PREFILL, SIZES = 128, (8, 16), (32, 64)


def _compiled(**overrides):
    options = dict(
        variant="e2b",
        model="random",
        backend="eager",
        context_length=CONTEXT,
        prefill_buckets=PREFILL,
        context_buckets=SIZES,
    )
    settings = PortSettings(**{**options, **overrides})
    model = load_model(settings)
    return model, compile_graphs(model, settings)


def _recorded(engine) -> list[tuple[str, int | None]]:
    """Every step call from here on as (graph, slots read; None: the whole context)."""
    calls: list[tuple[str, int | None]] = []

    def wrap(name, reads, step):
        return lambda *a: calls.append((name, reads)) or step(*a)

    steps = engine.steps
    steps.prefill = {b: wrap(f"prefill{b}", None, s) for b, s in steps.prefill.items()}
    steps.row_prefill = {b: wrap(f"row_prefill{b}", None, s) for b, s in steps.row_prefill.items()}
    for name in ("decode", "verify", "draft"):
        if getattr(steps, name) is not None:
            setattr(steps, name, wrap(name, None, getattr(steps, name)))
    steps.contexts = {n: {c: wrap(n, c, s) for c, s in by.items()} for n, by in steps.contexts.items()}
    return calls


def _smallest(reach: int, sizes=SIZES) -> int | None:
    return next((c for c in sizes if c >= reach), None)


def _prompts(model, lengths):
    return [random_prompt(model.config.vocab_size, n, 11 + n) for n in lengths]


def test_the_graph_set_has_one_key_per_bucket_and_a_prefill_per_bucket_it_fits():
    _, compiled = _compiled()
    assert sorted(compiled.graphs.named()) == [
        "decode",
        "decode@32",
        "decode@64",
        "prefill16",
        "prefill16@32",
        "prefill16@64",
        "prefill8",
        "prefill8@32",
        "prefill8@64",
    ]
    shapes = {name: g.shape.reads for name, g in compiled.graphs.named().items()}
    assert shapes["decode@32"] == 32 and shapes["decode"] is None
    assert compiled.graphs.contexts["decode@64"].shape.key["reads"] == 64
    assert "reads" not in compiled.graphs.decode.shape.key  # the whole context's key stays as it was


@pytest.mark.parametrize("ring", [True, False], ids=["ring", "full-sliding"])
def test_batched_rows_cross_a_bucket_mid_decode_and_equal_hf(ring):
    """Rows of 5 and 27 tokens: both prefilled through prefill16@32 (the second chunk at 16 too), then
    decode@32 until the longer row's next write passes slot 31, decode@64 after. Without rings the
    sliding layers' full-length buffers are read through the bucket as well."""
    model, compiled = _compiled(batch_size=2, ring_kv=ring)
    engine, new = compiled.runtime, 12
    calls = _recorded(engine)
    prompts = _prompts(model, (5, 27))
    result = engine.generate_rows([Request(ids, new) for ids in prompts], keep_logits=True)
    assert_rows_exact(model, result.rows, new)
    decode = [("decode", _smallest(p + 1)) for p in range(27, 27 + new - 1)]
    assert calls == [("prefill16", 32), ("prefill16", 32), *decode]
    assert {c for _, c in decode} == {32, 64}  # the boundary is crossed mid-decode


def test_a_chunked_prefill_takes_the_bucket_of_each_chunks_reach():
    """A 51-token prompt in chunks of 16: the chunks at 0 and 16 read 32 slots, the ones at 32 and 48
    read 64 (a chunk reads the K/V before it and its own); decode then crosses 64 into the whole context."""
    model, compiled = _compiled()
    engine, new = compiled.runtime, 20
    calls = _recorded(engine)
    ids = _prompts(model, (51,))[0]
    row = engine.generate(ids, new, keep_logits=True)
    assert row.chunks == 4
    assert_rows_exact(model, [row], new)
    prefill = [("prefill16", 32), ("prefill16", 32), ("prefill16", 64), ("prefill8", 64)]
    assert calls == [*prefill, *[("decode", _smallest(p + 1)) for p in range(51, 51 + new - 1)]]
    assert ("decode", None) in calls and ("decode", 64) in calls


def test_drafting_verifies_in_the_bucket_of_its_drafts():
    model, compiled = _compiled(draft="assistant", draft_tokens=2)
    assert sorted(compiled.graphs.contexts) == [
        "draft@32",
        "draft@64",
        "prefill16@32",
        "prefill16@64",
        "prefill8@32",
        "prefill8@64",
        "verify@32",
        "verify@64",
    ]
    engine, new = compiled.runtime, 16
    calls = _recorded(engine)
    row = engine.generate(_prompts(model, (25,))[0], new, keep_logits=True)
    assert_rows_exact(model, [row], new)
    for graph in ("verify", "draft"):  # the assistant's draft reads the committed K/V: its bucket too
        reads = [c for name, c in calls if name == graph]
        assert reads[0] == 32 and reads[-1] == 64 and reads == sorted(reads), (graph, reads)


def test_a_draft_in_its_bucket_reads_no_slot_past_it():
    """NaN past slot 32 of every full-length buffer: a drafted row that stays under 32 runs every
    graph in its bucket (prefill, verify and the assistant's draft), equals HF and leaves the NaN in
    place; the whole-context draft over the same buffers reads them (its logits are not finite)."""
    model, compiled = _compiled(ring_kv=False, draft="assistant", draft_tokens=2)
    engine, new = compiled.runtime, 10
    for t in compiled.kv:
        t[:, :, 32:] = float("nan")
    calls = _recorded(engine)
    row = engine.generate(_prompts(model, (14,))[0], new, keep_logits=True)
    assert_rows_exact(model, [row], new)
    assert {reads for _, reads in calls} == {32} and {"verify", "draft"} <= {name for name, _ in calls}
    assert all(torch.isnan(t[:, :, 32:]).all() for t in compiled.kv)
    x = torch.zeros(1, 1, 2 * model.config.hidden_size, dtype=engine.dtype)
    at = torch.tensor([20], dtype=torch.int32)
    assert torch.isfinite(engine.steps.contexts["draft"][32](x, at)[0]).all()
    assert not torch.isfinite(compiled.steps.draft(x, at)[0]).all()


def test_a_row_joining_a_running_batch_prefills_through_its_bucket():
    """One-row joins (`row_prefill`, a server's default): each chunk of a join runs its one-row graph
    reading 32 slots while the chunk ends inside them; the rows then decode across 32 together."""
    model, compiled = _compiled(batch_size=2, row_prefill=True)
    assert sorted(n for n in compiled.graphs.contexts if n.startswith("row_")) == [
        "row_prefill16@32",
        "row_prefill16@64",
        "row_prefill8@32",
        "row_prefill8@64",
    ]
    engine, new = compiled.runtime, 16
    calls = _recorded(engine)
    short, joining = _prompts(model, (6, 20))
    engine.admit({0: Request(short, new)}, keep_logits=True)
    engine.step()
    engine.admit({1: Request(joining, new)}, keep_logits=True)
    while engine.live_rows():
        engine.step()
    assert_rows_exact(model, [engine.release(r) for r in (0, 1)], new)
    assert calls[:4] == [("row_prefill8", 32), ("decode", 32), ("row_prefill16", 32), ("row_prefill8", 32)]
    assert [reads for _, reads in calls[4:]] == [_smallest(p + 1) for p in range(20, 20 + new - 1)]


def test_kv_past_the_bucket_are_neither_read_nor_written():
    """NaN in every full-length buffer's slots 32.. : a row that stays under 32 runs prefill16@32 and
    decode@32, equals HF, and leaves the NaN in place; the whole-context decode over the same buffers
    reads them (its logits are not finite), so the NaN would have shown."""
    model, compiled = _compiled(ring_kv=False)
    engine, new = compiled.runtime, 10
    full = [t for t in compiled.kv if t.shape[2] == CONTEXT]
    assert len(full) == len(compiled.kv)  # without rings every buffer is full-length
    for t in full:
        t[:, :, 32:] = float("nan")
    calls = _recorded(engine)
    ids = _prompts(model, (14,))[0]
    row = engine.generate(ids, new, keep_logits=True)
    assert_rows_exact(model, [row], new)
    assert {reads for _, reads in calls} == {32}
    assert all(torch.isnan(t[:, :, 32:]).all() for t in full)
    assert all(torch.isfinite(t[:, :, : len(ids) + new - 1]).all() for t in full)
    engine.steps.contexts.clear()
    inputs = engine.embed(torch.tensor([[row.tokens[-1]]]))
    logits = engine.steps.decode(
        *inputs, torch.tensor([len(ids) + new - 1], dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    )
    assert not torch.isfinite(logits[0]).all()


def test_cpu_compiled_buckets_equal_hf(ports):
    """AOTInductor, at the notebooks' smoke context (its whole-context graphs are the ones the other
    tests compile): one context bucket, 32, crossed mid-decode."""
    context = SMOKE_SHAPES["context_length"]
    p = ports.get("e2b", "random", context_length=context, prefill_buckets=(16,), context_buckets=(32,))
    assert sorted(p.compiled.graphs.contexts) == ["decode@32", "prefill16@32"]
    calls = _recorded(p.runtime)
    ids, new = _prompts(p.model, (24,))[0], 16
    assert_rows_exact(p.model, [p.runtime.generate(ids, new, keep_logits=True)], new)
    assert calls[0] == ("prefill16", 32) and ("decode", 32) in calls and calls[-1] == ("decode", None)


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"context_buckets": (64, 32)}, "must ascend without repeats"),
        ({"context_buckets": (32, 32)}, "must ascend without repeats"),
        ({"context_buckets": (256,)}, "at most context_length 128"),
        ({"context_buckets": (0,)}, "at least 1"),
    ],
)
def test_bad_context_buckets_are_refused_before_anything_loads(overrides, match):
    with pytest.raises(SettingsError, match=match):
        PortSettings(**{"variant": "e2b", "context_length": 128, **overrides})


def test_gloo_ranks_read_their_bucket_and_equal_hf():
    """TP = 2 over gloo: each rank runs its rank graph at `decode@32`, `decode@64` and `prefill16@32` (the
    same weights and K/V, `with_shape`), the parent routes by name; rows of 6 and 26 tokens cross 32 and
    64 mid-decode and equal HF, and the ranks agree. (Not 5 and 27 as above: on this random E4B the
    27-token row's 8th token is a 0.0013-logit tie that HF's own cached and uncached runs disagree on,
    with or without buckets.)"""
    model, compiled = _compiled(variant="e4b", backend="cpu", tp_degree=2, batch_size=2)
    engine, new = compiled.runtime, 12
    calls = _recorded(engine)
    result = engine.generate_rows([Request(ids, new) for ids in _prompts(model, (6, 26))], keep_logits=True)
    assert_rows_exact(model, result.rows, new)
    assert calls == [("prefill16", 32), ("prefill16", 32), *[("decode", _smallest(p + 1)) for p in range(26, 37)]]
    assert compiled.report()["ranks_agree"]


def test_gloo_ranks_draft_in_the_bucket_of_their_drafts_and_equal_hf():
    """TP = 2 over gloo with the assistant: the drafting modules at `verify@32`, `verify@64`, the
    assistant's `draft@32`, `draft@64` and the prefill buckets (the same weights and K/V); a 25-token
    row's verifies and drafts climb the buckets, the
    tokens and teacher-forced logits equal HF's, and the ranks agree."""
    model, compiled = _compiled(variant="e4b", backend="cpu", tp_degree=2, draft="assistant", draft_tokens=2)
    assert {"verify@32", "verify@64", "draft@32", "prefill16@32"} <= set(compiled.graphs.contexts)
    engine, new = compiled.runtime, 20
    calls = _recorded(engine)
    row = engine.generate(_prompts(model, (25,))[0], new, keep_logits=True)
    assert_rows_exact(model, [row], new)
    for graph in ("verify", "draft"):
        reads = [c for name, c in calls if name == graph]
        assert reads[0] == 32 and 64 in reads and reads == sorted(reads, key=lambda c: c or CONTEXT), (graph, reads)
    assert compiled.report()["ranks_agree"]  # (random weights: the drafts' acceptance is not the point)


def test_neuron_keys_of_each_bucket_route_by_their_positions(tmp_path, monkeypatch):
    """`backend="neuron"`, batch 2, `row_prefill`, buckets (32,) in a 64-token context: the recipe's own
    rank modules on CPU (`_RoutedNxDModel`: every key's module, one set of K/V, each call routed by its
    input shapes as NxD routes it). Every key routes apart (a bucket takes its positions `[C]` first);
    a row joins through `row_prefill16@32`, decodes through `decode@32` and crosses into the whole
    context; the tokens equal the eager engine's and HF's."""
    from test_neuron_recipes import _RoutedNxDModel

    from gemma4lib.recipes import neuron_env, neuron_model_builder

    monkeypatch.setenv("GEMMA4LIB_INSTANCE_TYPE", "inf2.8xlarge")
    monkeypatch.setattr(neuron_env, "require_sdk", lambda *a, **k: None)
    monkeypatch.setattr(neuron_env, "require", lambda *a, **k: None)
    kwargs = dict(batch_size=2, row_prefill=True, prefill_buckets=(16,), context_length=64, context_buckets=(32,))
    loaded = {}

    def compile_stub(m, tp, folder, graphs, **kw):
        loaded["model"] = _RoutedNxDModel(m, graphs)
        loaded["keys"] = sorted(graphs)
        (folder / "manifest.json").write_text("{}")

    monkeypatch.setattr(neuron_model_builder, "compile_model_builder", compile_stub)
    monkeypatch.setattr(neuron_model_builder, "load_model_builder", lambda path, tp: loaded["model"])
    new, tokens = 24, {}
    short, joining = _prompts(load_model(PortSettings(variant="e2b", model="random")), (6, 20))
    for backend in ("eager", "neuron"):
        model, compiled = _compiled(backend=backend, cache_dir=str(tmp_path), **kwargs)
        engine = compiled.runtime
        engine.admit({0: Request(short, new)}, keep_logits=True)
        engine.step()
        engine.admit({1: Request(joining, new)}, keep_logits=True)
        while engine.live_rows():
            engine.step()
        tokens[backend] = [engine.release(r) for r in (0, 1)]
    assert_rows_exact(model, tokens["neuron"], new)
    assert [r.tokens for r in tokens["neuron"]] == [r.tokens for r in tokens["eager"]]
    routed = loaded["model"]
    assert len(routed.routes) == len(loaded["keys"])  # no two keys take the same input shapes
    assert {"row_prefill16@32", "decode@32", "prefill16@32"} <= set(loaded["keys"])
    ran = routed.keys
    assert ran[:2] == ["row_prefill16@32", "decode@32"] and "row_prefill16@32" in ran[2:4], ran
    assert ran[-1] == "decode" and "decode@32" in ran


def test_the_context_itself_is_the_implied_last_bucket():
    assert PortSettings(variant="e2b", context_length=128, context_buckets=[32, 128]).context_buckets == (32,)
    assert PortSettings(variant="e2b").context_buckets == ()


def test_a_bundle_records_its_context_buckets_only_when_set():
    """A bundle's settings must equal the run's: a bucketed run needs a bucketed bundle, and bundles
    exported before (no buckets) still match the runs they were made for."""
    from gemma4lib.cache.bundle import settings_facts

    plain = settings_facts(PortSettings(variant="e2b"))
    assert "context_buckets" not in plain
    assert settings_facts(PortSettings(variant="e2b", context_buckets=(32,))) == {**plain, "context_buckets": [32]}


def test_sizes_given_as_one_string_are_split():
    """`serve run gemma4lib.cli:ray_app context_buckets=32,64` and the command line hand over a string."""
    settings = PortSettings(variant="e2b", context_length=128, prefill_buckets="16, 64", context_buckets="32,64")
    assert (settings.prefill_buckets, settings.context_buckets) == ((16, 64), (32, 64))
    with pytest.raises(SettingsError, match="context_buckets must be a whole number"):
        PortSettings(variant="e2b", context_length=128, context_buckets="32;64")
