"""`python -m papermill_runs bench`: judge a benchmark-suite report against a baseline, as ratios.

    python -m gemma4lab bench --suite cpu --json > bench.json
    python -m papermill_runs bench --report bench.json [--update-baseline] [--allow-missing-baseline]
                                   [--machine-kind K] [--baseline-dir D] [--tolerances T] [--out DIR]

Why ratios: the suite times this project's compiled decode next to Hugging Face `generate` on a shared
2-core machine, where the absolute tok/s of two runs of the same code differ by several times with
whatever else is running. Within one run the paths of a model are measured interleaved (A, B, C, A, B,
C, ...), so that load hits both sides of a ratio alike: ratios are what can be compared across runs.
Per subject this judges:

- each model (`e2b`, ..., `medium-dense`): `speedup_vs_hf_eager` (our decode / HF eager),
  `speedup_hf_compile_vs_eager` (HF static cache + torch.compile / HF eager; it measures Hugging Face,
  so its rule is informational), `roofline_fraction` (our tok/s over the ceiling from the bandwidth
  measured in the same run), and that every path that ran reproduced the reference tokens;
- `ring_kv`: ring tok/s at the longest context over the shortest (`ring_tok_s_<long>_over_<short>`,
  named as the suite names it) and ring / full-length buffers at the longest (`ring_speedup_at_<long>`);
- `experts`: `selective_over_dense_decode`, and both forms' token checks;
- `prefill_buckets`: correctness only (each prompt took the smallest bucket that fits, and matched);
- `batch:<model>` (one per model of the `batch` section): `speedup_b8_over_b1` (total decode tok/s at
  B=8 over B=1), `batch_min_over_hf` (the smallest ratio over HF generate across B), and that every
  row at every B reproduced its own reference.

Rules come from the `bench` profile of `tolerances.json`; only the rules named by a subject's metrics
apply (exactly, or by a `*` pattern), so the notebook metrics of the `default` block never do. Metrics
are compared with `baselines.check_metric` through `baselines.judge`; correctness is exact, any `False`
(or a check the report should hold but does not) is a `fail`. The report's `targets` are printed, never
gate. The baseline, `baselines/bench/<machine-kind>.json`, has the notebook baselines' format (one
`variants` entry per subject, `seq_match` true = every exact check passed), so `load_baseline` reads it.

Exit status: 0 every subject passed; 1 a correctness check failed, a gated ratio regressed, or a subject
has no baseline (unless `--allow-missing-baseline`); 2 the report, the baseline or the tolerance file is
unreadable or malformed. `--update-baseline` accepts regressions and missing baselines (and replaces a
malformed baseline), writing this run's figures for the subjects whose checks passed and keeping the
earlier entries of the others; a failed check still exits 1 and is never written.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import logging
import math
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from gemma4lib.cache.artifacts import atomic_write_json
from gemma4lib.errors import BaselineError

from . import baselines
from .report import _fmt, markdown_table

log = logging.getLogger(__name__)

PROFILE = "bench"
OURS = "gemma4lib"  # the suite's name for this project's path
VERDICT_FILE = "bench_verdict.json"
# `baselines.judge` also runs the notebook checks; none of them applies to a bench subject
NOTEBOOK_CHECKS_OFF = {"seq_match": False, "coherent": False, "logits_match": False, "witness": False}
TABLE_COLUMNS = ("subject", "metric", "value", "baseline", "verdict")


class ReportError(BaselineError):
    """The benchmark report cannot be read or lacks the suite's fields (exit 2, like a bad baseline)."""


# ---- reading the report --------------------------------------------------------------------------


def read_report(path: Path) -> dict[str, Any]:
    """The suite's JSON report (what `python -m gemma4lab bench --json` prints)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ReportError(
            f"bench report {path} is unreadable ({exc}); write it with "
            f"`python -m gemma4lab bench --suite cpu --json > {path}`"
        ) from None
    if not isinstance(data, dict):
        raise ReportError(f"bench report {path} is not a JSON object")
    return data


def _get(block: Mapping[str, Any], key: str, kind: type, where: str) -> Any:
    value = block.get(key)
    if not isinstance(value, kind):
        raise ReportError(f"bench report: {where}.{key} must be a {kind.__name__}, got {value!r:.80}")
    return value


def _number(value: Any, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ReportError(f"bench report: {where} must be a finite number or null, got {value!r:.80}")
    return float(value)


def _flag(value: Any, where: str) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    raise ReportError(f"bench report: {where} must be true, false or null, got {value!r:.80}")


def _subject(
    metrics: dict[str, float | None],
    checks: dict[str, bool | None] | None = None,
    notes: dict[str, str] | None = None,
    **info: Any,
) -> dict[str, Any]:
    """One subject: `metrics` (ratios, judged against the baseline), `checks` (exact; all must be
    true), `notes` (why a check failed), `info` (context, never judged)."""
    return {"metrics": metrics, "checks": checks or {}, "notes": notes or {}, "info": info}


def _model(model: Mapping[str, Any], where: str) -> dict[str, Any]:
    paths = _get(model, "paths", dict, where)
    speedup = _get(model, "speedup_vs_hf_eager", dict, where)
    roofline = _get(model, "roofline_fraction", dict, where)
    metrics = {
        "speedup_vs_hf_eager": _number(speedup.get(OURS), f"{where}.speedup_vs_hf_eager.{OURS}"),
        "speedup_hf_compile_vs_eager": _number(
            speedup.get("hf_static_compile"), f"{where}.speedup_vs_hf_eager.hf_static_compile"
        ),
        "roofline_fraction": _number(roofline.get(OURS), f"{where}.roofline_fraction.{OURS}"),
    }
    checks: dict[str, bool | None] = {}
    notes: dict[str, str] = {}
    status: dict[str, str] = {}
    for name, path in {OURS: paths.get(OURS) or {}, **paths}.items():
        if not isinstance(path, dict):
            raise ReportError(f"bench report: {where}.paths.{name} must be an object")
        status[name] = str(path.get("status") or "missing")
        check = f"{name}.tokens_match_reference"
        if path.get("status") == "ok":
            checks[check] = _flag(path.get("tokens_match_reference"), f"{where}.paths.{check}")
        elif name == OURS:  # a skipped or failed HF path is recorded; our own path must run
            checks[check] = None
            notes[check] = f"the {OURS} path did not run ({status[name]}: {path.get('error') or path.get('reason')})"
        else:
            status[name] += f": {path.get('error') or path.get('reason') or 'no reason recorded'}"
    decode = {name: path.get("decode_tok_s") for name, path in paths.items() if isinstance(path, dict)}
    return _subject(metrics, checks, notes, paths=status, decode_tok_s=decode, params=model.get("params"))


def _ring(ring: Mapping[str, Any]) -> dict[str, Any]:
    contexts = _get(ring, "contexts", dict, "ring_kv")
    if not contexts or not all(isinstance(row, dict) for row in contexts.values()):
        raise ReportError("bench report: ring_kv.contexts must map each context to an object")
    first, last = next(iter(contexts)), list(contexts)[-1]  # as `bench_ring_kv` names its ratios
    over = f"ring_tok_s_{last}_over_{first}"
    metrics = {
        over: _number(ring.get(over), f"ring_kv.{over}"),
        f"ring_speedup_at_{last}": _number(contexts[last].get("ring_speedup"), f"ring_kv.contexts.{last}.ring_speedup"),
    }
    checks = {
        f"{ctx}.{kind}.tokens_match_reference": _flag(
            row[kind]["tokens_match_reference"], f"ring_kv.contexts.{ctx}.{kind}.tokens_match_reference"
        )
        for ctx, row in contexts.items()
        for kind in ("full", "ring")
        if isinstance(row.get(kind), dict) and "tokens_match_reference" in row[kind]
    }
    return _subject(metrics, checks, model=ring.get("model"), sliding_window=ring.get("sliding_window"))


def _experts(experts: Mapping[str, Any]) -> dict[str, Any]:
    metrics = {
        "selective_over_dense_decode": _number(
            experts.get("selective_over_dense_decode"), "experts.selective_over_dense_decode"
        )
    }
    checks: dict[str, bool | None] = {}
    for block, key in (("decode", "tokens_match_reference"), ("prefill", "first_token_matches_reference")):
        for form, row in _get(experts, block, dict, "experts").items():
            if not isinstance(row, dict):
                raise ReportError(f"bench report: experts.{block}.{form} must be an object")
            checks[f"{form}.{key}"] = _flag(row.get(key), f"experts.{block}.{form}.{key}")
    return _subject(metrics, checks, model=experts.get("model"), recommendation=experts.get("recommendation"))


def _prefill_buckets(section: Mapping[str, Any]) -> dict[str, Any]:
    placement = _get(section, "placement", list, "prefill_buckets")
    if not all(isinstance(p, dict) for p in placement):
        raise ReportError("bench report: prefill_buckets.placement must be a list of objects")
    wrong = [
        f"{p.get('prompt_tokens')} tokens took bucket {p.get('bucket')}, smallest fitting {p.get('smallest_fitting')}"
        for p in placement
        if p.get("bucket") != p.get("smallest_fitting")
    ]
    differ = [f"{p.get('prompt_tokens')} tokens" for p in placement if p.get("tokens_match_reference") is not True]
    checks = {
        "smallest_bucket_used": not wrong if placement else None,
        "tokens_match_reference": not differ if placement else None,
    }
    notes = {
        "smallest_bucket_used": "; ".join(wrong) or "no placement recorded",
        "tokens_match_reference": ("differ from the reference: " + ", ".join(differ))
        if differ
        else "no placement recorded",
    }
    return _subject({}, checks, notes, model=section.get("model"), prompts=len(placement))


def _batch(section: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A model's batch sweep (`gemma4lab.benchmarks.batch`): the B=8 / B=1 total decode ratio and the
    smallest ratio over HF generate across B; every row of every B must equal its own reference."""
    metrics = {
        "speedup_b8_over_b1": _number(section.get("speedup_b8_over_b1"), f"{where}.speedup_b8_over_b1"),
        "batch_min_over_hf": _number(section.get("min_over_hf"), f"{where}.min_over_hf"),
    }
    checks = {"tokens_match_reference": _flag(section.get("tokens_match_reference"), f"{where}.tokens_match_reference")}
    return _subject(
        metrics,
        checks,
        model=section.get("model"),
        bandwidth_moved=section.get("bandwidth_moved"),
    )


def _mtp(row: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A variant's drafted decode (`gemma4lab.benchmarks.mtp`): decode tok/s with the assistant over
    without, from one run, and the tokens emitted per verify step; the drafted tokens must equal the
    plain reference and transformers' assisted generate."""
    metrics = {
        "speedup_with_draft": _number(row.get("speedup_with_draft"), f"{where}.speedup_with_draft"),
        "bench_accepted_per_step": _number(row.get("bench_accepted_per_step"), f"{where}.bench_accepted_per_step"),
    }
    checks = {
        "tokens_match_reference": _flag(row.get("tokens_equal_reference"), f"{where}.tokens_equal_reference"),
        "hf_assisted_match": _flag(row.get("hf_assisted_match"), f"{where}.hf_assisted_match"),
    }
    return _subject(metrics, checks, draft_tokens=row.get("draft_tokens"))


def figures(report: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """One entry per subject of the suite report (models by name, then `ring_kv`, `experts`,
    `prefill_buckets` when present); raises `ReportError` when the report lacks the suite's fields."""
    subjects: dict[str, dict[str, Any]] = {}
    for i, model in enumerate(_get(report, "models", list, "report")):
        if not isinstance(model, dict) or not isinstance(model.get("name"), str):
            raise ReportError(f'bench report: models[{i}] must be an object with a "name"')
        subjects[model["name"]] = _model(model, f"models[{i}] ({model['name']})")
    readers = {"ring_kv": _ring, "experts": _experts, "prefill_buckets": _prefill_buckets}
    for name, reader in readers.items():
        if report.get(name) is not None:
            subjects[name] = reader(_get(report, name, dict, "report"))
    for i, section in enumerate(report.get("batch") or []):
        if not isinstance(section, dict) or not isinstance(section.get("model"), str):
            raise ReportError(f'bench report: batch[{i}] must be an object with a "model"')
        subjects[f"batch:{section['model']}"] = _batch(section, f"batch[{i}] ({section['model']})")
    mtp = report.get("mtp")
    for i, row in enumerate(_get(report, "mtp", dict, "report").get("rows") or [] if mtp is not None else []):
        if not isinstance(row, dict) or not isinstance(row.get("variant"), str):
            raise ReportError(f'bench report: mtp.rows[{i}] must be an object with a "variant"')
        subjects[f"mtp:{row['variant']}"] = _mtp(row, f"mtp.rows[{i}] ({row['variant']})")
    if not subjects:
        raise ReportError("bench report has no models and no ring_kv/experts/prefill_buckets/batch/mtp section")
    return subjects


def targets(report: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The report's `targets` (target, value, threshold, met): informational, never judged."""
    items = report.get("targets") or []
    if not isinstance(items, list) or not all(isinstance(t, dict) for t in items):
        raise ReportError("bench report: targets must be a list of objects")
    return [{key: t.get(key) for key in ("target", "value", "threshold", "met")} for t in items]


# ---- judging -----------------------------------------------------------------------------------------


def rule_for(metric: str, rules: Mapping[str, Any]) -> dict[str, Any]:
    """The tolerance rule of `metric`: its own entry, else the first `*` pattern that matches it."""
    if metric in rules:
        return rules[metric]
    for pattern, rule in rules.items():
        if "*" in pattern and fnmatch.fnmatchcase(metric, pattern):
            return rule
    raise BaselineError(f"tolerances: no rule for bench metric {metric!r}; add it to profiles.{PROFILE}.metrics")


def failed_bench_checks(subject: Mapping[str, Any], rules: Mapping[str, Any]) -> list[str]:
    """Every bench check that is not exactly true (a check is switched off by its last name in `rules`);
    the notebook records' counterpart is `baselines.correctness_problems`."""
    problems = []
    for check, value in subject["checks"].items():
        if value is True or rules.get(check.rsplit(".", 1)[-1], True) is False:
            continue
        note = subject["notes"].get(check)
        problems.append(f"{check} is {'false' if value is False else 'not recorded'}" + (f": {note}" if note else ""))
    return problems


def judge_subject(
    name: str, subject: Mapping[str, Any], entry: Mapping[str, Any] | None, tolerances: Mapping[str, Any]
) -> baselines.Verdict:
    """The verdict for one subject: its ratios through `baselines.judge`, then its exact checks."""
    rules = {metric: rule_for(metric, tolerances["metrics"]) for metric in subject["metrics"]}
    verdict = baselines.judge(name, subject["metrics"], entry, {"metrics": rules, "correctness": NOTEBOOK_CHECKS_OFF})
    verdict.reasons += [
        c.describe() for c in verdict.metrics if c.status == "n/a" and (c.value is None) != (c.baseline is None)
    ]
    problems = failed_bench_checks(subject, tolerances.get("correctness") or {})
    if problems:
        verdict.reasons = problems + (verdict.reasons if entry is not None else [])
        verdict.status = "fail"
    return verdict


def judge_report(
    subjects: Mapping[str, Mapping[str, Any]], baseline: Mapping[str, Any] | None, tolerances: Mapping[str, Any]
) -> dict[str, baselines.Verdict]:
    entries = (baseline or {}).get("variants") or {}
    return {name: judge_subject(name, subject, entries.get(name), tolerances) for name, subject in subjects.items()}


# ---- the baseline ------------------------------------------------------------------------------------


def context(report: Mapping[str, Any]) -> dict[str, Any]:
    """What a ratio may depend on besides the code: the run's git sha, thread count and bandwidth."""
    bandwidth, versions = (report.get(k) if isinstance(report.get(k), dict) else {} for k in ("bandwidth", "versions"))
    return {
        "git_sha": versions.get("git_sha"),
        "threads": report.get("threads"),
        "bandwidth": {k: bandwidth.get(k) for k in ("gemv_gb_s", "stream_gb_s")},
        "suite": report.get("suite"),
    }


def update_baseline(
    path: Path,
    kind: str,
    report: Mapping[str, Any],
    subjects: Mapping[str, Mapping[str, Any]],
    verdicts: Mapping[str, baselines.Verdict],
    existing: Mapping[str, Any] | None,
) -> tuple[list[str], list[str]]:
    """Write this run's figures atomically for every subject whose checks passed; entries of other
    subjects (refused, or absent from this report) are kept, and so is an earlier value of a metric
    this run did not measure. Nothing is written when no subject qualifies. Returns (updated, refused)."""
    variants = dict((existing or {}).get("variants") or {})
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    run = context(report)
    updated, refused = [], []
    for name, subject in subjects.items():
        if verdicts[name].status in ("fail", "error"):
            refused.append(name)
            continue
        old = variants.get(name) or {}
        metrics = {m: old.get(m) if value is None else value for m, value in subject["metrics"].items()}
        variants[name] = {
            "seq_match": True,
            **metrics,
            "checks": subject["checks"],
            "git_sha": run["git_sha"],
            "recorded": stamp,
        }
        updated.append(name)
    if updated:
        atomic_write_json(
            Path(path),
            {
                "schema": baselines.SCHEMA,
                "profile": PROFILE,
                "machine_kind": kind,
                "updated": stamp,
                **run,
                "note": "written by `python -m papermill_runs bench --update-baseline`; ratios of one interleaved run; "
                "tolerances in tolerances.json (profile bench); seq_match: every exact check passed",
                "variants": dict(sorted(variants.items())),
            },
        )
        log.info("bench baseline %s: updated %s", path, ", ".join(updated))
    return updated, refused


# ---- output ------------------------------------------------------------------------------------------


def _metric_verdict(check: baselines.MetricCheck | None) -> str:
    if check is None:
        return "no baseline"
    if check.status == "worse":
        return "REGRESSION" if check.gate else "worse (informational)"
    if check.status == "n/a":
        return "not compared"
    return f"ok (limit {check.limit:.3g})" + ("" if check.gate else " (informational)")


def table_rows(
    subjects: Mapping[str, Mapping[str, Any]], verdicts: Mapping[str, baselines.Verdict], rules: Mapping[str, Any]
) -> list[list[str]]:
    """subject | metric | value | baseline | verdict: one row per ratio, exact check and path not run."""
    rows = []
    for name, subject in subjects.items():
        checks = {c.metric: c for c in verdicts[name].metrics}
        for metric, value in subject["metrics"].items():
            check = checks.get(metric)
            rows.append([name, metric, _fmt(value), _fmt(check.baseline if check else None), _metric_verdict(check)])
        for check_name, value in subject["checks"].items():
            off = rules.get(check_name.rsplit(".", 1)[-1], True) is False
            rows.append(
                [name, check_name, _fmt(value), "exact", "not checked" if off else "ok" if value is True else "FAIL"]
            )
        for path, status in (subject["info"].get("paths") or {}).items():
            if status != "ok" and f"{path}.tokens_match_reference" not in subject["checks"]:
                rows.append([name, f"{path} path", status, "—", "not run (informational)"])
    return rows


def target_rows(items: Iterable[Mapping[str, Any]]) -> list[list[str]]:
    met = {True: "met", False: "NOT MET", None: "not measured"}
    return [[str(t["target"]), _fmt(t["value"]), _fmt(t["threshold"]), met.get(t["met"], str(t["met"]))] for t in items]


def render(
    outcome: Mapping[str, Any],
    subjects: Mapping[str, Mapping[str, Any]],
    verdicts: Mapping[str, baselines.Verdict],
    rules: Mapping[str, Any],
) -> str:
    """The printed markdown: figures vs baseline, verdict per subject, targets, where the baseline is."""
    parts = [
        f"## bench: {outcome['report']} on {outcome['machine_kind']}",
        "",
        markdown_table(table_rows(subjects, verdicts, rules), TABLE_COLUMNS),
        "",
        markdown_table(
            [[n, v.status, "; ".join(v.reasons) or "—"] for n, v in verdicts.items()], ("subject", "verdict", "reasons")
        ),
        "",
    ]
    if outcome["absent"]:
        parts += [f"In the baseline but not in this report (not judged): {', '.join(outcome['absent'])}.", ""]
    for note in outcome["notes"]:
        parts += [f"Note: {note}", ""]
    parts += ["### Targets (informational: they never change the exit status)", ""]
    parts += [
        markdown_table(target_rows(outcome["targets"]), ("target", "value", "threshold", "met"))
        if outcome["targets"]
        else "(the report lists no targets)",
        "",
    ]
    parts += [f"baseline: {outcome['baseline_file']} ({outcome['baseline_state']}); exit {outcome['exit_code']}"]
    return "\n".join(parts)


# ---- the subcommand ----------------------------------------------------------------------------------


def cmd_bench(args: argparse.Namespace) -> int:
    """Judge `--report` against the bench baseline, print the tables, optionally write the verdict."""
    report = read_report(args.report)
    tolerances = baselines.load_tolerances(PROFILE, args.tolerances)
    subjects = figures(report)
    kind = args.machine_kind or baselines.machine_kind()
    path = baselines.baseline_path(PROFILE, kind, args.baseline_dir)
    metrics = sorted({m for subject in subjects.values() for m in subject["metrics"]})
    try:
        baseline = baselines.load_baseline(path, PROFILE, kind, metrics)
        state = "missing" if baseline is None else "loaded"
    except BaselineError as exc:
        if not args.update_baseline:
            raise
        log.warning("replacing the malformed bench baseline: %s", exc)
        baseline, state = None, "MALFORMED, replaced (--update-baseline)"
    verdicts = judge_report(subjects, baseline, tolerances)
    code = baselines.exit_code(verdicts, args.allow_missing_baseline, args.update_baseline)
    notes = []
    if baseline is not None and baseline.get("threads") not in (None, report.get("threads")):
        notes.append(
            f"the baseline was measured on {baseline['threads']} thread(s), this report on "
            f"{report.get('threads')}: ratios may differ for that reason alone"
        )
    absent = sorted(set((baseline or {}).get("variants") or {}) - set(subjects))
    if args.update_baseline:
        updated, refused = update_baseline(path, kind, report, subjects, verdicts, baseline)
        state += f"; updated {', '.join(updated) or 'nothing'}" + (f", refused {', '.join(refused)}" if refused else "")
    rules = tolerances.get("correctness") or {}
    outcome = {
        "report": str(args.report),
        "profile": PROFILE,
        "machine_kind": kind,
        "baseline_file": str(path),
        "baseline_state": state,
        "exit_code": code,
        **context(report),
        "absent": absent,
        "notes": notes,
        "targets": targets(report),
        "subjects": subjects,
        "verdicts": {n: v.to_dict() for n, v in verdicts.items()},
        "tolerances": {"metrics": {m: rule_for(m, tolerances["metrics"]) for m in metrics}, "correctness": rules},
    }
    text = render(outcome, subjects, verdicts, rules)
    if args.out:
        atomic_write_json(Path(args.out) / VERDICT_FILE, {**outcome, "markdown": text})
    print(text)
    return code


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register `bench` on the `python -m papermill_runs` subparsers."""
    p = sub.add_parser("bench", help="judge a `python -m gemma4lab bench --json` report against its baseline (ratios)")
    p.add_argument("--report", required=True, type=Path, help="the suite's JSON report")
    p.add_argument(
        "--update-baseline",
        action="store_true",
        help="write this report's ratios as the bench baseline (subjects whose checks passed)",
    )
    p.add_argument(
        "--allow-missing-baseline",
        action="store_true",
        help="a subject without a baseline passes on its exact checks alone",
    )
    p.add_argument(
        "--machine-kind",
        help="baseline key (default: $GEMMA4LIB_MACHINE_KIND or <instance>-<arch>); "
        "judge a report with the kind of the machine that produced it",
    )
    p.add_argument(
        "--baseline-dir", type=Path, help="default: papermill_runs/baselines (the file is bench/<kind>.json)"
    )
    p.add_argument("--tolerances", type=Path, help="default: papermill_runs/tolerances.json (profile bench)")
    p.add_argument("--out", type=Path, help=f"also write {VERDICT_FILE} into this folder")
    p.set_defaults(func=cmd_bench)
    return p
