"""The notebook's run record (`record.build_record`, the builder `port()` uses) and reading the
records the variant notebooks wrote."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from gemma4lab.notebook.display import _tables_to_dicts
from gemma4lib import checks
from gemma4lib.backends.base import CompiledGraphs, DeviceRun
from gemma4lib.backends.registry import prefill_logits_error
from gemma4lib.cache.artifacts import atomic_write_json
from gemma4lib.models.loading import LoadedModel
from gemma4lib.models.variants import VARIANTS
from gemma4lib.record import build_record
from gemma4lib.timing import BenchFigures

if TYPE_CHECKING:  # type names only
    from gemma4lib.runtime import RowResult
    from gemma4lib.settings import PortSettings


def record(
    settings: PortSettings,
    model: LoadedModel,
    compiled: CompiledGraphs,
    generation: RowResult,
    reference_tokens: Sequence[int],
    report: checks.CheckReport,
    figures: BenchFigures | None,
    results_path: str | Path | None,
    started: float | None = None,
    extra: Mapping[str, Any] | None = None,
    witness: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The record of the notebook's `generation` over `compiled` (`record.build_record`, the builder
    `port()` uses too), written atomically to `results_path` (JSON) when given; `extra` (the
    notebook's demonstrations) rides along."""
    device_run = DeviceRun(
        rows=[generation],
        compiler=compiled.compiler,
        compile_s=compiled.compile_s,
        prefill_logits_max_abs_diff=prefill_logits_error(model, generation),
        cache_hits=compiled.cache_hits,
        details=dict(compiled.info),
    )
    if figures is not None:
        device_run.bench, device_run.prefill_ms, device_run.decode_tok_s = (
            figures,
            figures.prefill_ms,
            figures.decode_tok_s,
        )
    if compiled.report:  # after the benchmark: the backend counts what the whole run did
        device_run.details.update(compiled.report())
    result = build_record(
        settings,
        model,
        list(generation.prompt_ids),
        device_run,
        report,
        list(reference_tokens),
        started=started,
        witness=witness,
        extra=_tables_to_dicts(dict(extra or {})),
    )
    if results_path:
        result["result_file"] = str(Path(results_path))
        atomic_write_json(Path(results_path), result)
    return result


def report_checks(report: checks.CheckReport) -> dict[str, Any]:
    """What a notebook's image or audio section records of one checked answer: it, the reference's, and
    the three checks (the logit error next to its tolerance)."""
    logits = report.logits
    return {
        "answer": report.answer,
        "reference_answer": report.reference_answer,
        "seq_match": report.seq_match,
        "logits_match": report.logits_match,
        "logits_max_err": logits.max_err if logits else None,
        "logits_tolerance": logits.tolerance if logits else None,
        "coherent": report.coherent,
    }


def save_record(path: str | Path | None, data: Mapping[str, Any]) -> Path | None:
    """Write a JSON record atomically (nothing when `path` is empty)."""
    if not path:
        return None
    atomic_write_json(Path(path), _tables_to_dicts(dict(data)))
    return Path(path)


def load_results(folder: str | Path) -> dict[str, dict[str, Any]]:
    """The newest port record per variant found in `folder` (empty when there is none); a record with
    a `kind` (the overview's, 06_serving's) is another notebook's, not the variant notebook's."""
    found: dict[str, tuple[float, dict[str, Any]]] = {}
    folder = Path(folder)
    if not folder.is_dir():
        return {}
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        name = data.get("variant") if isinstance(data, dict) else None
        if isinstance(data, dict) and data.get("kind"):  # another notebook's record (06_serving's), not a port's
            continue
        if name in VARIANTS and (name not in found or path.stat().st_mtime >= found[name][0]):
            found[name] = (path.stat().st_mtime, data)
    return {name: found[name][1] for name in VARIANTS if name in found}


def tensor_digest(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's float32 bytes: what a record keeps of the step logits, so a test can
    check that the notebook's cells computed exactly what `port()` computes for the same settings."""
    return hashlib.sha256(tensor.detach().float().contiguous().numpy().tobytes()).hexdigest()
