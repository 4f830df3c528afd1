"""The vision part in the inf2 plans, the image prefill floor and the bench's images section.

Counts are checked against hand formulas from the configs; the bench section's shape is checked on a
tiny eager run (its timings are never asserted)."""

from __future__ import annotations

import json

import pytest

from gemma4lab.inf2.image_prefill import image_prefill_estimate, vision_flops
from gemma4lab.inf2.plans import core_summary
from gemma4lab.tools.inf2_tables import format_plan_table
from gemma4lib.inf2.hardware import BF16_FLOPS_PER_CORE, GB, GIB
from gemma4lib.inf2.memory_plan import plan_core_memory
from gemma4lib.inf2.serving_host import serving_host_plan
from gemma4lib.inf2.vision_plan import PLACEMENT, vision_config, vision_plan, vision_spec


def encoder_hand_count(c, text_hidden: int) -> int:
    """Gemma4VisionModel + Gemma4MultimodalEmbedder parameters from the config alone."""
    h, i, d = c.hidden_size, c.intermediate_size, c.head_dim
    attention = h * c.num_attention_heads * d + 2 * h * c.num_key_value_heads * d + c.num_attention_heads * d * h
    layer = attention + 2 * d + 3 * h * i + 4 * h  # q/k norms, gated MLP, four RMSNorms
    patch = 3 * c.patch_size**2 * h + 2 * c.position_embedding_size * h
    standardize = 0  # std_bias / std_scale are buffers
    return patch + c.num_hidden_layers * layer + standardize + h * text_hidden  # embedder: its norm has no scale


def test_vision_params_on_the_meta_device_equal_the_hand_count():
    spec = vision_spec("e2b")
    assert spec.text_hidden == 1536 and spec.patches == 280 * 9 and spec.soft_tokens == 280
    assert vision_plan("e2b").params == encoder_hand_count(spec.config, 1536) == 168_544_256
    # 31B: the same default tower, a wider embedder into 5,376
    assert vision_plan("31b").params - vision_plan("e2b").params == 768 * (5376 - 1536)


def test_the_12b_unified_projection_hand_count():
    c = vision_config("12b")
    patch_dim = 3 * (c.patch_size * c.pooling_kernel_size) ** 2
    assert patch_dim == 6912
    mm = c.mm_embed_dim
    hand = 2 * patch_dim + patch_dim * mm + mm + 2 * mm + c.mm_posemb_size * 2 * mm + 2 * mm + mm * 3840
    assert vision_plan("12b").params == hand
    assert vision_spec("12b").patches == vision_spec("12b").soft_tokens == 280


def test_reported_31b_tower_matches_the_third_party_count():
    plan = vision_plan("31b", "reported")
    # the extraction's "_verified_total_params" counts every saved tensor: with standardize on, the
    # std_bias and std_scale buffers (1,152 each) too
    assert plan.tower_params + 2 * 1152 == 569_550_384
    assert plan.layers == 27 and "unverified" in plan.source


@pytest.mark.parametrize(("variant", "tp"), [("e2b", 1), ("31b", 8), ("12b", 2)])
def test_plan_total_grows_by_exactly_the_vision_bytes(variant, tp):
    without = plan_core_memory(variant, tp)
    with_vision = plan_core_memory(variant, tp, vision=True)
    part = vision_plan(variant)
    grown = with_vision.total_gib - without.total_gib
    assert grown == pytest.approx(part.weights_gib + part.activations_gib, abs=1e-12)
    assert with_vision.weights_gib == without.weights_gib  # the decoder's shard is unchanged: vision is not sharded
    assert with_vision.vision_placement == PLACEMENT and "no TP" in core_summary(with_vision)
    assert part.activations_gib > 0 and part.weights_gib > 0
    assert without.vision_gib == 0 and "vision" not in format_plan_table([without])
    assert "vision (rank 0's core)" in format_plan_table([with_vision])


def test_vision_weights_are_bf16_of_params_and_buffers():
    part = vision_plan("e4b")
    assert part.weights_gib * GIB == (part.params + 32) * 2  # 32: the encoder's two RoPE frequency buffers


def test_the_vision_part_can_tip_a_plan_over_a_core():
    """Some context where E4B at TP=1 fits a core without the vision part and not with it (found by
    bisection on full-length K/V); the refusal then names the vision part."""
    low, high = 2048, 262144  # fits plain at low; not even plain at high
    assert plan_core_memory("e4b", 1, context_length=low, ring=False).fits
    assert not plan_core_memory("e4b", 1, context_length=high, ring=False).fits
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if plan_core_memory("e4b", 1, context_length=mid, ring=False).fits else (low, mid)
    with_vision = plan_core_memory("e4b", 1, context_length=low, ring=False, vision=True)
    assert plan_core_memory("e4b", 1, context_length=low, ring=False).fits and not with_vision.fits
    assert "vision weights and activations" in "; ".join(with_vision.problems)


def test_serving_host_holds_the_vision_weights_too():
    plain, with_vision = serving_host_plan("e2b"), serving_host_plan("e2b", vision=True)
    assert with_vision.model_gb - plain.model_gb == pytest.approx(vision_plan("e2b").weights_gib * GIB / GB)
    assert with_vision.vision_gb > 0 and "vision" in with_vision.summary()


def test_vision_flops_of_a_toy_config_equal_the_hand_computation():
    from gemma4lib.models.vision import vision_configs

    c = vision_configs("e2b", 64)  # the tiny fixtures' tower: width 64, 2 layers of 2 heads of 32, MLP 128
    patches, soft, text = 64, 16, 96
    per_patch = 48 * 64 + 2 * (4 * 64 * 64 + 3 * 64 * 128)  # patch projection + each layer's q, k, v, o and MLP
    hand = 2 * patches * per_patch + 4 * patches**2 * 2 * 32 * 2 + 2 * patches * soft * 64 + 2 * soft * 64 * text
    assert hand == 13_303_808
    assert vision_flops(c, text, patches, soft) == hand


def test_unified_flops_are_its_two_projections():
    c = vision_config("12b", patch_size=4, pooling_kernel_size=2, mm_embed_dim=64, mm_posemb_size=64)
    c.output_proj_dims = 64
    assert vision_flops(c, 96, 16, 16) == 2 * 16 * (192 * 64 + 64 * 96)


def test_image_prefill_estimate_adds_the_vision_graph_on_one_core_and_the_soft_tokens():
    e = image_prefill_estimate("e4b")
    spec = vision_spec("e4b")
    assert e.vision_compute_ms == pytest.approx(e.vision_flops / BF16_FLOPS_PER_CORE * 1e3)  # one core, not TP=2
    assert e.tp == 2 and e.added_tokens == spec.soft_tokens + 2
    assert e.image_prefill_ms > e.text_prefill_ms
    assert e.total_ms == pytest.approx(e.vision_ms + e.image_prefill_ms)
    assert e.to_dict()["placement"] == "one NeuronCore, no TP" and "unverified" in e.source


def test_doctor_plans_the_vision_part_and_the_lab_prints_the_family(capsys):
    """`doctor --variant V --vision` counts V's vision part in its plan; the family's vision tables
    and image prefill floor are the lab's `plan` command (`inf2_tables.family_report`), text and JSON."""
    from gemma4lab.cli import main as lab_main
    from gemma4lab.tools.doctor import run_doctor
    from gemma4lab.tools.inf2_tables import family_report, format_family

    assert run_doctor(variant="e2b", vision=True)["plan"]["vision_gib"] == pytest.approx(vision_plan("e2b").total_gib)
    assert lab_main(["doctor", "--variant", "e2b", "--vision", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["plan"]["vision_gib"] > 0 and "vision" not in printed
    report = family_report()
    vision = report["vision"]
    assert vision["placement"] == PLACEMENT and "unverified" in vision["source"]
    assert [p["variant"] for p in vision["parts"]] == ["e2b", "e4b", "12b", "31b", "26b-a4b"]
    assert all(p["vision_gib"] > 0 for p in vision["plans"])
    assert len(vision["image_prefill"]) == 5
    text = format_family(report)
    assert "vision part per variant" in text and "image prefill floor" in text and "no TP" in text
    assert lab_main(["plan", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["vision"]["table"] == vision["table"]


def test_the_bench_images_section_shape_on_a_tiny_eager_run():
    from gemma4lab.benchmarks.images import bench_images
    from gemma4lab.benchmarks.suite import SECTIONS, SuiteOptions

    assert "images" in SECTIONS and SuiteOptions().image_variants == ("e2b",)
    report = bench_images(backend="eager", warmup=0, iters=1)
    row = report["rows"][0]
    assert row["variant"] == "e2b" and row["model_source"] == "tiny-trained-vision" and row["soft_tokens"] == [16]
    for part in ("vision", "image_prefill"):
        assert row[part]["gemma4lib_ms"] > 0 and row[part]["hf_eager_ms"] > 0
        assert row[part]["speedup_over_hf"] == pytest.approx(row[part]["hf_eager_ms"] / row[part]["gemma4lib_ms"])
        assert row[part]["max_abs_diff"] < 1e-4  # the same modules on the same pixels: ours equals HF's
        assert len(row[part]["gemma4lib_ms_runs"]) == 1
    assert row["first_token_equal"]
    assert report["vision_speedup_over_hf"]["e2b"] == row["vision"]["speedup_over_hf"]
    assert len(report["inf2_computed"]) == 5 and "unverified" in report["inf2_source"]
    json.dumps(report)  # the bench JSON
