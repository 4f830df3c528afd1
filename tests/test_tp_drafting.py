"""Drafting over the tensor-parallel rank graphs: the gloo ranks (one CPU process per rank) draft
with the assistant split like the target's K/V and verify k + 1 tokens per step. Checked like every
drafted run (SEQ_MATCH, LOGITS_MATCH at every kept token, coherence, transformers' assisted
generate) plus rank agreement and the plain TP ranks' tokens over the same eos-ignored length, every
rank running the steps of the one engine in the parent (`backends.gloo`)."""

from __future__ import annotations

import copy

import pytest
import torch

from gemma4lib.errors import TensorParallelError
from gemma4lib.models.assistant import load_assistant
from gemma4lib.port import PortSettings, load_model, port
from gemma4lib.tp.draft_rank_graph import (
    assistant_attention_plans,
    assistant_nxd_full,
    assistant_shard,
    build_drafting_modules,
    draft_key_shapes,
)
from gemma4lib.tp.plan import make_plan

K = 3


@pytest.mark.parametrize("variant,batch", [("e4b", 3), ("26b-a4b", 1)])
def test_gloo_tp2_drafting_is_exact_and_accepts_drafts(variant, batch):
    """Every row drafted by the assistant split over 2 ranks: each equal to its own greedy reference
    (tokens and logits), coherent, and drafts accepted; row 0 equal to transformers' assisted generate."""
    settings = PortSettings(
        variant=variant, tp_degree=2, batch_size=batch, draft="assistant", draft_tokens=K, iters=1, warmup=0
    )
    result = port(settings)
    assert result["compiler"] == "cpu-gloo-tp"
    assert result["checks_passed"], result["failed_checks"]
    assert result["seq_match"] and result["logits_match"] and result["coherent"]
    assert "Paris" in result["answer"]
    assert result["hf_assisted_match"] and result["ranks_agree"]
    assert result["accepted_per_step"] > 1.0
    for row in result.get("rows", []):
        assert row["seq_match"] and row["logits_match"] and row["coherent"], row
        assert row["accepted_per_step"] > 1.0, row
    assert len(result.get("rows", [None])) == batch
    # 32 tokens, eos ignored (crosses the tiny window of 8 several times): equal to the plain TP ranks'
    assert result["plain_tokens_match"] and result["bench_tokens"] > 3 * 8
    assert result["decode_tok_s_with_draft"] > 0 and result["decode_tok_s_without_draft"] > 0
    assert result["missing_keys"] == [] and result["tp_plan"]["tp"] == 2
    assert result["sliding_ring_slots"] == 8 + K + 1
    assert result["witness"]["seq_match"] and result["witness"]["logits_match"]


def _pair(variant):
    settings = PortSettings(variant=variant, draft="assistant", draft_tokens=K)
    model = load_model(settings)
    return settings, model, load_assistant(model, settings)


def test_the_assistant_reads_the_kv_heads_its_rank_holds():
    """26B-A4B at TP=2: sliding K/V sharded (4 of 8 heads a rank), full K/V sharded (1 of 2); the
    assistant's Q heads are cut so each rank's block reads exactly those heads."""
    _, model, assistant = _pair("26b-a4b")
    plan = make_plan(model.config, 2, model.variant)
    plans = assistant_attention_plans(assistant.model.config, plan, assistant.read_layers)
    for a in plans:
        target = plan.attention(assistant.read_layers[a.layer_type])
        assert [a.kv_heads_of(r) for r in range(2)] == [target.kv_heads_of(r) for r in range(2)]
        assert a.q_per_rank == 8 and a.kv_groups_per_rank == 8 // target.kv_per_rank
    eight = make_plan(model.config, 8, model.variant)  # 2 Q heads a rank over 1 (sharded or replicated) KV head
    assert all(
        a.kv_groups_per_rank == 2
        for a in assistant_attention_plans(assistant.model.config, eight, assistant.read_layers)
    )
    narrow = copy.deepcopy(assistant.model.config)
    narrow.get_text_config().num_attention_heads = 2  # 1 Q head a rank cannot read 4 sliding KV heads
    with pytest.raises(TensorParallelError, match="query heads cannot be cut"):
        assistant_attention_plans(narrow, plan, assistant.read_layers)


def test_every_key_shares_weights_and_states_and_the_draft_never_writes_them():
    settings, model, assistant = _pair("e4b")
    plan = make_plan(model.config, 2, model.variant)
    shapes = draft_key_shapes(settings.context_length, tuple(settings.prefill_buckets), K, settings.ring_kv)
    modules = build_drafting_modules(model.config, assistant.model.config, plan, assistant.read_layers, shapes, K)
    names = {key: set(m.state_dict()) for key, m in modules.items()}
    assert len({frozenset(n) for n in names.values()}) == 1  # one set of names in every key
    shard = assistant_shard(assistant.model, plan, 1)
    full = assistant_nxd_full(assistant.model, plan)
    for key, tensor in shard.items():  # NxD's contiguous cut of the full checkpoint gives the shard back
        rule = plan.rule(key)
        cut = full[key] if full[key].shape == tensor.shape else full[key].chunk(2, dim=rule.dim)[1]
        assert torch.equal(cut, tensor), key
    assert {"assistant." + k for k in shard} <= names["draft"]
    draft = modules["draft"]
    before = [t.clone() for t in draft.kv]
    out = draft(torch.randn(1, 1, 2 * model.config.hidden_size), torch.tensor([5]))
    assert all(o is p for o, p in zip(out[2:], draft.kv, strict=True))  # the states come back untouched
    assert all(torch.equal(a, b) for a, b in zip(before, draft.kv, strict=True))
    assert all(m.aliases().keys() == draft.aliases().keys() for m in modules.values())
