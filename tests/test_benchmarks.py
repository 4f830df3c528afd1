"""The benchmark suite's JSON (README, "Speed") and the roofline arithmetic. No timing asserted."""

from __future__ import annotations

import json
import math

import pytest
import torch

from gemma4lab.benchmarks.paths import PATHS
from gemma4lab.benchmarks.report import format_report
from gemma4lab.benchmarks.suite import SuiteOptions, run_suite
from gemma4lab.benchmarks.targets import check_targets
from gemma4lab.inf2 import bandwidth, roofline
from gemma4lab.models.medium import MEDIUM, get_medium, medium_config
from gemma4lab.tools import inf2_tables
from gemma4lib.inf2 import params

NUMBER = (int, float)


@pytest.fixture(scope="module")
def quick_report():
    # the --quick suite on two tiny variants (dense, MoE), graphs run uncompiled: the schema in seconds
    options = SuiteOptions.quick(
        tiny_variants=("31b", "26b-a4b"), backend="eager", iters=1, bandwidth_mb=64, tiny_new_tokens=8
    )
    report = run_suite("cpu", quick=True, options=options)
    return json.loads(json.dumps(report, default=str))  # what `bench --json` prints


def test_quick_report_schema(quick_report):
    r = quick_report
    assert r["suite"] == "cpu" and r["quick"] is True and r["schema_version"] == 1
    assert r["threads"] == torch.get_num_threads() and r["options"]["iters"] == 1
    assert {"versions", "machine", "bandwidth", "models", "targets", "recommendation", "wall_s"} <= set(r)
    assert {"gemv_gb_s", "stream_gb_s", "bandwidth_bytes_s"} <= set(r["bandwidth"])
    assert [m["name"] for m in r["models"]] == ["31b", "26b-a4b"]
    for m in r["models"]:
        assert set(m["paths"]) == set(PATHS)
        ours, eager, compiled = (m["paths"][p] for p in PATHS)
        assert ours["status"] == "ok" and ours["compiler"] == "eager"
        assert ours["tokens_match_reference"] is True and eager["tokens_match_reference"] is True
        for path in (ours, eager):
            assert isinstance(path["decode_tok_s"], NUMBER) and path["decode_tok_s"] > 0
            assert len(path["decode_tok_s_runs"]) == 1  # warm-up excluded
        assert isinstance(ours["prefill_ms"], NUMBER)
        assert compiled["status"] == "skipped" and compiled["reason"]
        assert m["speedup_vs_hf_eager"]["hf_eager"] == pytest.approx(1.0)
        assert m["speedup_vs_hf_eager"]["hf_static_compile"] is None
        b = m["bytes_per_step"]
        assert b["total"] == pytest.approx(b["weights"] + b["kv"]) and b["kv"] > 0
        assert m["ceiling_tok_s"] == pytest.approx(m["bandwidth"]["gb_s"] * 1e9 / b["total"])
        assert m["roofline_fraction"]["gemma4lib"] == pytest.approx(ours["decode_tok_s"] / m["ceiling_tok_s"])
    moe = r["models"][1]
    assert moe["decode_experts"] == "selective" and moe["bytes_per_step"]["experts_form"] == "selective"
    names = [t["target"] for t in r["targets"]]
    assert any(n.startswith("31b tiny") for n in names)
    assert all(set(t) == {"target", "value", "threshold", "met"} for t in r["targets"])


def test_report_rows_feed_the_notebook_plot(quick_report):
    from gemma4lab.notebook import plots

    rows = inf2_tables.rows_from_report(quick_report)
    assert [r["label"] for r in rows] == ["31b", "26b-a4b"]
    assert all(r["measured_tok_s"] > 0 and r["ceiling_tok_s"] > 0 for r in rows)
    ax = plots.measured_vs_ceiling(rows).axes[0]
    assert len(ax.patches) == 2 * len(rows)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["31b", "26b-a4b"]


def test_format_report_renders_every_model(quick_report):
    text = format_report(quick_report)
    assert "| 31b |" in text and "| 26b-a4b |" in text and "| target |" in text


def test_check_targets_reads_the_right_figures():
    report = {
        "models": [
            {"name": "e2b", "speedup_vs_hf_eager": {"gemma4lib": 6.0}, "roofline_fraction": {}},
            {
                "name": "medium-dense",
                "speedup_vs_hf_eager": {"gemma4lib": 1.1},
                "roofline_fraction": {"gemma4lib": 0.86},
            },
        ],
        "ring_kv": {"ring_tok_s_4096_over_512": 0.89, "full_tok_s_4096_over_512": 0.7},
        "experts": {"selective_over_dense_decode": None},
    }
    met = {t["target"]: t["met"] for t in check_targets(report)}
    assert met == {
        "e2b tiny: gemma4lib decode / HF eager >= 5": True,
        "medium-dense: gemma4lib decode / HF eager >= 1.15": False,
        "medium-dense: roofline_fraction >= 0.85": True,
        "medium-dense: ring_tok_s_4096_over_512 >= 0.9": False,
        "medium-moe: selective / dense decode >= 2": None,
    }


def test_unknown_suite_is_a_clear_error():
    with pytest.raises(ValueError, match="benchmark suite"):
        run_suite("gpu")


# ---- medium configs ----------------------------------------------------------------------------
def _meta_counts(name: str) -> params.ParamCounts:
    from gemma4lib.models.loading import _text_classes

    _, lm_cls = _text_classes(get_medium(name).variant)
    with torch.device("meta"):
        return params.count_params(lm_cls(medium_config(name)))


def test_medium_configs_have_the_promised_shape():
    dense = _meta_counts("medium-dense")
    assert 200e6 <= dense.total <= 300e6 and dense.experts == 0
    config = medium_config("medium-dense")
    types = list(config.layer_types)
    assert types.count("sliding_attention") >= 4 * types.count("full_attention") > 0
    moe = _meta_counts("medium-moe")
    assert moe.num_experts >= 32 and moe.experts > 0.7 * moe.total
    assert set(MEDIUM) == {"medium-dense", "medium-moe"}


# ---- roofline ------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant,gb", [("e2b", 4.6), ("e4b", 9.4), ("12b", 23.8), ("31b", 61.4), ("26b-a4b", 50.5)])
def test_bf16_weight_bytes_match_design_table(variant, gb):
    # bf16 weights read per token (PLE table on the host): docs/ROOFLINE.md, "inf2: bytes per token"
    steps = roofline.decode_bytes(variant, context_length=2048, ring=True)
    assert steps.weights / 1e9 == pytest.approx(gb, rel=0.015)


def test_selective_experts_read_only_the_routed_ones():
    dense = roofline.decode_bytes("26b-a4b", context_length=2048, experts="dense")
    selective = roofline.decode_bytes("26b-a4b", context_length=2048, experts="selective")
    assert selective.weights / 1e9 == pytest.approx(7.6, rel=0.015)  # docs/ROOFLINE.md
    assert dense.weights / selective.weights > 6


def test_selective_experts_on_expert_parallel_ranks_read_k_per_rank():
    counts = params.count_params(params.meta_model("26b-a4b"))  # 128 experts, top-8
    shared = counts.lm_head + counts.other
    # expert split at TP=8: 16 whole experts per rank, each rank gathers 8 slices whether routed
    # there or not: 64 of 128
    assert roofline.device_params(counts, "selective", tp=8, expert_split="experts") - shared == pytest.approx(
        counts.experts * 64 / 128
    )
    assert roofline.device_params(counts, "selective", tp=1) - shared == pytest.approx(counts.experts * 8 / 128)
    # TP=16: 8 experts per rank and 8 gathered: as many bytes as dense (selective stops paying off)
    assert roofline.device_params(counts, "selective", tp=16, expert_split="experts") == pytest.approx(
        roofline.device_params(counts, "dense")
    )
    row = roofline.compare(
        None,
        "26b-a4b",
        device="inf2.24xlarge",
        cores=8,
        context_length=2048,
        experts="selective",
        expert_split="experts",
    )
    assert row["bytes_per_step"]["weights"] == pytest.approx(
        roofline.device_params(counts, "selective", tp=8, expert_split="experts") * 2
    )


def test_selective_experts_on_intermediate_split_ranks_read_k_in_total():
    """Each rank a 1/8 slice of every expert (704 / 8 = 88 columns): its 8 gathered slices are its
    share of the 8 routed experts, so the ranks together read 8 of 128, as one device would."""
    counts = params.count_params(params.meta_model("26b-a4b"))
    shared = counts.lm_head + counts.other
    assert counts.moe_intermediate == 704 and roofline.plan_split(counts, 8) == "intermediate"
    for tp in (2, 8, 16):
        assert roofline.device_params(counts, "selective", tp=tp) == pytest.approx(
            roofline.device_params(counts, "selective")
        )
        assert roofline.device_params(
            counts, "selective", tp=tp, expert_split="intermediate"
        ) - shared == pytest.approx(counts.experts * 8 / 128)
    assert roofline.device_params(counts, "dense", tp=8) == roofline.device_params(
        counts, "dense", tp=8, expert_split="experts"
    )
    with pytest.raises(ValueError, match="expert_split"):
        roofline.device_params(counts, "selective", tp=8, expert_split="rows")
    steps = roofline.decode_bytes("26b-a4b", context_length=2048, experts="selective", tp=8)
    assert steps.expert_split == "intermediate" and steps.weights / 1e9 == pytest.approx(7.65, rel=0.01)
    row = roofline.compare(
        None, "26b-a4b", device="inf2.24xlarge", cores=8, context_length=2048, experts="selective"
    )  # the plan's default split
    assert row["bytes_per_step"]["expert_split"] == "intermediate"
    # the recipe's ceiling on inf2.24xlarge at TP=8 (8 cores x 410 GiB/s): ~450 tok/s, was ~126
    assert 430 < row["ceiling_tok_s"] < 460
    assert roofline.decode_bytes("e2b", context_length=512).expert_split is None


def test_ring_kv_bytes_stay_flat_with_context():
    ring = [roofline.decode_bytes("31b", context_length=c, ring=True).kv for c in (2048, 8192)]
    full = [roofline.decode_bytes("31b", context_length=c, ring=False).kv for c in (2048, 8192)]
    assert full[1] == pytest.approx(4 * full[0])
    assert ring[1] < 2 * ring[0] and ring[1] < full[1] / 3
    # full-attention layers still grow with context; only the sliding ones stay at the window
    assert ring[1] > ring[0]


def test_inf2_ceiling_and_compare():
    inst = roofline.INSTANCES["inf2.xlarge"]
    assert inst.hbm_bytes_s == 820 * 2**30 and inst.bandwidth_bytes_s(1) == inst.hbm_bytes_s / 2
    row = roofline.compare(30.0, "e2b", device="inf2.xlarge", cores=1, context_length=2048)
    expected = inst.hbm_bytes_s / 2 / row["bytes_per_step"]["total"]
    assert row["ceiling_tok_s"] == pytest.approx(expected)
    assert row["roofline_fraction"] == pytest.approx(30.0 / expected)
    cpu = roofline.compare(10.0, "e2b", device="cpu", bandwidth_bytes_s=20e9, context_length=512)
    assert cpu["ceiling_tok_s"] == pytest.approx(20e9 / cpu["bytes_per_step"]["total"])
    with pytest.raises(ValueError, match="unknown device"):
        roofline.compare(1.0, "e2b", device="trn1.2xlarge", bandwidth_bytes_s=1.0)
    with pytest.raises(ValueError, match="needs bandwidth_bytes_s: measure it with gemma4lab.inf2.bandwidth"):
        roofline.compare(1.0, "e2b", device="cpu")  # the library measures no CPU: the lab does


def test_inf2_table_covers_every_variant_and_form():
    rows = inf2_tables.inf2_table(contexts=(2048,))
    assert {r["variant"] for r in rows} == {"e2b", "e4b", "12b", "31b", "26b-a4b"}
    moe = [r for r in rows if r["variant"] == "26b-a4b"]
    assert {(r["kv"], r["experts"]) for r in moe} == {
        ("full", "dense"),
        ("full", "selective"),
        ("ring", "dense"),
        ("ring", "selective"),
    }
    e2b = next(r for r in rows if r["variant"] == "e2b")
    assert (
        e2b["fits_hbm"]["inf2.xlarge"] and not next(r for r in rows if r["variant"] == "31b")["fits_hbm"]["inf2.xlarge"]
    )
    assert all(math.isfinite(v) for r in rows for v in r["ceiling_tok_s"].values())
    text = inf2_tables.format_inf2_table(rows)
    assert text.count("\n") == len(rows) + 1
    # the MoE selective rows: the recipe's split (intermediate) first, the expert split to compare
    ring = [r for r in moe if r["kv"] == "ring" and r["experts"] == "selective"]
    assert [r["expert_split"] for r in ring] == ["intermediate", "experts"]
    assert ring[0]["recipe_gb"] == pytest.approx(ring[0]["total_gb"])  # k experts in total
    assert ring[1]["recipe_gb"] > 3 * ring[0]["recipe_gb"]  # tp x k slices
    assert 430 < ring[0]["recipe_ceiling_tok_s"] < 460 and 120 < ring[1]["recipe_ceiling_tok_s"] < 130
    assert "selective (intermediate split)" in text and "selective (expert split)" in text


def test_measure_bandwidth_reports_both_methods():
    bw = bandwidth.measure_bandwidth(size_mb=32, repeats=2)
    assert bw["gemv_gb_s"] > 0 and bw["stream_gb_s"] > 0
    assert bw["bandwidth_bytes_s"] == pytest.approx(max(bw["gemv_gb_s"], bw["stream_gb_s"]) * 1e9)
    assert bw["threads"] == 1


def test_recommendation_is_what_a_port_runs_by_default(quick_report):
    # the suite states PortSettings' defaults (read from them), and its models ran with them
    from gemma4lib.device.build import PREFILL_EXPERTS
    from gemma4lib.settings import PortSettings

    settings = PortSettings(variant="26b-a4b")
    assert quick_report["recommendation"] == {
        "ring_kv": settings.ring_kv,
        "decode_experts": settings.decode_experts,
        "prefill_experts": PREFILL_EXPERTS,
    }
    assert all(m["ring_kv"] is settings.ring_kv for m in quick_report["models"])
    moe = next(m for m in quick_report["models"] if m["name"] == "26b-a4b")
    assert moe["decode_experts"] == settings.decode_experts


def test_experts_choice_is_the_measured_winner():
    # dense vs selective on a tiny MoE (graphs eager): the report names the faster form, and renders it so
    from gemma4lab.benchmarks.fixes import bench_experts
    from gemma4lab.benchmarks.graphs import GraphFactory
    from gemma4lab.benchmarks.suite import load_bench_model
    from gemma4lib.reference import random_prompt
    from gemma4lib.settings import PortSettings

    model = load_bench_model("26b-a4b")
    prompt = random_prompt(model.config.vocab_size, 12, 3)
    experts = bench_experts(
        model,
        GraphFactory(model, "eager"),
        context_length=64,
        bucket=16,
        prompt=prompt,
        new_tokens=4,
        warmup=0,
        iters=1,
    )
    decode, prefill, choice = experts["decode"], experts["prefill"], experts["recommendation"]
    assert choice["decode"] == max(decode, key=lambda form: decode[form]["decode_tok_s"])
    assert choice["prefill"] == min(prefill, key=lambda form: prefill[form]["prefill_ms"])
    assert choice["port_settings_default_decode"] == PortSettings(variant="26b-a4b").decode_experts
    assert all(row["tokens_match_reference"] for row in decode.values())
    text = format_report({"experts": {"model": "26b-a4b", **experts}})
    assert f"measured choice: prefill {choice['prefill']}, decode {choice['decode']}" in text


def test_importing_port_does_not_load_the_benchmarks():
    # port times its runs with gemma4lib.timing; the benchmarks package (whose suite imports port) sits above it
    import subprocess
    import sys

    code = (
        "import sys, gemma4lib.port, gemma4lib.timing; "
        "assert not [m for m in sys.modules if m.startswith('gemma4lab.benchmarks')], sorted(sys.modules); "
        "from gemma4lab.benchmarks.suite import run_suite; assert 'gemma4lib.port' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_tempered_random_attention_is_numerically_stable():
    # a narrow medium-dense: same head sizes (128 sliding, 256 global) and attention scaling 1.0
    import copy

    from gemma4lab.models.medium import temper_attention
    from gemma4lib.models.loading import build_tiny

    spec = get_medium("medium-dense")
    overrides = dict(
        spec.overrides,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=12,
        layer_types=spec.overrides["layer_types"][:12],
        vocab_size=512,
    )
    model = build_tiny(spec.variant, seed=1, **overrides)  # untempered: fp32 and fp64 logits differ by ~1.0
    assert temper_attention(model.text_model) == 2 * 12
    q_norm = model.text_model.layers[0].self_attn.q_norm.weight
    assert torch.allclose(q_norm, torch.full_like(q_norm, q_norm.numel() ** -0.25))
    ids = torch.randint(0, 512, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        single = model.lm(ids).logits[0]
        double = copy.deepcopy(model.lm).double()(ids).logits[0].float()
    assert (single - double).abs().max() < 1e-4  # tempered: ~6e-6


def test_mtp_section_runs_and_feeds_the_judge():
    """The suite's mtp section end to end on the uncompiled graphs (seconds): each row's figures come
    from one drafted run, its tokens equal the plain reference and transformers' assisted generate,
    and the papermill judge reads the row as an `mtp:<variant>` subject."""
    from gemma4lab.benchmarks.mtp import bench_mtp
    from papermill_runs import bench as bench_judge

    section = bench_mtp(("e2b",), backend="eager", warmup=0, iters=1, new_tokens=8)
    (row,) = section["rows"]
    assert row["variant"] == "e2b" and row["draft_tokens"] == 4
    assert row["tokens_equal_reference"] is True and row["hf_assisted_match"] is True
    assert row["accepted_per_step"] > 1 and row["bench_accepted_per_step"] >= 1
    with_draft, without = row["decode_tok_s_with_draft"], row["decode_tok_s_without_draft"]
    assert with_draft > 0 and without > 0 and row["speedup_with_draft"] == pytest.approx(with_draft / without)
    computed = {r["variant"]: r for r in section["inf2_computed"]}
    assert computed["e2b"]["accepted_per_step"] == row["bench_accepted_per_step"]
    assert computed["e2b"]["status"] == section["inf2_status"] and "computed_speedup" in computed["e2b"]
    subject = bench_judge.figures({"models": [], "mtp": section})["mtp:e2b"]
    assert subject["metrics"]["speedup_with_draft"] == row["speedup_with_draft"]
    assert subject["checks"] == {"tokens_match_reference": True, "hf_assisted_match": True}


def test_batch_section_rows_equal_their_references_and_hf():
    """The suite's batch section on a tiny MoE, graphs uncompiled (seconds): every row of the engine's
    batch equals its own batch-1 reference and HF's batched generate; each figure comes with its bytes."""
    from gemma4lab.benchmarks.batch import bench_batch_model
    from gemma4lab.benchmarks.suite import load_bench_model

    model = load_bench_model("26b-a4b")
    section = bench_batch_model(
        "26b-a4b",
        model,
        backend="eager",
        batch_sizes=(1, 4),
        context_length=64,
        bucket=16,
        prompt_tokens=12,
        new_tokens=6,
        warmup=0,
        iters=1,
        bandwidth_mb=32,
    )
    assert section["tokens_match_reference"] is True and section["decode_experts"] == "selective"
    assert [r["batch"] for r in section["rows"]] == [1, 4]
    for row in section["rows"]:
        assert row["rows_match_reference"] == [True] * row["batch"] == row["rows_equal_hf"]
        assert len(set(row["prompt_lengths"])) == row["batch"]  # different lengths per row
        assert row["gemma4lib_tok_s"] > 0 and row["hf_eager_tok_s"] > 0 and row["bytes_per_step_gb"] > 0
        assert row["experts_read"] == (
            "selective" if row["batch"] == 1 else "grouped"
        )  # from B x k = E (16 experts, top-4) a CPU graph reads each expert once


def test_context_section_reads_fewer_bytes_in_its_buckets_and_equals_hf():
    """The suite's context section in a tiny form (the 31B's tiny k_eq_v model, contexts 32 / 64 / 128,
    graphs uncompiled: about a second): every decode step runs the bucket of its context and reads
    fewer K/V bytes than the whole context, the bytes grow linearly in the slots of the full-length
    buffers only (the rings are read whole at every bucket), the ratios are the figures' own, and the
    long prompt's first token equals HF's sdpa forward in both deployments."""
    options = SuiteOptions.quick(
        sections=("context",),
        backend="eager",
        warmup=0,
        medium_iters=1,
        bandwidth_mb=32,
        context_model="31b",
        context_lengths=(32, 64, 128),
        context_fill_limit=64,
        context_prefill_bucket=16,
        context_steps=4,
    )
    report = json.loads(json.dumps(run_suite("cpu", quick=True, options=options), default=str))
    section = report["context"]
    rows = {r["context"]: r for r in section["rows"]}
    assert section["context_length"] == 128 and section["context_buckets"] == [32, 64]
    assert [rows[c]["graph"] for c in (32, 64, 128)] == ["decode@32", "decode@64", "decode"]
    assert [rows[c]["filled"] for c in (32, 64, 128)] == [True, True, False] and rows[128]["fill_s_computed"] > 0
    assert rows[64]["chunks"] == math.ceil(60 / 16) and all(
        r["prompt_tokens"] == r["context"] - 4 for r in rows.values()
    )
    weights = {r["bytes"]["weights"] for r in rows.values()}
    assert len(weights) == 1
    kv = {c: rows[c]["bytes"]["kv"] for c in rows}
    assert kv[32] < kv[64] < kv[128] == section["kv_buffer_bytes"]
    assert kv[128] - kv[64] == 2 * (kv[64] - kv[32]) > 0  # only the full-length buffers' slots grow
    whole = rows[64]["whole_context"]
    assert whole["graph"] == "decode" and whole["bytes"]["kv"] == kv[128] > kv[64]
    assert rows[64]["bucket_speedup"] == pytest.approx(whole["step_s"] / rows[64]["step_s"])
    gb_s = section["bandwidth_used_gb_s"]
    for row in [*rows.values(), whole]:
        assert row["bytes"]["total"] == pytest.approx(row["bytes"]["weights"] + row["bytes"]["kv"])
        assert row["bytes_bound_s"] == pytest.approx(row["bytes"]["total"] / (gb_s * 1e9))
        assert row["over_bytes_bound"] == pytest.approx(row["step_s"] / row["bytes_bound_s"]) and row["step_s"] > 0
    assert section["max_over_bytes_bound"] == max(r["over_bytes_bound"] for r in rows.values())
    ttft = section["ttft"]
    assert ttft["prompt_tokens"] == 60 and [o["deployment_context"] for o in ttft["ours"]] == [128, 64]
    for ours in ttft["ours"]:
        assert ours["first_token"] == ttft["hf"]["first_token"] and ours["first_token_equal_hf"] is True
        assert ours["chunks"] == 4 and ours["ttft_hf_over_ours"] == pytest.approx(ttft["hf"]["ttft_s"] / ours["ttft_s"])
    met = {t["target"]: t for t in report["targets"]}
    assert (
        met["31b: decode step / bytes-bound time <= 1.2 at every context"]["value"] == section["max_over_bytes_bound"]
    )
