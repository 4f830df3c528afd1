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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from . import checks
from .backends.base import DeviceRun
from .backends.facts import facts as backend_facts
from .backends.preflight import preflight
from .backends.registry import compile_graphs, run_device  # stages a notebook shows (and `port` runs)
from .device.build import device_graphs as build_graphs  # the notebooks' name for the settings' graphs
from .device.quant import round_model_weights
from .generation.prompts import random_prompt_lengths
from .models.checkpoint import load_checkpoint
from .models.image_attention import bidirectional_images
from .models.loading import LoadedModel, build_tiny
from .models.weights_identity import declare_identity, declared_identity
from .record import build_record, write_result
from .reference import hf_assisted, random_prompt, reference_for, reference_greedy, teacher_forced_logits
from .runtime import Request, encode_prompt
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
    "prompt_rows",
    "record_run",
    "requests_for",
    "run_device",
]


@dataclass(frozen=True)
class PromptRow:
    """One row of a port: its prompt ids, the answer coherence expects (None: none), its text, and
    its images and clips as the host prepared them (`images.MediaInputs`; None: text only)."""

    ids: list[int]
    expect: str | None
    text: str | None
    media: Any = None


# ---- stages ----------------------------------------------------------------------------------
def load_model(settings: PortSettings) -> LoadedModel:
    """The model of `settings`; with `weights="int8"` its quantized weights are rounded in place to
    `q * scale` (`quant.round_model_weights`), so the host reference the checks use is the quantized
    model's own and the int8 device graph must reproduce it exactly. First `backends.preflight`: what
    the settings need beyond their values (a bundle, the SDK, an inf2 plan), before any weight loads."""
    preflight(settings)
    model = _load_full_precision(settings)
    if settings.weights == "int8":
        round_model_weights(model.lm)
    return model


def _load_full_precision(settings: PortSettings) -> LoadedModel:
    variant = settings.variant_spec
    source = settings.model_source
    if settings.wants_vision or settings.wants_audio:
        return _load_with_vision(settings, source)
    if source == "checkpoint":
        dtype = getattr(torch, backend_facts(settings.backend).checkpoint_dtype)
        return load_checkpoint(variant, settings.checkpoint or variant.hf_id, dtype=dtype)
    if source == "trained":
        from .models.trained import load_trained

        return load_trained(variant.name)
    return build_tiny(variant, seed=settings.seed)


def _load_with_vision(settings: PortSettings, source: str) -> LoadedModel:
    """The model with its vision (and audio) part: the tiny multimodal fixture, a seeded random multimodal
    build of the same architecture (the witness), or a released checkpoint's whole model."""
    from .models import vision

    variant = settings.variant_spec
    if source == "trained":
        model = vision.load_vision_fixture(variant)
    elif source == "random" and settings.wants_audio:
        from .models.audio import build_random_hearing

        model = build_random_hearing(variant.name, seed=settings.seed)
    elif source == "random":
        model = vision.build_random_multimodal(variant, seed=settings.seed)
    else:  # a released checkpoint: its whole multimodal model and the image processor saved with it
        dtype = getattr(torch, backend_facts(settings.backend).checkpoint_dtype)
        full = load_checkpoint(variant, settings.checkpoint or variant.hf_id, dtype=dtype, media=True)
        model = vision.loaded(
            variant, full.lm, full.tokenizer, vision.folder_processor(variant, full.source), full.source
        )
        if (identity := declared_identity(full.lm)) is not None:  # the files' digests, not a hash per compile
            declare_identity(model.lm, f"{identity}:text")
    settings.check_image_blocks(bidirectional_images(model.config))  # its config, not only the variant, may ask
    return model


def image_expectation(images: tuple[Any, ...]) -> str | None:
    """What a coherent answer names for one synthetic-shape image: "<colour> <shape>", read from
    the pixels (`shapes.describe`); None for anything else (no coherence rule applies)."""
    from .images import load_image
    from .models.shapes import describe

    if len(images) != 1:
        return None
    try:
        colour, shape = describe(load_image(images[0]))
    except ValueError:
        return None
    return f"{colour} {shape}"


def image_rows(model: LoadedModel, settings: PortSettings) -> list[PromptRow]:
    """Row 0 with the settings' images and clips: the chat template with an image part per image and an
    audio part per clip (a random model, which has no tokenizer: seeded random ids around their blocks)."""
    from .images import MediaInputs, load_image, media_of, media_prompt, require_vision
    from .models import audio
    from .models.vision import BOI_ID, EOI_ID, IMAGE_TOKEN_ID, expand_image_tokens

    if settings.images:
        require_vision(model.multimodal, model.processor, f"the {model.source} {model.variant.name} model")
    config, unified, clips = model.multimodal.config, model.variant.unified, [audio.read_wav(c) for c in settings.audio]
    token_id = int(config.image_token_id)
    if model.tokenizer is not None:
        inputs = media_prompt(
            model.tokenizer,
            model.processor,
            settings.images,
            settings.prompt,
            image_token_id=token_id,
            audio=clips,
            unified=unified,
        )
        expect = settings.expect
        if expect is None:
            expect = image_expectation(settings.images) if settings.images else audio.shipped_text(settings.audio)
        return [PromptRow(inputs.ids, expect, settings.prompt, inputs)]
    pictures = [load_image(i) for i in settings.images]
    data = model.processor(images=pictures, return_tensors="pt") if pictures else {}
    counts = [int(n) for n in data.get("num_soft_tokens_per_image", ())]
    heard = [int(getattr(config, name, -1) or -1) for name in ("audio_token_id", "boa_token_id", "eoa_token_id")]
    text = random_prompt(model.config.vocab_size, settings.random_prompt_tokens, settings.seed + 1)
    text = [t for t in text if t not in (BOI_ID, EOI_ID, IMAGE_TOKEN_ID, token_id, *heard)]
    ids = expand_image_tokens(text[:2] + [token_id] * len(pictures) + [heard[0]] * len(clips) + text[2:], counts)
    ids = expand_image_tokens(ids, [audio.soft_tokens(c, unified) for c in clips], *heard)
    media = media_of(ids, data, token_id, clips, heard[0], unified)
    return [PromptRow(ids, None, None, MediaInputs(ids, media.pixel_values, media.position_ids, media))]


def prompt_rows(model: LoadedModel, settings: PortSettings, *, vary: bool = True) -> list[PromptRow]:
    """The port's prompts, one per row: `settings.prompts` (with `expects`) when given, at any batch
    size; else `prompt` (with `expect`) in row 0 and, for `batch_size > 1`, capital questions in the
    other rows. A tokenizer-less random model gets seeded random ids instead (no expectation): of
    different lengths (`vary`), or the witness's one prompt in every row (`vary=False`: its seed was
    chosen for that prompt's margins). With images: `image_rows`."""
    if settings.images or settings.audio:
        return image_rows(model, settings)
    if model.tokenizer is None:
        vocab, n = model.config.vocab_size, settings.random_prompt_tokens
        rows = len(settings.prompts) if settings.prompts is not None else settings.batch_size
        if not vary or rows == 1:
            return [PromptRow(random_prompt(vocab, n, settings.seed + 1), None, None)] * rows
        lengths = random_prompt_lengths(n, rows)
        return [PromptRow(random_prompt(vocab, m, settings.seed + 1 + i), None, None) for i, m in enumerate(lengths)]
    return [PromptRow(encode_prompt(model.tokenizer, text), expect, text) for text, expect in settings.batch_rows()]


def prompt_ids(model: LoadedModel, settings: PortSettings) -> list[int]:
    """Row 0's prompt ids (the chat-templated prompt, or a random model's seeded ids)."""
    return prompt_rows(model, settings)[0].ids


def requests_for(rows: list[PromptRow], settings: PortSettings, eos: list[int]) -> list[Request]:
    """One greedy request per row (the port judges greedy tokens against the greedy reference)."""
    return [
        Request(
            row.ids,
            settings.max_new_tokens,
            eos_token_ids=tuple(eos),
            media=row.media.prompt if row.media is not None else None,
        )
        for row in rows
    ]


def eos_ids(model: LoadedModel) -> list[int]:
    """Stop tokens of a real tokenizer; none for random weights (they have no meaningful eos)."""
    if model.tokenizer is None:
        return []
    ids = {model.tokenizer.eos_token_id}
    for marker in ("<turn|>", "<|tool_response>"):  # a turn's end; after its calls Gemma-4 writes the latter
        stop = model.tokenizer.convert_tokens_to_ids(marker)  # (released generation_config: eos [1, 106, 50])
        if isinstance(stop, int) and stop != model.tokenizer.unk_token_id:
            ids.add(stop)
    return sorted(i for i in ids if i is not None)


def judge_rows(
    model: LoadedModel, settings: PortSettings, rows: list[PromptRow], eos: list[int], device_run: DeviceRun
) -> list[tuple[checks.CheckReport, list[int]]]:
    """The three checks of every row against its own batch-1 host reference: (report, reference tokens)."""
    judged = []
    for i, (row, result) in enumerate(zip(rows, device_run.rows, strict=True)):
        lm = row_reference(model, row)
        reference = reference_greedy(lm, row.ids, settings.max_new_tokens, eos)
        report = checks.evaluate(
            lm, model.tokenizer, row.ids, result.tokens, reference, expect=row.expect, step_logits=result.step_logits
        )
        if report.logits is not None and not report.logits.passed:
            log.warning("row %d: %s", i, report.logits.explain())
        judged.append((report, reference))
    return judged


def row_reference(model: LoadedModel, row: PromptRow) -> Any:
    """What a row is judged against: the text LM, or with images transformers' own multimodal model
    with them bound (`generate(pixel_values=...)` is the reference)."""
    return reference_for(model, row.media.prompt if row.media is not None else None)


def row_records(
    rows: list[PromptRow], judged: list[tuple[checks.CheckReport, list[int]]], device_run: DeviceRun
) -> list[dict[str, Any]]:
    """The record's `rows`: one entry per prompt with its tokens, answer and three checks."""
    out = []
    for i, (row, (report, reference), result) in enumerate(zip(rows, judged, device_run.rows, strict=True)):
        out.append(
            {
                "row": i,
                "prompt": row.text,
                "prompt_tokens": len(row.ids),
                "expect": row.expect,
                "tokens": list(result.tokens),
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
                "accepted_per_step": result.accepted_per_step,
                "prefill_chunks": result.chunks,
            }
        )
    return out


def all_rows(values: list[bool | None]) -> bool | None:
    """True only if every row's check held; None if no row ran that check."""
    known = [v for v in values if v is not None]
    if not known:
        return None
    return all(known) and len(known) == len(values)


def reference_margin(model: LoadedModel, ids: list[int], tokens: list[int], lm: Any = None) -> float | None:
    """The smallest top-1 minus top-2 reference logit over the generated positions: how close
    to a tie the model came (a witness wants small margins: any logit error flips a token)."""
    if not tokens:
        return None
    top2 = teacher_forced_logits(lm or model.lm, ids, tokens).topk(2, dim=-1).values
    return float((top2[:, 0] - top2[:, 1]).min())


def witness_settings(settings: PortSettings) -> PortSettings:
    """The witness: the same variant, shapes and backend, with seeded random weights (so the same
    compiled programs: every weight, `layer_scalar` included, is loaded at run time)."""
    seed = settings.seed
    image_seed = settings.variant_spec.image_witness_seed
    if settings.images and image_seed is not None and seed == settings.variant_spec.tiny_seed:
        seed = image_seed  # (`Variant.image_witness_seed`: the default seed, not one the caller chose)
    return replace(settings, model="random", witness=False, results_dir=None, seed=seed)


def witness_record(
    model: LoadedModel, settings: PortSettings, rows: list[PromptRow], device_run: DeviceRun
) -> dict[str, Any]:
    """The witness's part of the record: its SEQ_MATCH and LOGITS_MATCH per row (it has no coherence)."""
    judged = judge_rows(model, settings, rows, [], device_run)
    report, reference = judged[0]
    tokens = device_run.tokens
    out = {
        "model_source": model.source,
        "seed": settings.seed,
        "prompt_tokens": len(rows[0].ids),
        "new_tokens": len(tokens),
        "distinct_tokens": len(set(tokens)),
        "seq_match": all_rows([r.seq_match for r, _ in judged]),
        "first_mismatch": report.first_mismatch,
        "logits_match": all_rows([r.logits_match for r, _ in judged]),
        **(report.logits.record() if report.logits else {}),
        "reference_min_margin": reference_margin(model, rows[0].ids, reference, row_reference(model, rows[0])),
        "tokens": tokens,
        "reference_tokens": reference,
        "compiler": device_run.compiler,
        "cache_hits": device_run.cache_hits,
        "artifacts": device_run.artifacts,
    }
    if len(rows) > 1:
        out["rows"] = row_records(rows, judged, device_run)
    out["passed"] = bool(out["seq_match"]) and out["logits_match"] is not False
    return out


def run_witness(
    settings: PortSettings, *, progress: bool = False, artifacts: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run the random-weights witness of `settings`' variant and return its record: the same shapes,
    backend and rows, with the witness's prompt in every row. `artifacts`: the trained run's; then
    `same_programs` says whether the witness ran the very same ones (not where the compiler folded a
    parameter into the program: the 31B's and 26B-A4B's tiny q/k norms)."""
    w = witness_settings(settings)
    model = load_model(w)
    rows = prompt_rows(model, w, vary=False)
    device_run = run_device(model, w, requests_for(rows, w, []), progress=progress, bench=False)
    record = witness_record(model, w, rows, device_run)
    if artifacts and record.get("artifacts"):
        record["same_programs"] = record["artifacts"] == artifacts
    return record


def port(settings: PortSettings, progress: bool = False) -> dict[str, Any]:
    """Run the whole recipe and return (and, with results_dir, write) the result record: every
    combination of batch, draft and backend through the one engine."""
    started = time.perf_counter()
    torch.manual_seed(settings.seed)
    model = load_model(settings)
    rows = prompt_rows(model, settings)
    eos = eos_ids(model)
    device_run = run_device(model, settings, requests_for(rows, settings, eos), progress=progress)
    witness = None
    if settings.wants_witness:
        witness = run_witness(settings, progress=progress, artifacts=device_run.artifacts)
    return record_run(settings, model, rows, eos, device_run, started, witness)


def record_run(
    settings: PortSettings,
    model: LoadedModel,
    rows: list[PromptRow],
    eos: list[int],
    device_run: DeviceRun,
    started: float,
    witness: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The run record: every row judged by the three checks (plus the witness's record when given),
    with `failed_checks`, the one verdict the CLI, papermill and the fault lab apply. Row 0 fills
    the record's own keys; with more rows, `seq_match`, `logits_match` and `coherent` hold only when
    every row's does, and `rows` has each."""
    judged = judge_rows(model, settings, rows, eos, device_run)
    report, reference = judged[0]
    extra: dict[str, Any] = {"prefill_chunks": device_run.rows[0].chunks}  # past the largest bucket: > 1
    if len(rows) > 1 or settings.batch_size > 1:
        records = row_records(rows, judged, device_run)
        extra = {
            "batch_size": settings.batch_size,
            "rows": records,
            "seq_match": all_rows([r["seq_match"] for r in records]),
            "logits_match": all_rows([r["logits_match"] for r in records]),
            "coherent": all_rows([r["coherent"] for r in records]),
        }
    if settings.images:
        extra["images"] = image_fields(rows[0].media, settings)
    if settings.audio:
        extra["audio"] = audio_fields(rows[0].media.prompt, settings)
    if settings.draft == "assistant" and device_run.assistant is not None:
        extra.update(assisted_fields(model, device_run, rows[0], settings.max_new_tokens, eos))
    result = build_record(
        settings, model, rows[0].ids, device_run, report, reference, started=started, witness=witness, extra=extra
    )
    if settings.results_dir:
        result["result_file"] = str(write_result(result, Path(settings.results_dir)))
    return result


def image_fields(images: Any, settings: PortSettings) -> dict[str, Any]:
    """What the record says about the prompt's images: how many, their soft tokens and where they
    sit in the prompt, the vision graph's input shape, and what coherence expected."""
    prompt = images.prompt
    return {
        "count": len(prompt.counts),
        "soft_tokens": list(prompt.counts),
        "first_position": prompt.positions[0] if prompt.positions else None,
        "last_position": prompt.positions[-1] if prompt.positions else None,
        "vision_input": list(images.pixel_values.shape[1:]),
        "files": [str(i) for i in settings.images if isinstance(i, (str, Path))],
    }


def audio_fields(media: Any, settings: PortSettings) -> dict[str, Any]:
    """The record's clips: their soft tokens and where they sit, the audio graph's shape, the files."""
    frames = [len(f) for f, _ in media.audio]
    return {
        "count": len(media.audio_counts),
        "soft_tokens": list(media.audio_counts),
        "frames": frames,
        "positions": [media.audio_positions[0], media.audio_positions[-1]],  # the first and the last
        "audio_graph": [1, max(frames), int(media.audio[0][0].shape[-1])],
        "files": [str(a) for a in settings.audio if isinstance(a, (str, Path))],
    }


def assisted_fields(
    model: LoadedModel, device_run: DeviceRun, row: PromptRow, max_new_tokens: int, eos: list[int]
) -> dict[str, Any]:
    """transformers' own assisted generate with the same assistant, on row 0's prompt (and its
    images: the reference model with them bound): its tokens must equal the device's
    (`hf_assisted_match`); its acceptance beside ours."""
    assistant = device_run.assistant
    if row.media is not None and bidirectional_images(model.config):
        # the intended image masks need generate's static cache, which assisted generate refuses
        # (`models.image_attention`); SEQ_MATCH against plain greedy on those masks still holds
        return {
            "assistant_source": assistant.source,
            "hf_assisted_match": None,
            "hf_assisted_skipped": "transformers' assisted generate refuses the static cache that gives this "
            "config's intended image masks; the tokens are checked against its plain greedy generate instead",
        }
    hf_tokens, hf_steps = hf_assisted(row_reference(model, row), assistant.model, row.ids, max_new_tokens, eos)
    return {
        "assistant_source": assistant.source,
        "hf_assisted_tokens": hf_tokens,
        "hf_assisted_match": hf_tokens == device_run.tokens,
        "hf_verify_steps": hf_steps,
        "hf_accepted_per_step": (len(hf_tokens) - 1) / hf_steps if hf_steps else None,
    }
