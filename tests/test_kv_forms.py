"""The decode-side forms (README, "Speed"; docs/ROOFLINE.md) against the HF reference: ring KV far
past the sliding window, selective experts (== dense == HF), and prefill buckets (smallest that
fits, padding masked).

Most checks run the device graphs eagerly (the exact module that is exported and compiled; seconds
on the tiny models); one runs the compiled AOTInductor graphs of the MoE tiny with both new forms.
Logits are compared, not only tokens.
"""

from __future__ import annotations

import pytest
import torch
from conftest import VARIANT_NAMES

from gemma4lib.device.experts import StaticExperts
from gemma4lib.device.graph import DeviceGraph, GraphShape
from gemma4lib.models.loading import build_tiny
from gemma4lib.models.variants import VARIANTS
from gemma4lib.port import PortSettings, compile_graphs, load_model, prompt_ids
from gemma4lib.reference import reference_greedy
from gemma4lib.runtime import Engine, Steps, bind_kv, softcap

CONTEXT = 96
PROMPT = 20
# Positions up to 52: six times past the tiny window of 8. The tiny seeds (variants.py) guarantee a
# top-1/top-2 margin >= 0.035 for 32 tokens of this prompt; past that a near-tie may let fp32
# rounding, not the port, pick the token (seen at step ~44 on e4b, for HF's own paths too).
NEW_TOKENS = 32


def _model(variant: str):
    return build_tiny(VARIANTS[variant], seed=VARIANTS[variant].tiny_seed)


def _prompt(model, n: int = PROMPT, seed: int | None = None) -> list[int]:
    """Seeded ids; by default the variant's own prompt (seed tiny_seed + 1, as `port.prompt_ids`)."""
    if seed is None:
        seed = VARIANTS[model.variant.name].tiny_seed + 1
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.config.vocab_size, (n,), generator=generator).tolist()


def _runtime(
    model,
    *,
    ring: bool,
    buckets=(32,),
    decode_form: str = "dense",
    context: int = CONTEXT,
    record: list | None = None,
    kv: list | None = None,
) -> Engine:
    """The engine over the eager device graphs (one K/V, `kv` when given); `record` collects the
    raw logits of every decode step."""

    def graph(tokens, form):
        return DeviceGraph(
            model.text_model, model.lm_head, model.layout, GraphShape(1, tokens, context, ring), expert_form=form
        )

    decode = graph(1, decode_form)
    kv = decode.new_kv() if kv is None else kv
    step = bind_kv(decode, kv)
    if record is not None:
        bound = step

        def step(*args):
            logits = bound(*args)
            record.append(logits[0].clone())
            return logits

    prefill = {b: bind_kv(graph(b, "dense"), kv) for b in buckets}
    return Engine.for_model(model, Steps(prefill, step), batch=1, context_length=context)


@torch.no_grad()
def _hf_logits(model, prompt: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor, float]:
    """HF greedy tokens, the (softcapped) logits of every step, and a logits tolerance.

    The tolerance is scaled by HF's own spread: its cached `generate` against one no-cache forward
    over the same tokens. fp32 rounding grows along the sequence, far more on the PLE models with
    init 0.1 (e4b: up to ~4e-2 between HF's own two paths) than on the others (~1e-4); an error of
    the port (a wrong mask or slot) shows up at O(1).
    """
    ids = torch.tensor([prompt])
    out = model.lm.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logits = torch.stack([step[0].float() for step in out.logits])
    no_cache = model.lm(out.sequences[:, :-1]).logits[0, len(prompt) - 1 :].float()
    spread = float((logits - no_cache).abs().max())
    return tokens, logits, 1e-3 + 2 * spread


# ---- ring KV -----------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANT_NAMES)
def test_ring_kv_matches_hf_far_past_the_window(variant):
    model = _model(variant)
    window = model.config.sliding_window
    assert PROMPT + NEW_TOKENS > 6 * window
    prompt = _prompt(model)
    reference, hf_logits, atol = _hf_logits(model, prompt, NEW_TOKENS)
    assert len(set(reference)) >= 8, "the reference repeats itself: a weak comparison"

    decode_logits: list[torch.Tensor] = []
    runtime = _runtime(model, ring=True, record=decode_logits)
    sliding = [s for s in model.layout.buffer_shapes(1, CONTEXT, True)]
    assert min(s[2] for s in sliding) == window, "sliding buffers must hold only the window"
    generation = runtime.generate(prompt, NEW_TOKENS)

    assert generation.tokens == reference
    ours = torch.stack([generation.first_logits, *decode_logits])
    cap = model.config.final_logit_softcapping
    assert torch.allclose(softcap(ours, cap), hf_logits, atol=atol, rtol=0)


def test_ring_and_full_buffers_give_the_same_logits():
    model = _model("e2b")  # PLE + KV sharing: consumers read a producer's ring
    prompt = _prompt(model)
    logits = {}
    for ring in (False, True):
        record: list[torch.Tensor] = []
        runtime = _runtime(model, ring=ring, record=record)
        generation = runtime.generate(prompt, NEW_TOKENS)
        logits[ring] = torch.stack([generation.first_logits, *record])
    # same math on differently sized buffers; rounding differs only through the summation length
    assert torch.allclose(logits[True], logits[False], atol=1e-2, rtol=0)


def test_ring_prefill_longer_than_the_window_keeps_the_newest_tokens():
    # a 30-token prompt into a ring of 8: prefill attends over the chunk, then keeps positions 22..29
    model = _model("31b")
    prompt = _prompt(model, 30, seed=5)
    kv = [torch.zeros(s) for s in model.layout.buffer_shapes(1, CONTEXT, True)]
    generation = _runtime(model, ring=True, kv=kv).generate(prompt, 12)
    assert generation.tokens == reference_greedy(model.lm, prompt, 12)
    window = model.config.sliding_window
    layout = model.layout
    for i, layer in enumerate(layout.producers):
        if layer.layer_type == "sliding_attention":
            k = kv[2 * i]
            assert k.shape[2] == window and bool(k.abs().sum(dim=-1).gt(0).all())


# ---- selective experts ----------------------------------------------------------------------
@pytest.mark.parametrize("tokens", [1, 5])
def test_static_expert_forms_equal_transformers_experts(tokens):
    model = _model("26b-a4b")
    layer = next(m for m in model.text_model.layers if getattr(m, "experts", None) is not None)
    hf = layer.experts
    config = model.config
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, config.hidden_size, generator=generator)
    scores = torch.randn(tokens, config.num_experts, generator=generator).softmax(-1)
    weights, index = scores.topk(config.top_k_experts, dim=-1)
    expected = hf(hidden, index, weights)
    for form in ("dense", "selective", "grouped"):
        got = StaticExperts(hf, form)(hidden, index, weights)
        assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5), form


def test_selective_and_dense_decode_match_hf():
    model = _model("26b-a4b")
    prompt = _prompt(model)
    reference, hf_logits, atol = _hf_logits(model, prompt, NEW_TOKENS)
    cap = model.config.final_logit_softcapping
    logits = {}
    for form in ("dense", "selective"):
        record: list[torch.Tensor] = []
        generation = _runtime(model, ring=True, decode_form=form, record=record).generate(prompt, NEW_TOKENS)
        assert generation.tokens == reference, form
        logits[form] = softcap(torch.stack([generation.first_logits, *record]), cap)
        assert torch.allclose(logits[form], hf_logits, atol=atol, rtol=0), form
    assert torch.allclose(logits["selective"], logits["dense"], atol=1e-4, rtol=0)


def test_compiled_ring_and_selective_decode_match_hf():
    # the two new forms through the real CPU recipe (AOTInductor), on the MoE tiny
    settings = PortSettings(variant="26b-a4b", model="random", ring_kv=True, decode_experts="selective")
    model = load_model(settings)
    compiled = compile_graphs(model, settings)
    decode = compiled.graphs.decode
    assert decode.shape.ring and decode.expert_form == "selective"
    ids = prompt_ids(model, settings)
    assert model.config.sliding_window * 6 < len(ids) + NEW_TOKENS <= settings.context_length
    reference = reference_greedy(model.lm, ids, NEW_TOKENS)
    assert compiled.runtime.generate(ids, NEW_TOKENS).tokens == reference


# ---- prefill buckets --------------------------------------------------------------------------
def test_prompt_runs_in_the_smallest_bucket_that_fits():
    model = _model("e4b")
    runtime = _runtime(model, ring=True, buckets=(8, 16, 32))
    for n, bucket in ((3, 8), (8, 8), (9, 16), (16, 16), (17, 32), (32, 32)):
        prompt = _prompt(model, n, seed=n)
        generation = runtime.generate(prompt, 6)
        assert generation.bucket == bucket
        assert generation.tokens == reference_greedy(model.lm, prompt, 6), n


def test_bucket_padding_is_masked():
    # the same prompt through a tight and a loose bucket: identical logits and tokens
    model = _model("12b")
    prompt = _prompt(model, 7)
    tight = _runtime(model, ring=True, buckets=(8,)).generate(prompt, 10)
    loose = _runtime(model, ring=True, buckets=(32,)).generate(prompt, 10)
    assert (tight.bucket, loose.bucket) == (8, 32)
    assert tight.tokens == loose.tokens
    assert torch.allclose(tight.first_logits, loose.first_logits, atol=1e-5, rtol=0)
