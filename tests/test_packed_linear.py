"""Batched decode graphs built for one CPU thread run their fp32 linears on oneDNN's packed layout
(`device.packed_linear`): only where arithmetic bounds the step (B >= 4), never at batch 1, never
for int8 or the XLA/Neuron graphs; the rows still equal their own references; and a compiled
package takes packed copies re-derived from the model's *current* weights.

The packed form runs only where it was measured (x86-64 with oneDNN): the tests that run it skip
elsewhere and say so (the rule then keeps the plain layout, which the other batch tests cover)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gemma4lib.backends.registry import cpu_balance
from gemma4lib.device import packed_linear
from gemma4lib.device.build import device_graph
from gemma4lib.device.experts import CPU_THREAD_FLOP_PER_BYTE
from gemma4lib.device.graph import GraphShape
from gemma4lib.device.quant import target_linears
from gemma4lib.runtime import Engine, Request, Steps, bind_kv

needs_packing = pytest.mark.skipif(
    not packed_linear.available(),
    reason="packed linears run only where they were measured: x86-64 with oneDNN (this machine is not)",
)
BATCH, CONTEXT, BUCKET, NEW = 4, 32, 16, 12
LENGTHS = (12, 5, 9, 7)


@pytest.fixture
def pack_small(monkeypatch):
    """The tiny fixtures' weights are below `PACK_MIN_ELEMENTS` (they run faster plain): lower it so
    they exercise the packed path, whose correctness does not depend on size."""
    monkeypatch.setattr(packed_linear, "PACK_MIN_ELEMENTS", 0)


def test_the_rule_packs_only_where_arithmetic_bounds_the_step():
    balance = CPU_THREAD_FLOP_PER_BYTE
    for rows in (1, 2, 3):  # bound by bytes: the packed copy's extra bytes would cost more
        assert not packed_linear.packs(rows, torch.float32, balance)
    assert not packed_linear.packs(8, torch.bfloat16, balance)  # fp32 only: where the products were measured
    assert not packed_linear.packs(8, torch.float32, None)  # xla / Neuron: bytes decide, never packs
    assert cpu_balance("xla") is None and cpu_balance("neuron") is None
    if packed_linear.available():
        assert packed_linear.packs(4, torch.float32, balance) and packed_linear.packs(16, torch.float32, balance)
    small, large = nn.Linear(64, 128, bias=False), nn.Linear(512, 1024, bias=False)  # 8k and 512k elements
    assert packed_linear.maybe_pack(small, 8) is small  # in the caches: oneDNN's per-call cost outweighs it
    if packed_linear.available():
        assert isinstance(packed_linear.maybe_pack(large, 8), packed_linear.PackedLinear)


def test_the_tiny_fixtures_batched_graphs_keep_the_plain_layout_and_key():
    """Their linears are all below the size where packing gains: nothing packs, and the key is the
    one a graph without a compute balance has (no recompile)."""
    from gemma4lib.models.loading import build_tiny
    from gemma4lib.models.variants import get_variant

    model = build_tiny(get_variant("e2b"))
    shape = GraphShape(BATCH, 1, CONTEXT, True)
    graph = device_graph(model, shape, "dense", compute_balance=cpu_balance("cpu"))
    assert graph.linear_form == "plain"
    assert graph.key_parts() == device_graph(model, shape, "dense").key_parts()
    assert not any(isinstance(m, packed_linear.PackedLinear) for m in graph.modules())


@needs_packing
def test_a_packed_linear_follows_its_weight():
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, bias=False)
    packed = packed_linear.PackedLinear(linear, 4)
    assert packed.weight is linear.weight  # shared, not copied
    x = torch.randn(4, 1, 64)
    with torch.no_grad():
        torch.testing.assert_close(packed(x), linear(x))
        linear.weight.mul_(-2.0)
        assert packed_linear.repack_all(packed) == 1
        torch.testing.assert_close(packed(x), linear(x))
    with pytest.raises(ValueError, match="bias-free"):
        packed_linear.PackedLinear(nn.Linear(4, 4, bias=True), 4)


def _engine(model, decode, batch=BATCH):
    prefill, kv = device_graph(model, GraphShape(batch, BUCKET, CONTEXT, True), "dense"), decode.new_kv()
    steps = Steps(prefill={BUCKET: bind_kv(prefill, kv)}, decode=bind_kv(decode, kv))
    return Engine.for_model(model, steps, batch=batch, context_length=CONTEXT)


@needs_packing
def test_a_batch_4_decode_graph_packs_and_its_rows_equal_their_references(pack_small):
    from test_batch import _assert_rows_match

    from gemma4lib.models.loading import build_tiny
    from gemma4lib.models.variants import get_variant
    from gemma4lib.reference import random_prompt

    model = build_tiny(get_variant("e2b"))
    shape = GraphShape(BATCH, 1, CONTEXT, True)
    graph = device_graph(model, shape, "dense", compute_balance=cpu_balance("eager"))
    assert graph.linear_form == packed_linear.FORM and graph.key_parts()["linear_form"] == packed_linear.FORM
    packed = [m for m in graph.modules() if isinstance(m, packed_linear.PackedLinear)]
    linears = sum(len(list(target_linears(layer))) for layer in model.text_model.layers)  # q/k/v/o, gate/up/down
    assert len(packed) == linears + 1 and isinstance(graph.lm_head, packed_linear.PackedLinear)  # and the LM head
    host = model.text_model.layers[0].self_attn.q_proj
    assert isinstance(host, nn.Linear) and graph.model.layers[0].self_attn.q_proj.weight is host.weight
    plain = device_graph(model, shape, "dense")  # no compute balance: the XLA/Neuron stand-in
    assert plain.linear_form == "plain" and "linear_form" not in plain.key_parts()
    one = device_graph(model, GraphShape(1, 1, CONTEXT, True), "dense", compute_balance=cpu_balance("cpu"))
    assert one.linear_form == "plain"
    assert device_graph(model, shape, "dense", weights="int8", compute_balance=1.0).linear_form == "plain"

    prompts = [random_prompt(model.config.vocab_size, n, 100 + n) for n in LENGTHS]
    generation = _engine(model, graph).generate_rows([Request(p, NEW) for p in prompts], keep_logits=True)
    _assert_rows_match(model, prompts, generation, new=NEW)  # test_batch's: tokens and logits per row


@needs_packing
def test_a_compiled_packed_graph_takes_the_models_current_weights(tmp_path, pack_small):
    """Compile the batch-4 decode graph once; a second model's graph, whose weights change after
    it was built, loads the same package (a cache hit) and runs with the weights as they are at
    load time: `load_weights` re-derives the packed copies before handing them over."""
    from gemma4lib.backends.compile_cpu import compile_graph
    from gemma4lib.cache.artifacts import ArtifactCache
    from gemma4lib.models.loading import build_tiny
    from gemma4lib.models.variants import get_variant

    cache = ArtifactCache(tmp_path / "cache")
    shape = GraphShape(BATCH, 1, CONTEXT, True)
    balance = cpu_balance("cpu")
    first = build_tiny(get_variant("e2b"))
    graph = device_graph(first, shape, "dense", compute_balance=balance)
    torch.manual_seed(0)
    inputs = list(graph.example_inputs())
    inputs[0] = torch.randn_like(inputs[0])  # the embeddings of one token per row
    compiled = compile_graph(graph, cache)
    with torch.no_grad():
        torch.testing.assert_close(compiled(*inputs), graph(*inputs), rtol=1e-4, atol=1e-4)

    second = build_tiny(get_variant("e2b"))
    other = device_graph(second, shape, "dense", compute_balance=balance)  # packed from these weights...
    with torch.no_grad():
        for name, p in second.text_model.layers.named_parameters():
            if name.endswith("proj.weight"):  # ...which then change (tiny norms are folded: left alone)
                p.mul_(-1.0)
    reloaded = compile_graph(other, cache)
    assert reloaded.cache_hit  # the same program: one compile serves every model of the architecture
    truth = device_graph(second, shape, "dense")  # plain linears over the changed weights
    with torch.no_grad():
        mine = reloaded(*inputs)
        torch.testing.assert_close(mine, truth(*inputs), rtol=1e-4, atol=1e-4)
        assert not torch.allclose(mine, graph(*inputs), atol=1e-3)  # not the first model's logits


def test_two_and_three_rows_keep_the_plain_layout_and_four_pack():
    balance = CPU_THREAD_FLOP_PER_BYTE
    for rows in (1, 2, 3):  # bound by bytes: the plain product, measured quiet (module docstring)
        assert not packed_linear.packs(rows, torch.float32, balance)
    assert packed_linear.packs(4, torch.float32, balance) is packed_linear.available()


@pytest.mark.parametrize("faster", [True, False], ids=["left-faster-here", "plain-faster-here"])
def test_two_rows_run_weight_left_only_where_this_machine_measures_it_faster(pack_small, monkeypatch, faster):
    """Batch 2 (two rows, bound by bytes): the large fp32 linears run `(W @ x.T).T` when the
    per-process measurement says so (`left_is_faster`, stood in here both ways), else plain; never at
    one row, for int8 or without a CPU balance; the form keys the program, and the rows equal their
    own references either way."""
    from test_batch import _assert_rows_match

    from gemma4lib.models.loading import build_tiny
    from gemma4lib.models.variants import get_variant
    from gemma4lib.reference import random_prompt

    monkeypatch.setattr(packed_linear, "left_is_faster", lambda rows: faster)
    model, balance = build_tiny(get_variant("e2b")), cpu_balance("eager")
    shape = GraphShape(2, 1, CONTEXT, True)
    graph = device_graph(model, shape, "dense", compute_balance=balance)
    left = [m for m in graph.modules() if isinstance(m, packed_linear.WeightLeftLinear)]
    assert (graph.linear_form, bool(left)) == ((packed_linear.LEFT, True) if faster else ("plain", False))
    assert ("linear_form" in graph.key_parts()) == faster
    assert device_graph(model, GraphShape(1, 1, CONTEXT, True), "dense", compute_balance=balance).linear_form == "plain"
    assert device_graph(model, shape, "dense", weights="int8", compute_balance=balance).linear_form == "plain"
    assert device_graph(model, shape, "dense").linear_form == "plain"
    x = torch.randn(2, 3, model.config.hidden_size)
    lm_head = model.lm_head
    assert torch.allclose(packed_linear.WeightLeftLinear(lm_head)(x), lm_head(x), atol=1e-5)
    prompts = [random_prompt(model.config.vocab_size, n, 100 + n) for n in LENGTHS[:2]]
    generation = _engine(model, graph, batch=2).generate_rows([Request(p, NEW) for p in prompts], keep_logits=True)
    _assert_rows_match(model, prompts, generation, new=NEW)
