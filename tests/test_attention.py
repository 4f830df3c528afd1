"""The device graph's grouped attention (`gemma4lib.device.attention`) against transformers' eager attention.

Three levels: the attention function alone on random tensors (GQA groups, decode and prefill,
causal / sliding / fully-masked rows, softcap); every tiny variant's device graph in both forms
(logits and updated K/V); and the exported program, which must differ between the forms so the
artifact cache keys them apart. The compiled graphs' SEQ_MATCH and logits checks
(tests/test_spine.py, tests/test_kv_forms.py) run the grouped form, the default.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import VARIANT_NAMES
from transformers import AttentionInterface
from transformers.models.gemma4.modeling_gemma4 import eager_attention_forward

from gemma4lib.backends.compile_cpu import export_graph
from gemma4lib.backends.program_key import program_digest
from gemma4lib.checks import logits_tolerance
from gemma4lib.device import attention
from gemma4lib.device.graph import DeviceGraph, GraphShape, additive_mask, index_tensor, slot_positions
from gemma4lib.errors import UnknownNameError
from gemma4lib.models.loading import build_tiny
from gemma4lib.models.variants import VARIANTS


class _Module(torch.nn.Module):
    """What the attention functions read from their module: head_dim (default scaling) and training."""

    def __init__(self, head_dim: int, groups: int):
        super().__init__()
        self.head_dim, self.num_key_value_groups = head_dim, groups


def _mask(tokens: int, slots: int, start: int, window: int | None) -> torch.Tensor:
    """An additive mask as the graph builds it: ring slot positions, causal, optionally a window."""
    k_pos = slot_positions(index_tensor([start + tokens - 1]), slots)[0]
    q_pos = start + torch.arange(tokens)
    allowed = (k_pos[None, :] >= 0) & (k_pos[None, :] <= q_pos[:, None])
    if window is not None:
        allowed &= q_pos[:, None] - k_pos[None, :] < window
    return additive_mask(allowed, torch.float32)[None, None]


@pytest.mark.parametrize("q_heads,kv_heads", [(8, 1), (8, 4), (4, 4), (16, 2)])
@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("window,softcap", [(None, None), (7, None), (None, 50.0)])
def test_grouped_equals_eager_on_random_inputs(q_heads, kv_heads, tokens, window, softcap):
    generator = torch.Generator().manual_seed(q_heads * 100 + kv_heads * 10 + tokens)
    d, dv, slots, start = 32, 24, 40, 53  # start past the slots: a ring that has wrapped
    query = torch.randn(2, q_heads, tokens, d, generator=generator)
    key = torch.randn(2, kv_heads, slots, d, generator=generator)
    value = torch.randn(2, kv_heads, slots, dv, generator=generator)
    mask = _mask(tokens, slots, start, window)
    module = _Module(d, q_heads // kv_heads).eval()
    expected = eager_attention_forward(module, query, key, value, mask, scaling=0.3, softcap=softcap)
    got = attention.grouped_attention_forward(module, query, key, value, mask, scaling=0.3, softcap=softcap)
    for name, e, g in zip(("output", "weights"), expected, got, strict=True):
        assert g.shape == e.shape, name
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6, msg=name)


def test_grouped_keeps_fully_masked_rows_finite_and_uses_default_scaling():
    """A padding query (every key masked) stays NaN-free as in eager; scaling None means head_dim^-0.5."""
    query, key, value = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16)
    allowed = torch.ones(3, 6, dtype=torch.bool)
    allowed[2] = False
    mask = additive_mask(allowed, torch.float32)[None, None]
    module = _Module(16, 2).eval()
    expected, _ = eager_attention_forward(module, query, key, value, mask)
    got, _ = attention.grouped_attention_forward(module, query, key, value, mask)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_grouped_refuses_heads_that_do_not_group():
    query, key = torch.randn(1, 6, 1, 8), torch.randn(1, 4, 5, 8)
    with pytest.raises(ValueError, match="multiple of K/V heads"):
        attention.grouped_attention_forward(_Module(8, 1), query, key, key, None)


def _graph_inputs(graph: DeviceGraph, start: int, length: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    inputs = list(graph.example_inputs())
    first = 2 if graph.has_ple else 1
    for i in range(first):
        inputs[i] = torch.randn(inputs[i].shape, generator=generator)
    inputs[first], inputs[first + 1] = index_tensor([start]), index_tensor([length])
    for i in range(first + 2, len(inputs)):
        inputs[i] = torch.randn(inputs[i].shape, generator=generator)
    return inputs


@pytest.mark.parametrize("variant", VARIANT_NAMES)
def test_device_graph_grouped_equals_eager(variant, monkeypatch):
    """Decode (ring and full length) and ring prefill, past the tiny window: logits and written K/V.

    The two forms sum in different orders, so the logits may differ by fp32 rounding. They are held
    to the project's logits tolerance (`checks.logits_tolerance`) of the spread between the eager
    graph in fp32 and in fp64 on the same inputs: that rounding, times a factor, never more.
    """
    model = build_tiny(VARIANTS[variant], seed=VARIANTS[variant].tiny_seed)
    precise = copy.deepcopy(model)
    precise.text_model.double(), precise.lm_head.double()
    models = {torch.float32: model, torch.float64: precise}
    calls = []
    forward = attention.grouped_attention_forward
    monkeypatch.setitem(
        AttentionInterface._global_mapping, attention.GROUPED, lambda *a, **k: calls.append(1) or forward(*a, **k)
    )
    for shape, start, length in [
        (GraphShape(1, 1, 64, True), 40, 1),
        (GraphShape(1, 1, 64, False), 40, 1),
        (GraphShape(1, 8, 64, True), 30, 6),
    ]:
        results = {}
        for form, dtype in [
            (attention.EAGER, torch.float64),
            (attention.EAGER, torch.float32),
            (attention.GROUPED, torch.float32),
        ]:
            model = models[dtype]
            graph = DeviceGraph(model.text_model, model.lm_head, model.layout, shape, attention=form)
            inputs = [t.to(dtype) if t.is_floating_point() else t for t in _graph_inputs(graph, start, length, seed=7)]
            kv = inputs[-2 * len(model.layout.producers) :]
            with torch.no_grad():
                results[(form, dtype)] = (graph(*inputs).double(), [t.double() for t in kv])
        precise, eager, grouped = results.values()
        spread = (eager[0] - precise[0]).abs().max().item()
        err = (grouped[0] - eager[0]).abs().max().item()
        assert err <= logits_tolerance(spread), f"{shape}: |grouped - eager| {err:.3g}, fp32 spread {spread:.3g}"
        for e, g in zip(eager[1], grouped[1], strict=True):
            torch.testing.assert_close(g, e, rtol=1e-4, atol=logits_tolerance(spread), msg=f"{shape} K/V")
    assert calls, "the grouped graph never called the grouped attention"
    assert models[torch.float32].text_model.config._attn_implementation == "eager"  # the host keeps its own


def test_attention_form_changes_the_exported_program_and_the_key():
    model = build_tiny(VARIANTS["e2b"], seed=VARIANTS["e2b"].tiny_seed)
    shape = GraphShape(1, 1, 32, True)
    graphs = {
        form: DeviceGraph(model.text_model, model.lm_head, model.layout, shape, attention=form)
        for form in attention.FORMS
    }
    digests = {form: program_digest(export_graph(g)) for form, g in graphs.items()}
    assert digests[attention.GROUPED] != digests[attention.EAGER]
    assert graphs[attention.GROUPED].key_parts() != graphs[attention.EAGER].key_parts()
    with pytest.raises(UnknownNameError, match="attention form"):
        DeviceGraph(model.text_model, model.lm_head, model.layout, shape, attention="sdpa")
