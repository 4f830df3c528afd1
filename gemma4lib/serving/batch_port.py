"""A port with `batch_size > 1`: B prompts through one set of batched graphs, every row checked.

Each row is judged exactly as a batch-1 run is: its tokens against its own batch-1 host reference
(SEQ_MATCH), its logits at every generated position against the reference's teacher-forced logits
(LOGITS_MATCH) and its answer against its own expectation (coherence). The record keeps the
batch-1 keys (filled from row 0, so every reader keeps working), overrides `seq_match`,
`logits_match` and `coherent` with the verdict over all rows, and adds `batch_size` and `rows`.
`decode_tok_s` is the batch's total (tokens of all rows per second), `decode_tok_s_per_row` beside it.

`port.port()` comes here when `settings.batch_size > 1`; it hands over the loader so this module
never imports `port` (no cycle).
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from .. import backends, checks
from ..backends.base import DeviceRun
from ..models.loading import LoadedModel
from ..record import build_record
from ..reference import random_prompt, reference_greedy
from ..results import write_result
from ..runtime import encode_prompt
from ..settings import PortSettings
from .batch_prompts import random_prompt_lengths
from .batch_runtime import BatchGeneration, generate_batch

log = logging.getLogger(__name__)

Loader = Callable[[PortSettings], LoadedModel]


def batch_prompt_rows(
    model: LoadedModel, settings: PortSettings, *, vary: bool = True
) -> list[tuple[list[int], str | None]]:
    """(prompt ids, expected answer) per row: chat-templated prompts, or for a tokenizer-less random
    model seeded random ids (no expectation): of different lengths (`vary`), or the batch-1 prompt in
    every row (`vary=False`, the witness: see `batch_witness`)."""
    if model.tokenizer is None:
        vocab = model.config.vocab_size
        if not vary:
            return [
                (random_prompt(vocab, settings.random_prompt_tokens, settings.seed + 1), None)
            ] * settings.batch_size
        lengths = random_prompt_lengths(settings.random_prompt_tokens, settings.batch_size)
        return [(random_prompt(vocab, n, settings.seed + 1 + i), None) for i, n in enumerate(lengths)]
    return [(encode_prompt(model.tokenizer, prompt), expect) for prompt, expect in settings.batch_rows()]


def _row_device_run(generation: BatchGeneration) -> list[dict[str, Any]]:
    return [{"tokens": row.tokens, "step_logits": row.step_logits} for row in generation.rows]


def bench_batch(runtime, prompts: list[list[int]], max_new_tokens: int, warmup: int, iters: int) -> dict[str, Any]:
    """Median prefill ms and total decode tok/s of whole batched generations (eos ignored)."""
    prefill_ms, tok_s = [], []
    for i in range(warmup + iters):
        generation = generate_batch(runtime, prompts, max_new_tokens)
        if i >= warmup:
            prefill_ms.append(generation.prefill_s * 1000)
            if generation.decode_tok_s:
                tok_s.append(generation.decode_tok_s)
    total = statistics.median(tok_s) if tok_s else 0.0
    return {
        "prefill_ms": statistics.median(prefill_ms),
        "decode_tok_s": total,
        "decode_tok_s_per_row": total / len(prompts),
        "decode_tok_s_runs": tok_s,
        "threads": torch.get_num_threads(),
        "warmup": warmup,
        "iters": iters,
    }


def run_device_batch(
    model: LoadedModel,
    settings: PortSettings,
    prompts: list[list[int]],
    eos: list[int],
    *,
    progress: bool = False,
    bench: bool = True,
) -> dict[str, Any]:
    """Compile the batched graphs with the settings' backend and generate every row; the device run
    with `rows` (tokens and per-step logits per row)."""
    if backends.backend_for(settings) == "gloo":
        from ..tp.cpu_gloo import run_tp_batch

        return run_tp_batch(model, settings, prompts, eos)
    compiled = backends.compile_graphs(model, settings, progress=progress)
    runtime = compiled.runtime
    generation = generate_batch(runtime, prompts, settings.max_new_tokens, eos_token_ids=eos, keep_logits=True)
    device_run: dict[str, Any] = {
        "rows": _row_device_run(generation),
        "compiler": compiled.compiler,
        "compile_s": compiled.compile_s,
        "cache_hits": compiled.cache_hits,
        "prefill_ms": generation.prefill_s * 1000,
        "decode_tok_s": generation.decode_tok_s,
        "decode_tok_s_per_row": generation.decode_tok_s_per_row,
        **compiled.info,
    }
    if bench:
        figures = bench_batch(runtime, prompts, settings.max_new_tokens, settings.warmup, settings.iters)
        device_run.update(
            bench=figures,
            prefill_ms=figures["prefill_ms"],
            decode_tok_s=figures["decode_tok_s"],
            decode_tok_s_per_row=figures["decode_tok_s_per_row"],
        )
    if compiled.report:
        device_run.update(compiled.report())
    return device_run


def judge_rows(
    model: LoadedModel,
    settings: PortSettings,
    rows: list[tuple[list[int], str | None]],
    eos: list[int],
    device_rows: list[dict[str, Any]],
) -> list[tuple[checks.CheckReport, list[int]]]:
    """The three checks of every row against its own batch-1 host reference."""
    judged = []
    for (ids, expect), run in zip(rows, device_rows, strict=True):
        reference = reference_greedy(model.lm, ids, settings.max_new_tokens, eos)
        report = checks.evaluate(
            model.lm, model.tokenizer, ids, run["tokens"], reference, expect=expect, step_logits=run["step_logits"]
        )
        if report.logits is not None and not report.logits.passed:
            log.warning("row %d: %s", len(judged), report.logits.explain())
        judged.append((report, reference))
    return judged


def row_records(
    rows: list[tuple[list[int], str | None]],
    judged: list[tuple[checks.CheckReport, list[int]]],
    device_rows: list[dict[str, Any]],
    prompts_text: list[str | None],
) -> list[dict[str, Any]]:
    """The record's `rows`: one entry per prompt with its tokens, answer and three checks."""
    out = []
    for i, ((ids, expect), (report, reference), run, text) in enumerate(
        zip(rows, judged, device_rows, prompts_text, strict=True)
    ):
        out.append(
            {
                "row": i,
                "prompt": text,
                "prompt_tokens": len(ids),
                "expect": expect,
                "tokens": list(run["tokens"]),
                "reference_tokens": list(reference),
                "answer": report.answer,
                "reference_answer": report.reference_answer,
                "seq_match": report.seq_match,
                "first_mismatch": report.first_mismatch,
                "logits_match": report.logits_match,
                **(
                    {"logits_max_err": report.logits.max_err, "logits_tolerance": report.logits.tolerance}
                    if report.logits
                    else {}
                ),
                "coherent": report.coherent,
            }
        )
    return out


def _all(values: list[bool | None]) -> bool | None:
    """True only if every row's check held; None if no row ran that check."""
    known = [v for v in values if v is not None]
    if not known:
        return None
    return all(known) and len(known) == len(values)


def batch_witness(settings: PortSettings, load: Loader, artifacts: dict[str, str] | None) -> dict[str, Any]:
    """The random-weights witness of a batched run: the same batched programs, each row's SEQ_MATCH
    and LOGITS_MATCH against its own reference (random weights have no coherence).

    Every row gets the batch-1 witness prompt, the one its seed was chosen for (a top-1/top-2 margin
    >= 0.019 at every step, `variants`): other random prompts sit on near-ties (margins of 0.000-0.015
    over 32 tokens, measured on 12 of them for the tiny E2B), where a logit difference well inside
    LOGITS_MATCH's tolerance flips a token (seen on the XLA lane). Rows of different lengths are the
    trained run's own rows and the batch tests'."""
    w = replace(settings, model="random", witness=False, results_dir=None, prompts=None, expects=None)
    model = load(w)
    rows = batch_prompt_rows(model, w, vary=False)
    device_run = run_device_batch(model, w, [ids for ids, _ in rows], [], bench=False)
    judged = judge_rows(model, w, rows, [], device_run["rows"])
    records = row_records(rows, judged, device_run["rows"], [None] * len(rows))
    out = {
        "model_source": model.source,
        "seed": w.seed,
        "rows": records,
        "seq_match": _all([r["seq_match"] for r in records]),
        "logits_match": _all([r["logits_match"] for r in records]),
        "compiler": device_run.get("compiler"),
        "cache_hits": device_run.get("cache_hits"),
        "artifacts": device_run.get("artifacts"),
    }
    out["passed"] = bool(out["seq_match"]) and out["logits_match"] is not False
    if artifacts and out.get("artifacts"):
        out["same_programs"] = out["artifacts"] == artifacts
    return out


def port_batch(
    settings: PortSettings,
    model: LoadedModel,
    eos: list[int],
    started: float,
    *,
    load: Loader,
    progress: bool = False,
) -> dict[str, Any]:
    """`port()` for `batch_size > 1`: the batched device run, every row judged, one record."""
    rows = batch_prompt_rows(model, settings)
    prompts_text = [p for p, _ in settings.batch_rows()] if model.tokenizer is not None else [None] * len(rows)
    device_run = run_device_batch(model, settings, [ids for ids, _ in rows], eos, progress=progress)
    device_rows = device_run.pop("rows")
    judged = judge_rows(model, settings, rows, eos, device_rows)
    records = row_records(rows, judged, device_rows, prompts_text)
    witness = None
    if settings.wants_witness:
        witness = batch_witness(settings, load, device_run.get("artifacts"))
    report0, reference0 = judged[0]
    device_run["tokens"] = device_rows[0]["tokens"]
    extra = {
        "batch_size": settings.batch_size,
        "rows": records,
        "seq_match": _all([r["seq_match"] for r in records]),
        "logits_match": _all([r["logits_match"] for r in records]),
        "coherent": _all([r["coherent"] for r in records]),
        "decode_tok_s_per_row": device_run.get("decode_tok_s_per_row"),
    }
    run = DeviceRun.from_fields(device_run)
    result = build_record(
        settings, model, rows[0][0], run, report0, reference0, started=started, witness=witness, extra=extra
    )
    if settings.results_dir:
        result["result_file"] = str(write_result(result, Path(settings.results_dir)))
    return result


__all__ = ["batch_prompt_rows", "bench_batch", "judge_rows", "port_batch", "run_device_batch"]
