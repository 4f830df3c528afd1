"""One port, end to end: load → device graph → compile → the three checks → benchmark → record.

Each stage is its own function so a notebook can show them one cell at a time; `port()` chains
them for the command line and CI. The checks (`checks.py`): SEQ_MATCH, LOGITS_MATCH (every
generated position against the reference's logits for the same tokens) and coherence; smoke runs
of a trained fixture also run a seeded random-weights witness of the same architecture through the
same compiled programs, whose near-ties turn any logit error into a different token.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from . import backends, checks
from .backends.base import CompiledGraphs, DeviceRun
from .device.build import Graphs, device_graphs
from .device.quant import round_model_weights
from .models.checkpoint import load_checkpoint
from .models.loading import LoadedModel, build_tiny
from .record import build_record
from .reference import random_prompt, reference_greedy, teacher_forced_logits
from .results import write_result
from .runtime import encode_prompt
from .settings import BACKENDS, DEFAULT_PROMPT, MODEL_SOURCES, PortSettings

log = logging.getLogger(__name__)

__all__ = [
    "BACKENDS",
    "DEFAULT_PROMPT",
    "MODEL_SOURCES",
    "PortSettings",
    "build_graphs",
    "compile_graphs",
    "eos_ids",
    "load_model",
    "port",
    "prompt_ids",
    "record_run",
    "run_device",
]


# ---- stages ----------------------------------------------------------------------------------
def load_model(settings: PortSettings) -> LoadedModel:
    """The model of `settings`; with `weights="int8"` its quantized weights are rounded in place to
    `q * scale` (`quant.round_model_weights`), so the host reference the checks use is the quantized
    model's own and the int8 device graph must reproduce it exactly."""
    model = _load_full_precision(settings)
    if settings.weights == "int8":
        round_model_weights(model.lm)
    return model


def _load_full_precision(settings: PortSettings) -> LoadedModel:
    variant = settings.variant_spec
    source = settings.model_source
    if source == "checkpoint":
        dtype = torch.bfloat16 if settings.backend == "neuron" else torch.float32
        return load_checkpoint(variant, settings.checkpoint or variant.hf_id, dtype=dtype)
    if source == "trained":
        from .models.trained import load_trained

        return load_trained(variant.name)
    return build_tiny(variant, seed=settings.seed)


def prompt_ids(model: LoadedModel, settings: PortSettings) -> list[int]:
    """The chat-templated prompt, or a seeded random id sequence for a tokenizer-less random model."""
    if model.tokenizer is not None:
        return encode_prompt(model.tokenizer, settings.prompt)
    return random_prompt(model.config.vocab_size, settings.random_prompt_tokens, settings.seed + 1)


def eos_ids(model: LoadedModel) -> list[int]:
    """Stop tokens of a real tokenizer; none for random weights (they have no meaningful eos)."""
    if model.tokenizer is None:
        return []
    ids = {model.tokenizer.eos_token_id}
    turn_end = model.tokenizer.convert_tokens_to_ids("<turn|>")
    if isinstance(turn_end, int) and turn_end != model.tokenizer.unk_token_id:
        ids.add(turn_end)
    return sorted(i for i in ids if i is not None)


def build_graphs(model: LoadedModel, settings: PortSettings, inplace: bool = True) -> Graphs:
    """Prefill graphs (one per bucket, all-experts-dense) and the decode graph."""
    return device_graphs(model, settings, inplace)


def compile_graphs(
    model: LoadedModel, settings: PortSettings, *, graphs: Graphs | None = None, progress: bool = False
) -> CompiledGraphs:
    """Compile the device graphs with the settings' backend (`backends`) and wrap them in a host
    runtime; `graphs` hands over prebuilt prefill and decode graphs (`cpu` and `eager` only)."""
    return backends.compile_graphs(model, settings, graphs=graphs, progress=progress)


def run_device(
    model: LoadedModel,
    settings: PortSettings,
    ids: list[int],
    eos: list[int],
    *,
    progress: bool = False,
    bench: bool = True,
) -> DeviceRun:
    """Build, compile and run the device graphs with the settings' backend (every backend has a
    `run`: `backends.base`): the device part of the record, with the per-step logits LOGITS_MATCH needs.
    With a draft, the assistant drafts and the target verifies k + 1 at a time (`speculative`)."""
    if settings.draft is not None:
        from .serving.drafted_run import run_device_drafted

        return run_device_drafted(model, settings, ids, eos, progress=progress, bench=bench)
    return backends.run_device(model, settings, ids, eos, progress=progress, bench=bench)


def judge_run(
    model: LoadedModel,
    settings: PortSettings,
    ids: list[int],
    eos: list[int],
    tokens: list[int],
    step_logits: torch.Tensor | None,
) -> tuple[checks.CheckReport, list[int]]:
    """The three checks of one device run against the host reference; (report, reference tokens)."""
    reference = reference_greedy(model.lm, ids, settings.max_new_tokens, eos)
    report = checks.evaluate(
        model.lm, model.tokenizer, ids, tokens, reference, expect=settings.expect, step_logits=step_logits
    )
    if report.logits is not None and not report.logits.passed:
        log.warning("%s", report.logits.explain())
    return report, reference


def reference_margin(model: LoadedModel, ids: list[int], tokens: list[int]) -> float | None:
    """The smallest top-1 minus top-2 reference logit over the generated positions: how close
    to a tie the model came (a witness wants small margins: any logit error flips a token)."""
    if not tokens:
        return None
    top2 = teacher_forced_logits(model.lm, ids, tokens).topk(2, dim=-1).values
    return float((top2[:, 0] - top2[:, 1]).min())


def witness_settings(settings: PortSettings) -> PortSettings:
    """The witness: the same variant, shapes and backend, with seeded random weights (so the same
    compiled programs: parameters are loaded at run time, and the buffers the compiler folds in,
    such as `layer_scalar`, hold the same values in the random and the trained tiny models)."""
    return replace(settings, model="random", witness=False, results_dir=None)


def witness_record(model: LoadedModel, settings: PortSettings, ids: list[int], device_run: DeviceRun) -> dict[str, Any]:
    """The witness's part of the record: its SEQ_MATCH and LOGITS_MATCH (it has no coherence)."""
    tokens = device_run.tokens
    report, reference = judge_run(model, settings, ids, [], tokens, device_run.step_logits)
    out = {
        "model_source": model.source,
        "seed": settings.seed,
        "prompt_tokens": len(ids),
        "new_tokens": len(tokens),
        "distinct_tokens": len(set(tokens)),
        "seq_match": report.seq_match,
        "first_mismatch": report.first_mismatch,
        "logits_match": report.logits_match,
        **(report.logits.record() if report.logits else {}),
        "reference_min_margin": reference_margin(model, ids, reference),
        "tokens": tokens,
        "reference_tokens": reference,
        "compiler": device_run.compiler,
        "cache_hits": device_run.cache_hits,
        "artifacts": device_run.artifacts,
    }
    out["passed"] = report.seq_match and report.logits_match is not False
    return out


def run_witness(
    settings: PortSettings, *, progress: bool = False, artifacts: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run the random-weights witness of `settings`' variant and return its record.

    `artifacts`: the trained run's compiled artifacts; `same_programs` then says whether the
    witness ran the very same ones (not when the compiler folded a parameter whose values differ
    between the two models into the program: 31B's and 26B-A4B's tiny q/k norms)."""
    w = witness_settings(settings)
    model = load_model(w)
    ids = prompt_ids(model, w)
    device_run = run_device(model, w, ids, [], progress=progress, bench=False)
    record = witness_record(model, w, ids, device_run)
    if artifacts and record.get("artifacts"):
        record["same_programs"] = record["artifacts"] == artifacts
    return record


def port(settings: PortSettings, progress: bool = False) -> dict[str, Any]:
    """Run the whole recipe and return (and, with results_dir, write) the result record."""
    started = time.perf_counter()
    torch.manual_seed(settings.seed)
    model = load_model(settings)
    if settings.batch_size > 1:  # B prompts through batched graphs, every row judged (batch_port.py)
        from .serving.batch_port import port_batch

        return port_batch(settings, model, eos_ids(model), started, load=load_model, progress=progress)
    ids = prompt_ids(model, settings)
    eos = eos_ids(model)
    device_run = run_device(model, settings, ids, eos, progress=progress)
    witness = None
    if settings.wants_witness:
        witness = run_witness(settings, progress=progress, artifacts=device_run.artifacts)
    return record_run(settings, model, ids, eos, device_run, started, witness)


def record_run(
    settings: PortSettings,
    model: LoadedModel,
    ids: list[int],
    eos: list[int],
    device_run: DeviceRun,
    started: float,
    witness: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The run record: the device run judged by the three checks (plus the witness's record when
    given), with `failed_checks`, the one verdict the CLI, papermill and the fault lab apply."""
    report, reference = judge_run(model, settings, ids, eos, device_run.tokens, device_run.step_logits)
    result = build_record(settings, model, ids, device_run, report, reference, started=started, witness=witness)
    if settings.results_dir:
        result["result_file"] = str(write_result(result, Path(settings.results_dir)))
    return result
