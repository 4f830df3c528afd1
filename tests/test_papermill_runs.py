"""papermill_runs: the regression verdict on synthetic results, the CLI's exit codes, baseline files
(missing, malformed, updated), the history, and the failure report of a notebook that raises."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from gemma4lib.errors import BaselineError
from papermill_runs import baselines, run
from papermill_runs.report import failure_report, markdown_table, summary_rows

PROFILE, KIND = "smoke", "test-kind"


def result(variant="e2b", **changes):
    base = {
        "variant": variant, "profile": PROFILE, "recipe": "cpu-aotinductor", "tp_degree": 1,
        "model_source": "tiny-trained", "seq_match": True, "coherent": True, "coherence_rule": "contains('Paris')",
        "answer": "The capital of France is Paris.", "first_mismatch": None, "new_tokens": 8,
        "prefill_ms": 10.0, "decode_tok_s": 200.0, "compile_s": 0.0, "peak_rss_mb": 500.0,
        "prefill_logits_max_abs_diff": 1e-5, "versions": {"git_sha": "abc"},
    }
    base.update(changes)
    return base


@pytest.fixture
def tolerances():
    return baselines.load_tolerances(PROFILE)


def baseline_file(folder: Path, variants: dict, profile=PROFILE, kind=KIND) -> Path:
    path = baselines.baseline_path(profile, kind, folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"schema": 1, "profile": profile, "machine_kind": kind,
                                "variants": {n: baselines.baseline_entry(r) for n, r in variants.items()}}))
    return path


# ---- the verdict on synthetic results ------------------------------------------------------------

def limits(tolerances, base):
    """The smoke profile's bounds for `base` figures, from tolerances.json."""
    p, d = tolerances["metrics"]["prefill_ms"], tolerances["metrics"]["decode_tok_s"]
    return (base["prefill_ms"] * (1 + p["rel_tol"]) + p["abs_tol"],
            base["decode_tok_s"] * (1 - d["rel_tol"]) - d["abs_tol"])


def test_within_tolerance_passes(tolerances):
    entry = baselines.baseline_entry(result())
    prefill_limit, decode_limit = limits(tolerances, result())
    assert prefill_limit > 15.0 and decode_limit < 120.0, "smoke tolerances should absorb 1.5x CPU noise"
    verdict = baselines.judge("e2b", result(prefill_ms=prefill_limit * 0.99, decode_tok_s=decode_limit * 1.01),
                              entry, tolerances)
    assert verdict.status == "pass", verdict.reasons


def test_slower_than_tolerance_is_a_regression(tolerances):
    entry = baselines.baseline_entry(result())
    prefill_limit, decode_limit = limits(tolerances, result())
    verdict = baselines.judge("e2b", result(decode_tok_s=decode_limit * 0.99), entry, tolerances)
    assert verdict.status == "regression"
    assert any("decode_tok_s" in r for r in verdict.reasons)
    verdict = baselines.judge("e2b", result(prefill_ms=prefill_limit * 1.01), entry, tolerances)
    assert verdict.status == "regression" and "prefill_ms" in verdict.reasons[0]


def test_informational_metric_never_fails(tolerances):
    entry = baselines.baseline_entry(result(compile_s=30.0))
    verdict = baselines.judge("e2b", result(compile_s=900.0), entry, tolerances)
    assert verdict.status == "pass"
    assert any("compile_s" in r and "informational" in r for r in verdict.reasons)


@pytest.mark.parametrize("changes, words", [
    ({"seq_match": False, "first_mismatch": 3}, "SEQ_MATCH failed (first mismatch at token 3)"),
    ({"coherent": False, "answer": "Athens"}, "incoherent"),
    ({"prefill_logits_max_abs_diff": 0.5}, "prefill logits"),
    ({"answer": "The capital of France is Lyon. Paris"}, "answer changed"),
    ({"coherent": None, "model_source": "tiny-random(seed=27)"}, "coherence not checked"),
])
def test_correctness_failure_fails_even_when_fast(tolerances, changes, words):
    entry = baselines.baseline_entry(result())
    verdict = baselines.judge("e2b", result(decode_tok_s=10_000.0, **changes), entry, tolerances)
    assert verdict.status == "fail"
    assert any(words in r for r in verdict.reasons), verdict.reasons


def test_correctness_is_judged_without_a_baseline(tolerances):
    assert baselines.judge("e2b", result(), None, tolerances).status == "no-baseline"
    assert baselines.judge("e2b", result(seq_match=False), None, tolerances).status == "fail"


def test_missing_record_is_an_error(tolerances):
    verdict = baselines.judge("e2b", None, None, tolerances, "01_e2b.ipynb", "cell 12 raised ValueError: boom")
    assert verdict.status == "error" and verdict.reasons == ["cell 12 raised ValueError: boom"]


def test_worst_status_order():
    assert baselines.worst(["pass", "regression", "no-baseline"]) == "regression"
    assert baselines.worst(["regression", "fail", "error"]) == "error"


# ---- baseline and tolerance files ------------------------------------------------------------------

def test_missing_baseline_file_is_none_not_a_pass(tmp_path):
    assert baselines.load_baseline(tmp_path / "nope.json", PROFILE, KIND) is None


@pytest.mark.parametrize("content, words", [
    ("{not json", "not valid JSON"),
    ("[]", "top level"),
    (json.dumps({"schema": 2, "profile": PROFILE, "machine_kind": KIND, "variants": {}}), "schema"),
    (json.dumps({"schema": 1, "profile": "full", "machine_kind": KIND, "variants": {}}), "profile"),
    (json.dumps({"schema": 1, "profile": PROFILE, "machine_kind": "other", "variants": {}}), "machine_kind"),
    (json.dumps({"schema": 1, "profile": PROFILE, "machine_kind": KIND, "variants": []}), "variants"),
    (json.dumps({"schema": 1, "profile": PROFILE, "machine_kind": KIND,
                 "variants": {"e2b": {"seq_match": True, "decode_tok_s": "fast"}}}), "decode_tok_s"),
])
def test_malformed_baseline_raises(tmp_path, content, words):
    path = tmp_path / "b.json"
    path.write_text(content)
    with pytest.raises(BaselineError, match=words):
        baselines.load_baseline(path, PROFILE, KIND, ["decode_tok_s"])


def test_malformed_tolerances_raise(tmp_path):
    path = tmp_path / "t.json"
    data = json.loads(baselines.TOLERANCES_FILE.read_text())
    data["default"]["metrics"]["prefill_ms"]["direction"] = "sideways"
    path.write_text(json.dumps(data))
    with pytest.raises(BaselineError, match="direction"):
        baselines.load_tolerances(PROFILE, path)
    path.write_text("{")
    with pytest.raises(BaselineError, match="not valid JSON"):
        baselines.load_tolerances(PROFILE, path)


def test_profile_overrides_merge_into_defaults():
    smoke, full = baselines.load_tolerances("smoke"), baselines.load_tolerances("full")
    assert full["metrics"]["decode_tok_s"]["rel_tol"] < smoke["metrics"]["decode_tok_s"]["rel_tol"]
    assert full["metrics"]["decode_tok_s"]["direction"] == "higher_is_better"  # kept from default
    assert smoke["correctness"]["seq_match"] is True


def test_committed_baselines_are_well_formed():
    tolerances = baselines.load_tolerances(PROFILE)
    files = sorted(baselines.BASELINE_DIR.glob("*/*.json"))
    assert files, "no committed baseline (papermill_runs/baselines/<profile>/<machine-kind>.json)"
    for path in files:
        data = baselines.load_baseline(path, path.parent.name, path.stem, list(tolerances["metrics"]))
        assert data["variants"], path


# ---- the CLI, on a synthetic results.json --------------------------------------------------------

def write_results(folder: Path, results: dict, notebooks: dict | None = None) -> Path:
    path = folder / "run" / "results.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"profile": PROFILE, "machine_kind": KIND, "results": results,
                                "notebooks": notebooks or {}, "errors": {}}))
    return path


def check(tmp_path: Path, results_file: Path, *extra: str) -> int:
    return run.main(["check", "--results", str(results_file), "--baseline-dir", str(tmp_path / "baselines"),
                     "--history", str(tmp_path / "history.jsonl"), *extra])


def test_cli_pass_then_tightened_baseline_fails(tmp_path, capsys):
    good = {"e2b": result(), "12b": result("12b")}
    baseline_file(tmp_path / "baselines", good)
    results_file = write_results(tmp_path, good)
    assert check(tmp_path, results_file) == 0
    out = capsys.readouterr().out
    assert "e2b" in out and "pass" in out
    summary = (results_file.parent / "summary.md").read_text()
    assert "| 03_12b.ipynb | 12b |" in summary
    assert (results_file.parent / "summary.csv").read_text().startswith("notebook,variant,recipe,TP,seq_match")

    # someone raises the bar past what was measured: the same figures are now a regression
    tight = copy.deepcopy(good)
    tight["e2b"]["decode_tok_s"] = 2000.0
    baseline_file(tmp_path / "baselines", tight)
    assert check(tmp_path, results_file) == 1
    out = capsys.readouterr().out
    assert "REGRESSION: 01_e2b.ipynb" in out and "decode_tok_s" in out
    verdicts = json.loads(results_file.read_text())["verdicts"]
    assert verdicts["e2b"]["status"] == "regression" and verdicts["12b"]["status"] == "pass"
    for name in ("family_metrics.png", "checks.png", "baseline_decode_tok_s.png", "summary.md"):
        assert (results_file.parent / name).is_file(), name


def test_cli_correctness_failure_exits_nonzero(tmp_path, capsys):
    baseline_file(tmp_path / "baselines", {"e2b": result()})
    results_file = write_results(tmp_path, {"e2b": result(coherent=False, answer="Athens")})
    assert check(tmp_path, results_file) == 1
    assert "FAIL: 01_e2b.ipynb" in capsys.readouterr().out


def test_cli_missing_baseline_fails_unless_allowed(tmp_path, capsys):
    results_file = write_results(tmp_path, {"e2b": result()})
    assert check(tmp_path, results_file) == 1
    assert "NO-BASELINE" in capsys.readouterr().out
    assert check(tmp_path, results_file, "--allow-missing-baseline") == 0
    # a baseline file that lacks this variant is the same case
    baseline_file(tmp_path / "baselines", {"12b": result("12b")})
    assert check(tmp_path, results_file) == 1


def test_cli_malformed_baseline_is_an_error_not_a_pass(tmp_path, capsys):
    path = baselines.baseline_path(PROFILE, KIND, tmp_path / "baselines")
    path.parent.mkdir(parents=True)
    path.write_text('{"schema": 1, "profile": "smoke"')
    results_file = write_results(tmp_path, {"e2b": result()})
    assert check(tmp_path, results_file) == 2
    assert check(tmp_path, results_file, "--allow-missing-baseline") == 2
    assert "not valid JSON" in capsys.readouterr().err
    data = json.loads(results_file.read_text())  # the results and verdicts are still written
    assert data["baseline_state"] == "MALFORMED" and data["results"]["e2b"]["seq_match"] is True


def test_cli_update_baseline_writes_passing_variants_only(tmp_path):
    results_file = write_results(tmp_path, {"e2b": result(), "12b": result("12b", seq_match=False)})
    assert check(tmp_path, results_file, "--update-baseline") == 1  # 12b's failure still fails the run
    path = baselines.baseline_path(PROFILE, KIND, tmp_path / "baselines")
    data = baselines.load_baseline(path, PROFILE, KIND, ["prefill_ms"])
    assert set(data["variants"]) == {"e2b"}
    assert data["variants"]["e2b"]["decode_tok_s"] == 200.0
    assert not list(path.parent.glob(".*.tmp")), "atomic write left a temporary file"
    # now the baseline exists: the passing variant alone passes
    assert check(tmp_path, write_results(tmp_path, {"e2b": result()})) == 0


def test_cli_update_baseline_accepts_a_slower_run(tmp_path):
    baseline_file(tmp_path / "baselines", {"e2b": result()})
    results_file = write_results(tmp_path, {"e2b": result(decode_tok_s=20.0)})
    assert check(tmp_path, results_file) == 1
    assert check(tmp_path, results_file, "--update-baseline") == 0
    assert check(tmp_path, results_file) == 0


def test_history_is_append_only(tmp_path):
    history = tmp_path / "h.jsonl"
    baselines.append_history(history, [{"variant": "e2b", "metrics": {"decode_tok_s": 1.0}}])
    baselines.append_history(history, [{"variant": "e2b", "metrics": {"decode_tok_s": 2.0}}])
    with open(history, "a") as handle:
        handle.write('{"torn')  # a crash mid-line must not lose the rest
    assert [h["metrics"]["decode_tok_s"] for h in baselines.read_history(history)] == [1.0, 2.0]


def test_failure_report_names_notebook_and_cell(tolerances):
    verdicts = baselines.judge_all({"31b": None}, None, tolerances, {"31b": "04_31b.ipynb"},
                                   {"31b": "04_31b.ipynb: cell 27 raised RuntimeError: out of memory"})
    runs = {"31b": {"failed_cell": {"index": 27, "exec_count": 14, "source": "compiled = compile_graphs(...)"},
                    "executed": "out/notebooks/04_31b.ipynb", "log": "out/logs/04_31b.log"}}
    text = failure_report(verdicts, runs)
    assert "ERROR: 04_31b.ipynb, cell 27 (In [14])" in text and "RuntimeError: out of memory" in text
    assert "compile_graphs" in text and "out/logs/04_31b.log" in text
    table = markdown_table(summary_rows({"31b": None}, verdicts))
    assert "| 04_31b.ipynb | 31b |" in table and "error |" in table


# ---- arguments and the notebook runner ------------------------------------------------------------

def test_variant_selection_and_parameter_parsing():
    assert run.selected(None)[-1] == "overview" and len(run.selected(None)) == 6
    assert run.selected(["26b,e2b"]) == ["e2b", "26b-a4b"]
    assert run.selected(["overview", "12b"]) == ["12b", "overview"]
    with pytest.raises(SystemExit):
        run.selected(["e3b"])
    assert run.parse_overrides(["tp_degree=2", "prefill_buckets=[16, 32]", "prompt=Hi there", "checkpoint=null"]) == {
        "tp_degree": 2, "prefill_buckets": [16, 32], "prompt": "Hi there", "checkpoint": None}


def test_full_profile_parameters(tmp_path):
    params = run.notebook_parameters(run.load_profiles(), "full", "31b", tmp_path, {"iters": 2})
    assert params["backend"] == "neuron" and params["tp_degree"] == 8 and params["iters"] == 2
    assert params["checkpoint"] == "google/gemma-4-31B-it"
    assert params["results_path"] == str(tmp_path / "results" / "31b.json")


def test_failing_notebook_is_reported_with_its_cell(tmp_path):
    """A real papermill run of a two-cell notebook whose second cell raises."""
    folder = tmp_path / "nbs"
    folder.mkdir()
    notebook = new_notebook(cells=[new_code_cell("answer = 1", metadata={"tags": ["parameters"]}),
                                   new_code_cell("raise ValueError(f'bad answer {answer}')")])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, str(folder / "broken.ipynb"))
    with run.patched_environ(run.kernel_environment(run.kernelspec_dir(tmp_path / "jupyter"))):
        outcome = run.execute("broken", "broken.ipynb", tmp_path / "out", {"answer": 42, "unknown": 1}, 60,
                              notebook_dir=folder)
    assert outcome["status"] == "failed"
    assert "ValueError: bad answer 42" in outcome["error"]
    assert outcome["failed_cell"]["index"] == 1  # the source notebook's cell, not papermill's inserted ones
    assert outcome["failed_cell"]["exec_count"] == 3  # parameters, injected parameters, then this one
    assert "raise ValueError" in outcome["failed_cell"]["source"]
    assert outcome["ignored_parameters"] == ["unknown"]
    assert "bad answer 42" in Path(outcome["log"]).read_text()
    assert Path(outcome["executed"]).is_file()


def test_update_baseline_takes_the_median_of_recent_runs(tmp_path):
    history = tmp_path / "history.jsonl"
    past = [{"variant": "e2b", "verdict": v, "profile": PROFILE, "machine_kind": KIND,
             "metrics": {"decode_tok_s": x, "prefill_ms": 10.0}}
            for v, x in [("pass", 100.0), ("fail", 5.0), ("pass", 300.0), ("regression", 110.0)]]
    baselines.append_history(history, past)
    results_file = write_results(tmp_path, {"e2b": result(decode_tok_s=900.0)})
    assert check(tmp_path, results_file, "--update-baseline") == 0  # "no-baseline" is accepted when writing one
    entry = json.loads(baselines.baseline_path(PROFILE, KIND, tmp_path / "baselines").read_text())["variants"]["e2b"]
    assert entry["decode_tok_s"] == 205.0  # median of 100, 300, 110, 900; the failed run's 5.0 is ignored
    assert entry["runs_in_median"] == 4
