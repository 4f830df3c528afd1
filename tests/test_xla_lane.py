"""The XLA lane (README, "Environments"): every tiny variant's prefill + decode graphs through
torch_xla on CPU.

Runs in the lane's environment (``scripts/setup_xla_env.sh``)::

    PJRT_DEVICE=CPU .venv-xla/bin/python -m pytest tests/test_xla_lane.py

In an environment without torch_xla (the main venv) only the pure-Python checks run; the rest skip.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

from gemma4lib.backends import xla as xla_backend
from gemma4lib.backends.xla import hlo_op_counts
from gemma4lib.models.variants import VARIANTS

HAS_XLA = importlib.util.find_spec("torch_xla") is not None
VARIANT_NAMES = tuple(VARIANTS)
DECODE_STEPS = 16


@pytest.fixture(scope="module")
def xla_lane():
    """torch_xla on the CPU client, with the fast XLA:CPU compile flags, set before first use."""
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    xla_backend.use_fast_cpu_compile()
    pytest.importorskip("torch_xla")
    from gemma4lab.tools import xla_check

    return xla_check


def test_module_imports_without_torch_xla():
    """The backend imports torch_xla only when a graph runs: importing it (the main venv has no
    torch_xla; the lane's does) loads none of it."""
    import subprocess

    code = "import sys, gemma4lib.backends.xla; print('torch_xla' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_hlo_op_counts_parses_instructions_and_tuples():
    text = """HloModule m
%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add.1 = f32[] add(f32[] %x, f32[] %y)
}
ENTRY %main (p0: f32[2,3]) -> (f32[2], f32[2,3]) {
  %p0 = f32[2,3]{1,0} parameter(0)
  %c = f32[] constant(0)
  %r = f32[2]{0} reduce(f32[2,3]{1,0} %p0, f32[] %c), dimensions={1}, to_apply=%add
  ROOT %t = (f32[2]{0}, /*index=1*/f32[2,3]{1,0}) tuple(f32[2]{0} %r, f32[2,3]{1,0} %p0)
}
"""
    counts = hlo_op_counts(text)
    assert counts == {"parameter": 3, "add": 1, "constant": 1, "reduce": 1, "tuple": 1, "total": 7}


def test_session_rejects_inplace_graphs():
    from torch import nn

    graph = nn.Linear(2, 2)
    graph.inplace = True
    with pytest.raises(ValueError, match="inplace=False"):
        xla_backend.XLASession({"decode": graph})


def test_session_rejects_index_inputs_that_are_not_int32(xla_lane):
    """Index inputs are int32 on every backend (`graph.INDEX_DTYPE`): a step refuses an int64 start
    before tracing anything, so every passing run of the lane received int32 in every graph."""
    import torch

    from gemma4lib.device.graph import DeviceGraph, GraphShape, index_tensor
    from gemma4lib.errors import GraphFormError

    model = _audit_model("12b")
    graph = DeviceGraph(model.text_model, model.lm_head, model.layout, GraphShape(1, 1, 16), inplace=False)
    session = xla_backend.XLASession({"decode": graph})
    embeds, start, length, *_ = graph.example_inputs()
    assert start.dtype == length.dtype == index_tensor([0]).dtype == torch.int32
    kv = session.new_kv("decode")
    with pytest.raises(GraphFormError, match="int32"):
        session.run("decode", embeds, start.long(), length, *kv)
    assert session.report()["xla_steps"] == {}


@pytest.mark.parametrize("variant", VARIANT_NAMES)
def test_variant_on_xla(xla_lane, variant, tmp_path):
    result = xla_lane.run_variant(variant, decode_steps=DECODE_STEPS, hlo_dir=tmp_path)
    assert result["seq_match"], (result["tokens"], result["reference"])
    assert result["xla_fallbacks"] == 0, result["xla_fallback_ops"]
    # one compilation, one traced graph per graph shape; one execution per step (no graph break)
    assert result["xla_compilations"] == {"prefill24": 1, "decode": 1}
    assert result["xla_graph_hashes"] == {"prefill24": 1, "decode": 1}
    assert result["xla_steps"] == {"prefill24": 1, "decode": DECODE_STEPS}
    assert result["xla_executions"] == result["xla_steps"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["decode.0.hlo.txt", "prefill24.0.hlo.txt"]
    for phase in ("prefill24", "decode"):
        ops = result["hlo_op_counts"][phase]
        assert ops["dot"] > 0 and ops["parameter"] > 0 and ops["total"] > 1000


def test_ring_buffers_on_xla(xla_lane):
    """Sliding layers as ring buffers (the prompt is longer than the window; decode wraps)."""
    result = xla_lane.run_variant("e2b", decode_steps=DECODE_STEPS, ring=True)
    assert xla_lane.passed(result), result


@pytest.mark.parametrize("chunks", [3, 8])
def test_a_prompt_of_several_buckets_is_prefilled_in_chunks_on_xla(xla_lane, chunks):
    """A prompt of 3x and 8x the one bucket, ring K/V (window 8 < the bucket 16): the one prefill graph
    runs once per chunk at its offset, compiled once; HF's greedy tokens and logits, 0 fallbacks. (A
    context of its own: a graph another test compiled is XLA's cache hit, no compilation to count.)"""
    bucket = 16
    result = xla_lane.run_variant(
        "e2b",
        decode_steps=8,
        prompt_tokens=chunks * bucket,
        bucket=bucket,
        context_length=chunks * bucket + 12,
        ring=True,
    )
    assert xla_lane.passed(result) and result["logits_match"] and len(set(result["reference"])) > 2, result
    assert result["prefill_chunks"] == chunks and result["xla_steps"][f"prefill{bucket}"] == chunks
    assert result["xla_compilations"] == {f"prefill{bucket}": 1, "decode": 1}


def test_context_buckets_on_xla_compile_once_each_and_equal_hf(xla_lane):
    """Context bucket 32 in a 72-token context (issue 48 item 2): a 20-token prompt's two chunks run
    prefill16@32, decode runs decode@32 until its write passes slot 31, then the whole-context decode;
    each compiled once, 0 fallbacks, HF's greedy tokens and logits; then the same row without its
    logits through decode_ids@32 and decode_ids (the device chooses), the same tokens."""
    from gemma4lib import checks
    from gemma4lib.port import PortSettings, compile_graphs, load_model
    from gemma4lib.reference import random_prompt, reference_greedy

    settings = PortSettings(
        variant="e2b", model="random", backend="xla", context_length=72, prefill_buckets=(16,), context_buckets=(32,)
    )
    model = load_model(settings)
    compiled = compile_graphs(model, settings)
    ids, new = random_prompt(model.config.vocab_size, 20, 3), 16
    row = compiled.runtime.generate(ids, new, keep_logits=True)
    expected = reference_greedy(model.lm, ids, new)
    assert row.tokens == expected and len(set(expected)) > 2, (row.tokens, expected)
    logits = checks.check_logits(model.lm, ids, row.tokens, row.step_logits)
    assert logits.passed, logits.explain()
    report = compiled.report()
    assert report["xla_fallbacks"] == 0, report["xla_fallback_ops"]
    assert report["xla_steps"] == {"prefill16@32": 2, "decode@32": 32 - 20, "decode": new - 1 - (32 - 20)}
    assert report["xla_compilations"] == {"prefill16@32": 1, "decode@32": 1, "decode": 1}
    assert report["xla_executions"] == report["xla_steps"]
    # a row nobody reads the logits of: the device chooses its tokens, in the same buckets
    assert compiled.runtime.generate(ids, new).tokens == expected
    report = compiled.report()
    assert report["xla_steps"]["decode_ids@32"] == 32 - 20 and report["xla_steps"]["decode_ids"] == new - 1 - (32 - 20)
    assert report["xla_compilations"]["decode_ids@32"] == report["xla_compilations"]["decode_ids"] == 1
    assert report["xla_fallbacks"] == 0 and report["xla_executions"] == report["xla_steps"]


def test_context_buckets_on_xla_drafting_verifies_and_drafts_in_its_buckets(xla_lane):
    """Drafting with the assistant, bucket 32 in a 72-token context: the checked row (logits kept)
    runs verify@32 then verify, the assistant's draft_ids@32 then draft_ids, and a row nobody reads
    the logits of runs verify_ids@32 then verify_ids; HF's greedy tokens both times, 0 fallbacks,
    one compilation per graph."""
    from gemma4lib.port import PortSettings, compile_graphs, load_model
    from gemma4lib.reference import random_prompt, reference_greedy

    settings = PortSettings(
        variant="e2b", model="random", backend="xla", context_length=72, prefill_buckets=(16,), context_buckets=(32,),
        draft="assistant", draft_tokens=2,
    )  # fmt: skip
    model = load_model(settings)
    compiled = compile_graphs(model, settings)
    ids, new = random_prompt(model.config.vocab_size, 20, 3), 24
    expected = reference_greedy(model.lm, ids, new)
    assert compiled.runtime.generate(ids, new, keep_logits=True).tokens == expected
    assert compiled.runtime.generate(ids, new).tokens == expected
    report = compiled.report()
    assert report["xla_fallbacks"] == 0, report["xla_fallback_ops"]
    for graph in ("verify", "verify_ids", "draft_ids"):
        assert report["xla_steps"][f"{graph}@32"] > 0 and report["xla_steps"][graph] > 0, report["xla_steps"]
    assert set(report["xla_compilations"].values()) == {1} and report["xla_executions"] == report["xla_steps"]


def test_context_buckets_on_xla_a_join_runs_its_bucket(xla_lane):
    """With `row_prefill` at batch 2: row 0 joins (6 tokens), decodes a step, row 1 joins (20 tokens,
    two chunks) through the one-row join reading 32 slots (`row_prefill16@32`), then both decode
    across 32; each graph compiled once, 0 fallbacks, every row HF's tokens and logits."""
    from gemma4lib import checks
    from gemma4lib.port import PortSettings, compile_graphs, load_model
    from gemma4lib.reference import random_prompt, reference_greedy
    from gemma4lib.runtime import Request

    settings = PortSettings(
        variant="e2b",
        model="random",
        backend="xla",
        batch_size=2,
        row_prefill=True,
        context_length=80,
        prefill_buckets=(16,),
        context_buckets=(32,),
    )
    model = load_model(settings)
    compiled = compile_graphs(model, settings)
    engine, new = compiled.runtime, 16
    prompts = [random_prompt(model.config.vocab_size, n, n) for n in (6, 20)]
    engine.admit({0: Request(prompts[0], new)}, keep_logits=True)
    engine.step()
    engine.admit({1: Request(prompts[1], new)}, keep_logits=True)
    while engine.live_rows():
        engine.step()
    for r, ids in enumerate(prompts):
        row = engine.release(r)
        assert row.tokens == reference_greedy(model.lm, ids, new) and len(set(row.tokens)) > 2, r
        logits = checks.check_logits(model.lm, ids, row.tokens, row.step_logits)
        assert logits.passed, logits.explain()
    report = compiled.report()
    assert report["xla_fallbacks"] == 0, report["xla_fallback_ops"]
    assert report["xla_steps"] == {"row_prefill16@32": 3, "decode@32": 1 + 32 - 20, "decode": new - 1 - (32 - 20)}
    assert report["xla_compilations"] == {"row_prefill16@32": 1, "decode@32": 1, "decode": 1}
    assert report["xla_executions"] == report["xla_steps"]


def test_shape_leak_is_caught_by_the_compile_count(xla_lane):
    """A Python-int position baked into the trace: a new graph and a compilation for every token."""
    steps = 3
    result = xla_lane.run_variant("12b", decode_steps=steps, context_length=48, leaky=True)
    assert result["seq_match"]  # the numbers are right; only the graph count gives it away
    assert result["xla_compilations"]["decode"] == steps
    assert result["xla_graph_hashes"]["decode"] == steps
    assert not result["one_compile_per_shape"]
    assert result["xla_fallback_ops"].get("aten::_local_scalar_dense", 0) >= steps  # the int() read


# ---- the HLO byte audit (README, "Environments"): what each decode graph reads ------------------

from gemma4lab.tools import hlo_audit  # noqa: E402  (imports without torch_xla)

_audit_models: dict[str, object] = {}


def _audit_model(name: str):
    if name not in _audit_models:
        _audit_models[name] = hlo_audit._tiny(name)
    return _audit_models[name]


def _expert_slice_bytes(model) -> int:
    """One expert's gate, up and down weights, in bytes (from the config, not the HLO)."""
    c = model.config
    return 3 * c.moe_intermediate_size * c.hidden_size * model.lm_head.weight.element_size()


def _assert_int32_index_inputs(audit) -> None:
    """The lowered program's index inputs (start, length) are s32 entry parameters: int32 reaches the
    compiler, not only the step (`XLASession.run` refuses anything else)."""
    inputs = [
        p.type.split("{")[0] for p, role in zip(audit.params, audit.roles, strict=True) if role == hlo_audit.INPUT
    ]
    index = [t for t in inputs if not t.startswith(("f32", "bf16", "f16"))]
    rows = hlo_audit.array_dims(inputs[0])[0]  # every input leads with the batch B
    assert index == [f"s32[{rows}]"] * 2, inputs


def _moe_layers(model) -> int:
    layers = model.text_model.layers
    return sum(1 for layer in layers if getattr(layer, "experts", None) is not None)


@pytest.mark.parametrize("variant,form", hlo_audit.SINGLE, ids=[f"{v}-{f}" for v, f in hlo_audit.SINGLE])
def test_hlo_audit_single_device_decode(xla_lane, variant, form):
    model = _audit_model(variant)
    audit, row = hlo_audit.audit_single(model, form)
    table = hlo_audit.format_table([row])
    _assert_int32_index_inputs(audit)
    assert row.weights_delta == row.expected_delta, table
    assert row.kv_delta == 0 and row.kv_read > 0, table
    assert row.flagged == [], table  # no weight is transposed or copied except into a dot
    if not getattr(model.config, "enable_moe_block", False):
        assert row.expected_delta == 0 and row.experts_size == 0
        return
    c = model.config
    assert row.expected_delta == -_moe_layers(model) * (c.num_experts - c.top_k_experts) * 4
    if form == "dense":
        assert row.experts_read == row.experts_size
    else:  # k slices per MoE layer, gathered straight from the [E, ...] parameters
        assert row.experts_read == _moe_layers(model) * c.top_k_experts * _expert_slice_bytes(model)
        for p, role in zip(audit.params, audit.roles, strict=True):
            if role == hlo_audit.EXPERT:
                assert p.partial_ops and all(op.startswith("gather") for op in p.partial_ops)
                assert p.read_bytes < p.bytes and not p.relayouts


@pytest.mark.parametrize(
    "variant,tp,form,split",
    hlo_audit.TENSOR_PARALLEL,
    ids=[f"{v}-tp{t}-{f}" + (f"-{s}" if s else "") for v, t, f, s in hlo_audit.TENSOR_PARALLEL],
)
def test_hlo_audit_rank_graph_decode(xla_lane, variant, tp, form, split):
    model = _audit_model(variant)
    audit, row = hlo_audit.audit_rank(model, tp, form, expert_split=split)
    table = hlo_audit.format_table([row])
    _assert_int32_index_inputs(audit)
    assert row.weights_delta == row.expected_delta, table
    assert row.kv_delta == 0 and row.kv_read > 0, table
    assert row.flagged == [], table
    assert row.ok
    assert row.expert_split == split
    # one rank's program, collectives included, over the rank group {0..tp-1}
    group = "replica_groups={{" + ",".join(map(str, range(tp))) + "}}"
    assert "all-reduce(" in audit.hlo_text and group in audit.hlo_text
    if not getattr(model.config, "enable_moe_block", False):
        return
    c = model.config
    whole = _moe_layers(model) * _expert_slice_bytes(model)  # one whole expert, every MoE layer
    assert row.experts_size == c.num_experts * whole // tp  # either split: 1/tp of the expert bytes
    if form == "dense":
        assert row.experts_read == row.experts_size, table
    elif split == "experts":  # k whole-expert slices on every rank, routed there or not
        assert row.experts_read == c.top_k_experts * whole, table
    else:  # k slices of 1/tp of an expert: k / num_experts of what the rank holds
        assert row.experts_read * c.num_experts == c.top_k_experts * row.experts_size, table
        assert tp * row.experts_read == c.top_k_experts * whole, table  # k experts over all ranks
    if form == "selective":  # gathered straight from the shard weights, nothing re-laid out
        for p, role in zip(audit.params, audit.roles, strict=True):
            if role == hlo_audit.EXPERT:
                assert p.partial_ops and all(op.startswith("gather") for op in p.partial_ops), table
                assert not p.relayouts and not p.strided_gathers, table
                if split == "intermediate":  # (the expert split at TP=8 gathers 4 of 2 held experts)
                    assert p.read_bytes * c.num_experts == c.top_k_experts * p.bytes, table


def _permuted_view(self, hidden, index, scale):
    """The rank graph's first selective gather: a permuted view of the whole down shard, indexed."""
    from gemma4lib.device.experts import gathered_experts

    gate_up_w = self.gate_up.weight.view(self.local, 2 * self.intermediate, self.hidden)
    down_w = self.down.weight.view(self.hidden, self.local, self.intermediate).permute(1, 0, 2)
    return gathered_experts(gate_up_w, down_w, hidden, index, scale, self.act_fn)


def _inner_dim_gather(self, hidden, index, scale):
    """No permute, but the gather runs along the down shard's inner (expert) dimension."""
    gate_up_w = self.gate_up.weight.view(self.local, 2 * self.intermediate, self.hidden)
    down_w = self.down.weight.view(self.hidden, self.local, self.intermediate)
    x, flat = hidden[0], index.reshape(-1)
    gate, up = (gate_up_w[flat] * x).sum(-1).chunk(2, dim=-1)
    inner = self.act_fn(gate) * up  # [k, I]
    out = (down_w.index_select(1, flat) * inner.unsqueeze(0)).sum(-1).t()  # [k, H]
    return (out * scale[0].unsqueeze(-1)).sum(0, keepdim=True)


@pytest.mark.parametrize("split", ["experts", "intermediate"])
@pytest.mark.parametrize("bad_gather", [_permuted_view, _inner_dim_gather], ids=lambda f: f.__name__)
def test_hlo_audit_flags_a_whole_shard_copy(xla_lane, monkeypatch, bad_gather, split):
    """Two ways to gather the down shard that copy all of it every step under XLA (a transpose
    before the gather; XLA's canonicalisation of an inner-dimension gather): the audit must flag
    every layer's `down` weight and the row must fail, in either expert split. Same numbers as
    the real gather."""
    import torch

    from gemma4lib.tp.layers import ShardedExperts

    model = _audit_model("26b-a4b")
    real = ShardedExperts._selective

    def patched(self, hidden, top_k_index, top_k_weights):
        index, scale = self.local_routes(top_k_index, top_k_weights, hidden.dtype)
        return self._reduce(bad_gather(self, hidden, index, scale))

    # on CPU first: the bad form computes what the real one does (it is only the bytes that differ)
    from gemma4lib.device.graph import GraphShape
    from gemma4lib.tp.plan import make_plan
    from gemma4lib.tp.rank_graph import build_rank_graph, load_shard
    from gemma4lib.tp.shard import shard_state_dict

    plan = make_plan(model.config, 8, model.variant, expert_split=split)
    graph = build_rank_graph(model.config, plan, GraphShape(1, 1, hlo_audit.CONTEXT), expert_form="selective")
    load_shard(graph, shard_state_dict(model.lm, plan, 1))
    experts = graph._rank_users[0]
    experts.current_rank = graph.spmd_rank.get_rank()
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(1, plan.hidden, generator=g)
    top_k_index = torch.tensor([[2, 9, 3, 14]])  # expert split: rank 1 holds experts 2 and 3 of the 16
    top_k_weights = torch.rand(1, 4, generator=g)
    with torch.no_grad():
        expected = real(experts, hidden, top_k_index, top_k_weights)
        torch.testing.assert_close(patched(experts, hidden, top_k_index, top_k_weights), expected)
    assert expected.abs().max() > 0

    monkeypatch.setattr(ShardedExperts, "_selective", patched)
    audit, row = hlo_audit.audit_rank(model, 8, "selective", expert_split=split)
    layers = _moe_layers(model)
    assert row.flagged_experts == [f"model.layers.{i}.experts.down.weight" for i in range(layers)]
    assert not row.ok and row.weights_delta != row.expected_delta


def test_e2b_model_builder_pair_at_tp1_on_xla(xla_lane, tmp_path):
    """E2B's ModelBuilder recipe at TP=1: the rank graphs of its prefill and decode keys (CPU layers
    for NxD's, weights from the recipe's checkpoint) through torch_xla over ONE set of K/V buffers,
    as the two keys share one set of aliased states on the device: the prompt in one prefill call,
    then decode steps that read the K/V it wrote; one compile per shape, tokens equal HF greedy."""
    import torch

    from gemma4lib.backends.xla import XLASession
    from gemma4lib.models.loading import build_tiny
    from gemma4lib.models.variants import get_variant
    from gemma4lib.recipes import neuron_model_builder as mb
    from gemma4lib.reference import random_prompt, reference_greedy
    from gemma4lib.runtime import Engine, Steps, bind_kv
    from gemma4lib.tp.plan import make_plan
    from gemma4lib.tp.rank_graph import build_rank_graph, load_shard

    v = get_variant("e2b")
    model = build_tiny(v, seed=v.tiny_seed)
    plan = make_plan(model.config, 1, v)
    weights = {k.removeprefix(mb.GRAPH_PREFIX): t for k, t in mb.nxd_checkpoint(model, plan, torch.float32).items()}
    graphs = {}
    for key, shape in mb.bucket_shapes(64, (24,)).items():
        graphs[key] = build_rank_graph(model.config, plan, shape)
        assert load_shard(graphs[key], weights) == []
    # the decode key that returns token ids (`DeviceGraph.chooses`), as the neuron backend adds it
    graphs["decode_ids"] = build_rank_graph(model.config, plan, graphs["decode"].shape, chooses=True)
    assert load_shard(graphs["decode_ids"], weights) == []
    session = XLASession(graphs, hlo_dir=tmp_path)
    kv = session.new_kv("decode")  # the one set every key aliases
    steps = Steps({24: bind_kv(session.step("prefill24"), kv)}, bind_kv(session.step("decode"), kv))
    steps.decode_ids = bind_kv(session.step("decode_ids"), kv)
    engine = Engine.for_model(model, steps, batch=1, context_length=64)
    ids = random_prompt(model.config.vocab_size, 20, v.tiny_seed + 1)  # its margins are the seed's
    new_tokens = 9
    by_logits = engine.generate(ids, new_tokens, keep_logits=True).tokens  # a check keeps them: decode
    by_ids = engine.generate(ids, new_tokens).tokens  # nobody reads them: the device chooses
    reference = reference_greedy(model.lm, ids, new_tokens)
    report = session.report()
    assert by_logits == by_ids == reference
    # at most one compile per key: none when an earlier test in this process compiled the same HLO
    # (torch_xla caches it), and never one per decode step
    assert set(report["xla_compilations"]) == {"prefill24", "decode", "decode_ids"}
    assert all(n <= 1 for n in report["xla_compilations"].values()), report["xla_compilations"]
    assert report["xla_steps"] == {"prefill24": 2, "decode": new_tokens - 1, "decode_ids": new_tokens - 1}


@pytest.mark.parametrize(
    "variant,form,batch", [("e2b", "dense", 3), ("26b-a4b", "selective", 3), ("26b-a4b", "selective", 4)]
)
def test_hlo_audit_batched_decode_reads_the_batch_roofline_bytes(xla_lane, variant, form, batch):
    """Batch 3: the weights once (the selective experts' k slices per row), the K/V of every row.
    Batch 4 of the tiny MoE (16 experts, top-4): 4 x 4 = E, so the graph reads every expert once."""
    model = _audit_model(variant)
    audit, row = hlo_audit.audit_single(model, form, batch=batch)
    table = hlo_audit.format_table([row])
    _assert_int32_index_inputs(audit)
    assert row.batch == batch and f"batch {batch}" in table
    assert row.weights_delta == row.expected_delta, table
    assert row.kv_delta == 0 and row.kv_read > 0, table
    assert row.flagged == [], table
    # what a step returns to the host: each row's fp32 logits over the vocabulary (issue 46 item 2)
    assert row.returned == batch * model.config.vocab_size * 4, table
    if form == "selective":
        c = model.config
        slices = min(batch * c.top_k_experts, c.num_experts)
        assert row.experts_read == _moe_layers(model) * slices * _expert_slice_bytes(model), table
        assert row.read_form == (None if batch * c.top_k_experts < c.num_experts else "dense"), table


@pytest.mark.parametrize(
    "variant,tp,form,split,read",
    [
        ("31b", 8, "dense", None, None),
        ("26b-a4b", 2, "selective", "intermediate", None),
        ("26b-a4b", 2, "selective", "experts", "dense"),
    ],
)
def test_hlo_audit_batched_rank_graphs_read_the_batch_roofline_bytes_per_rank(xla_lane, variant, tp, form, split, read):
    """Rank graphs at batch 2: tp x a rank's bytes = `batch_decode_bytes(tp=)` + what the plan
    replicates. The expert split's rank holds 8 of 16 experts: 2 rows x top-4 = 8 reads them densely."""
    model = _audit_model(variant)
    audit, row = hlo_audit.audit_rank(model, tp, form, expert_split=split, batch=2)
    table = hlo_audit.format_table([row])
    _assert_int32_index_inputs(audit)
    assert row.batch == 2 and "batch 2" in table and row.read_form == read, table
    assert row.weights_delta == row.expected_delta, table
    assert row.kv_delta == 0 and row.kv_read > 0, table
    assert row.ok, table


def test_batched_port_on_xla_rows_match_their_references(xla_lane):
    """`port(backend="xla", batch_size=3)`: the capital of France and two capital questions, prompts of
    different lengths, through the batched graphs of the trained E2B fixture on XLA (trained: no
    near-ties, so exact tokens are a fair ask): every row equal to its own batch-1 reference in tokens
    and logits and answering its capital, 0 fallbacks, one compilation per graph."""
    from gemma4lib.port import PortSettings, port

    settings = PortSettings(variant="e2b", backend="xla", batch_size=3, iters=1, warmup=0, witness=False)
    result = port(settings)
    assert result["checks_passed"], result["failed_checks"]
    rows = result["rows"]
    assert len(rows) == 3 and len({r["prompt_tokens"] for r in rows}) > 1, rows
    for row in rows:
        assert row["tokens"] == row["reference_tokens"] and row["logits_match"] and row["coherent"], row
        assert row["expect"] in row["answer"], row
    assert result["xla_fallbacks"] == 0, result["xla_fallback_ops"]
    # the checked run keeps its logits (decode); the timed run, as a server's, lets the device choose
    graphs = ("prefill64", "decode", "decode_ids")
    assert result["xla_compilations"] == dict.fromkeys(graphs, 1), result["xla_compilations"]
    assert result["xla_graph_hashes"] == dict.fromkeys(graphs, 1)
    assert result["xla_executions"] == result["xla_steps"]


def test_e2b_decode_chooses_on_xla_the_tokens_the_logits_step_gives(xla_lane):
    """The xla backend builds `decode_ids` (issue 46 item 2): rows nobody reads the logits of (greedy
    and plainly sampled) take it, each step returning 4 bytes a row; their tokens equal the logits
    step's (the same engine keeping logits), 0 fallbacks, one traced graph, one execution a step."""
    from gemma4lib.port import PortSettings, compile_graphs, load_model, prompt_ids
    from gemma4lib.runtime import Request, Sampling

    settings = PortSettings(variant="e2b", backend="xla", batch_size=3)
    model = load_model(settings)
    compiled = compile_graphs(model, settings)
    engine, ids = compiled.runtime, prompt_ids(model, settings)
    samplings = [Sampling(), Sampling(temperature=0.8, seed=5), Sampling(temperature=1.2, top_p=0.7, seed=9)]

    def run(keep_logits: bool) -> list[list[int]]:
        requests = [Request(ids, 12, s, ()) for s in samplings]
        return [r.tokens for r in engine.generate_rows(requests, keep_logits=keep_logits).rows]

    by_logits, by_ids = run(True), run(False)
    assert by_ids == by_logits and all(len(t) == 12 for t in by_ids)
    report = compiled.report()
    assert report["xla_fallbacks"] == 0, report["xla_fallback_ops"]
    # at most one compile (none when an earlier test in this process compiled the same HLO), one graph
    assert report["xla_compilations"]["decode_ids"] <= 1 and report["xla_graph_hashes"]["decode_ids"] == 1
    assert report["xla_steps"]["decode_ids"] == 11 and report["xla_executions"] == report["xla_steps"]
    graph = compiled.graphs.decode_ids
    assert graph.example_inputs()[graph.num_inputs - 1].shape == (3, 3)  # (temperature, draw, top_p) a row


# ---- images (docs/IMAGES.md): the vision graph through torch_xla beside prefill and decode ----------


@pytest.mark.parametrize("variant", ["e2b", "26b-a4b", "12b", "e4b", "31b"])
def test_image_port_on_xla(xla_lane, variant):
    """`port(backend="xla", images=[...])` on the trained vision fixture (a random-weight multimodal
    model where none is shipped): the vision graph (no K/V) runs in the same session as prefill and
    decode, its soft tokens go into the host embeddings, and the tokens and logits equal
    transformers' `generate(pixel_values=...)`, the answer names the red circle, with 0 CPU fallbacks
    and one compilation per graph (the vision graph once per image, the step count says it ran).
    E2B, 26B-A4B and the 12B (its prefill takes the image blocks: bidirectional on the sliding
    layers) are in CI's XLA subset (~10 s each here)."""
    from gemma4lib.models.vision import VISION_DIR
    from gemma4lib.port import PortSettings, port

    image = str(VISION_DIR / "images" / "red_circle.png")
    trained = (VISION_DIR / variant / "model.safetensors").is_file()
    settings = PortSettings(
        variant=variant,
        model="trained" if trained else "random",
        backend="xla",
        images=(image,),
        max_new_tokens=16,  # "A red circle." and its end of turn
        iters=1,
        warmup=0,
        witness=False,
    )
    result = port(settings)
    assert result["seq_match"] and result["logits_match"], result["failed_checks"]
    if trained:
        assert result["coherent"] and "red circle" in result["answer"], result["answer"]
    assert result["compiler"] == "torch-xla" and result["images"]["soft_tokens"] == [16]
    assert result["xla_fallbacks"] == 0, result["xla_fallback_ops"]
    graphs = ("vision", "prefill128", "decode", "decode_ids")  # decode_ids: the timed run's steps
    assert result["xla_graph_hashes"] == dict.fromkeys(graphs, 1)
    # the variants share one tiny vision config, so after the first variant torch_xla's per-process
    # cache already holds the vision program (same graph hash): 0 compilations then, never 2
    compilations = result["xla_compilations"]
    assert compilations["vision"] <= 1 and compilations["prefill128"] == compilations["decode"] == 1, compilations
    # the generation, the warm-up and the timed run: one vision step each, one execution per step
    assert result["xla_steps"]["vision"] == 3 and result["xla_executions"] == result["xla_steps"]
    assert result["hlo_op_counts"]["vision"]["dot"] > 0


@pytest.mark.parametrize(("variant", "clip"), [("e2b", "france.wav"), ("12b", "japan.wav")])
def test_audio_port_on_xla(xla_lane, variant, clip):
    """`port(backend="xla", audio=[...])` on the tiny random model that hears (E2B: the conformer; the 12B:
    its frame embedder): the audio graph runs in the same session as prefill and decode with 0 CPU
    fallbacks, one compilation, one step per generation (the run, the warm-up and the timed run), and the
    tokens and logits equal transformers' `generate(input_features=...)` (issue 50)."""
    from gemma4lib.models.audio import CLIPS_DIR
    from gemma4lib.port import PortSettings, port

    settings = PortSettings(
        variant=variant, model="random", backend="xla", audio=(str(CLIPS_DIR / clip),), max_new_tokens=6, iters=1
    )
    result = port(settings)
    assert result["seq_match"] and result["logits_match"], result["failed_checks"]
    assert result["xla_fallbacks"] == 0, result["xla_fallback_ops"]
    assert result["xla_graph_hashes"]["audio"] == 1 and result["xla_compilations"]["audio"] <= 1
    assert result["xla_steps"]["audio"] == 3 and result["xla_executions"] == result["xla_steps"]


# ---- drafting with Gemma-4's own assistant (docs/DRAFTING.md) on the XLA lane -------------------

DRAFT_K = 4


@pytest.mark.parametrize("variant", ["e2b", "26b-a4b"])
def test_drafted_port_on_xla(xla_lane, variant):
    """`port(backend="xla", draft="assistant")`: the prefill, verify (k + 1 tokens, logits at every
    position) and draft graphs through torch_xla over one set of device K/V, trained target and
    assistant: greedy-exact like on cpu, 0 fallbacks, one compilation per graph over every verify step.
    Greedy rows draft by the assistant's argmax on the device (`draft_ids`: the logits draft never runs);
    the checked generation keeps the target's logits (verify), the benchmark's rows keep none, so they
    run the greedy verdict (`verify_ids`; issue 46 item 2)."""
    from gemma4lib.port import PortSettings, port

    witness = variant == "e2b"  # (the witness runs the same graphs again: once is enough for the lane)
    settings = PortSettings(
        variant=variant, backend="xla", draft="assistant", draft_tokens=DRAFT_K, iters=1, warmup=0, witness=witness
    )
    result = port(settings)
    assert result["checks_passed"], result["failed_checks"]
    assert result["seq_match"] and result["logits_match"] and result["coherent"]
    assert result["hf_assisted_match"] and result["accepted_per_step"] > 1.0
    assert result["compiler"] == "torch-xla"
    assert not witness or (result["witness"]["seq_match"] and result["witness"]["logits_match"])
    assert result["xla_fallbacks"] == 0, result["xla_fallback_ops"]
    graphs = {"prefill64", "verify", "verify_ids", "draft_ids"}
    assert result["xla_compilations"] == dict.fromkeys(graphs, 1), result["xla_compilations"]
    assert result["xla_graph_hashes"] == dict.fromkeys(graphs, 1)
    assert result["xla_steps"]["verify"] > 1 and result["xla_executions"] == result["xla_steps"]
    assert (
        result["xla_steps"]["verify_ids"] > 1 and result["xla_steps"]["draft_ids"] >= result["xla_steps"]["verify_ids"]
    )
    # the tiny MoE (16 experts, top 4): 5 tokens x 4 routed slices would read more than all 16
    assert result.get("verify_experts") == (None if variant == "e2b" else "dense")


@pytest.mark.parametrize("k", [2, 4])
def test_drafted_26b_selective_verify_on_xla_is_exact(xla_lane, k):
    """The MoE's selective verify (each of the k + 1 tokens' routed experts gathered, the tokens as
    rows): the default at k = 2 (3 x 4 slices < 16 experts), asked for at k = 4; tokens and logits
    equal the plain greedy reference over a prompt that crosses the sliding window."""
    from gemma4lib import checks
    from gemma4lib.port import PortSettings, compile_graphs, load_model, prompt_ids
    from gemma4lib.reference import reference_greedy

    asked = None if k == 2 else "selective"
    settings = PortSettings(variant="26b-a4b", backend="xla", draft="assistant", draft_tokens=k, verify_experts=asked)
    model = load_model(settings)
    compiled = compile_graphs(model, settings)
    verify = compiled.graphs.verify
    assert verify.expert_form == "selective" and not verify.inplace and verify.every_position
    ids = prompt_ids(model, settings)
    steps = 24
    assert len(ids) + steps > 3 * model.config.sliding_window
    generation = compiled.runtime.generate(ids, steps, keep_logits=True)
    reference = reference_greedy(model.lm, ids, steps)
    report = checks.evaluate(model.lm, None, ids, generation.tokens, reference, step_logits=generation.step_logits)
    assert report.seq_match, (generation.tokens, reference)
    assert report.logits_match, report.logits.explain()
    assert generation.accepted_per_step > 1.0
    figures = compiled.report()
    assert figures["xla_fallbacks"] == 0, figures["xla_fallback_ops"]
    # the selective verify is this test's own graph; the prefill and draft graphs (weights are data)
    # may already be compiled in this process by the port test (torch_xla caches by graph hash)
    compilations = figures["xla_compilations"]
    assert compilations["verify"] == 1 and set(compilations) == {"prefill64", "verify", "draft_ids"}, compilations
    assert all(n <= 1 for n in compilations.values()) and set(figures["xla_graph_hashes"].values()) == {1}


@pytest.mark.parametrize(
    "variant,form,k", hlo_audit.VERIFY, ids=[f"{v}-{f or 'default'}-k{k}" for v, f, k in hlo_audit.VERIFY]
)
def test_hlo_audit_verify_graph_reads_the_mtp_roofline_bytes(xla_lane, variant, form, k):
    """Drafting's verify graph (k + 1 tokens) reads `mtp_roofline.verify_bytes`: the weights and K/V
    once; MoE dense all experts, selective (k + 1) x top_k gathered slices a layer."""
    model = _audit_model(variant)
    audit, row = hlo_audit.audit_verify(model, form, k)
    table = hlo_audit.format_table([row])
    _assert_int32_index_inputs(audit)
    assert row.ok and row.tokens == k + 1 and f"verify, {k + 1} tokens" in table, table
    assert row.weights_delta == row.expected_delta and row.kv_delta == 0 and row.kv_read > 0, table
    assert row.flagged == [], table
    if not getattr(model.config, "enable_moe_block", False):
        return
    c = model.config
    slices = _moe_layers(model) * _expert_slice_bytes(model)  # one expert in every MoE layer
    if row.form == "dense":
        assert row.experts_read == row.experts_size == c.num_experts * slices, table
    else:
        assert row.experts_read == (k + 1) * c.top_k_experts * slices, table
    # the default form is the one that reads fewer expert bytes
    if form is None:
        assert row.experts_read == min((k + 1) * c.top_k_experts, c.num_experts) * slices, table


@pytest.mark.parametrize("batch", [1, 4])
def test_hlo_audit_decode_ids_returns_four_bytes_a_row(xla_lane, batch):
    """The decode that chooses on the device (`GraphSet.decode_ids`) reads what the logits decode
    reads (weights, K/V: the roofline's bytes) and returns 4 bytes a row, where the logits decode
    returns the vocabulary's fp32 logits (issue 46's bound: <= 16 bytes a row)."""
    model = _audit_model("e2b")
    _, logits_row = hlo_audit.audit_single(model, "dense", batch=batch)
    audit, ids_row = hlo_audit.audit_single(model, "dense", batch=batch, chooses=True)
    _assert_int32_index_inputs(audit)
    assert ids_row.ok and ids_row.returned == 4 * batch <= hlo_audit.IDS_BYTES_PER_ROW * batch
    assert logits_row.returned == 4 * batch * model.config.vocab_size
    assert (ids_row.weights_read, ids_row.kv_read) == (logits_row.weights_read, logits_row.kv_read)
    assert ids_row.graph == ("decode → ids" if batch == 1 else f"decode → ids, batch {batch}")


# ---- the one-row join (issue 46 item 3): a batch-1 prefill over one row of the batch's device K/V ----

JOIN_QUESTIONS = ("France", "Japan")


def _joined(compiled, model, new_tokens: int = 8) -> dict:
    """Row 0 joins alone and decodes two steps, then row 1 joins the running batch alone; both run
    to their end. Each row's result, and which step each admission ran."""
    from gemma4lib.port import eos_ids
    from gemma4lib.runtime import Request, encode_prompt

    engine, calls = compiled.runtime, []
    eos = tuple(eos_ids(model))
    requests = [
        Request(encode_prompt(model.tokenizer, f"What is the capital of {c}?"), new_tokens, eos_token_ids=eos)
        for c in JOIN_QUESTIONS
    ]

    def counted(step):
        return lambda row, *inputs: calls.append(row) or step(row, *inputs)

    engine.steps.row_prefill = {b: counted(step) for b, step in engine.steps.row_prefill.items()}
    engine.admit({0: requests[0]}, keep_logits=True)
    engine.step()
    engine.step()
    engine.admit({1: requests[1]}, keep_logits=True)
    while engine.live_rows():
        engine.step()
    assert calls == [0, 1]  # both admissions went through the join
    return {r: engine.release(r) for r in range(2)}


def test_a_row_joins_a_running_batch_on_xla_as_on_eager(xla_lane):
    """`row_prefill` on xla: each join runs the join graph (`device.row_join`: the batch-1 prefill over
    one row of the batch's device K/V) and every row's tokens and first logits equal the eager
    engine's one-row prefill over host views, with 0 CPU fallbacks and one compilation of the join."""
    import torch

    from gemma4lib.port import PortSettings, compile_graphs, load_model

    kwargs = dict(variant="e2b", batch_size=2, row_prefill=True, prefill_buckets=(32,), context_length=64)
    model = load_model(PortSettings(backend="eager", **kwargs))
    want = _joined(compile_graphs(model, PortSettings(backend="eager", **kwargs)), model)
    compiled = compile_graphs(model, PortSettings(backend="xla", **kwargs))
    got = _joined(compiled, model)
    for r in range(2):
        assert got[r].tokens == want[r].tokens, r
        torch.testing.assert_close(got[r].first_logits, want[r].first_logits, atol=1e-4, rtol=1e-4)
    assert "Paris" in model.tokenizer.decode(got[0].tokens)  # the trained fixture still answers
    report = compiled.report()
    assert report["xla_fallbacks"] == 0, report["xla_fallback_ops"]
    assert report["xla_compilations"]["row_prefill32"] == 1 and report["xla_graph_hashes"]["row_prefill32"] == 1
    assert report["xla_steps"]["row_prefill32"] == 2 and "prefill32" not in report["xla_steps"]
    assert report["xla_executions"] == report["xla_steps"]


def test_a_join_on_xla_writes_its_row_and_no_other(xla_lane):
    """The join graph on the XLA device over the batch's K/V (random contents), 5 tokens at position 3:
    every other row's K/V and every other slot of the joined row come back bit-identical, and the
    joined row equals the batch-1 graph's own write (`ExplicitKV` over that row alone)."""
    import torch

    from gemma4lib.backends.xla import XLASession
    from gemma4lib.device.build import graph_set
    from gemma4lib.device.graph import index_tensor

    model = _audit_model("e2b")
    graphs = graph_set(
        model, batch=3, context_length=32, ring=False, prefill_buckets=(8,), inplace=False, row_prefill=True
    )
    join = graphs.row_prefill[8]
    session = XLASession({"row_prefill8": join})
    torch.manual_seed(0)
    before = [torch.randn_like(t) for t in join.new_kv()]
    kv = [t.to(session.device) for t in before]
    inputs = [torch.randn_like(t) if t.is_floating_point() else t for t in join.example_inputs()[1 : join.num_inputs]]
    inputs[-2:] = [index_tensor([3]), index_tensor([5])]  # 5 of the bucket's 8 tokens, at position 3
    logits = session.run("row_prefill8", index_tensor([1]), *inputs, *kv).cpu()
    after = [t.cpu() for t in kv]
    row = [t[1:2].clone() for t in before]
    with torch.no_grad():
        expected = join.graph(*inputs, *row)
    noise = 1e-4 * float(expected[0].abs().max())  # fp32 sums in XLA:CPU's order, not eager's
    torch.testing.assert_close(logits, expected[0], atol=noise, rtol=0)
    for old, new, one in zip(before, after, expected[1:], strict=True):
        assert torch.equal(old[[0, 2]], new[[0, 2]])
        untouched = [s for s in range(old.shape[2]) if not 3 <= s < 8]
        assert torch.equal(old[1][:, untouched], new[1][:, untouched])
        torch.testing.assert_close(new[1:2], one, atol=noise, rtol=0)
    assert any(not torch.equal(old[1], new[1]) for old, new in zip(before, after, strict=True))
    assert session.report()["xla_fallbacks"] == 0


# ---- issue 46's byte table (`tools.graph_bytes`): what every graph writes, returns and gathers ------

from gemma4lab.tools import graph_bytes  # noqa: E402  (imports without torch_xla)

_KV_HLO = """HloModule m
ENTRY %main (p0: f32[2,1,8,16], p1: s32[2,1,4,3], p2: f32[2,1,4,16]) -> (f32[2,1,4,16], f32[2,1,8,16]) {
  %p0 = f32[2,1,8,16]{3,2,1,0} parameter(0)
  %p1 = s32[2,1,4,3]{3,2,1,0} parameter(1)
  %p2 = f32[2,1,4,16]{3,2,1,0} parameter(2)
  %r = f32[2,1,8,16]{3,2,1,0} reshape(%p0)
  %g = f32[2,1,4,16]{3,2,1,0} gather(%r, %p1), SLICE
  %s = f32[2,1,8,16]{3,2,1,0} scatter(%p0, %p1, %p2), INSERTED, to_apply=%add
  %n = f32[2,1,8,16]{3,2,1,0} gather(%p2, %p1), slice_sizes={1,1,1,1}
  %b = f32[2,1,8,16]{3,2,1,0} broadcast(%n), dimensions={0,1,2,3}
  ROOT %t = (f32[2,1,4,16]{3,2,1,0}, f32[2,1,8,16]{3,2,1,0}) tuple(%g, %OUT)
}
"""


def _kv_hlo(slice_sizes="1,1,1,16", inserted="0,1,2", out="s") -> str:
    """A K/V buffer [2, 1, 8, 16] (parameter 0) gathered (through a reshape) and scattered into; the
    returned K/V is the scatter (`out="s"`) or an element gather of the new values (`out="b"`)."""
    return (
        _KV_HLO.replace("SLICE", f"slice_sizes={{{slice_sizes}}}")
        .replace("INSERTED", f"update_window_dims={{3}}, inserted_window_dims={{{inserted}}}")
        .replace("%OUT", f"%{out}")
    )


def _bytes_row(**changes) -> graph_bytes.GraphBytes:
    row = dict(variant="e2b", graph="prefill", batch=4, tokens=8, ring=False, weight_bytes_read=1000)
    row.update(kv_bytes_read=4096, kv_bytes_written=1024, new_positions_bytes=1024, bytes_returned=64)
    row.update(gather_elements=256, scatter_elements=256)
    return graph_bytes.GraphBytes(**{**row, **changes})


def test_hlo_audit_bytes_table_checks_can_fail():
    """The table's checker (no torch_xla): rows of D-wide gathers and scatters over the K/V pass and
    count their elements; a D = 1 gather or scatter over the K/V, an element gather into it, a doubled
    write and an ids decode returning logits are each flagged; a ring prefill longer than its ring is
    exempt from the write bound only."""
    access = graph_bytes.kv_access(_kv_hlo(), [0], kv_outputs=1)
    assert access == graph_bytes.KVAccess(2 * 4 * 16, 2 * 4 * 16, (), ())
    assert access == graph_bytes.kv_access(_kv_hlo(), [0])  # nothing gathered into it either way
    assert graph_bytes.kv_access(_kv_hlo(), [1]).gather_elements == 0  # not the K/V: not counted
    gather = graph_bytes.kv_access(_kv_hlo(slice_sizes="1,1,1,1"), [0]).elementwise
    assert len(gather) == 1 and "gather %g" in gather[0] and "(16)" in gather[0]
    scatter = graph_bytes.kv_access(_kv_hlo(inserted="0,1,2,3"), [0]).elementwise
    assert len(scatter) == 1 and "scatter %s" in scatter[0]
    into = graph_bytes.kv_access(_kv_hlo(out="b"), [0], kv_outputs=1)
    assert into.elementwise == () and len(into.elementwise_into) == 1 and "gather %n" in into.elementwise_into[0]
    # the byte audit's read of the K/V: its gathered rows; the scatter into it and the output read none
    assert hlo_audit.audit_hlo(_kv_hlo())[0].read_bytes == 2 * 4 * 16 * 4

    assert _bytes_row().failures() == []
    assert _bytes_row(kv_bytes_written=1075).failures() == []  # within 1.05 x
    assert "writes 2,048 K/V bytes for 1,024 new" in _bytes_row(kv_bytes_written=2048).failures()[0]
    ids = _bytes_row(graph="decode_ids", tokens=1, bytes_returned=16 * 4)
    assert ids.failures() == [] and _bytes_row(graph="decode", tokens=1, bytes_returned=4 * 810).failures() == []
    assert "returns 3,240 bytes for 4 rows" in _bytes_row(graph="decode_ids", bytes_returned=4 * 810).failures()[0]
    assert len(_bytes_row(elementwise=gather).failures()) == 1
    assert len(_bytes_row(elementwise_into=into.elementwise_into).failures()) == 1
    ring = _bytes_row(ring=True, tokens=16, ring_longer=True, kv_bytes_written=4096)
    assert ring.failures() == [] and "no write bound" in graph_bytes.format_table([ring])
    assert len(_bytes_row(ring=True, ring_longer=True, elementwise=gather).failures()) == 1
    assert len(_bytes_row(ring=True, ring_longer=True, elementwise_into=["g"]).failures()) == 1


def test_hlo_audit_bytes_table_holds_its_bounds(xla_lane):
    """Issue 46's table on the tiny E2B at B = 1 and 4 (CI's HLO audit step runs it for the MoE as
    well and writes its JSON): every graph writes exactly its new positions' K/V bytes, one scatter
    element per new K/V element (a join: one row; the draft: nothing), the ids decode returns 4 bytes
    a row, no element-wise gather over or into the K/V; a ring prefill longer than its ring is
    labelled and rewrites its ring from D-wide rows of the chunk."""
    model = _audit_model("e2b")
    rows = graph_bytes.audit_rows(model)
    table = graph_bytes.format_table(rows)
    assert [r.failures() for r in rows] == [[] for _ in rows], table
    graphs = {(r.graph, r.batch, r.tokens, r.ring) for r in rows}
    for b in graph_bytes.BATCHES:
        for t in graph_bytes.BUCKETS:
            assert {("prefill", b, t, False), ("prefill", b, t, True)} <= graphs, table
        k = hlo_audit.VERIFY_DRAFTS
        assert {("decode", b, 1, False), ("decode_ids", b, 1, False), ("verify", b, k + 1, False)} <= graphs
        assert {("verify_ids", b, k + 1, False), ("draft", b, 1, False), ("draft_ids", b, 1, False)} <= graphs, table
    joins = [r for r in rows if r.graph == "row_join"]
    assert [(r.batch, r.tokens) for r in joins] == [(graph_bytes.JOIN_BATCH, t) for t in graph_bytes.BUCKETS]
    vocab = model.config.vocab_size
    for r in rows:
        assert r.ring_longer == (r.ring and r.tokens > model.config.sliding_window), table
        assert r.weight_bytes_read > 0 and r.kv_bytes_read > 0 and r.elementwise == r.elementwise_into == [], table
        if r.ring_longer:  # the ring's rewrite: fewer bytes than the chunk's
            assert r.kv_bytes_written < r.new_positions_bytes, table
            continue
        assert r.kv_bytes_written == r.new_positions_bytes == 4 * r.scatter_elements, table
        assert (r.new_positions_bytes == 0) == r.graph.startswith("draft"), table
        hidden = 4 * model.config.hidden_size  # fp32: the one hidden state a row hands the next draft
        returned = {"decode_ids": 4 * r.batch, "decode": 4 * r.batch * vocab, "row_join": 4 * vocab}
        returned.update(verify_ids=r.batch * (4 * (k + 2) + hidden), draft_ids=r.batch * (4 + hidden))
        returned.update(verify=r.batch * (k + 1) * (4 * vocab + hidden), draft=r.batch * (4 * vocab + hidden))
        assert r.bytes_returned == returned.get(r.graph, r.bytes_returned), table
    # a join writes one row's new positions, a quarter of the batch-4 prefill's, and reads one row's
    # K/V (what a batch-1 decode reads) and the old values of the slots it writes
    prefill = {r.tokens: r for r in rows if r.graph == "prefill" and r.batch == 4 and not r.ring}
    assert all(4 * j.kv_bytes_written == prefill[j.tokens].kv_bytes_written for j in joins), table
    one_row = next(r.kv_bytes_read for r in rows if r.graph == "decode" and r.batch == 1)
    assert all(j.kv_bytes_read == one_row + j.kv_bytes_written < prefill[j.tokens].kv_bytes_read for j in joins)
