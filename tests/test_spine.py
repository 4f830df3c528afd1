"""The spine: one device graph, compiled on CPU, checked against HF for all five variants, at the
notebooks' smoke shapes (`SMOKE_SHAPES`: the programs the headless notebook run compiles)."""

from __future__ import annotations

import pytest
import torch
from conftest import SMOKE_SHAPES, VARIANT_NAMES

from gemma4lib import checks
from gemma4lib.backends.compile_cpu import compile_graph, graph_key
from gemma4lib.cache.artifacts import make_key
from gemma4lib.device.graph import DeviceGraph, GraphShape
from gemma4lib.errors import PromptTooLongError
from gemma4lib.models.loading import build_tiny
from gemma4lib.models.variants import VARIANTS
from gemma4lib.reference import reference_greedy, reference_last_logits
from gemma4lib.runtime import Engine, Sampling, Steps, choose_token, sampling_probs, softcap

NEW_TOKENS = 32
# fp32 CPU: compiled kernels sum in a different order than HF's eager ops. Measured max |diff|
# of softcapped last-token logits: <= 5e-4 on all five tiny models.
PREFILL_LOGITS_ATOL = 2e-3


@pytest.mark.parametrize("variant", VARIANT_NAMES)
def test_compiled_graph_reproduces_hf_greedy(ports, variant):
    port = ports.get(variant, **SMOKE_SHAPES)
    window = port.model.config.sliding_window
    assert len(port.ids) + NEW_TOKENS > 2 * window, "generation must cross the sliding window"

    reference = reference_greedy(port.model.lm, port.ids, NEW_TOKENS)
    generation = port.runtime.generate(port.ids, NEW_TOKENS, keep_logits=True)

    assert len(set(reference)) >= 8, f"reference repeats itself ({len(set(reference))} distinct tokens)"
    assert checks.seq_match(generation.tokens, reference), (
        f"first mismatch at {checks.first_mismatch(generation.tokens, reference)}"
    )
    device_logits = softcap(generation.first_logits, port.model.config.final_logit_softcapping)
    hf_logits = reference_last_logits(port.model.lm, port.ids)
    assert torch.allclose(device_logits, hf_logits, atol=PREFILL_LOGITS_ATOL, rtol=0)
    # LOGITS_MATCH: every step's logits, against the reference's spread on this sequence
    assert generation.step_logits.shape == (NEW_TOKENS, port.model.config.vocab_size)
    assert torch.equal(generation.step_logits[0], generation.first_logits)
    logits = checks.check_logits(port.model.lm, port.ids, generation.tokens, generation.step_logits)
    assert logits.passed, logits.explain()
    assert logits.tolerance == checks.logits_tolerance(logits.spread) and logits.spread > 0


# ---- LOGITS_MATCH on synthetic logits: the rule, the softcap, a failure that explains itself ----


def _rows(n: int = 4, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, vocab, generator=generator, dtype=torch.float64) * 20


def test_logits_tolerance_is_the_spread_times_the_factor_with_a_floor():
    assert checks.logits_tolerance(1e-4) == pytest.approx(checks.LOGITS_FACTOR * 1e-4)
    assert checks.logits_tolerance(0.0) == checks.LOGITS_FLOOR
    assert checks.logits_tolerance(1e-3, factor=2, floor=0.5) == 0.5


def test_logits_match_compares_raw_device_logits_softcapped():
    raw = _rows()
    reference = softcap(raw, 30.0)
    spread = 1e-6
    assert checks.compare_logits(raw, reference, spread, 30.0, prompt_tokens=10).passed
    # without the cap on the device side the same logits are off by whole logits
    uncapped = checks.compare_logits(raw, reference, spread, None, prompt_tokens=10)
    assert not uncapped.passed and uncapped.max_err > 1.0


def test_logits_match_fails_at_the_step_that_is_off_and_says_so():
    raw = _rows()
    reference = softcap(raw, 30.0)
    device = raw.clone()
    device[2, 7] += 0.1  # decode step 2 only: tokens unchanged, one logit off by 0.1
    result = checks.compare_logits(device, reference, 1e-5, 30.0, prompt_tokens=10)
    assert not result.passed
    worst = (result.worst_position, result.worst_phase, result.worst_token_id, result.first_failure)
    assert worst == (2, "decode", 7, 2)
    assert result.prefill_max_err < result.tolerance < result.decode_max_err
    text = result.explain()
    assert "decode step 2" in text and "sequence position 11" in text, text
    assert "tolerance 8e-05" in text, text
    record = result.record()
    assert record["logits_match"] is False and record["logits_worst_phase"] == "decode"
    assert record["logits_explain"] == text and len(record["logits_step_errors"]) == 4
    prefill_off = raw.clone()
    prefill_off[0] += 0.01
    result = checks.compare_logits(prefill_off, reference, 1e-5, 30.0, prompt_tokens=10)
    assert result.worst_phase == "prefill"


def test_tiny_builds_are_identical():
    a, b = build_tiny(VARIANTS["e2b"], seed=3), build_tiny(VARIANTS["e2b"], seed=3)
    state_a, state_b = a.lm.state_dict(), b.lm.state_dict()
    assert state_a.keys() == state_b.keys()
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    c = build_tiny(VARIANTS["e2b"], seed=4)
    assert not torch.equal(
        state_a["model.layers.0.self_attn.q_proj.weight"], c.lm.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    )


def test_tiny_configs_keep_every_feature():
    e2b = build_tiny(VARIANTS["e2b"]).layout
    assert e2b.consumers and {lay.layer_type for lay in e2b.consumers} == {"sliding_attention", "full_attention"}
    assert build_tiny(VARIANTS["e2b"]).config.use_double_wide_mlp
    for name in ("12b", "31b", "26b-a4b"):
        layout = build_tiny(VARIANTS[name]).layout
        full = [lay for lay in layout.layers if lay.layer_type == "full_attention"]
        sliding = [lay for lay in layout.layers if lay.layer_type == "sliding_attention"]
        assert all(lay.k_eq_v for lay in full) and not any(lay.k_eq_v for lay in sliding)
        assert full[0].kv_heads < sliding[0].kv_heads and full[0].head_dim > sliding[0].head_dim
    moe = build_tiny(VARIANTS["26b-a4b"]).config
    assert moe.num_experts >= 8 and moe.top_k_experts >= 2 and moe.enable_moe_block


def test_kv_sharing_consumers_read_the_producer_buffer():
    model = build_tiny(VARIANTS["e2b"], seed=VARIANTS["e2b"].tiny_seed)
    layout = model.layout
    shape = GraphShape(1, 1, 32)
    graph = DeviceGraph(model.text_model, model.lm_head, layout, shape)
    # buffers exist for producers only
    assert len(graph.new_kv()) == 2 * len(layout.producers) < 2 * len(layout.layers)
    consumer = next(lay for lay in layout.consumers if lay.layer_type == "sliding_attention")
    producer_slot = [lay.index for lay in layout.producers].index(consumer.producer)

    captured = []
    hook = graph.model.layers[consumer.index].self_attn.register_forward_hook(
        lambda module, args, output: captured.append(output[0].detach().clone())
    )
    ids = torch.tensor([[5, 9, 11, 3, 7]])
    embeds, ple = model.text_model.embed_tokens(ids), model.text_model.get_per_layer_inputs(ids)

    def decode_last(kv):
        for pos in range(ids.shape[1]):
            with torch.no_grad():
                graph(embeds[:, pos : pos + 1], ple[:, pos : pos + 1], torch.tensor([pos]), torch.tensor([1]), *kv)
        return captured[-1]

    clean = decode_last(graph.new_kv())
    # Same steps, but the producer's K for position 0 is overwritten before the last step runs.
    kv = graph.new_kv()
    captured.clear()
    for pos in range(ids.shape[1] - 1):
        with torch.no_grad():
            graph(embeds[:, pos : pos + 1], ple[:, pos : pos + 1], torch.tensor([pos]), torch.tensor([1]), *kv)
    kv[2 * producer_slot][:, :, 0].add_(1.0)
    with torch.no_grad():
        graph(embeds[:, -1:], ple[:, -1:], torch.tensor([ids.shape[1] - 1]), torch.tensor([1]), *kv)
    hook.remove()
    assert not torch.allclose(clean, captured[-1]), "consumer output ignored its producer's K buffer"


def test_softcap_never_changes_greedy_but_shapes_sampling():
    logits = torch.randn(4, 512) * 40
    for row in logits:
        assert int(row.argmax()) == int(softcap(row, 30.0).argmax())
    sampling = Sampling(temperature=1.0)
    capped = sampling_probs(logits[0], sampling, 30.0)
    assert torch.allclose(capped, torch.softmax(softcap(logits[0], 30.0), -1), atol=1e-6)
    assert not torch.allclose(capped, torch.softmax(logits[0], -1), atol=1e-3)
    assert choose_token(logits[0], Sampling(), 30.0) == int(logits[0].argmax())
    nucleus = sampling_probs(logits[0], Sampling(temperature=1.0, top_p=0.5), 30.0)
    assert (nucleus > 0).sum() < (capped > 0).sum()


class _Forbidden:
    def __call__(self, *args):
        raise AssertionError("device step called for a request that cannot fit")


def test_prompt_too_long_fails_before_any_device_work():
    model = build_tiny(VARIANTS["12b"])
    runtime = Engine.for_model(model, Steps({16: _Forbidden()}, _Forbidden()), batch=1, context_length=24)
    with pytest.raises(PromptTooLongError, match="more than the compiled context length 24"):
        runtime.generate(list(range(3, 19)), max_new_tokens=10)
    with pytest.raises(PromptTooLongError, match="more than the compiled context length 24"):
        runtime.generate(
            list(range(3, 28)), max_new_tokens=1
        )  # longer than the bucket is chunked; the context is the limit


def test_second_compile_is_a_cache_hit_and_a_config_change_misses(ports):
    port = ports.get("12b", **SMOKE_SHAPES)
    again = compile_graph(port.decode)
    assert again.cache_hit and again.compile_s == 0.0
    # The same weights at another compiled length: a different key, so no stale artifact is used.
    other = DeviceGraph(port.model.text_model, port.model.lm_head, port.model.layout, GraphShape(1, 1, 48))
    assert _key(other, {}) != _key(port.decode, {})
    changed = build_tiny(VARIANTS["12b"], sliding_window=4)
    graph = DeviceGraph(changed.text_model, changed.lm_head, changed.layout, port.decode.shape)
    from gemma4lib.backends.compile_cpu import DEFAULT_COMPILER_OPTIONS
    from gemma4lib.cache.artifacts import ArtifactCache

    cache = ArtifactCache()
    assert cache.lookup(_key(graph, DEFAULT_COMPILER_OPTIONS)) is None
    assert cache.lookup(_key(port.decode, DEFAULT_COMPILER_OPTIONS)) is not None


def _key(graph, options):
    from gemma4lib.backends.compile_cpu import RECIPE, export_graph

    return make_key(graph_key(graph, RECIPE, options, export_graph(graph)))


def test_a_tagless_edit_to_the_graph_code_misses_the_cache(ports, monkeypatch):
    """The key is the exported program's digest: a change to what the graph computes, made with no
    tag and no config change (here the masked-out score raised from the dtype's minimum to -1e4, the
    kind of edit a developer makes to `graph.py`), misses the cache instead of serving the old
    program."""
    from gemma4lib.backends.compile_cpu import DEFAULT_COMPILER_OPTIONS
    from gemma4lib.cache.artifacts import ArtifactCache
    from gemma4lib.device import graph as graph_module

    port = ports.get("e2b", **SMOKE_SHAPES)
    stored = compile_graph(port.decode)
    assert stored.cache_hit and stored.info["key"] == _key(port.decode, DEFAULT_COMPILER_OPTIONS)

    def softer_mask(allowed, dtype):
        zero = torch.zeros((), dtype=dtype, device=allowed.device)
        return torch.where(allowed, zero, torch.full((), -1e4, dtype=dtype, device=allowed.device))

    monkeypatch.setattr(graph_module, "additive_mask", softer_mask)
    assert not port.decode.tags  # nothing but the code changes
    edited = _key(port.decode, DEFAULT_COMPILER_OPTIONS)
    assert edited != stored.info["key"]
    assert ArtifactCache().lookup(edited) is None
    monkeypatch.undo()
    assert _key(port.decode, DEFAULT_COMPILER_OPTIONS) == stored.info["key"]  # deterministic, not random


def test_weights_are_loaded_not_baked(ports):
    """One compile serves another model of the same architecture: the parameters come at load time,
    the small ones too (31b's 8-wide q_norm/k_norm, which Inductor would inline as literals), so a
    model with other values runs its own numbers through the first model's program."""
    from gemma4lib.models.trained import load_trained

    port = ports.get("31b", **SMOKE_SHAPES)
    for other in (build_tiny(VARIANTS["31b"], seed=123), load_trained("31b")):
        graph = DeviceGraph(other.text_model, other.lm_head, other.layout, port.decode.shape)
        compiled = compile_graph(graph)
        inputs = graph.example_inputs()
        x = torch.randn_like(inputs[0])
        with torch.no_grad():
            eager = graph(x, *inputs[1:3], *graph.new_kv())
        assert torch.allclose(compiled(x, *inputs[1:3], *graph.new_kv()), eager, atol=1e-4)


def test_one_decode_program_serves_the_trained_the_random_and_the_vision_fixture():
    """Two ways the program key once followed something other than the program: AOTInductor writes
    its own keys into the options dict it is given (a shared dict changed every later key in the
    process), and it inlines weights of <= 8 values (each layer's `layer_scalar`, a buffer whose
    values differ between fixtures) as literals. Now the three models of one decoder architecture
    run one compiled decode program, each with its own weights, and the key is stable."""
    from gemma4lib.backends.compile_cpu import DEFAULT_COMPILER_OPTIONS
    from gemma4lib.models.trained import load_trained
    from gemma4lib.models.vision import load_vision_fixture

    before, shape = dict(DEFAULT_COMPILER_OPTIONS), GraphShape(1, 1, 40, True)
    models = [load_trained("e2b"), build_tiny(VARIANTS["e2b"], seed=10), load_vision_fixture("e2b")]
    graphs = [DeviceGraph(m.text_model, m.lm_head, m.layout, shape) for m in models]
    scalars = [[float(layer.layer_scalar) for layer in g.model.layers] for g in graphs]
    assert scalars[2] != scalars[0]  # the vision fixture's own values (the random model's are the trained's)
    steps = [compile_graph(g) for g in graphs]
    assert dict(DEFAULT_COMPILER_OPTIONS) == before
    assert len({step.entry.key for step in steps}) == 1 and steps[1].cache_hit and steps[2].cache_hit
    assert steps[0].entry.key == _key(graphs[0], DEFAULT_COMPILER_OPTIONS)  # recomputed after the compile
    outputs = []
    for graph, step in zip(graphs, steps, strict=True):
        torch.manual_seed(0)
        inputs = list(graph.example_inputs()[: -len(graph.new_kv())])  # embeddings, PLE, start, length
        inputs[:2] = [torch.randn_like(inputs[0]), torch.randn_like(inputs[1])]
        with torch.no_grad():
            eager = graph(*inputs, *graph.new_kv())
        outputs.append(step(*inputs, *graph.new_kv()))
        assert torch.allclose(outputs[-1], eager, atol=1e-4)
    assert not torch.allclose(outputs[0], outputs[1]) and not torch.allclose(outputs[0], outputs[2])


# ---- the run record: three checks, and the random-weights witness --------------------------------

RECORD_LOGITS_KEYS = (
    "logits_match",
    "logits_max_err",
    "logits_tolerance",
    "logits_worst_position",
    "logits_worst_phase",
    "logits_spread",
    "logits_explain",
    "logits_step_errors",
)


def _check_record(result: dict) -> None:
    import json

    assert result["seq_match"] and result["logits_match"] and result["coherent"], result.get("failed_checks")
    assert set(RECORD_LOGITS_KEYS) <= set(result)
    assert result["logits_max_err"] <= result["logits_tolerance"]
    assert len(result["logits_step_errors"]) == result["new_tokens"]
    witness = result["witness"]
    assert witness["model_source"].startswith("tiny-random")
    assert witness["seq_match"] and witness["logits_match"]
    assert set(RECORD_LOGITS_KEYS) <= set(witness) and witness["new_tokens"] > result["new_tokens"]
    assert result["failed_checks"] == [] and result["checks_passed"] is True
    json.dumps(result)  # no tensors left in the record


def test_port_record_carries_the_three_checks_and_the_witness():
    from gemma4lib.port import PortSettings, port

    result = port(PortSettings(variant="e2b", backend="eager", warmup=0, iters=1))
    assert result["model_source"] == "tiny-trained"
    _check_record(result)
    # the witness is the sensitive one: near-ties where the trained model has margins of logits
    assert result["witness"]["reference_min_margin"] < 0.1
    alone = port(PortSettings(variant="e2b", backend="eager", warmup=0, iters=1, witness=False))
    assert "witness" not in alone


def test_witness_runs_the_same_compiled_programs():
    """Every weight loads at run time (`layer_scalar` too): the witness reuses the trained run's artifacts."""
    from gemma4lib.port import PortSettings, port

    result = port(PortSettings(variant="e2b", warmup=0, iters=1))
    _check_record(result)
    assert result["witness"]["same_programs"] is True and all(result["witness"]["cache_hits"])


def test_tp_port_checks_logits_too():
    from gemma4lib.port import PortSettings, port

    result = port(PortSettings(variant="12b", tp_degree=2, warmup=0, iters=1))
    assert result["compiler"] == "cpu-gloo-tp"
    _check_record(result)
