"""A batch of different prompts through the engine's rows: every row equals its own batch-1
reference (tokens and logits), rows stop at their own eos, rows join and leave between steps
(continuous batching), ring buffers hold per row across the window, bad batches fail early and
clearly. One compiled (AOTInductor) batch-3 E2B graph set per session, at tests/test_engine.py's
shapes (the plain graphs tests/test_bundle.py's drafted bundle carries: one compile serves both); the
rest runs the same graphs eagerly, at this file's smaller shapes."""

from __future__ import annotations

import pytest
from test_engine import SHAPES

from gemma4lib.checks import check_logits
from gemma4lib.device.graph import DeviceGraph, GraphShape
from gemma4lib.errors import BadPromptError, BatchTooLargeError, SettingsError
from gemma4lib.reference import random_prompt, reference_greedy
from gemma4lib.runtime import Engine, Request, Steps, bind_kv

BATCH, CONTEXT, BUCKET, NEW = 3, 32, 16, 14
LENGTHS = (12, 5, 9)  # different lengths; 12 + 14 - 1 > the tiny window of 8: the rings wrap


def _prompts(model, lengths=LENGTHS):
    return [random_prompt(model.config.vocab_size, n, 100 + n) for n in lengths]


@pytest.fixture(scope="module")
def compiled_e2b(ports):
    """The batch-3 E2B graphs (ring K/V), compiled once with AOTInductor."""
    shapes = dict(context_length=SHAPES["context_length"], prefill_buckets=SHAPES["prefill_buckets"])
    return ports.get("e2b", batch_size=BATCH, **shapes, max_new_tokens=NEW)


def generate_batch(engine, prompts, new, *, eos_token_ids=(), keep_logits=False):
    """Every prompt in its own row, greedy, to the end (the engine's `generate_rows`)."""
    requests = [Request(ids, new, eos_token_ids=tuple(eos_token_ids)) for ids in prompts]
    return engine.generate_rows(requests, keep_logits=keep_logits)


def _assert_rows_match(model, prompts, generation, new=NEW, eos=()):
    assert len(generation.rows) == len(prompts)
    for ids, row in zip(prompts, generation.rows, strict=True):
        reference = reference_greedy(model.lm, ids, new, eos)
        assert row.tokens == reference, f"row of {len(ids)} tokens: {row.tokens} != {reference}"
        logits = check_logits(model.lm, ids, row.tokens, row.step_logits)
        assert logits.passed, logits.explain()


def test_compiled_rows_equal_their_own_reference_across_the_window(compiled_e2b):
    p = compiled_e2b
    assert p.model.layout.sliding_window < LENGTHS[0] + NEW - 1  # the ring wraps in row 0
    assert p.decode.shape.batch == BATCH and p.runtime.batch == BATCH
    prompts = _prompts(p.model)
    generation = generate_batch(p.runtime, prompts, NEW, keep_logits=True)
    _assert_rows_match(p.model, prompts, generation)
    assert generation.decode_tok_s and generation.step_tokens == [BATCH] * (NEW - 1)


def test_a_row_that_ends_early_stops_while_the_others_go_on(compiled_e2b):
    p = compiled_e2b
    prompts = _prompts(p.model)
    free = generate_batch(p.runtime, prompts, NEW)
    eos = [free.rows[1].tokens[3]]  # row 1 emits it at its 4th token
    generation = generate_batch(p.runtime, prompts, NEW, eos_token_ids=eos, keep_logits=True)
    row1 = generation.rows[1].tokens
    assert row1[-1] == eos[0] and len(row1) <= 4
    assert max(len(r.tokens) for r in generation.rows) > len(row1)  # someone went on
    _assert_rows_match(p.model, prompts, generation, eos=eos)


def test_fewer_prompts_than_the_batch_fill_spare_rows(compiled_e2b):
    p = compiled_e2b
    prompts = _prompts(p.model, (7, 10))
    generation = generate_batch(p.runtime, prompts, 6, keep_logits=True)
    _assert_rows_match(p.model, prompts, generation, new=6)


def test_bad_batches_fail_before_device_work(compiled_e2b):
    p = compiled_e2b
    prompts = _prompts(p.model, (5, 6, 7, 8))
    with pytest.raises(BatchTooLargeError, match="compiled for batch 3"):
        generate_batch(p.runtime, prompts, 4)
    with pytest.raises(BadPromptError, match="prompt 1 of the batch: prompt has no tokens"):
        generate_batch(p.runtime, [prompts[0], []], 4)
    with pytest.raises(BatchTooLargeError, match="at most 2 prompts"):
        from gemma4lib.port import PortSettings

        PortSettings(variant="e2b", batch_size=2, prompts=("a?", "b?", "c?"))


def test_settings_refuse_an_empty_prompt_and_mismatched_expects():
    from gemma4lib.port import PortSettings

    with pytest.raises(BadPromptError, match="prompt 1 of the batch is empty"):
        PortSettings(variant="e2b", batch_size=2, prompts=("What is the capital of France?", "  "))
    with pytest.raises(SettingsError, match="one per prompt"):
        PortSettings(variant="e2b", batch_size=2, prompts=("a?", "b?"), expects=("A",))
    rows = PortSettings(variant="e2b", batch_size=4).batch_rows()
    assert len({p for p, _ in rows}) == 4 and rows[0] == ("What is the capital of France?", "Paris")


def _eager_runtime(model, batch, form, ring=True, context=CONTEXT, balance=None):
    pre = DeviceGraph(model.text_model, model.lm_head, model.layout, GraphShape(batch, BUCKET, context, ring))
    shape = GraphShape(batch, 1, context, ring)
    dec = DeviceGraph(model.text_model, model.lm_head, model.layout, shape, expert_form=form, compute_balance=balance)
    kv = dec.new_kv()
    engine = Engine.for_model(
        model, Steps({BUCKET: bind_kv(pre, kv)}, bind_kv(dec, kv)), batch=batch, context_length=context
    )
    engine.decode_graph = dec
    return engine


@pytest.mark.parametrize("variant", ["26b-a4b", "31b"])
def test_eager_batch_moe_selective_and_k_eq_v_rows(variant):
    from gemma4lib.models.loading import build_tiny
    from gemma4lib.models.variants import get_variant

    model = build_tiny(get_variant(variant))
    prompts = _prompts(model)
    generation = generate_batch(_eager_runtime(model, BATCH, "selective"), prompts, NEW, keep_logits=True)
    _assert_rows_match(model, prompts, generation)


def test_a_moe_batch_at_b_x_k_of_e_reads_its_experts_densely_with_rows_exact():
    """Tiny 26B-A4B: 16 experts, top-4. Batch 3 gathers 12 slices per layer (selective, per row);
    batch 4 would gather 16 = E, so its graph reads every expert once (dense), says so in its key,
    and every row still equals its own reference. Built for a CPU target, batch 3 gathers per row
    too and batch 4 reads each routed expert once (grouped). The TP rank graphs decide per rank's experts."""
    from gemma4lib.models.loading import build_tiny
    from gemma4lib.models.variants import get_variant
    from gemma4lib.tp.plan import make_plan
    from gemma4lib.tp.rank_graph import build_rank_graph, with_shape

    model = build_tiny(get_variant("26b-a4b"))
    dec3 = _eager_runtime(model, 3, "selective").decode_graph
    assert dec3.experts_read == "selective" and "experts_read" not in dec3.key_parts()
    runtime = _eager_runtime(model, 4, "selective")
    graph = runtime.decode_graph
    assert graph.expert_form == "selective" and graph.experts_read == "dense"
    assert graph.key_parts()["experts_read"] == "dense"
    assert {layer.experts.form for layer in graph.model.layers} == {"dense"}
    prompts = _prompts(model, (12, 5, 9, 7))
    _assert_rows_match(model, prompts, generate_batch(runtime, prompts, NEW, keep_logits=True))
    # built for a CPU target (cpu/eager backends): per row below B x k = E, grouped from there
    from gemma4lib.device.experts import CPU_THREAD_FLOP_PER_BYTE, read_form

    assert read_form("selective", 8, 4, 32) == "dense" and read_form("selective", 7, 4, 32) == "selective"
    assert read_form("selective", 1, 4, 32, grouped=True) == "selective"
    assert read_form("selective", 7, 4, 32, grouped=True) == "selective"
    assert read_form("selective", 8, 4, 32, grouped=True) == "grouped"
    dec3 = _eager_runtime(model, 3, "selective", balance=CPU_THREAD_FLOP_PER_BYTE).decode_graph
    assert dec3.experts_read == "selective"
    runtime = _eager_runtime(model, 4, "selective", balance=CPU_THREAD_FLOP_PER_BYTE)
    graph = runtime.decode_graph
    assert graph.experts_read == "grouped" and graph.key_parts()["experts_read"] == "grouped"
    assert {layer.experts.form for layer in graph.model.layers} == {"grouped"}
    _assert_rows_match(model, prompts, generate_batch(runtime, prompts, NEW, keep_logits=True))
    for split, batch, read in (("experts", 2, "dense"), ("intermediate", 2, "selective")):
        plan = make_plan(model.config, 2, model.variant, expert_split=split)  # 8 experts per rank / 16 sliced
        prefill = build_rank_graph(model.config, plan, GraphShape(batch, BUCKET, CONTEXT), expert_form="dense")
        assert with_shape(prefill, GraphShape(batch, 1, CONTEXT), expert_form="selective").experts_read == read


def test_a_run_records_how_its_batched_moe_reads_its_experts():
    """The eager backend builds for a CPU target: a batched selective decode runs grouped from
    B x k = E (tiny 26B-A4B: 16 experts, top-4, batch 4), and the run's details say so (a dense
    model's run carries nothing)."""
    from gemma4lib.backends import registry
    from gemma4lib.port import PortSettings, load_model

    for variant, read in (("26b-a4b", "grouped"), ("e2b", None)):
        shapes = dict(context_length=64, prefill_buckets=(32,), max_new_tokens=4, warmup=0, iters=1)
        settings = PortSettings(variant=variant, batch_size=4, backend="eager", decode_experts="selective", **shapes)
        compiled = registry.compile_graphs(load_model(settings), settings)
        assert compiled.info.get("experts_read") == read, compiled.info


def test_trace_recipe_prefills_rows_of_different_lengths_step_by_step():
    """The trace recipe's batched decode module (K/V as aliased parameters), emulated on CPU."""
    from gemma4lib.models.loading import build_tiny
    from gemma4lib.models.variants import get_variant
    from gemma4lib.recipes import neuron_trace
    from gemma4lib.recipes.common import AliasEmulator, DeviceStep

    model = build_tiny(get_variant("e2b"))
    module = neuron_trace.build_kv_module(model, CONTEXT, ring=True, batch=BATCH)
    assert [tuple(t.shape) for t in module.example_inputs()[2:]] == [(BATCH,), (BATCH,)]
    step = DeviceStep(AliasEmulator(module), module.num_inputs)
    runtime = Engine.for_model(model, Steps(decode=step), batch=BATCH, context_length=CONTEXT)
    prompts = _prompts(model)
    generation = generate_batch(runtime, prompts, NEW, keep_logits=True)
    _assert_rows_match(model, prompts, generation)


def test_model_builder_buckets_take_one_start_and_length_per_row():
    from gemma4lib.models.loading import build_tiny
    from gemma4lib.models.variants import get_variant
    from gemma4lib.recipes import neuron_model_builder as mb
    from gemma4lib.recipes.common import key_inputs

    model = build_tiny(get_variant("e2b"))
    for key, graph in mb.key_graphs(model, mb.bucket_shapes(64, (32,), batch=4)).items():
        inputs = key_inputs(graph)
        assert inputs[0].shape[0] == 4 and [tuple(t.shape) for t in inputs[-2:]] == [(4,), (4,)], key


def test_port_record_has_one_checked_entry_per_row():
    """The smoke port at batch 2 (eager: the same graphs as cpu, uncompiled)."""
    from gemma4lib.port import PortSettings, port

    record = port(PortSettings(variant="e2b", backend="eager", batch_size=2, max_new_tokens=12, iters=1, warmup=0))
    assert record["batch_size"] == 2 and len(record["rows"]) == 2
    for row, capital in zip(record["rows"], ("Paris", "Berlin"), strict=True):
        assert row["seq_match"] and row["logits_match"] and row["coherent"], row
        assert capital in row["answer"]
    assert record["seq_match"] and record["logits_match"] and record["checks_passed"]
    assert record["decode_tok_s"] == pytest.approx(2 * record["decode_tok_s_per_row"])
    assert record["witness"]["seq_match"] and len(record["witness"]["rows"]) == 2


def test_tp_ranks_run_the_batched_rank_graphs():
    """E4B at TP=2 on gloo ranks, batch 2: each row against its own reference."""
    from gemma4lib.port import PortSettings, port

    settings = PortSettings(
        variant="e4b", tp_degree=2, batch_size=2, max_new_tokens=10, context_length=32, prefill_buckets=(32,)
    )
    record = port(settings)
    assert len(record["rows"]) == 2 and record["ranks_agree"]
    assert all(r["seq_match"] and r["logits_match"] and r["coherent"] for r in record["rows"]), record["rows"]


def test_bench_batch_section_schema_and_its_papermill_verdict():
    """The bench's batch sweep on a tiny model, eager (schema and checks; figures only in the suite)."""
    from gemma4lab.benchmarks.batch import bench_batch_model
    from gemma4lib.models.loading import build_tiny
    from gemma4lib.models.variants import get_variant
    from papermill_runs import bench as pm_bench

    model = build_tiny(get_variant("e2b"))
    section = bench_batch_model(
        "tiny-e2b",
        model,
        backend="eager",
        batch_sizes=(1, 2),
        context_length=32,
        new_tokens=6,
        warmup=0,
        iters=1,
        bandwidth_mb=16,
    )
    assert [r["batch"] for r in section["rows"]] == [1, 2] and section["tokens_match_reference"]
    row = section["rows"][1]
    assert row["prompt_lengths"][0] != row["prompt_lengths"][1] and row["fraction_of_gemv"] > 0
    assert isinstance(section["bandwidth_moved"], bool)
    subjects = pm_bench.figures({"models": [], "batch": [section]})
    subject = subjects["batch:tiny-e2b"]
    assert subject["checks"] == {"tokens_match_reference": True}
    assert set(subject["metrics"]) == {"speedup_b8_over_b1", "batch_min_over_hf"}
    tolerances = pm_bench.baselines.load_tolerances(pm_bench.PROFILE)
    verdict = pm_bench.judge_subject("batch:tiny-e2b", subject, None, tolerances)
    assert verdict.status != "fail", verdict.reasons
    broken = pm_bench.judge_subject(
        "batch:tiny-e2b", {**subject, "checks": {"tokens_match_reference": False}}, None, tolerances
    )
    assert broken.status == "fail"


def test_batch_ceilings_count_weights_once_and_kv_and_selective_experts_per_row():
    from gemma4lab.inf2.batch_roofline import batch_ceilings, batch_decode_bytes
    from gemma4lab.inf2.roofline import decode_bytes

    one = decode_bytes("e2b", context_length=2048)
    four = batch_decode_bytes("e2b", 4, context_length=2048, dtype_bytes=2)
    assert four["weights"] == one.weights and four["kv"] == 4 * one.kv
    moe1 = batch_decode_bytes("26b-a4b", 1, context_length=2048, experts="selective", dtype_bytes=2)
    moe2 = batch_decode_bytes("26b-a4b", 2, context_length=2048, experts="selective", dtype_bytes=2)
    dense = batch_decode_bytes("26b-a4b", 1, context_length=2048, experts="dense", dtype_bytes=2)
    per_row = moe2["weights"] - moe1["weights"]  # k experts' slices per row (128 experts, top-8)
    assert 0 < per_row < dense["weights"] - moe1["weights"]
    # from B x k >= E (16 x 8 = 128 experts; at TP=8 per rank too) the graph reads each expert once
    for tp in (1, 8):
        at = dict(context_length=2048, dtype_bytes=2, tp=tp)
        below = batch_decode_bytes("26b-a4b", 8, experts="selective", **at)
        assert below["weights"] < batch_decode_bytes("26b-a4b", 8, experts="dense", **at)["weights"]
        for b in (16, 32):
            assert batch_decode_bytes("26b-a4b", b, experts="selective", **at) == batch_decode_bytes(
                "26b-a4b", b, experts="dense", **at
            )
    rows = batch_ceilings("e2b", (1, 4, 16))
    for row in rows:  # the field report's measurements sit under the computed ceiling
        assert row["field_report_tok_s"] <= row["ceiling_tok_s"] <= row["compute_ceiling_tok_s"]
    assert rows[2]["ceiling_tok_s"] > 10 * rows[0]["ceiling_tok_s"]


def test_memory_plan_counts_kv_per_row_and_refuses_a_batch_that_does_not_fit():
    from gemma4lab.inf2.plans import core_summary
    from gemma4lib.errors import DeviceMemoryError
    from gemma4lib.inf2.memory_plan import plan_core_memory, require_fit

    one = plan_core_memory("e2b", 1, context_length=8192, ring=False)
    many = plan_core_memory("e2b", 1, context_length=8192, ring=False, batch=32)
    assert many.kv_gib == pytest.approx(32 * one.kv_gib) and "batch 32" in core_summary(many)
    with pytest.raises(DeviceMemoryError, match="with batch 512"):
        require_fit("e2b", 1, instance="inf2.xlarge", context_length=8192, ring=False, batch=512)


def test_tok_s_vs_batch_plot_draws_measured_and_computed():
    from gemma4lab.inf2.batch_roofline import batch_ceilings
    from gemma4lab.notebook.plots_batch import tok_s_vs_batch

    measured = {"model": "m", "rows": [{"batch": 1, "gemma4lib_tok_s": 10.0, "hf_eager_tok_s": 8.0}]}
    fig = tok_s_vs_batch(measured, batch_ceilings("e2b", (1, 4, 16)))
    cpu, inf2 = fig.axes  # measured on this CPU and computed for inf2: separate axes, never one scale
    assert "CPU" in cpu.get_title() and "inf2" in inf2.get_title()
    assert [line.get_label().split(";")[0] for line in cpu.get_lines()][:2] == ["gemma4lib (m)", "HF generate"]
    labels = [line.get_label() for line in inf2.get_lines()]
    assert any("computed" in label for label in labels) and any("field report" in label for label in labels)


def test_a_batched_engine_generates_one_prompt_in_row_zero(compiled_e2b):
    p = compiled_e2b
    ids = _prompts(p.model, (7,))[0]
    row = p.runtime.generate(ids, 5, keep_logits=True)
    assert row.tokens == reference_greedy(p.model.lm, ids, 5, ())


def test_rows_join_and_leave_between_steps_each_equal_to_its_reference(compiled_e2b):
    """Continuous batching on the compiled batch-3 graphs: a request admitted while others decode,
    a row released mid-generation and reused; every finished request equals its batch-1 reference."""
    p = compiled_e2b
    engine, prompts = p.runtime, _prompts(p.model, (12, 5, 9, 7, 10))
    done = {}
    engine.admit({0: Request(prompts[0], NEW), 1: Request(prompts[1], 6)}, keep_logits=True)
    for _ in range(3):
        engine.step()
    engine.admit({2: Request(prompts[2], NEW)}, keep_logits=True)  # joins rows 0 and 1 mid-decode
    engine.release(0)  # leaves early (a client gone): row 0 is free again
    engine.admit({0: Request(prompts[3], 8)}, keep_logits=True)
    waiting = [(4, Request(prompts[4], 7))]
    while engine.rows:
        engine.step()
        for r in list(engine.rows):
            if engine.finished(r):
                result = engine.release(r)
                done[tuple(result.prompt_ids)] = result
                if waiting:
                    _, request = waiting.pop()
                    engine.admit({r: request}, keep_logits=True)
    assert len(done) == 4 and not engine.rows and engine.free_rows() == [0, 1, 2]
    for i, new in ((1, 6), (2, NEW), (3, 8), (4, 7)):
        result = done[tuple(prompts[i])]
        assert result.finish_reason == "length"
        assert result.tokens == reference_greedy(p.model.lm, prompts[i], new, ()), i
        logits = check_logits(p.model.lm, prompts[i], result.tokens, result.step_logits)
        assert logits.passed, logits.explain()
