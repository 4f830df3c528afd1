"""Tensor parallelism on CPU: every sharded plan against the unsharded model, token for token.

The ranks run as real processes joined by gloo (one thread each), each running the one generation
engine's steps over its rank graphs (`backends.gloo`); every row is checked like any device run: its
tokens equal the reference's, its logits at every step within the reference's own spread, the ranks
agree. 8 ranks on 2 shared cores are bound by collective latency, so the TP=8 runs take 10-20 s
each; everything else is fast. The
MoE expert forms (dense, selective) are also checked module by module, without gloo, in both
expert splits: each rank a 1/tp slice of every expert (`intermediate`, the plan's default where it
divides) or E/tp whole experts (`experts`, the first form).
"""

from __future__ import annotations

import gc

import pytest
import torch

from gemma4lab.tools.shard_report import shard_shapes
from gemma4lib import checks
from gemma4lib.backends import DeviceRun, gloo, registry
from gemma4lib.device.experts import StaticExperts
from gemma4lib.device.graph import DeviceGraph, GraphShape
from gemma4lib.errors import RankProcessError, SettingsError, TensorParallelError
from gemma4lib.models.loading import build_tiny, text_config
from gemma4lib.models.variants import get_variant
from gemma4lib.reference import reference_greedy
from gemma4lib.runtime import GREEDY, Request, Sampling
from gemma4lib.settings import PortSettings
from gemma4lib.tp.layers import ShardedExperts
from gemma4lib.tp.plan import CANDIDATE_TP, COLUMN, REPLICATE, ROW, make_plan, tp_problems
from gemma4lib.tp.rank_graph import CpuParallelFactory, build_rank_graph, load_shard, with_shape
from gemma4lib.tp.shard import iter_shards, nxd_full_checkpoint, rank_tensor, shard_kv, shard_state_dict

NEW_TOKENS = 16
PROMPT_TOKENS = 20  # longer than the tiny sliding window (8)
PREFILL_LEN = 24
CONTEXT = 64
CASES = [("e4b", 2), ("12b", 2), ("31b", 8), ("26b-a4b", 8)]

_models: dict[str, object] = {}


def tiny(name: str):
    if name not in _models:
        v = get_variant(name)
        _models[name] = build_tiny(v, seed=v.tiny_seed)
    return _models[name]


def prompt(name: str) -> list[int]:
    v = get_variant(name)
    g = torch.Generator().manual_seed(v.tiny_seed + 1)
    return torch.randint(3, tiny(name).config.vocab_size, (PROMPT_TOKENS,), generator=g).tolist()


def run(
    name: str,
    tp: int,
    *,
    lengths: tuple[int, ...] = (PROMPT_TOKENS,),
    decode_experts: str = "dense",
    draft: str | None = None,
    sampling: Sampling = GREEDY,
    **options,
) -> DeviceRun:
    """One prompt (a prefix of `prompt(name)`) per row over `tp` gloo ranks; `options` go to `gloo.rank_graphs`."""
    settings = PortSettings(
        variant=name,
        model="random",
        tp_degree=tp,
        max_new_tokens=NEW_TOKENS,
        context_length=CONTEXT,
        prefill_buckets=(PREFILL_LEN,),
        decode_experts=decode_experts,
        batch_size=len(lengths),
        draft=draft,
        draft_tokens=3 if draft else None,
    )
    requests = [Request(prompt(name)[:n], NEW_TOKENS, sampling) for n in lengths]
    graphs = gloo.rank_graphs(tiny(name), settings, **options)
    return registry.run_device(tiny(name), settings, requests, graphs=graphs, bench=False)


_runs: dict[tuple, DeviceRun] = {}


def run_once(name: str, tp: int, **kwargs) -> DeviceRun:
    """`run`, remembered: several tests compare against the same (deterministic) sharded run."""
    key = (name, tp, tuple(sorted(kwargs.items())))
    if key not in _runs:
        _runs[key] = run(name, tp, **kwargs)
    return _runs[key]


_references: dict[tuple, list[int]] = {}


def reference(name: str, ids: list[int]) -> list[int]:
    key = (name, tuple(ids))
    if key not in _references:
        _references[key] = reference_greedy(tiny(name).lm, ids, NEW_TOKENS)
    return _references[key]


def assert_exact(name: str, result: DeviceRun) -> None:
    """Every row: the reference's tokens (a varied sequence, or the check proves little), its logits
    at every step within the reference's own spread; the first prefill's logits close; the ranks
    agreeing; no key missing from the shards."""
    assert result.details["ranks_agree"] and result.details["missing_keys"] == []
    assert result.prefill_logits_max_abs_diff < 1e-2
    for row in result.rows:
        expected = reference(name, row.prompt_ids)
        assert len(set(expected)) > 4, "reference degenerate: the comparison would prove little"
        assert row.tokens == expected, (row.tokens, expected)
        logits = checks.check_logits(tiny(name).lm, row.prompt_ids, row.tokens, row.step_logits)
        assert logits.passed, logits.explain()


def matches_reference(name: str, result: DeviceRun) -> bool:
    return result.tokens == reference(name, result.rows[0].prompt_ids)


# ---- the sharded runs --------------------------------------------------------------------------


@pytest.mark.parametrize("name,tp", CASES)
def test_sharded_equals_unsharded(name, tp):
    result = run(name, tp)
    assert_exact(name, result)
    assert result.compiler == "cpu-gloo-tp" and result.details["world"]["processes"] == tp
    m = tiny(name)  # the shards the ranks were handed: the same `iter_shards` over the same plan
    shapes = shard_shapes(make_plan(m.config, tp, m.variant), lm=m.lm)
    assert shapes["tp"] == tp and shapes["identical_shapes_across_ranks"]
    assert [r["rank_tensor"] for r in shapes["ranks"]] == [[r] for r in range(tp)]
    assert all(r["has_layer_scalar"] for r in shapes["ranks"])
    # the MoE default: a slice of every expert per rank (16 experts x 32 -> 32 / tp per rank)
    assert result.details["expert_split"] == ("intermediate" if get_variant(name).is_moe else None)


def test_a_batch_of_prompts_of_different_lengths_each_equals_its_own_reference():
    """E4B at TP=2, batch 3: every row prefilled at once (right-padded) and decoded together."""
    result = run("e4b", 2, lengths=(PROMPT_TOKENS, 13, 7))
    assert [len(r.prompt_ids) for r in result.rows] == [PROMPT_TOKENS, 13, 7]
    assert_exact("e4b", result)
    assert result.details["kv_shapes_per_rank"][0][0] == 3  # one K/V row per prompt
    assert result.details["decode_tok_s_per_row"] > 0


def test_prompt_lookup_drafting_over_the_ranks_is_exact():
    """The verify graph of k + 1 tokens over the rank graphs, drafts from the row's own history:
    greedy verification keeps every row equal to plain greedy decoding."""
    result = run("e4b", 2, lengths=(PROMPT_TOKENS, 11), draft="prompt_lookup")
    assert_exact("e4b", result)
    assert result.details["draft"] == "prompt_lookup" and result.details["verify_steps"] >= 1
    assert all(sum(r.emitted) == len(r.tokens) - 1 for r in result.rows)  # every token after the first verified


def test_sampled_drafting_is_refused_on_the_ranks():
    with pytest.raises(SettingsError, match="backend 'gloo'.*verify greedily.*tp_degree=1"):
        run("e4b", 2, draft="prompt_lookup", sampling=Sampling(temperature=0.7))


# (TP, expert split, decode form); the default split's dense decode at TP=8 is in CASES above
MOE_CASES = [
    (2, "intermediate", "dense"),
    (2, "intermediate", "selective"),
    (8, "intermediate", "selective"),
    (8, "experts", "dense"),
]


@pytest.mark.parametrize("tp,split,form", MOE_CASES, ids=[f"tp{t}-{s}-{f}" for t, s, f in MOE_CASES])
def test_moe_sharded_equals_unsharded_in_both_splits(tp, split, form):
    result = run_once("26b-a4b", tp, expert_split=split, decode_experts=form)
    assert result.details["expert_split"] == split and result.details["decode_experts"] == form
    assert_exact("26b-a4b", result)
    moe = result.details["tp_plan"]["moe"]
    assert moe["split"] == split
    if split == "intermediate":  # every rank: all 16 experts, 32 / tp columns of each
        assert moe["experts_per_rank"] == 16 and moe["intermediate_per_rank"] == 32 // tp
        assert moe["intermediate_by_rank"] == [[r * 32 // tp, (r + 1) * 32 // tp] for r in range(tp)]
        assert (
            moe["weights_read_per_rank_per_layer"]["selective_per_token"]["params"] == 4 * 3 * (32 // tp) * 64
        )  # k slices of 1/tp of an expert: the rank's share of k experts
        assert moe["rank_source"].startswith("not read")
    else:
        assert moe["experts_per_rank"] == 16 // tp and moe["intermediate_per_rank"] == 32


def test_moe_intermediate_split_selective_equals_dense_tokens():
    dense = run_once("26b-a4b", 2, expert_split="intermediate", decode_experts="dense")
    selective = run_once("26b-a4b", 2, expert_split="intermediate", decode_experts="selective")
    assert selective.tokens == dense.tokens and matches_reference("26b-a4b", dense)


def test_shard_shapes_per_rank():
    """What each rank gets, per variant: the hard cases are KV heads < TP and experts split."""
    # 31B tiny at TP=8: 16 Q heads -> 2 per rank; sliding 8 KV heads -> 1 each (sharded);
    # full 2 KV heads < 8 -> replicated: ranks 0-3 read head 0, ranks 4-7 head 1.
    m = tiny("31b")
    plan = make_plan(m.config, 8, m.variant)
    s = shard_shapes(plan, lm=m.lm)
    assert s["kv_modes"] == {"sliding_attention": "shard", "full_attention": "replicate"}
    assert [r["kv_heads"]["full_attention"] for r in s["ranks"]] == [[0]] * 4 + [[1]] * 4
    assert [r["kv_heads"]["sliding_attention"] for r in s["ranks"]] == [[r] for r in range(8)]
    hd, ghd, hidden = 8, 16, 64
    assert s["shapes"]["layers[sliding_attention].self_attn.q_proj.weight"] == [2 * hd, hidden]
    assert s["shapes"]["layers[sliding_attention].self_attn.k_proj.weight"] == [hd, hidden]
    assert s["shapes"]["layers[full_attention].self_attn.k_proj.weight"] == [ghd, hidden]
    assert "layers[full_attention].self_attn.v_proj.weight" not in s["shapes"]  # k_eq_v
    assert s["shapes"]["layers[full_attention].self_attn.o_proj.weight"] == [hidden, 2 * ghd]
    assert s["shapes"]["layers[sliding_attention].mlp.down_proj.weight"] == [hidden, 128 // 8]
    # the tiny vocabulary (810) does not split over 8 ranks: the LM head falls back to replicated
    vocab = m.config.vocab_size
    assert plan.lm_head == ("column" if vocab % 8 == 0 else "replicate")
    assert s["shapes"]["lm_head.weight"] == ([vocab // 8, hidden] if vocab % 8 == 0 else [vocab, hidden])
    assert s["shapes"]["spmd_rank.rank"] == [1]
    # 26B-A4B tiny at TP=8, expert split: 16 experts -> 2 per rank, as two parallel linears
    m = tiny("26b-a4b")
    plan = make_plan(m.config, 8, m.variant, expert_split="experts")
    s = shard_shapes(plan, lm=m.lm)
    assert s["expert_split"] == "experts"
    assert [r["experts"] for r in s["ranks"]] == [[2 * r, 2 * r + 1] for r in range(8)]
    assert [r["expert_intermediate"] for r in s["ranks"]] == [[0, 32]] * 8
    assert s["shapes"]["layers[sliding_attention].experts.gate_up.weight"] == [2 * 2 * 32, hidden]
    assert s["shapes"]["layers[sliding_attention].experts.down.weight"] == [hidden, 2 * 32]
    # intermediate split (the default): all 16 experts, 32 / 8 = 4 intermediate columns of each;
    # the tensors have the same shapes (and bytes) as the expert split's
    plan = make_plan(m.config, 8, m.variant)
    s = shard_shapes(plan, lm=m.lm)
    assert s["expert_split"] == "intermediate"
    assert [r["experts"] for r in s["ranks"]] == [[0, 15]] * 8
    assert [r["expert_intermediate"] for r in s["ranks"]] == [[4 * r, 4 * r + 4] for r in range(8)]
    assert s["shapes"]["layers[sliding_attention].experts.gate_up.weight"] == [16 * 2 * 4, hidden]
    assert s["shapes"]["layers[sliding_attention].experts.down.weight"] == [hidden, 16 * 4]
    by_split = {
        split: shard_shapes(make_plan(m.config, 8, m.variant, expert_split=split), lm=m.lm)
        for split in ("experts", "intermediate")
    }
    assert by_split["experts"]["ranks"][3]["bytes"] == by_split["intermediate"]["ranks"][3]["bytes"]
    # 12B tiny at TP=2: one global KV head, replicated on both ranks; E4B: 2 KV heads, 1 per rank
    m = tiny("12b")
    s = shard_shapes(make_plan(m.config, 2, m.variant), lm=m.lm)
    assert [r["kv_heads"]["full_attention"] for r in s["ranks"]] == [[0], [0]]
    m = tiny("e4b")
    s = shard_shapes(make_plan(m.config, 2, m.variant), lm=m.lm)
    assert s["kv_modes"]["sliding_attention"] == "shard"
    assert [r["kv_heads"]["sliding_attention"] for r in s["ranks"]] == [[0], [1]]
    assert "layers[sliding_attention (kv-shared)].self_attn.q_proj.weight" in s["shapes"]
    assert "layers[sliding_attention (kv-shared)].self_attn.k_proj.weight" not in s["shapes"]


@pytest.mark.parametrize("name,tp", CASES)
def test_shards_fit_the_rank_graph_exactly(name, tp):
    """Every key and shape of a shard is what the (config-built) rank graph expects, and back."""
    m = tiny(name)
    plan = make_plan(m.config, tp, m.variant)
    graph = build_rank_graph(m.config, plan, GraphShape(1, 1, CONTEXT))
    expected = {k: tuple(v.shape) for k, v in graph.state_dict().items()}
    for rank in (0, tp - 1):
        shard = shard_state_dict(m.lm, plan, rank)
        assert {k: tuple(v.shape) for k, v in shard.items()} == expected
        assert shard["spmd_rank.rank"].dtype == torch.int32 and shard["spmd_rank.rank"].tolist() == [rank]


def test_rank_graph_at_tp1_is_the_device_graph():
    m = tiny("26b-a4b")
    plan = make_plan(m.config, 1, m.variant)
    shape = GraphShape(1, PREFILL_LEN, CONTEXT)
    graph = build_rank_graph(m.config, plan, shape)
    assert load_shard(graph, shard_state_dict(m.lm, plan, 0)) == []
    ref = DeviceGraph(m.text_model, m.lm_head, m.layout, shape, inplace=False)
    inputs = list(ref.example_inputs())
    inputs[0] = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(0))
    inputs[2] = torch.tensor([PROMPT_TOKENS])
    with torch.no_grad():
        a, b = ref(*inputs), graph(*inputs)
    assert torch.allclose(a[0], b[0], atol=1e-4)


@pytest.mark.parametrize(
    "name,tp,split",
    [("31b", 8, None), ("26b-a4b", 8, "intermediate"), ("26b-a4b", 8, "experts"), ("26b-a4b", 2, "intermediate")],
)
def test_nxd_checkpoint_splits_back_into_our_shards(name, tp, split):
    """ModelBuilder's contiguous split of the full checkpoint must give exactly our shards."""
    m = tiny(name)
    plan = make_plan(m.config, tp, m.variant, expert_split=split)
    full = nxd_full_checkpoint(m.lm, plan)
    assert full["spmd_rank.rank"].tolist() == list(range(tp))
    for rank in sorted({0, max(tp - 3, 0), tp - 1}):
        shard = shard_state_dict(m.lm, plan, rank)
        for key, value in shard.items():
            rule = plan.rule(key)
            if rule.kind == REPLICATE:
                piece = full[key]
            else:
                assert rule.kind in (COLUMN, ROW, "rank")
                piece = full[key].chunk(tp, dim=rule.dim)[rank]
            assert torch.equal(piece, value), key


def test_nxd_checkpoint_is_rank_major_under_the_intermediate_split():
    """Checked against HF's own [E, 2I, H] / [E, H, I] tensors, not through the sharder: NxD's
    contiguous block r of the full checkpoint is rank r's gate rows and up rows of *every* expert
    (gate_up) and its intermediate columns of every expert (down)."""
    m = tiny("26b-a4b")
    tp, E, inter, H = 8, 16, 32, 64
    w = inter // tp  # the intermediate columns a rank holds of each expert
    plan = make_plan(m.config, tp, m.variant)
    full = nxd_full_checkpoint(m.lm, plan)
    hf = m.text_model.layers[2].experts
    gate_up, down = full["model.layers.2.experts.gate_up.weight"], full["model.layers.2.experts.down.weight"]
    assert gate_up.shape == (E * 2 * inter, H) and down.shape == (H, E * inter)
    assert not torch.equal(gate_up, hf.gate_up_proj.reshape(-1, H))  # not HF's layout
    for r in (0, 5):
        block = gate_up.chunk(tp, dim=0)[r].view(E, 2 * w, H)
        assert torch.equal(block[:, :w], hf.gate_up_proj[:, r * w : (r + 1) * w])  # gate rows
        assert torch.equal(block[:, w:], hf.gate_up_proj[:, inter + r * w : inter + (r + 1) * w])  # up rows
        cols = down.chunk(tp, dim=1)[r].view(H, E, w)
        assert torch.equal(cols, hf.down_proj[:, :, r * w : (r + 1) * w].permute(1, 0, 2))


# ---- the field report's TP faults (gemma4lab.tools.faults) ---------------------------------------------


def test_baked_rank_bug_is_reproduced_and_flagged():
    """The MoE reading the rank as a trace-time int: rank 1 weights rank 0's experts."""
    real = run_once("26b-a4b", 2, expert_split="experts")
    baked = run_once("26b-a4b", 2, baked_rank=True)
    assert_exact("26b-a4b", real)
    assert baked.details["expert_split"] == "experts"  # the bug's form, even though it is not the default
    assert not matches_reference("26b-a4b", baked)
    assert baked.prefill_logits_max_abs_diff > 0.1
    assert baked.details["ranks_agree"]  # the ranks agree with each other: only the reference check sees it


def test_baked_rank_is_a_python_int_and_the_real_rank_is_data():
    m = tiny("26b-a4b")
    plan = make_plan(m.config, 2, m.variant, expert_split="experts")
    shape = GraphShape(1, 1, CONTEXT)
    baked = build_rank_graph(m.config, plan, shape, baked_rank=True)
    real = build_rank_graph(m.config, plan, shape)
    for graph in (baked, real):
        load_shard(graph, shard_state_dict(m.lm, plan, 1))
        assert graph.spmd_rank.rank.tolist() == [1]
    assert baked.baked_rank == 0 and all(e.baked_rank == 0 for e in baked._rank_users)
    assert real.baked_rank is None and all(e.baked_rank is None for e in real._rank_users)
    assert isinstance(real.spmd_rank.rank, torch.nn.Parameter)


def test_intermediate_split_has_no_rank_to_bake_in():
    """Under the intermediate split the expert math never reads the rank: asking for the field
    report's bug there is an error, not a silently correct run."""
    m = tiny("26b-a4b")
    plan = make_plan(m.config, 2, m.variant, expert_split="intermediate")
    with pytest.raises(ValueError, match="never reads the rank"):
        build_rank_graph(m.config, plan, GraphShape(1, 1, CONTEXT), baked_rank=True)
    with pytest.raises(ValueError, match="never reads the rank"):  # refused before any rank starts
        run("26b-a4b", 2, baked_rank=True, expert_split="intermediate")


def test_layer_scalar_missing_from_shards_is_detected():
    result = run("12b", 2, include_buffers=False)
    assert any(k.endswith("layer_scalar") for k in result.details["missing_keys"])
    m = tiny("12b")  # the shards the ranks were handed, without the buffers
    shards = list(iter_shards(m.lm, make_plan(m.config, 2, m.variant), include_buffers=False))
    assert not any(r["has_layer_scalar"] for r in shard_shapes(make_plan(m.config, 2, m.variant), shards)["ranks"])
    assert not matches_reference("12b", result)
    assert result.prefill_logits_max_abs_diff > 0.1


# ---- the E4B recipe's data path ------------------------------------------------------------------


def test_cpu_seeded_prefill_then_sharded_decode():
    """The unsharded model prefills every row on the host; each rank starts from its K/V slice."""
    result = run("e4b", 2, lengths=(PROMPT_TOKENS, 9), prefill="cpu-seeded")
    assert result.details["prefill"] == "cpu-seeded" and "host_prefill_s" in result.details["tp_timings"]
    assert_exact("e4b", result)


def test_shard_kv_picks_the_rank_heads():
    m = tiny("31b")
    plan = make_plan(m.config, 8, m.variant)
    kv = DeviceGraph(m.text_model, m.lm_head, m.layout, GraphShape(1, 1, CONTEXT)).new_kv()
    kv = [torch.arange(t.numel(), dtype=t.dtype).view(t.shape) for t in kv]
    rank5 = shard_kv(kv, plan, 5)
    full = m.layout.producers.index(next(lay for lay in m.layout.producers if lay.layer_type == "full_attention"))
    assert torch.equal(rank5[2 * full], kv[2 * full][:, 1:2])  # full layers: KV head 5 // 4 = 1
    assert torch.equal(rank5[0], kv[0][:, 5:6])  # sliding: head 5


# ---- plans -----------------------------------------------------------------------------------


def test_invalid_tp_names_the_degrees_that_work():
    v = get_variant("26b-a4b")
    with pytest.raises(TensorParallelError, match=r"26b-a4b cannot use TP=3: .*use one of 1, 2, 4, 8$"):
        make_plan(text_config(v, "real"), 3, v)
    v = get_variant("e4b")
    with pytest.raises(TensorParallelError, match=r"e4b cannot use TP=4: .*use one of 1, 2$"):
        make_plan(tiny("e4b").config, 4, v)
    with pytest.raises(TensorParallelError, match="TP >= 2"):
        run("e4b", 1)


def test_real_configs_plan_at_their_recipe_tp():
    for name in ("e2b", "e4b", "12b", "31b", "26b-a4b"):
        v = get_variant(name)
        config = text_config(v, "real")
        plan = make_plan(config, v.tp_degree, v)
        assert v.tp_degree in CANDIDATE_TP and tp_problems(config, v.tp_degree) == []
        if name == "31b":  # 4 global KV heads at TP=8: replicated
            assert plan.kv_modes() == {"sliding_attention": "shard", "full_attention": "replicate"}
            assert plan.describe()["attention"]["full_attention"]["kv_heads_by_rank"] == [
                [0],
                [0],
                [1],
                [1],
                [2],
                [2],
                [3],
                [3],
            ]
        if name == "26b-a4b":  # default: a 704 / 8 = 88-column slice of all 128 experts per rank
            moe = plan.describe()["moe"]
            assert (moe["split"], moe["experts_per_rank"], moe["intermediate_per_rank"]) == ("intermediate", 128, 88)
            assert moe["intermediate_by_rank"][7] == [616, 704]
            moe = make_plan(config, 8, v, expert_split="experts").describe()["moe"]
            assert (moe["split"], moe["experts_per_rank"], moe["intermediate_per_rank"]) == ("experts", 16, 704)


def test_memory_plan_counts_the_same_expert_bytes_per_rank_in_either_split():
    """The released 26B-A4B on the meta device: a rank's shard is the same size whether it holds
    16 whole experts or 1/8 of all 128, and the memory plan counts that size."""
    from gemma4lib.inf2.memory_plan import plan_core_memory, rank_weight_bytes
    from gemma4lib.inf2.params import count_params, meta_model

    v = get_variant("26b-a4b")
    lm = meta_model(v)
    sizes = {}
    for split in ("experts", "intermediate"):
        shard = shard_state_dict(lm, make_plan(lm.config, 8, v, expert_split=split), 3)
        sizes[split] = sum(t.numel() for k, t in shard.items() if k != "spmd_rank.rank")
        experts = sum(t.numel() for k, t in shard.items() if ".experts." in k)
        assert experts == count_params(lm).experts // 8
    assert sizes["experts"] == sizes["intermediate"] == rank_weight_bytes("26b-a4b", 8, dtype_bytes=1)
    assert plan_core_memory("26b-a4b", 8).fits


def test_expert_split_is_validated():
    from gemma4lib.device.experts import default_expert_split

    v = get_variant("26b-a4b")
    config = text_config(v, "real")
    with pytest.raises(TensorParallelError, match="unknown expert_split 'rows'"):
        make_plan(config, 8, v, expert_split="rows")
    with pytest.raises(
        TensorParallelError,
        match="128 experts do not split into 3 equal groups and the experts' intermediate size 704 does not split",
    ):
        make_plan(config, 3)
    # 704 = 2^6 x 11, 128 = 2^7: the default falls back to the expert split only past TP=64
    assert [default_expert_split(128, 704, t) for t in (1, 8, 64, 128, 3)] == [
        "intermediate",
        "intermediate",
        "intermediate",
        "experts",
        None,
    ]
    assert make_plan(tiny("31b").config, 8, expert_split="intermediate").expert_split is None  # dense


def test_rank_processes_end_with_the_compiled_steps_and_a_dead_rank_is_a_clear_error():
    """The ranks live as long as the compiled steps (the engine's); a rank that dies mid-run stops
    the others and raises, never hangs."""
    settings = PortSettings(
        variant="e4b", model="random", tp_degree=2, context_length=CONTEXT, prefill_buckets=(PREFILL_LEN,)
    )
    compiled = registry.compile_graphs(tiny("e4b"), settings)
    assert compiled.kv is None  # the ranks hold the K/V
    procs = list(compiled.steps.decode.world.procs)
    assert len(procs) == 2 and all(p.is_alive() for p in procs)
    del compiled
    gc.collect()
    assert not any(p.is_alive() for p in procs)
    engine = registry.compile_graphs(tiny("e4b"), settings).runtime
    world = engine.steps.decode.world
    world.procs[1].kill()
    with pytest.raises(RankProcessError, match="rank"):
        engine.generate(prompt("e4b")[:5], 2)
    assert world.closed and not any(p.is_alive() for p in world.procs)


# ---- MoE expert forms: selective (top-k gather) next to dense ---------------------------------------


def _sharded_experts(m, plan, layer: int, rank: int, form: str, baked_rank: int | None = None):
    """One rank's `ShardedExperts` of `layer` (the plan's split), filled through the sharder."""
    moe = plan.layers[layer].moe
    factory = CpuParallelFactory(plan.tp)  # identity collectives: each rank's partial sum
    hf = m.text_model.layers[layer].experts
    experts = ShardedExperts(
        moe.num_experts,
        plan.hidden,
        moe.intermediate,
        plan.tp,
        hf.act_fn,
        gate_up=factory.column(plan.hidden, moe.num_experts * 2 * moe.intermediate),
        down=factory.row(moe.num_experts * moe.intermediate, plan.hidden),
        baked_rank=baked_rank,
        form=form,
        split=moe.split,
    )
    prefix = f"model.layers.{layer}.experts."
    with torch.no_grad():
        experts.gate_up.weight.copy_(rank_tensor(plan, prefix + "gate_up_proj", hf.gate_up_proj, rank)[1])
        experts.down.weight.copy_(rank_tensor(plan, prefix + "down_proj", hf.down_proj, rank)[1])
    experts.current_rank = torch.tensor([rank], dtype=torch.int32)
    return experts


def _routes(m, tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    c = m.config
    hidden = torch.randn(tokens, c.hidden_size, generator=g)
    scores = torch.randn(tokens, c.num_experts, generator=g)
    top_k_weights, top_k_index = scores.softmax(-1).topk(c.top_k_experts, dim=-1)
    return hidden, top_k_index, top_k_weights


@pytest.mark.parametrize("split", ["experts", "intermediate"])
@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("tokens", [1, 5])  # 1: the fused gather-multiply-reduce; 5: the bmm form
def test_selective_sharded_experts_equal_dense_over_ranks(tp, tokens, split):
    m = tiny("26b-a4b")
    plan = make_plan(m.config, tp, m.variant, expert_split=split)
    layer = 1
    hidden, index, weights = _routes(m, tokens, seed=tp * 10 + tokens)
    if split == "experts":
        owners = {int(e) // plan.layers[layer].moe.experts_per_rank for e in index.reshape(-1)}
        assert len(owners) > 1, "the routes should span ranks, or masking is not exercised"
    else:  # every rank holds a slice of every routed expert: every rank adds to the sum
        owners = set(range(tp))
    with torch.no_grad():
        dense = [_sharded_experts(m, plan, layer, r, "dense")(hidden, index, weights) for r in range(tp)]
        selective = [_sharded_experts(m, plan, layer, r, "selective")(hidden, index, weights) for r in range(tp)]
        reference = StaticExperts(m.text_model.layers[layer].experts, "dense")(hidden, index, weights)
    for r in range(tp):  # each rank's partial sum, before the all-reduce, is the same in both forms
        assert selective[r].shape == (tokens, plan.hidden)
        torch.testing.assert_close(selective[r], dense[r], atol=1e-5, rtol=1e-4)
    assert sum(bool(p.abs().max() > 0) for p in selective) == len(owners)  # ranks owning no route add 0
    torch.testing.assert_close(sum(selective), sum(dense), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(sum(selective), reference, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("tokens", [1, 5])
def test_selective_sharded_experts_reproduce_the_baked_rank_bug(tokens):
    """With the rank baked in at build time, rank 1 offsets the expert ids by rank 0's: wrong, and
    wrong in exactly the way the dense form is."""
    m = tiny("26b-a4b")
    plan = make_plan(m.config, 2, m.variant, expert_split="experts")
    hidden, index, weights = _routes(m, tokens, seed=7 + tokens)
    with torch.no_grad():
        real = _sharded_experts(m, plan, 1, 1, "selective")(hidden, index, weights)
        baked = _sharded_experts(m, plan, 1, 1, "selective", baked_rank=0)(hidden, index, weights)
        baked_dense = _sharded_experts(m, plan, 1, 1, "dense", baked_rank=0)(hidden, index, weights)
    torch.testing.assert_close(baked, baked_dense, atol=1e-5, rtol=1e-4)
    assert (baked - real).abs().max() > 1e-2


def test_rank_graph_selective_decode_at_tp1_is_the_device_graph():
    """`with_shape(..., expert_form=)` gives a selective decode over the prefill graph's modules;
    each graph runs its own form."""
    m = tiny("26b-a4b")
    plan = make_plan(m.config, 1, m.variant)
    prefill = build_rank_graph(m.config, plan, GraphShape(1, PREFILL_LEN, CONTEXT))
    load_shard(prefill, shard_state_dict(m.lm, plan, 0))
    decode = with_shape(prefill, GraphShape(1, 1, CONTEXT), expert_form="selective")
    assert (prefill.expert_form, decode.expert_form) == ("dense", "selective")
    ref = DeviceGraph(
        m.text_model, m.lm_head, m.layout, GraphShape(1, 1, CONTEXT), inplace=False, expert_form="selective"
    )
    inputs = list(ref.example_inputs())
    inputs[0] = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = ref(*inputs), decode(*inputs)
    assert all(e.form == "selective" for e in decode._rank_users)
    torch.testing.assert_close(b[0], a[0], atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        prefill(*prefill.example_inputs())
    assert all(e.form == "dense" for e in prefill._rank_users)  # the shared modules follow the graph


def test_selective_decode_at_tp2_equals_reference_and_dense():
    dense = run_once("26b-a4b", 2, expert_split="experts")
    selective = run_once("26b-a4b", 2, decode_experts="selective", expert_split="experts")
    assert selective.details["decode_experts"] == "selective" and dense.details["decode_experts"] == "dense"
    assert_exact("26b-a4b", selective)
    assert selective.tokens == dense.tokens
    read = selective.details["tp_plan"]["moe"]["weights_read_per_rank_per_layer"]
    assert read["dense"]["experts"] == 8 and read["selective_per_token"]["experts"] == 4
    assert read["dense"]["params"] == 2 * read["selective_per_token"]["params"] == 8 * 3 * 32 * 64


def test_selective_decode_with_baked_rank_is_wrong():
    """The host prefills (right), so every wrong token comes from the baked-rank selective decode."""
    real = run_once("26b-a4b", 2, decode_experts="selective", prefill="cpu-seeded", expert_split="experts")
    baked = run_once("26b-a4b", 2, decode_experts="selective", prefill="cpu-seeded", baked_rank=True)
    assert_exact("26b-a4b", real)
    assert not matches_reference("26b-a4b", baked) and baked.details["ranks_agree"]
    assert checks.first_mismatch(baked.tokens, reference("26b-a4b", prompt("26b-a4b"))) >= 1  # token 0: the host's
    baked_dense = run_once("26b-a4b", 2, prefill="cpu-seeded", baked_rank=True)
    assert baked.tokens == baked_dense.tokens  # the same wrong answer as the dense form's
