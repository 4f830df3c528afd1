"""Weight-only int8 (`gemma4lib.device.quant`, `PortSettings(weights="int8")`).

The device graph with int8 weights is checked against the quantized model's own host reference
(the fp32 model with `q * scale` substituted), so SEQ_MATCH and LOGITS_MATCH stay exact checks;
the error int8 adds against full precision is measured and bounded separately here."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import VARIANT_NAMES
from torch import nn

from gemma4lib.backends.preflight import preflight
from gemma4lib.device.graph import DeviceGraph, GraphShape
from gemma4lib.device.quant import (
    Int8Linear,
    dequantize,
    expert_weights,
    quantize,
    round_model_weights,
    target_linears,
)
from gemma4lib.errors import SettingsError, UnknownNameError

# Largest |int8 - full precision| softcapped logit the trained tiny fixtures may show over 12
# greedy tokens (teacher-forced on the full-precision tokens). Measured 0.22-0.74 (e4b/31b 0.22,
# 26b-a4b 0.63, e2b 0.67, 12b 0.74; their hidden size is 64, so each row has 64 weights to share
# one scale): the bound leaves ~35 % headroom and is ~7 % of their smallest logit range (11-14).
TINY_LOGIT_ERROR_BOUND = 1.0


def test_quantize_is_per_row_within_half_a_step_and_idempotent():
    torch.manual_seed(0)
    weight = torch.randn(3, 16, 40)
    weight[1, 5] = 0.0  # an all-zero row: scale 1, q 0
    q, scale = quantize(weight)
    assert q.dtype == torch.int8 and scale.shape == (3, 16)
    assert int(q.abs().max()) == 127
    assert torch.all(q[1, 5] == 0) and float(scale[1, 5]) == 1.0
    rounded = dequantize(q, scale)
    assert torch.all((weight - rounded).abs() <= scale.unsqueeze(-1) / 2 * (1 + 1e-6))
    q2, scale2 = quantize(rounded)  # the host reference's weights give the device graph the same int8
    assert torch.equal(q2, q)
    assert torch.allclose(scale2, scale, rtol=1e-6, atol=0)


def test_weights_setting_is_validated():
    from gemma4lib.port import PortSettings

    assert PortSettings("e2b").weights == "bf16"
    with pytest.raises(UnknownNameError, match="weights form 'int4'"):
        PortSettings("e2b", weights="int4")
    with pytest.raises(SettingsError, match="use tp_degree=1"):
        PortSettings("e4b", weights="int8", tp_degree=2)


def _tiny(variant: str):
    from gemma4lib.models.loading import build_tiny
    from gemma4lib.models.variants import get_variant

    spec = get_variant(variant)
    return build_tiny(spec, seed=spec.tiny_seed)


def test_int8_graph_holds_int8_weights_and_leaves_the_host_model_alone():
    model = _tiny("26b-a4b")
    shape = GraphShape(1, 1, 32, True)
    full = DeviceGraph(model.text_model, model.lm_head, model.layout, shape, expert_form="selective")
    int8 = DeviceGraph(model.text_model, model.lm_head, model.layout, shape, expert_form="selective", weights="int8")
    for layer, host in zip(int8.model.layers, model.text_model.layers, strict=True):
        swapped = list(target_linears(layer))  # only nn.Linear children are yielded: none are left
        assert not swapped
        assert isinstance(layer.self_attn.q_proj, Int8Linear) and isinstance(layer.mlp.down_proj, Int8Linear)
        assert layer.experts.gate_up_proj.dtype == torch.int8 and layer.experts.down_scale is not None
        assert isinstance(host.self_attn.q_proj, nn.Linear) and host.experts.gate_up_proj.dtype == torch.float32
    assert int8.key_parts() != full.key_parts()
    assert "weights" not in full.key_parts()  # full-precision cache keys are unchanged

    def device_bytes(graph: DeviceGraph) -> int:
        return sum(p.numel() * p.element_size() for n, p in graph.named_parameters() if "layers." in n)

    assert device_bytes(int8) < 0.4 * device_bytes(full)


def test_int8_changes_the_compiled_program_key():
    from gemma4lib.backends.compile_cpu import RECIPE, export_graph, graph_key

    model = _tiny("e2b")
    shape = GraphShape(1, 1, 16, True)
    keys = {}
    for weights in ("bf16", "int8"):
        graph = DeviceGraph(model.text_model, model.lm_head, model.layout, shape, weights=weights)
        keys[weights] = graph_key(graph, RECIPE, {}, export_graph(graph))
    assert keys["int8"]["program"] != keys["bf16"]["program"]
    assert keys["int8"]["weights"] != keys["bf16"]["weights"]


@pytest.mark.parametrize("variant", VARIANT_NAMES)
def test_int8_port_matches_its_own_reference_and_answers_paris(variant):
    """Eager backend: the int8 graphs against the rounded host model, all three checks."""
    from gemma4lib.port import PortSettings, port

    record = port(PortSettings(variant, backend="eager", weights="int8", warmup=0, iters=1, witness=False))
    assert record["parameters"]["weights"] == "int8"
    assert record["failed_checks"] == [], record["failed_checks"]
    assert record["seq_match"] and record["logits_match"] and record["coherent"]


@pytest.mark.slow  # minutes of AOTInductor compiles; CI keeps the five eager int8 ports and the int8 program key
def test_int8_compiled_moe_port_passes_with_its_witness():
    """AOTInductor (backend cpu): the int8 decode with selective experts, the dense-expert prefill
    and the random-weights witness through the same programs."""
    from gemma4lib.port import PortSettings, port

    record = port(PortSettings("26b-a4b", backend="cpu", weights="int8", warmup=0, iters=1))
    assert record["failed_checks"] == [], record["failed_checks"]
    assert record["witness"]["passed"]


@pytest.mark.parametrize("variant", VARIANT_NAMES)
def test_int8_logit_error_against_full_precision_is_bounded(variant):
    from gemma4lib.port import PortSettings, load_model, prompt_ids
    from gemma4lib.reference import reference_greedy, teacher_forced_logits

    settings = PortSettings(variant, backend="eager")
    model = load_model(settings)
    ids = prompt_ids(model, settings)
    tokens = reference_greedy(model.lm, ids, 12)
    rounded = copy.deepcopy(model.lm)
    weight_error = round_model_weights(rounded)
    assert 0 < max(weight_error.values()) <= 0.5 / 127 * (1 + 1e-6)
    error = float(
        (teacher_forced_logits(rounded, ids, tokens) - teacher_forced_logits(model.lm, ids, tokens)).abs().max()
    )
    assert 0 < error <= TINY_LOGIT_ERROR_BOUND


@pytest.mark.parametrize("variant", VARIANT_NAMES)
def test_roofline_int8_bytes_count_exactly_what_quant_quantizes(variant):
    from gemma4lab.inf2 import roofline
    from gemma4lib.inf2 import params

    lm = params.meta_model(variant)
    counts = params.count_params(lm)
    assert counts.linear + counts.experts == quantized_count(lm)
    bf16 = roofline.decode_bytes(variant, context_length=2048)
    int8 = roofline.decode_bytes(variant, context_length=2048, weight_format="int8")
    scales = 4 * (counts.linear_rows + counts.expert_rows)
    assert bf16.weights - int8.weights == (counts.linear + counts.experts) * (2 - 1) - scales
    assert int8.kv == bf16.kv


def test_inf2_table_has_the_int8_columns():
    from gemma4lab.tools import inf2_tables

    rows = inf2_tables.inf2_table(contexts=(2048,), variants=("26b-a4b",))
    for row in rows:
        assert row["int8_recipe_gb"] < row["recipe_gb"]
        assert row["int8_recipe_ceiling_tok_s"] > row["recipe_ceiling_tok_s"]
    assert "int8: recipe ceiling tok/s" in inf2_tables.format_inf2_table(rows)


@pytest.mark.parametrize("variant", ["12b", "26b-a4b"])
def test_bench_int8_section_reports_ratios_and_errors(variant):
    """The suite's int8 entry on a tiny model, eager (the figures come from the CPU run; here the schema
    and the exactness against the int8 model's own reference)."""
    from gemma4lab.benchmarks.fixes import bench_int8
    from gemma4lab.benchmarks.graphs import GraphFactory
    from gemma4lab.benchmarks.report import format_report
    from gemma4lab.benchmarks.suite import load_bench_model
    from gemma4lib.reference import random_prompt

    model = load_bench_model(variant)
    prompt = random_prompt(model.config.vocab_size, 12, 3)
    row = bench_int8(
        model,
        GraphFactory(model, "eager"),
        context_length=32,
        bucket=16,
        prompt=prompt,
        new_tokens=6,
        warmup=0,
        iters=1,
        decode_form="selective",
    )
    assert row["int8"]["tokens_match_own_reference"] and row["full"]["tokens_match_own_reference"]
    assert row["logits_max_abs_diff_vs_own_reference"] < 1e-3 < row["logits_max_abs_error_vs_full"]
    assert row["full_over_int8_bytes"] > 1.5  # fp32 tiny model: linears 4 -> 1 byte, LM head unchanged
    assert row["int8_over_full_decode"] is not None
    assert "Weight-only int8" in format_report({"int8": [{"model": variant, **row}], "models": []})


def test_bench_cli_rejects_an_unknown_section():
    from gemma4lab.cli import main

    assert main(["bench", "--sections", "int9"]) == 2


# ---- inf2: the ModelBuilder recipe with NxD's quantized layers (SDK stood in by fakes) ------------


def test_int8_settings_pick_the_recipes_that_build_it():
    from gemma4lib.port import PortSettings

    with pytest.raises(SettingsError, match="ModelBuilder"):
        preflight(PortSettings("e2b", backend="neuron", weights="int8", neuron_recipe="trace"))  # the one-graph recipe
    with pytest.raises(SettingsError, match="gloo"):
        PortSettings("31b", backend="cpu", weights="int8", tp_degree=8)


@pytest.mark.parametrize("variant,tp", [("12b", 2), ("26b-a4b", 8)])
def test_model_builder_int8_converts_exactly_the_checkpoints_int8_weights(variant, tp, monkeypatch):
    """NxD's `convert` gets the per-channel int8 config and include patterns; the modules those
    patterns select in the rank module are exactly the ones whose weights the checkpoint holds as
    int8 with a scale (NxD matches checkpoint keys to module parameters by name)."""
    import fnmatch
    import types

    from gemma4lib.recipes import neuron_env
    from gemma4lib.recipes import neuron_model_builder as mb
    from gemma4lib.tp.layers import ColumnShard, RowShard
    from gemma4lib.tp.plan import make_plan
    from gemma4lib.tp.rank_graph import CpuParallelFactory

    calls = []
    per_channel = {"quantization_type": "per_channel_symmetric", "quantized_dtype": torch.int8}
    fakes = {
        "neuronx_distributed.quantization.quantization_config": types.SimpleNamespace(
            get_default_per_channel_custom_qconfig_dict=lambda: dict(per_channel)
        ),
        "neuronx_distributed.quantization.quantize": types.SimpleNamespace(
            convert=lambda module, **kwargs: calls.append(kwargs) or module
        ),
        # the fake convert swaps nothing: no QuantizedRowParallel for `reduce_rows_in_float32` to find
        "neuronx_distributed.quantization.quantization_layers": types.SimpleNamespace(
            QuantizedRowParallel=type("QuantizedRowParallel", (torch.nn.Module,), {})
        ),
        "neuronx_distributed.parallel_layers.mappings": types.SimpleNamespace(),
    }
    monkeypatch.setattr(neuron_env, "require", lambda name, purpose="": fakes[name])
    model = _tiny(variant)
    plan = make_plan(model.config, tp, model.variant)
    shape = mb.bucket_shapes(32, (16,))["decode"]
    module = mb.rank_module(model.config, plan, shape, torch.float32, CpuParallelFactory(tp), "selective", "int8")
    assert calls == [{"q_config": per_channel, "inplace": True, "include": list(mb.INT8_INCLUDE)}]
    selected = {
        name
        for name, sub in module.named_modules()
        if any(fnmatch.fnmatch(name, pattern) for pattern in mb.INT8_INCLUDE)
    }
    assert selected and all(isinstance(module.get_submodule(n), (ColumnShard, RowShard)) for n in selected)

    full = mb.nxd_checkpoint(model, plan, torch.float32)
    int8 = mb.nxd_checkpoint(model, plan, torch.float32, "int8")
    quantized = {k for k, v in int8.items() if v.dtype == torch.int8}
    assert quantized == {f"{n}.weight" for n in selected}
    assert set(int8) == set(full) | {k[: -len("weight")] + "scale" for k in quantized}
    for key in quantized:
        scale = int8[key[: -len("weight")] + "scale"]
        assert scale.shape == (full[key].shape[0], 1) and scale.dtype == torch.float32
        assert torch.allclose(int8[key].float() * scale, full[key], atol=float(scale.max()) / 2 * 1.001, rtol=0)
    assert all(int8[k].dtype == torch.float32 for k in full if ".experts." in k)  # experts stay full precision


def test_neuron_cache_key_tracks_int8():
    from gemma4lib.backends.neuron import neuron_cache_key
    from gemma4lib.recipes import neuron_env

    model = _tiny("12b")
    shapes = {"decode": GraphShape(1, 1, 64), "prefill": GraphShape(1, 32, 64)}
    args = ("model_builder", 2, shapes, neuron_env.COMPILER_ARGS, torch.bfloat16)
    full, parts = neuron_cache_key(model, *args)
    int8, int8_parts = neuron_cache_key(model, *args, weights="int8")
    assert int8 != full and int8_parts["weight_format"] == "int8" and "weight_format" not in parts


def test_port_cli_takes_weights(capsys):
    import json

    from gemma4lib.cli import main

    assert main(["port", "--variant", "e2b", "--weights", "int4"]) == 2
    assert "weights form 'int4'" in capsys.readouterr().err
    argv = ["port", "--variant", "e2b", "--backend", "eager", "--weights", "int8", "--iters", "1", "--warmup", "0"]
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["parameters"]["weights"] == "int8"


@pytest.mark.parametrize("tokens", [1, 5])
def test_int8_expert_forms_equal_transformers_experts_with_rounded_weights(tokens):
    from gemma4lib.device.experts import StaticExperts

    model = _tiny("26b-a4b")
    round_model_weights(model.lm)
    layer = next(m for m in model.text_model.layers if getattr(m, "experts", None) is not None)
    config = model.config
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, config.hidden_size, generator=generator)
    scores = torch.randn(tokens, config.num_experts, generator=generator).softmax(-1)
    weights, index = scores.topk(config.top_k_experts, dim=-1)
    expected = layer.experts(hidden, index, weights)
    for form in ("dense", "selective", "grouped"):
        experts = StaticExperts(layer.experts, form, int8=True)
        assert experts.gate_up_proj.dtype == torch.int8
        assert torch.allclose(experts(hidden, index, weights), expected, atol=1e-5, rtol=1e-5), form


def quantized_count(lm: nn.Module) -> int:
    """Parameters int8 applies to (the rest stays at the model's dtype)."""
    total = 0
    for layer in lm.model.layers:
        total += sum(getattr(parent, name).weight.numel() for parent, name in target_linears(layer))
        total += sum(getattr(experts, name).numel() for experts, name in expert_weights(layer))
    return total
