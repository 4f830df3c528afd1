"""Baselines, tolerances and the regression verdict.

A baseline is one JSON file per profile and machine kind, `baselines/<profile>/<machine-kind>.json`,
holding the last accepted figures of every variant. `tolerances.json` says, per metric, which
direction is worse, how far (relative, plus an absolute floor) a run may drift before it is a
regression, and whether the metric gates the verdict or is only reported.

Verdicts, worst first:

- `error`: the notebook failed (or wrote no record);
- `fail`: a correctness check failed (SEQ_MATCH, LOGITS_MATCH, coherence, the witness's
  SEQ_MATCH or LOGITS_MATCH, the prefill logits bound, the answer changed);
- `regression`: a gated metric is worse than its baseline beyond tolerance;
- `no-baseline`: nothing to compare with (no file, or no entry for the variant). It fails the run
  unless `--allow-missing-baseline` (or `--update-baseline`, which writes one);
- `pass`.

A baseline or tolerance file that exists but cannot be read or has the wrong shape raises
`BaselineError`: it is never treated as "no baseline".
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gemma4lib.cache.artifacts import atomic_write_json
from gemma4lib.errors import BaselineError

PACKAGE_DIR = Path(__file__).resolve().parent
BASELINE_DIR = PACKAGE_DIR / "baselines"
TOLERANCES_FILE = PACKAGE_DIR / "tolerances.json"
SCHEMA = 1

LOWER, HIGHER = "lower_is_better", "higher_is_better"
STATUS_ORDER = ("pass", "no-baseline", "regression", "fail", "error")
# what a baseline entry keeps of a result
BASELINE_KEYS = (
    "seq_match",
    "logits_match",
    "coherent",
    "answer",
    "model_source",
    "compiler",
    "tp_degree",
    "new_tokens",
    "prefill_ms",
    "decode_tok_s",
    "compile_s",
    "peak_rss_mb",
    "prefill_logits_max_abs_diff",
    "logits_max_err",
    "logits_tolerance",
)


def machine_kind() -> str:
    """What the baselines are keyed by: `$GEMMA4LIB_MACHINE_KIND`, else `<instance type>-<arch>`
    (instance type from `$GEMMA4LIB_INSTANCE_TYPE`, `cpu` when unset), e.g. `cpu-x86_64`."""
    explicit = os.environ.get("GEMMA4LIB_MACHINE_KIND")
    if explicit:
        return explicit
    instance = os.environ.get("GEMMA4LIB_INSTANCE_TYPE") or "cpu"
    return f"{instance}-{platform.machine() or 'unknown'}"


def baseline_path(profile: str, kind: str, root: Path | None = None) -> Path:
    return Path(root or BASELINE_DIR) / profile / f"{kind}.json"


# ---- tolerances -----------------------------------------------------------------------------------


def _merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        nested = isinstance(value, Mapping) and isinstance(out.get(key), Mapping)
        out[key] = _merge(out[key], value) if nested else value
    return out


def load_tolerances(profile: str, path: Path | None = None) -> dict[str, Any]:
    """The tolerances for `profile`: the file's `default` block with `profiles.<profile>` merged in."""
    path = Path(path or TOLERANCES_FILE)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise BaselineError(f"tolerance file {path} is missing; restore papermill_runs/tolerances.json") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise BaselineError(f"tolerance file {path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or not isinstance(data.get("default"), dict):
        raise BaselineError(f'tolerance file {path} must be an object with "schema": {SCHEMA} and a "default" block')
    merged = _merge(data["default"], (data.get("profiles") or {}).get(profile) or {})
    problems = []
    for name, rule in (merged.get("metrics") or {}).items():
        if not isinstance(rule, dict):
            problems.append(f"metrics.{name} is not an object")
            continue
        if rule.get("direction") not in (LOWER, HIGHER):
            problems.append(f"metrics.{name}.direction must be {LOWER!r} or {HIGHER!r}")
        for key in ("rel_tol", "abs_tol"):
            value = rule.get(key, 0.0)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                problems.append(f"metrics.{name}.{key} must be a number >= 0")
        if not isinstance(rule.get("gate", True), bool):
            problems.append(f"metrics.{name}.gate must be true or false")
    correctness = merged.get("correctness")
    if not isinstance(correctness, dict):
        problems.append("correctness block missing")
    if problems:
        raise BaselineError(f"tolerance file {path}: " + "; ".join(problems))
    return merged


# ---- baseline files -------------------------------------------------------------------------------


def _check_entry(name: str, entry: Any, metrics: Iterable[str]) -> list[str]:
    if not isinstance(entry, dict):
        return [f"variants.{name} is not an object"]
    problems = []
    if not isinstance(entry.get("seq_match"), bool):
        problems.append(f"variants.{name}.seq_match must be true or false")
    if entry.get("coherent") not in (True, False, None):
        problems.append(f"variants.{name}.coherent must be true, false or null")
    if entry.get("logits_match") not in (True, False, None):
        problems.append(f"variants.{name}.logits_match must be true, false or null")
    if entry.get("witness") is not None and not isinstance(entry.get("witness"), dict):
        problems.append(f"variants.{name}.witness must be an object or null")
    for metric in metrics:
        value = entry.get(metric)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
            problems.append(f"variants.{name}.{metric} must be a number >= 0 or null, got {value!r}")
    return problems


def load_baseline(path: Path, profile: str, kind: str, metrics: Iterable[str] = ()) -> dict[str, Any] | None:
    """The baseline file's content, or None when the file does not exist. Any other problem raises
    `BaselineError` naming the file and what is wrong with it."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise BaselineError(
            f"baseline {path} is not valid JSON ({exc}); fix it, or delete it and rerun with --update-baseline"
        ) from None
    problems = []
    if not isinstance(data, dict):
        problems.append("top level is not an object")
    else:
        if data.get("schema") != SCHEMA:
            problems.append(f"schema is {data.get('schema')!r}, expected {SCHEMA}")
        if data.get("profile") != profile:
            problems.append(f"profile is {data.get('profile')!r}, expected {profile!r}")
        if data.get("machine_kind") != kind:
            problems.append(f"machine_kind is {data.get('machine_kind')!r}, expected {kind!r}")
        variants = data.get("variants")
        if not isinstance(variants, dict):
            problems.append('"variants" is not an object')
        else:
            for name, entry in variants.items():
                problems += _check_entry(name, entry, metrics)
    if problems:
        raise BaselineError(
            f"baseline {path} is malformed: "
            + "; ".join(problems)
            + "; fix it, or delete it and rerun with --update-baseline"
        )
    return data


def baseline_entry(result: Mapping[str, Any]) -> dict[str, Any]:
    entry = {k: result.get(k) for k in BASELINE_KEYS}
    witness = result.get("witness")
    entry["witness"] = None if not witness else {k: witness.get(k) for k in ("seq_match", "logits_match")}
    entry["git_sha"] = (result.get("versions") or {}).get("git_sha")
    entry["recorded"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return entry


def smoothed(name: str, metric: str, current: Any, history: Iterable[Mapping[str, Any]], runs: int) -> Any:
    """The median of `current` and the variant's last `runs - 1` correct runs in `history`.

    One timing on a shared machine can be off by 2-4x; a baseline taken from a single run would
    turn the next ordinary run into a "regression". The median of a few runs is what a run is
    compared with instead."""
    if current is None or runs <= 1:
        return current
    past = [
        h["metrics"][metric]
        for h in history
        if h.get("variant") == name
        and h.get("verdict") not in ("fail", "error")
        and isinstance(h.get("metrics"), dict)
        and isinstance(h["metrics"].get(metric), (int, float))
    ]
    values = sorted(past[-(runs - 1) :] + [current])
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def update_baseline(
    path: Path,
    profile: str,
    kind: str,
    results: Mapping[str, Mapping[str, Any]],
    verdicts: Mapping[str, Verdict],
    existing: Mapping[str, Any] | None,
    history: Iterable[Mapping[str, Any]] = (),
    metrics: Iterable[str] = (),
    runs: int = 5,
) -> tuple[list[str], list[str]]:
    """Write the baseline file atomically for every variant whose checks passed (earlier entries kept
    for the others). Metrics are the median of this run and the last `runs - 1` correct runs in
    `history` (pass the history *before* this run is appended). Returns (updated, refused) names."""
    variants = dict((existing or {}).get("variants") or {})
    history = list(history)
    updated, refused = [], []
    for name, result in results.items():
        verdict = verdicts.get(name)
        if verdict is None or verdict.status in ("error", "fail"):
            refused.append(name)
            continue
        entry = baseline_entry(result)
        for metric in metrics:
            entry[metric] = smoothed(name, metric, result.get(metric), history, runs)
        entry["runs_in_median"] = min(
            runs, 1 + sum(1 for h in history if h.get("variant") == name and h.get("verdict") not in ("fail", "error"))
        )
        variants[name] = entry
        updated.append(name)
    data = {
        "schema": SCHEMA,
        "profile": profile,
        "machine_kind": kind,
        "updated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "note": "written by `python -m papermill_runs run --update-baseline`; tolerances in tolerances.json",
        "variants": dict(sorted(variants.items())),
    }
    atomic_write_json(Path(path), data)
    return updated, refused


# ---- the verdict ----------------------------------------------------------------------------------


@dataclass
class MetricCheck:
    metric: str
    value: float | None
    baseline: float | None
    limit: float | None
    gate: bool
    status: str  # ok | worse | n/a
    change: float | None = None  # relative change, signed so that positive = worse

    def describe(self) -> str:
        if self.value is None or self.baseline is None or self.limit is None:
            return f"{self.metric}: not compared (value {self.value}, baseline {self.baseline})"
        word = ">" if self.value > self.limit else "<"
        change = "" if self.change is None else f", {self.change:+.0%} {'worse' if self.change > 0 else 'better'}"
        return f"{self.metric} {self.value:.4g} {word} limit {self.limit:.4g} (baseline {self.baseline:.4g}{change})"


@dataclass
class Verdict:
    variant: str
    status: str
    reasons: list[str] = field(default_factory=list)
    metrics: list[MetricCheck] = field(default_factory=list)
    notebook: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def ok(self) -> bool:
        return self.status == "pass"


def tolerated_statuses(allow_missing: bool, update: bool) -> set[str]:
    """Verdicts besides "pass" that do not fail a run: a missing baseline when that is allowed or one
    is being written, a regression when the baseline is being rewritten. "fail" and "error" never."""
    return ({"no-baseline"} if allow_missing or update else set()) | ({"regression"} if update else set())


def exit_code(verdicts: Mapping[str, Verdict], allow_missing: bool, update: bool) -> int:
    """0 when every verdict passed or is tolerated (`tolerated_statuses`), else 1."""
    tolerated = {"pass"} | tolerated_statuses(allow_missing, update)
    return 0 if all(v.status in tolerated for v in verdicts.values()) else 1


def worst(statuses: Iterable[str]) -> str:
    return max(statuses, key=STATUS_ORDER.index, default="pass")


def check_metric(metric: str, value: Any, base: Any, rule: Mapping[str, Any]) -> MetricCheck:
    gate = bool(rule.get("gate", True))
    if value is None or base is None:
        return MetricCheck(metric, value, base, None, gate, "n/a")
    value, base = float(value), float(base)
    rel, floor = float(rule.get("rel_tol", 0.0)), float(rule.get("abs_tol", 0.0))
    if rule["direction"] == LOWER:
        limit = base * (1 + rel) + floor
        worse = value > limit
        change = (value - base) / base if base else None
    else:
        limit = max(base * (1 - rel) - floor, 0.0)
        worse = value < limit
        change = (base - value) / base if base else None
    return MetricCheck(metric, value, base, limit, gate, "worse" if worse else "ok", change)


def correctness_problems(
    result: Mapping[str, Any], entry: Mapping[str, Any] | None, rules: Mapping[str, Any]
) -> list[str]:
    problems = []
    if rules.get("seq_match", True) and result.get("seq_match") is not True:
        where = result.get("first_mismatch")
        problems.append("SEQ_MATCH failed" + (f" (first mismatch at token {where})" if where is not None else ""))
    coherent = result.get("coherent")
    if rules.get("coherent", True):
        if coherent is False:
            problems.append(f"incoherent answer {result.get('answer')!r} ({result.get('coherence_rule')})")
        elif coherent is None and entry is not None and entry.get("coherent") is True:
            problems.append(
                f"coherence not checked (model source {result.get('model_source')!r}) although the "
                f"baseline was coherent: is the trained fixture missing?"
            )
    if rules.get("logits_match", True):
        if result.get("logits_match") is False:
            problems.append(str(result.get("logits_explain") or "LOGITS_MATCH failed"))
        elif result.get("logits_match") is None and (entry or {}).get("logits_match") is True:
            problems.append(
                "LOGITS_MATCH not checked (the record has no per-step logits) although the baseline checked it"
            )
    witness = result.get("witness")
    if rules.get("witness", True):
        for key, name in (("seq_match", "SEQ_MATCH"), ("logits_match", "LOGITS_MATCH")):
            if witness and witness.get(key) is False:
                detail = (
                    f" (first mismatch at token {witness.get('first_mismatch')})"
                    if key == "seq_match"
                    else f": {witness.get('logits_explain')}"
                )
                problems.append(f"witness {name} failed{detail}")
        if not witness and entry is not None and entry.get("witness"):
            problems.append("the random-weights witness did not run although the baseline ran it")
    if (
        rules.get("answer_matches_baseline")
        and entry is not None
        and entry.get("answer") is not None
        and result.get("answer") != entry.get("answer")
    ):
        problems.append(f"answer changed: {result.get('answer')!r}, baseline {entry.get('answer')!r}")
    return problems


def judge(
    name: str,
    result: Mapping[str, Any] | None,
    entry: Mapping[str, Any] | None,
    tolerances: Mapping[str, Any],
    notebook: str | None = None,
    error: str | None = None,
) -> Verdict:
    """The verdict for one variant's record against its baseline entry (None: no baseline)."""
    if result is None:
        return Verdict(name, "error", [error or "the notebook wrote no result record"], notebook=notebook)
    problems = correctness_problems(result, entry, tolerances.get("correctness") or {})
    checks = []
    if entry is not None:
        checks = [
            check_metric(metric, result.get(metric), entry.get(metric), rule)
            for metric, rule in (tolerances.get("metrics") or {}).items()
        ]
    regressions = [c.describe() for c in checks if c.status == "worse" and c.gate]
    notes = [c.describe() + " [informational]" for c in checks if c.status == "worse" and not c.gate]
    if problems:
        return Verdict(name, "fail", problems + regressions + notes, checks, notebook)
    if entry is None:
        return Verdict(name, "no-baseline", ["no baseline entry for this variant"], checks, notebook)
    if regressions:
        return Verdict(name, "regression", regressions + notes, checks, notebook)
    return Verdict(name, "pass", notes, checks, notebook)


def judge_all(
    results: Mapping[str, Mapping[str, Any] | None],
    baseline: Mapping[str, Any] | None,
    tolerances: Mapping[str, Any],
    notebooks: Mapping[str, str] | None = None,
    errors: Mapping[str, str] | None = None,
) -> dict[str, Verdict]:
    entries = (baseline or {}).get("variants") or {}
    return {
        name: judge(name, result, entries.get(name), tolerances, (notebooks or {}).get(name), (errors or {}).get(name))
        for name, result in results.items()
    }


# ---- history ----------------------------------------------------------------------------------------


def append_history(path: Path, records: Iterable[Mapping[str, Any]]) -> Path:
    """Append one JSON line per record (never rewritten; flushed and synced)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        for record in records:
            handle.write(json.dumps(record, sort_keys=True, default=str) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    return path


def read_history(path: Path) -> list[dict[str, Any]]:
    """Every readable line of the history file (a torn last line is skipped, not fatal)."""
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records
