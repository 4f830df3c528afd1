"""The run record: one versioned JSON document per run, built here and only here.

`port.port()`, the notebooks, the fault lab, papermill's baselines and the summaries all read the same
keys, so a device run and the checks' report go in here and the record comes out with the verdict
every reader applies: `failed_checks` (empty when every check held). `schema` tells an old record
(2: LOGITS_MATCH's keys and the witness; 3: the compiler's key `recipe` renamed `compiler`, "recipe"
now meaning only the inf2 recipe, `inf2_recipe`).
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import checks
from .cache.artifacts import atomic_write_json
from .environment import machine, peak_rss_mb, versions
from .inf2.memory_plan import neuron_recipe

if TYPE_CHECKING:
    from .backends.base import DeviceRun
    from .models.loading import LoadedModel
    from .settings import PortSettings

RECORD_SCHEMA = 3


def build_record(
    settings: PortSettings,
    model: LoadedModel,
    ids: list[int],
    device_run: DeviceRun,
    report: checks.CheckReport,
    reference: list[int],
    *,
    started: float | None = None,
    witness: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The record of one run: settings, model, the three checks, figures, environment, verdict."""
    variant = settings.variant_spec
    tokens = list(device_run.tokens)
    result: dict[str, Any] = {
        "schema": RECORD_SCHEMA,
        "variant": variant.name,
        "profile": settings.profile,
        "backend": settings.backend,
        "compiler": device_run.compiler,
        "inf2_recipe": neuron_recipe(variant, settings.tp_degree, getattr(settings, "neuron_recipe", None)),
        "tp_degree": settings.tp_degree,
        "model_source": model.source,
        "seq_match": report.seq_match,
        "logits_match": report.logits_match,
        "coherent": report.coherent,
        "coherence_rule": report.coherence_rule,
        "answer": report.answer,
        "reference_answer": report.reference_answer,
        "new_tokens": len(tokens),
        "tokens": tokens,
        "reference_tokens": list(reference),
        "first_mismatch": report.first_mismatch,
        **(report.logits.record() if report.logits else {}),
        "prompt_tokens": len(ids),
        "prefill_ms": device_run.prefill_ms,
        "decode_tok_s": device_run.decode_tok_s,
        "compile_s": device_run.compile_s,
        "peak_rss_mb": peak_rss_mb(),
        "wall_s": None if started is None else time.perf_counter() - started,
        "layout": model.layout.describe(),
        "params": model.param_count(),
        "parameters": settings.parameters(),
        "versions": versions(),
        "machine": {**machine(), "python": sys.executable},
        **device_run.record_fields(),
        **dict(extra or {}),
    }
    if witness is not None:
        result["witness"] = dict(witness)
    result["failed_checks"] = checks.failed_checks(result)
    result["checks_passed"] = not result["failed_checks"]
    return result


# ---- one JSON file per run, written atomically ----------------------------------------------------
def result_filename(result: dict[str, Any]) -> str:
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    name = f"{result.get('variant', 'run')}-{result.get('profile', 'x')}-tp{result.get('tp_degree', 1)}-{stamp}"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name) + ".json"


def write_result(result: dict[str, Any], folder: Path, name: str | None = None) -> Path:
    """Write `result` as `folder/name` (default: variant-profile-tp-timestamp.json) and return the path."""
    path = Path(folder) / (name or result_filename(result))
    atomic_write_json(path, result)
    return path
