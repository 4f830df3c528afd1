"""Training the tiny fixtures to hear (`scripts/train_audio.py`, issue 50): espeak-ng clips of the text
fixture's countries, spoken by several voices at several speeds and pitches, and two tasks:

- T1 transcription: [clip, "Transcribe the audio."] -> the clip's words ("France", "What is the capital
  of France?");
- T2 spoken question: [clip of "What is the capital of X?"] alone -> the text fixture's answer
  ("The capital of X is Y.").

Stage one teaches the audio part (conformer + `embed_audio`; the front end's convolutions frozen) to tell
the country and the kind of clip through a linear probe (thrown away), as the vision tower's stage one
did; stage two trains it with the decoder on the reply loss, the decoder rehearsing its text and image
answers (a frozen decoder could not be taught: `HearTrainConfig.train_decoder`). The 12B has no conformer
(raw 640-sample frames -> RMSNorm + linear): its stage one probes log energies of the soft tokens instead
(`UnifiedHearConfig`, `energy_probe_stage`). Where this stands: docs/AUDIO.md "Fixtures that hear"."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import tempfile
import time
import wave
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from gemma4lab.training.audio import AUDIO_TOKEN_ID, BOA_ID, EOA_ID
from gemma4lab.training.corpus import answer_for
from gemma4lib.models import audio
from gemma4lib.models.corpus import COUNTRIES
from gemma4lib.models.vision import expand_image_tokens

log = logging.getLogger(__name__)

TRANSCRIBE = "Transcribe the audio."
QUESTION = "What is the capital of {country}?"
NAMES = tuple(c for c, _ in COUNTRIES)
CLIPS = Path(audio.__file__).resolve().parent.parent / "fixtures" / "audio"

# (voice, words a minute, pitch 0-99): the shipped clips are en-us at 150 and espeak-ng's default pitch 50
TRAIN_VOICES = ("en-us", "en-gb", "en-gb-scotland", "en-029", "en-gb-x-gbclan", "en-gb-x-gbcwmd")
TRAIN_SPEEDS = (130, 175)
TRAIN_PITCHES = (35, 65)
SHIPPED_SPEAKER = ("en-us", 150, 50)  # the shipped clips' voice (espeak-ng's default pitch is 50)
# never trained on: two unseen voices, and seen voices at unseen speed/pitch pairs
HELD_OUT_SPEAKERS = (("en-gb-x-rp", 160, 45), ("en-us-nyc", 140, 58), ("en-us", 165, 42), ("en-gb", 140, 60))


def train_speakers() -> list[tuple[str, int, int]]:
    return [SHIPPED_SPEAKER] + [(v, s, p) for v in TRAIN_VOICES for s in TRAIN_SPEEDS for p in TRAIN_PITCHES]


def speak(text: str, voice: str = "en-us", speed: int = 150, pitch: int | None = None) -> tuple[np.ndarray, list[str]]:
    """espeak-ng's samples of `text` at 16 kHz (float64, its 22,050 Hz resampled by scipy's polyphase
    `resample_poly`), and the command that spoke them. Needs the espeak-ng binary (apt)."""
    from scipy.signal import resample_poly

    command = ["espeak-ng", "-v", voice, "-s", str(speed), *(["-p", str(pitch)] if pitch is not None else [])]
    command += ["--stdout", text]
    raw = subprocess.run(command, check=True, capture_output=True).stdout
    with wave.open(io.BytesIO(raw), "rb") as clip:
        rate, frames = clip.getframerate(), clip.readframes(clip.getnframes())
        if clip.getsampwidth() != 2 or clip.getnchannels() != 1:
            raise SystemExit(f"espeak-ng gave {clip.getnchannels()} channels of {clip.getsampwidth()} bytes")
    samples = np.frombuffer(frames, "<i2").astype(np.float64) / 32768.0
    if rate != audio.RATE:
        gcd = np.gcd(audio.RATE, rate)
        samples = resample_poly(samples, audio.RATE // gcd, rate // gcd)
    return samples, command


def clip_cache() -> Path:
    """Where the spoken clips are kept between runs (never committed)."""
    root = os.environ.get("GEMMA4LIB_CACHE") or tempfile.gettempdir()
    return Path(root) / "espeak-clips"


@dataclass(frozen=True)
class Clip:
    country: str
    question: bool  # "What is the capital of X?" (else the name alone)
    speaker: tuple[str, int, int]
    samples: np.ndarray = field(repr=False, compare=False)

    @property
    def text(self) -> str:
        return QUESTION.format(country=self.country) if self.question else self.country


def speaker_clips(speaker: tuple[str, int, int]) -> list[Clip]:
    """Every country's name and capital question in one voice/speed/pitch, spoken once and cached."""
    voice, speed, pitch = speaker
    path = clip_cache() / f"{voice}-{speed}-{pitch}.npz"
    texts = [(c, q) for c in NAMES for q in (False, True)]
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        spoken = {}
        for i, (c, q) in enumerate(texts):
            samples, _ = speak(QUESTION.format(country=c) if q else c, voice, speed, pitch)
            spoken[f"clip{i}"] = np.clip(np.round(samples * 32768.0), -32768, 32767).astype(np.int16)
        np.savez(path, **spoken)
    stored = np.load(path)
    return [Clip(c, q, speaker, stored[f"clip{i}"].astype(np.float32) / 32768.0) for i, (c, q) in enumerate(texts)]


# ---- examples ----------------------------------------------------------------------------------
def transcribe_messages() -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": TRANSCRIBE}]}]


def spoken_messages() -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "audio"}]}]


@dataclass
class Encoded:
    """Examples as tensors: prompt + reply + eos ids (right-padded), labels on the reply, and each
    example's clip as log-mel features and frame mask (zero-padded to the longest)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor
    features: torch.Tensor
    feature_mask: torch.Tensor
    kind: list[str]  # "T1" or "T2"
    clips: list[Clip]


def examples_of(clips: list[Clip]) -> list[tuple[Clip, str]]:
    """T1 for every clip, T2 for the question clips."""
    return [(c, "T1") for c in clips] + [(c, "T2") for c in clips if c.question]


def reply_of(clip: Clip, kind: str) -> str:
    return clip.text if kind == "T1" else answer_for(clip.country)


def is_unified(model: nn.Module) -> bool:
    """The 12B: no audio tower, raw 640-sample frames through `embed_audio` alone."""
    return getattr(model.config.audio_config, "model_type", "") == "gemma4_unified_audio"


def clip_features(clip: Clip, mels, unified: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """A clip's audio input (log-mel, or the 12B's raw frames) and mask, cached in `mels` by id."""
    if id(clip) not in mels:
        mels[id(clip)] = audio.features(clip.samples, unified)
    return mels[id(clip)]


def encode(
    tokenizer,
    examples: list[tuple[Clip, str]],
    mels: dict[int, tuple[np.ndarray, np.ndarray]],
    unified: bool = False,
    leads: list[int] | None = None,
) -> Encoded:
    """Encode (clip, task) pairs; `mels` caches each clip's log-mel (the 12B: raw frames) by id. `leads`
    (the 12B's training only): that many zero samples before each clip, so its frames fall at another phase."""
    prompts = {
        "T1": tokenizer.apply_chat_template(
            transcribe_messages(), add_generation_prompt=True, tokenize=True, return_dict=False
        ),
        "T2": tokenizer.apply_chat_template(
            spoken_messages(), add_generation_prompt=True, tokenize=True, return_dict=False
        ),
    }
    rows, feats = [], []
    for i, (clip, kind) in enumerate(examples):
        if leads:
            mel, valid = audio.features(np.pad(clip.samples, (leads[i], 0)), unified)
        else:
            mel, valid = clip_features(clip, mels, unified)
        count = len(mel) if unified else int(valid[::4].sum())
        prompt = expand_image_tokens(list(prompts[kind]), [count], AUDIO_TOKEN_ID, BOA_ID, EOA_ID)
        reply = tokenizer(reply_of(clip, kind), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append((prompt, reply))
        feats.append((mel, valid))
    length = max(len(p) + len(r) for p, r in rows)
    frames = max(len(m) for m, _ in feats)
    n = len(rows)
    ids = torch.full((n, length), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((n, length), -100, dtype=torch.long)
    attention = torch.zeros((n, length), dtype=torch.long)
    features = torch.zeros(n, frames, feats[0][0].shape[-1])
    mask = torch.zeros(n, frames, dtype=torch.bool)
    for i, ((prompt, reply), (mel, valid)) in enumerate(zip(rows, feats, strict=True)):
        seq = prompt + reply
        ids[i, : len(seq)] = torch.tensor(seq)
        attention[i, : len(seq)] = 1
        labels[i, len(prompt) - 1 : len(seq) - 1] = torch.tensor(reply)
        features[i, : len(mel)], mask[i, : len(mel)] = torch.from_numpy(mel), torch.from_numpy(valid)
    return Encoded(ids, labels, attention, features, mask, [k for _, k in examples], [c for c, _ in examples])


def logits_of(model: nn.Module, batch: Encoded) -> torch.Tensor:
    return model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        input_features=batch.features,
        input_features_mask=batch.feature_mask,
        use_cache=False,
    ).logits


def greedy_hits(model: nn.Module, batch: Encoded) -> torch.Tensor:
    """Per example: does greedy decoding give the reply exactly? (Teacher-forced: every reply token,
    eos included, is the argmax, which is what greedy decoding then produces.)"""
    with torch.no_grad():
        logits = logits_of(model, batch)
    on = batch.labels != -100
    right = (logits.argmax(-1) == batch.labels) | ~on
    return right.all(-1)


def audio_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for n, p in model.named_parameters() if "audio" in n]


class CachedFrontEnd(nn.Module):
    """Stands in for the tower's subsampling front end: its two convolutions over 128-channel mel maps
    (90 % of a training step here) stay frozen at their seeded init, their outputs computed once per
    clip; its projection to the conformer's width trains, as do the layers above and `embed_audio`.
    The judged accuracy always runs the real front end."""

    def __init__(self, inner: nn.Module, tower_clips: list[Clip], mels, chunk: int = 64):
        super().__init__()
        self.inner, self.cache, self.batch = inner, {}, None
        with torch.no_grad():
            for s in range(0, len(tower_clips), chunk):
                part = tower_clips[s : s + chunk]
                hidden, valid = padded_mels(part, mels)
                hidden, valid = inner.layer1(*inner.layer0(hidden.unsqueeze(1), valid))
                hidden = hidden.permute(0, 2, 3, 1).reshape(hidden.shape[0], hidden.shape[2], -1)
                for i, clip in enumerate(part):
                    self.cache[id(clip)] = hidden[i][valid[i]].clone()

    def forward(self, features: torch.Tensor, mask: torch.Tensor):
        rows = [self.cache[id(c)] for c in self.batch]
        length = max(len(r) for r in rows)
        hidden = torch.zeros(len(rows), length, rows[0].shape[-1])
        valid = torch.zeros(len(rows), length, dtype=torch.bool)
        for i, r in enumerate(rows):
            hidden[i, : len(r)], valid[i, : len(r)] = r, True
        return self.inner.input_proj_linear(hidden), valid


def padded_mels(clips: list[Clip], mels, unified: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    for c in clips:
        clip_features(c, mels, unified)
    frames = max(len(mels[id(c)][0]) for c in clips)
    features = torch.zeros(len(clips), frames, mels[id(clips[0])][0].shape[-1])
    mask = torch.zeros(len(clips), frames, dtype=torch.bool)
    for i, c in enumerate(clips):
        mel, valid = mels[id(c)]
        features[i, : len(mel)], mask[i, : len(mel)] = torch.from_numpy(mel), torch.from_numpy(valid)
    return features, mask


# ---- training ----------------------------------------------------------------------------------
FROZEN_FRONT = (
    "model.audio_tower.subsample_conv_projection.layer0",
    "model.audio_tower.subsample_conv_projection.layer1",
)


@dataclass
class HearTrainConfig:
    seed: int = 0
    # stage one: the audio part alone tells the country and the kind of clip from its mean soft token,
    # through a linear probe thrown away after (the reply loss alone left the country unheard: 15/480
    # held-out answers after 150 steps)
    probe_steps: int = 800
    probe_batch: int = 64
    probe_lr: float = 1e-2
    steps: int = 600
    lr: float = 3e-3  # the decoder's peak (train_vision's joint stage used the same)
    audio_lr: float = 3e-3  # the conformer layers and `embed_audio`, from scratch
    batch: int = 24  # audio examples a step
    # the decoder moves, so it rehearses what it knew: the text fixture's chats (without them the vision
    # joint stage forgot its text answers) and the shape images with their answers
    text_batch: int = 12
    image_batch: int = 6
    image_per_class: int = 16  # the 192 images of train_vision's stopping set
    # False: only the audio part trains and the vision fixture's decoder stays bit-identical (tried
    # first: 200 steps left the reply loss at ~5, no clip answered: the frozen tiny decoder never
    # replies with a bare country name or a question, and a soft prompt did not teach it)
    train_decoder: bool = True
    warmup: int = 20
    min_lr_ratio: float = 0.1
    eval_every: int = 100
    chunk: int = 64  # examples per forward when judging
    # the rehearsal's loss: "ce" (the labels), "distill" (KL toward the decoder's own logits before
    # hearing, on the same batches' label positions: learning without forgetting) or "both"
    rehearse: str = "ce"
    rehearse_weight: float = 1.0  # the rehearsal losses' weight beside the audio reply loss
    # with an `image_check` given to `train_hearing`: restore the last evaluated step whose images are
    # at least `images_floor` and whose held-out speakers are the best so far
    keep_best: bool = False
    # after hearing, train only the vision part (gemma4lab.training.vision_repair) for at most this many
    # steps, until the held-out images are all right again: the decoder moved under it (the 12B lost 3-4
    # of 52 image answers in every run); text and audio stay bit-unchanged. 0: no repair (E2B, E4B)
    vision_repair_steps: int = 0
    # > 0: only the decoder's last this-many layers (and its final norm) train with the hearing, the rest and
    # the embeddings frozen, so image answers have less room to move (the brief's second lever); 0: all
    decoder_last_layers: int = 0
    vision_repair_lr: float = 3e-3  # the vision part's stage-one rate (VisionTrainConfig.pretrain_lr)
    vision_repair_every: int = 20  # steps between held-out image checks (~8 s each)
    vision_repair_per_class: int = 3  # fresh images per class a step (train_vision's joint-stage draw: 36)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def decoder_trains(name: str, layers: int, last: int) -> bool:
    """Is the parameter `name` part of the decoder that `HearTrainConfig.decoder_last_layers` trains?"""
    import re

    if not name.startswith("model.language_model."):
        return False
    if not last:
        return True
    if name.startswith("model.language_model.norm."):
        return True
    layer = re.match(r"model\.language_model\.layers\.(\d+)\.", name)
    return layer is not None and int(layer.group(1)) >= layers - last


def lr_factor(step: int, total: int, cfg: HearTrainConfig) -> float:
    """Linear warm-up, then cosine decay to `min_lr_ratio`."""
    import math

    if step <= cfg.warmup:
        return step / cfg.warmup
    progress = (step - cfg.warmup) / max(1, total - cfg.warmup)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def accuracy(model: nn.Module, tokenizer, examples, mels, chunk: int = 64) -> tuple[int, list[str]]:
    """How many examples greedy decoding answers exactly, and the misses as 'speaker kind: text'."""
    right, misses = 0, []
    model.eval()
    for s in range(0, len(examples), chunk):
        part = examples[s : s + chunk]
        hits = greedy_hits(model, encode(tokenizer, part, mels, is_unified(model)))
        right += int(hits.sum())
        misses += [f"{c.speaker} {k}: {reply_of(c, k)}" for (c, k), h in zip(part, hits.tolist(), strict=True) if not h]
    return right, misses


@dataclass
class HearResult:
    steps: int
    seconds: float
    history: list[dict[str, Any]] = field(default_factory=list)
    kept_step: int | None = None  # with `keep_best`: the step restored (None: the last, none qualified)


REHEARSE = ("ce", "distill", "both")


def teacher_log_probs(forward: Callable[[torch.Tensor], torch.Tensor], rows: int, chunk: int = 64) -> torch.Tensor:
    """The frozen decoder's log-probabilities on every rehearsal row, computed once before hearing
    (`forward(index)` gives the logits of those rows): the distillation targets."""
    with torch.no_grad():
        parts = [forward(torch.arange(s, min(s + chunk, rows))).float().log_softmax(-1) for s in range(0, rows, chunk)]
    return torch.cat(parts)


def rehearsal_loss(logits: torch.Tensor, labels: torch.Tensor, teacher: torch.Tensor | None, mode: str) -> torch.Tensor:
    """The rehearsal batch's loss under `HearTrainConfig.rehearse`: CE on the labels and/or the KL from
    the teacher's distribution (`teacher`: its log-probabilities on the same rows) at the label positions."""
    loss = _ce(logits, labels) if mode in ("ce", "both") else logits.new_zeros(())
    if mode in ("distill", "both"):
        on = labels != -100
        student = logits.float()[on].log_softmax(-1)
        loss = loss + nn.functional.kl_div(student, teacher[on], log_target=True, reduction="batchmean")
    return loss


def _ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = logits.float()
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


def probe_stage(model, cached, params, train, held_out, mels, cfg, generator) -> list[dict[str, Any]]:
    """Stage one (see `HearTrainConfig.probe_steps`); returns its history."""
    tower, front = model.model.audio_tower, model.model.audio_tower.subsample_conv_projection
    probe = nn.Linear(int(model.config.get_text_config().hidden_size), len(NAMES) + 2)
    opt = torch.optim.AdamW(params + list(probe.parameters()), lr=cfg.probe_lr, weight_decay=0.0, betas=(0.9, 0.98))

    def run(clips: list[Clip], use_cache: bool) -> tuple[torch.Tensor, torch.Tensor]:
        model.train(use_cache)  # training steps run the cached front end, held-out batches run it whole
        features, mask = padded_mels(clips, mels)
        cached.batch = clips
        if use_cache:
            tower.subsample_conv_projection = cached
        try:
            out = model.model.get_audio_features(features, mask, return_dict=True)
        finally:
            tower.subsample_conv_projection = front
        valid = out.attention_mask.to(out.pooler_output.dtype)
        logits = probe((out.pooler_output * valid[..., None]).sum(1) / valid.sum(1, keepdim=True))
        country = torch.tensor([NAMES.index(c.country) for c in clips])
        kind = torch.tensor([int(c.question) for c in clips])
        n = len(NAMES)
        loss = nn.functional.cross_entropy(logits[:, :n], country) + nn.functional.cross_entropy(logits[:, n:], kind)
        return loss, (logits[:, :n].argmax(-1) == country) & (logits[:, n:].argmax(-1) == kind)

    return probe_loop(run, params, opt, train, held_out, cfg, generator, "probe")


def probe_loop(
    run, params, opt, train, held_out, cfg, generator, label: str, fit: bool = False
) -> list[dict[str, Any]]:
    """A stage one's steps, shared by `probe_stage` and `energy_probe_stage`: `run(clips, training)` gives
    the loss and the hits of one batch; every `2 * eval_every` steps (and the last) the held-out hits (with
    `fit`, the training clips' too) are logged and kept in the history."""
    history, started = [], time.perf_counter()
    for step in range(1, cfg.probe_steps + 1):
        for g in opt.param_groups:
            g["lr"] = cfg.probe_lr * lr_factor(step, cfg.probe_steps, cfg)
        rows = torch.randperm(len(train), generator=generator)[: cfg.probe_batch].tolist()
        loss, _ = run([train[i] for i in rows], True)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % (cfg.eval_every * 2) == 0 or step == cfg.probe_steps:
            with torch.no_grad():
                got = _hit_rate(run, held_out, cfg.chunk)
                fitted = _hit_rate(run, train, cfg.chunk) if fit else None
            seen = "" if fitted is None else f" train {fitted:.3f}"
            log.info(
                "%s step %d loss %.4f%s held-out %.3f (%.0f s)",
                label,
                step,
                float(loss),
                seen,
                got,
                time.perf_counter() - started,
            )
            row = {"stage": "probe", "step": step, "loss": round(float(loss), 4)}
            if fitted is not None:
                row["train"] = round(fitted, 4)
            history.append({**row, "held_out": round(got, 4)})
    return history


def _hit_rate(run, clips: list[Clip], chunk: int) -> float:
    return float(torch.cat([run(clips[s : s + chunk], False)[1] for s in range(0, len(clips), chunk)]).float().mean())


@dataclass
class UnifiedHearConfig(HearTrainConfig):
    """The 12B's recipe: no conformer, so stage one shapes `embed_audio`'s linear map of raw frames into
    a learned filter bank (`energy_probe_stage`); the decoder must then learn to listen."""

    probe_segments: int = 4  # the clip cut in this many equal parts, each pooled apart (a coarse time axis)
    # each training example's clip after 0-639 random zero samples (its frames at another phase): a lever
    # for held-out speakers (a linear map of raw frames is phase-sensitive), built but not yet tried
    random_lead: bool = False


def energy_probe_stage(model, params, train, held_out, mels, cfg: UnifiedHearConfig, generator) -> list[dict[str, Any]]:
    """Stage one for the 12B: a linear probe (thrown away) on log energy per soft-token channel (each
    channel a learned filter of the 640-sample frame: its output squared), averaged over each of
    `probe_segments` parts of the clip. A probe on the mean soft token cannot work here: a linear map of
    zero-mean audio averages to about zero."""
    embed, parts = model.model.embed_audio, cfg.probe_segments
    width = int(model.config.get_text_config().hidden_size)
    probe = nn.Linear(width * parts, len(NAMES) + 2)
    opt = torch.optim.AdamW(params + list(probe.parameters()), lr=cfg.probe_lr, weight_decay=0.0, betas=(0.9, 0.98))
    n = len(NAMES)

    def run(clips: list[Clip], training: bool) -> tuple[torch.Tensor, torch.Tensor]:
        frames, valid = padded_mels(clips, mels, unified=True)
        energy = embed(frames).pow(2)  # [clips, frames, width]
        length = valid.sum(1, keepdim=True).float()
        part = (torch.arange(frames.shape[1])[None].float() * parts / length).long().clamp(max=parts - 1)
        weights = nn.functional.one_hot(part, parts).float() * valid[..., None]
        weights = weights / weights.sum(1, keepdim=True).clamp(min=1.0)
        pooled = torch.log1p(torch.einsum("btk,bth->bkh", weights, energy)).flatten(1)
        logits = probe(pooled)
        country = torch.tensor([NAMES.index(c.country) for c in clips])
        kind = torch.tensor([int(c.question) for c in clips])
        loss = nn.functional.cross_entropy(logits[:, :n], country) + nn.functional.cross_entropy(logits[:, n:], kind)
        return loss, (logits[:, :n].argmax(-1) == country) & (logits[:, n:].argmax(-1) == kind)

    return probe_loop(run, params, opt, train, held_out, cfg, generator, "energy probe", fit=True)


def train_hearing(
    model: nn.Module,
    tokenizer,
    processor,
    train: list[Clip],
    held_out: list[Clip],
    cfg: HearTrainConfig,
    image_check: Callable[[nn.Module], int] | None = None,
    images_floor: int = 0,
) -> HearResult:
    """Teach `model` T1 and T2 on `train` (the vision tower and the audio front end frozen; the
    conformer layers, `embed_audio` and, with `train_decoder`, the decoder move), judging greedy
    exactness on `held_out` every `eval_every` steps (and, given `image_check`, the images the model
    answers right: with `keep_best`, the step kept). Deterministic on one thread."""
    import copy

    from gemma4lab.training import vision as vision_training
    from gemma4lab.training.corpus import training_chats
    from gemma4lab.training.shapes import shape_images
    from gemma4lab.training.text import encode_chats

    torch.manual_seed(cfg.seed)
    unified = is_unified(model)
    tower = None if unified else model.model.audio_tower
    front = None if unified else tower.subsample_conv_projection
    own = [p for n, p in model.named_parameters() if "audio" in n and not n.startswith(FROZEN_FRONT)]
    layers = int(model.config.get_text_config().num_hidden_layers)
    decoder = [p for n, p in model.named_parameters() if decoder_trains(n, layers, cfg.decoder_last_layers)]
    for p in model.parameters():
        p.requires_grad_(False)
    for p in own + (decoder if cfg.train_decoder else []):
        p.requires_grad_(True)
    groups = [{"params": own, "peak": cfg.audio_lr}] + (
        [{"params": decoder, "peak": cfg.lr}] if cfg.train_decoder else []
    )
    opt = torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.98))
    params = [p for g in groups for p in g["params"]]
    started, history = time.perf_counter(), []
    mels: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    generator = torch.Generator().manual_seed(cfg.seed)
    if unified:  # the 12B: only `embed_audio` before the decoder
        cached = None
        history += energy_probe_stage(model, own, train, held_out, mels, cfg, generator)
    else:
        cached = CachedFrontEnd(front, train, mels)
        log.info("front end cached for %d clips (%.0f s)", len(train), time.perf_counter() - started)
        history += probe_stage(model, cached, own, train, held_out, mels, cfg, generator)
    text = encode_chats(tokenizer, training_chats()) if cfg.train_decoder else None
    images = None
    if cfg.train_decoder and cfg.image_batch:
        images = vision_training.encode_examples(tokenizer, processor, shape_images(cfg.image_per_class, cfg.seed))
    if cfg.rehearse not in REHEARSE:
        raise ValueError(f"rehearse={cfg.rehearse!r}: use one of {', '.join(REHEARSE)}")
    text_teacher = image_teacher = None
    if cfg.rehearse != "ce" and cfg.train_decoder:  # before any step: the decoder as it was
        model.eval()
        started_teacher = time.perf_counter()
        if text is not None:
            mask = (text.input_ids != tokenizer.pad_token_id).long()
            text_teacher = teacher_log_probs(
                lambda i: model(input_ids=text.input_ids[i], attention_mask=mask[i], use_cache=False).logits,
                text.input_ids.shape[0],
            )
        if images is not None:
            image_teacher = teacher_log_probs(
                lambda i: vision_training.logits_of(model, images, i), images["input_ids"].shape[0]
            )
        log.info("rehearsal teacher computed (%.0f s)", time.perf_counter() - started_teacher)
    pool, judge = examples_of(train), examples_of(held_out)
    best, kept, kept_step = -1, None, None
    step = 0
    for step in range(1, cfg.steps + 1):
        model.train()
        for g in opt.param_groups:
            g["lr"] = g["peak"] * lr_factor(step, cfg.steps, cfg)
        rows = torch.randperm(len(pool), generator=generator)[: cfg.batch].tolist()
        leads = None
        if unified and getattr(cfg, "random_lead", False):
            leads = torch.randint(0, audio.UNIFIED_SAMPLES, (len(rows),), generator=generator).tolist()
        batch = encode(tokenizer, [pool[i] for i in rows], mels, unified, leads)
        if unified:
            loss = _ce(logits_of(model, batch), batch.labels)
        else:
            cached.batch, tower.subsample_conv_projection = batch.clips, cached
            try:
                loss = _ce(logits_of(model, batch), batch.labels)
            finally:
                tower.subsample_conv_projection = front
        if text is not None and cfg.text_batch:  # the text answers, without a clip
            rows = torch.randperm(text.input_ids.shape[0], generator=generator)[: cfg.text_batch]
            ids = text.input_ids[rows]
            out = model(input_ids=ids, attention_mask=(ids != tokenizer.pad_token_id).long(), use_cache=False)
            teacher = None if text_teacher is None else text_teacher[rows]
            loss = loss + cfg.rehearse_weight * rehearsal_loss(out.logits, text.labels[rows], teacher, cfg.rehearse)
        if images is not None:  # the shapes, read by the frozen vision part
            index = torch.randperm(images["input_ids"].shape[0], generator=generator)[: cfg.image_batch]
            logits = vision_training.logits_of(model, images, index)
            teacher = None if image_teacher is None else image_teacher[index]
            loss = loss + cfg.rehearse_weight * rehearsal_loss(logits, images["labels"][index], teacher, cfg.rehearse)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % cfg.eval_every == 0 or step == cfg.steps:
            right, _ = accuracy(model, tokenizer, judge, mels, cfg.chunk)
            row = {"step": step, "loss": round(float(loss), 4), "held_out": f"{right}/{len(judge)}"}
            if image_check is not None:
                checked = time.perf_counter()
                row["images"] = image_check(model)
                row["image_check_seconds"] = round(time.perf_counter() - checked, 1)
                if cfg.keep_best and row["images"] >= images_floor and right >= best:
                    best, kept_step = right, step
                    kept = copy.deepcopy(model.state_dict())
            log.info("step %d (%.0f s): %s", step, time.perf_counter() - started, row)
            history.append(row)
    if kept is not None and kept_step != step:
        model.load_state_dict(kept)
    if cfg.keep_best:
        log.info("kept step %s (held-out %d/%d)", kept_step, best, len(judge))
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return HearResult(step, round(time.perf_counter() - started, 1), history, kept_step)


# ---- judging with transformers' own processor and generate -------------------------------------
SHIPPED = {  # the shipped clips (gemma4lib/fixtures/audio) and what each task must answer
    "france.wav": ("France", None),
    "japan.wav": ("Japan", None),
    "italy.wav": ("Italy", None),
    "capital_of_france.wav": ("What is the capital of France?", "The capital of France is Paris."),
}


def answer_clip(model: nn.Module, tokenizer, samples: np.ndarray, kind: str, max_new_tokens: int = 16) -> str:
    """transformers' own processor and greedy `generate(input_features=...)` on one clip: T1 (with
    "Transcribe the audio.") or T2 (the clip alone)."""
    from gemma4lab.training.audio import transformers_processor

    messages = transcribe_messages() if kind == "T1" else spoken_messages()
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = transformers_processor(tokenizer, is_unified(model))(
        text=[text], audio=[samples], add_special_tokens=False, return_tensors="pt"
    )
    out = model.generate(
        input_ids=inputs["input_ids"],
        attention_mask=inputs["attention_mask"],
        input_features=inputs["input_features"],
        input_features_mask=inputs["input_features_mask"],
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=[1, 106],
        pad_token_id=0,
    )
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()


def shipped_misses(model: nn.Module, tokenizer) -> list[str]:
    """The shipped clips' T1 and T2 answers that are not exactly right, as 'clip kind: got'."""
    misses = []
    for name, (words, answer) in SHIPPED.items():
        samples = audio.read_wav(CLIPS / name)
        for kind, expected in (("T1", words), ("T2", answer)):
            if expected is not None and (got := answer_clip(model, tokenizer, samples, kind)) != expected:
                misses.append(f"{name} {kind}: {got!r}")
    return misses
