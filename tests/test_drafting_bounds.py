"""The mtp section's drafting bounds and prompt lookup (`benchmarks.drafting`) on a tiny random model,
graphs uncompiled (seconds): the oracle drafter has every draft accepted, the always-wrong one none,
both stay greedy-exact, prompt lookup stays exact, and the section's headline keys carry one figure
per model and k. Timings are recorded, never asserted."""

from __future__ import annotations

import pytest

from gemma4lab.benchmarks.drafting import bench_bounds, bench_prompt_lookup, summary_keys
from gemma4lab.benchmarks.suite import SuiteOptions, drafting_where_bytes_decide, load_bench_model
from gemma4lib.reference import random_prompt, reference_greedy

KS = (1, 3)
NEW = 8


@pytest.fixture(scope="module")
def tiny():
    model = load_bench_model("31b")
    return model, random_prompt(model.config.vocab_size, 12, 5)


@pytest.fixture(scope="module")
def bounds(tiny):
    model, prompt = tiny
    return bench_bounds(
        "31b", model, prompt, backend="eager", draft_tokens=KS, context_length=64, new_tokens=NEW, warmup=0, iters=1
    )


def test_oracle_accepts_every_draft_and_always_wrong_none(bounds):
    assert bounds["plain_equal_reference"] is True and bounds["tokens_exact"] is True
    assert [r["draft_tokens"] for r in bounds["rows"]] == list(KS)
    for row in bounds["rows"]:
        k, oracle, wrong = row["draft_tokens"], row["oracle"], row["always_wrong"]
        assert oracle["tokens_equal_plain"] and wrong["tokens_equal_plain"]
        # every verify proposes k drafts (fewer only where the budget ends) and the oracle keeps them all
        assert oracle["drafts_proposed"][0] == k and oracle["drafts_accepted"] == oracle["drafts_proposed"]
        assert sum(oracle["drafts_proposed"]) + len(oracle["drafts_proposed"]) == NEW - 1
        # the always-wrong drafter proposes every round (but the last, one token from the budget's end)
        # and loses every draft: one token per verify
        assert all(n > 0 for n in wrong["drafts_proposed"][:-1]) and wrong["drafts_proposed"][-1] == 0
        assert set(wrong["drafts_accepted"]) == {0}
        assert wrong["accepted_per_verify"] == 1.0 and len(wrong["drafts_proposed"]) == NEW - 1
        assert oracle["accepted_per_verify"] > 1.0
        assert row["ms_per_verify"] > 0 and row["ms_per_step"] > 0
        assert row["verify_over_step"] == pytest.approx(row["ms_per_verify"] / row["ms_per_step"])


def test_prompt_lookup_finds_repeats_and_stays_exact():
    # the tiny random 12b's greedy tokens repeat themselves (53, 53, 105, 105, ...): lookup has matches
    model = load_bench_model("12b")
    prompt = random_prompt(model.config.vocab_size, 12, 5)
    assert len(set(reference_greedy(model.lm, prompt, 6))) < 6
    section = bench_prompt_lookup(
        "12b",
        model,
        {"repeat": prompt},
        backend="eager",
        draft_tokens=(3,),
        context_length=64,
        bucket=32,
        new_tokens=NEW,
        warmup=0,
        iters=1,
    )
    (row,) = section["rows"]
    assert section["tokens_exact"] and row["tokens_equal_reference"] and row["plain_equal_reference"]
    assert sum(row["drafts_proposed"]) > 0
    assert row["speedup"] > 0 and row["ms_per_verify"] > 0


def test_the_section_carries_the_headline_keys_per_model_and_k(bounds):
    lookup = {"model": "m", "rows": [{"draft_tokens": 4, "speedup": 2.0, "accepted_per_verify": 3.0}] * 2}
    keys = summary_keys([bounds], [lookup])
    for key in ("verify_over_step", "oracle_speedup", "always_wrong_speedup"):
        assert set(keys[key]["31b"]) == {"1", "3"} and all(v > 0 for v in keys[key]["31b"].values())
    assert keys["oracle_speedup"]["31b"]["3"] == bounds["rows"][1]["oracle"]["speedup"]
    assert keys["prompt_lookup_speedup"] == {"m": {"4": pytest.approx(2.0)}}


def test_the_suite_section_reports_a_missing_real_model_instead_of_a_figure(monkeypatch):
    from gemma4lab.benchmarks import suite

    monkeypatch.setattr(suite, "load_real_model", lambda name: f"{name} is not installed")
    options = SuiteOptions(
        mtp_bound_models=("31b",), mtp_bound_draft_tokens=(2,), mtp_bound_context=64, mtp_bound_new_tokens=6,
        backend="eager", warmup=0, medium_iters=1, tiny_prompt_tokens=12,
    )  # fmt: skip
    section = drafting_where_bytes_decide(options, lambda message: None)
    assert set(section["oracle_speedup"]["31b"]) == {"2"} and section["bounds"][0]["tokens_exact"]
    assert section["prompt_lookup"] == [{"model": "gemma3-270m", "skipped": "gemma3-270m is not installed", "rows": []}]
    assert section["prompt_lookup_speedup"] == {}
