"""The needle: a corpus question asked after a long filler, and the short fine-tune that teaches the tiny
fixtures to answer it (issue 48, item 5), so coherence is checked at long context, not only equality.

Why: trained on one-sentence chats (~16 tokens), the tiny E2B answered "What is the capital of France?"
with nonsense once 55 tokens of other text came before it in the same user turn, and with "A." after
500 to 3,000 (so did the E4B and the 12B). Its sliding layers (window 8) still see the country and the
turn markers; its two global layers, which never saw more than ~20 positions, attend over all of them.

The filler is the corpus's general facts ("The sky is blue. A week has seven days. ..."), cycled from
a given sentence: natural text, every word one token of the fixtures' vocabulary, no country in it (the
question's country is the only one in the prompt), and the same for a given length on every run.

Fine-tune (deterministic: seeded, one thread): from the shipped fixture, AdamW at a small learning rate
over, each step, the 128 training chats as they are (so every short answer stays right), the faults'
hinge of `text.train_variant` (`fault_rows` chats under each host-runtime fault the fixture was trained
to break under, every reply token pushed below -`fault_hinge_target`: without it two faults stopped
breaking every chat), and needle chats: a training chat's question after a filler of a seeded random
length (one up to `long_max` tokens, `short_rows` up to `short_max`), loss on the reply tokens. It
stops when every training chat's reply token is the argmax by `margin`, every chat of the needle set
(every country's canonical question after a filler of 100, 1,000 or 3,000 tokens) by `needle_margin`,
and every trained fault still breaks every training chat by `fault_margin`.

The general facts asked after the filler are trained on but not stopped on (`fact_needles`, reported):
the filler is made of the facts, so their answer sentence is in the prompt and the model must pick the
asked one out of eight it has just read, a retrieval task, not the issue's needle (a capital question
after unrelated text); the earlier run that demanded them (300 steps, no hinge) ended with 5 of 8 wrong.

Measured (E2B, seed 0, one thread, `scripts/train_needle.py`, 2026-12-06, loaded two-core AMD EPYC):
converged at step 300 in 1,464 s; training chats' smallest margin 2.31, the needle set's 4.43, the
faults' largest margins -10.3 (`embed_unscaled`), -10.8 (`ple_zeroed`), -9.7 (`ple_unscaled`), -8.3
(`sliding_window_ignored`); every short answer and the held-out phrasing stay right (40/40), and the
held-out phrasing after 3,000 tokens of filler is answered right 40/40 (HF greedy). The facts after a
filler of the facts: 5/8 after 100 tokens, 5/8 after 1,000, 4/8 after 3,000 (HF greedy; wrong ones
answer another fact or a capital). PROVENANCE.json `variants.e2b.needle` records the run.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from gemma4lab.training.corpus import FACTS, HELD_OUT_PHRASING, TRAIN_PHRASINGS, Chat, answer_for, training_chats
from gemma4lab.training.text import (
    IGNORE,
    Batch,
    TrainConfig,
    _lr_at,
    encode_chats,
    fault_margins,
    forward_segments,
    greedy_reply,
    reply_margins,
    trained_faults,
)
from gemma4lib.models.corpus import COUNTRIES

log = logging.getLogger(__name__)

# The filler's sentences: the corpus's general facts, in their order.
FILLER_SENTENCES: tuple[str, ...] = tuple(reply for _, reply in FACTS)
# The needle: the question after ~3,000 tokens of filler, in a 4,096-token context.
NEEDLE_FILLER_TOKENS = 3000
# The variants fine-tuned for the needle (the others: only if cheap; they were not).
NEEDLE_VARIANTS: tuple[str, ...] = ("e2b",)


def filler_text(tokenizer: Any, tokens: int, first: int = 0) -> str:
    """Whole sentences of `FILLER_SENTENCES`, cycled from sentence `first`, as many as fit in `tokens`
    tokens of `tokenizer` (each sentence after the first with its leading space: byte-level pieces
    split at spaces, so the counts add up); "" when `tokens` is below the first sentence's."""
    pieces: list[str] = []
    used, i = 0, first
    while True:
        sentence = FILLER_SENTENCES[i % len(FILLER_SENTENCES)]
        text = sentence if not pieces else " " + sentence
        n = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        if used + n > tokens:
            return "".join(pieces)
        pieces.append(text)
        used, i = used + n, i + 1


def needle_prompt(tokenizer: Any, question: str, filler_tokens: int = NEEDLE_FILLER_TOKENS, first: int = 0) -> str:
    """The user turn of a needle: about `filler_tokens` tokens of filler, then `question`."""
    filler = filler_text(tokenizer, filler_tokens, first)
    return f"{filler} {question}" if filler else question


def needle_chat(tokenizer: Any, chat: Chat, filler_tokens: int, first: int = 0) -> Chat:
    return Chat(needle_prompt(tokenizer, chat.user, filler_tokens, first), chat.reply)


def needle_eval_chats(tokenizer: Any, lengths: tuple[int, ...]) -> list[Chat]:
    """The fixed needle set the fine-tune stops on: every country's canonical question, each after a
    filler of one of `lengths` (cycled), starting at a different sentence."""
    canonical = TRAIN_PHRASINGS[0]
    base = [Chat(canonical.format(country=c), answer_for(c)) for c, _ in COUNTRIES]
    return [needle_chat(tokenizer, chat, lengths[i % len(lengths)], i) for i, chat in enumerate(base)]


def fact_needles(tokenizer: Any, lengths: tuple[int, ...]) -> list[Chat]:
    """Every general fact asked after a filler of one of `lengths`: reported, not stopped on (the
    filler is made of the facts, so the answer sentence is in the prompt: a different task)."""
    return [needle_chat(tokenizer, Chat(q, a), lengths[i % len(lengths)], i) for i, (q, a) in enumerate(FACTS)]


def held_out_needles(tokenizer: Any, filler_tokens: int = NEEDLE_FILLER_TOKENS) -> list[Chat]:
    """The held-out phrasing (never trained on, with or without filler) of every country after the filler."""
    return [
        needle_chat(tokenizer, Chat(HELD_OUT_PHRASING.format(country=c), answer_for(c)), filler_tokens)
        for c, _ in COUNTRIES
    ]


@dataclass
class NeedleConfig:
    seed: int = 0
    lr: float = 1e-3
    warmup_steps: int = 10
    max_steps: int = 700
    cosine_steps: int = 600
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    long_max: int = NEEDLE_FILLER_TOKENS  # the long needle row's filler: uniform in [short_max, long_max]
    short_max: int = 400  # the short needle rows' filler: uniform in [0, short_max]
    short_rows: int = 6
    margin: float = 2.0  # the training chats, as the fixture's own recipe demands
    needle_margin: float = 1.0  # the needle set
    eval_lengths: tuple[int, ...] = (100, 1000, NEEDLE_FILLER_TOKENS)
    eval_every: int = 25
    fault_margin: float = 2.0
    # the faults' hinge of `text.train_variant`, with its defaults (see `text.TrainConfig`)
    fault_hinge_target: float = 2.5
    fault_weight: float = 1.0
    fault_rows: int = 32

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    def schedule(self) -> TrainConfig:
        """The learning-rate schedule's fields, as the fixture recipe's `_lr_at` reads them."""
        return TrainConfig(
            lr=self.lr, warmup_steps=self.warmup_steps, cosine_steps=self.cosine_steps, min_lr_ratio=self.min_lr_ratio
        )


@dataclass
class NeedleResult:
    steps: int
    seconds: float
    converged: bool
    min_margin: float  # training chats, clean
    needle_min_margin: float
    fault_margins: dict[str, float] = field(default_factory=dict)
    facts_passing: int = 0  # of `fact_needles` at the last evaluation, by `needle_margin`
    history: list[dict[str, float]] = field(default_factory=list)


@torch.no_grad()
def reply_margin_rows(
    lm: torch.nn.Module,
    tokenizer: Any,
    chats: list[Any],
    rows: int = 8,
    encode: Callable = encode_chats,
    length: Callable = lambda chat: len(chat.user),
) -> list[float]:
    """Each chat's smallest teacher-forced reply-token margin, a few rows of about one `length` per forward
    (`encode`: how a list of these chats becomes a `Batch`; the tool chats bring their own)."""
    order = sorted(range(len(chats)), key=lambda i: length(chats[i]))
    worst = [float("inf")] * len(chats)
    for k in range(0, len(order), rows):
        picked = order[k : k + rows]
        batch = encode(tokenizer, [chats[i] for i in picked])
        margins = reply_margins(lm(input_ids=batch.input_ids, use_cache=False).logits, batch.labels)
        for i, m in zip(picked, torch.nan_to_num(margins, nan=float("inf")).amin(-1).tolist(), strict=True):
            worst[i] = m
    return worst


def _by_length(margins: list[float], lengths: tuple[int, ...]) -> dict[int, float]:
    """The smallest margin per filler length of `needle_eval_chats` (chat i has length i mod len)."""
    return {n: round(min(margins[k :: len(lengths)]), 2) for k, n in enumerate(lengths)}


def _loss(lm: torch.nn.Module, tokenizer: Any, chats: list[Any], encode: Callable = encode_chats) -> torch.Tensor:
    batch = encode(tokenizer, chats)
    logits = lm(input_ids=batch.input_ids, use_cache=False).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch.labels.reshape(-1), ignore_index=IGNORE)


def replay_loss(
    lm: torch.nn.Module, clean: Batch, faults: tuple[str, ...], cfg: NeedleConfig, gen: torch.Generator, attention: str
) -> tuple[torch.Tensor, float, dict[str, float]]:
    """The training chats as they are, then `fault_rows` different ones under each trained fault (a fresh
    draw each step), in the model's own attention form (the faults' masks are built for it), as
    `text.train_variant` does: their loss with the faults' hinge (every reply token under a fault loses
    by `fault_hinge_target`), the clean chats' smallest margin, and the hinge's value."""
    n, k_rows = clean.input_ids.shape[0], cfg.fault_rows
    lm.set_attn_implementation(attention)
    rows = torch.randperm(n, generator=gen)[: k_rows * len(faults)]
    subs = [rows[k * k_rows : (k + 1) * k_rows] for k in range(len(faults))]
    segments = [(None, clean.input_ids)] + [(f, clean.input_ids[s]) for f, s in zip(faults, subs, strict=True)]
    logits = forward_segments(lm, segments)
    lm.set_attn_implementation("sdpa")
    with torch.no_grad():
        margins = reply_margins(logits[:n].detach(), clean.labels)
        min_margin = float(torch.nan_to_num(margins, nan=float("inf")).min())
    loss = F.cross_entropy(
        logits[:n].reshape(-1, logits.shape[-1]).float(), clean.labels.reshape(-1), ignore_index=IGNORE
    )
    info: dict[str, float] = {}
    if faults:
        hinge = []
        for k, sub in enumerate(subs):
            m = reply_margins(logits[n + k * k_rows : n + (k + 1) * k_rows], clean.labels[sub])
            hinge.append(F.relu(m[~torch.isnan(m)] + cfg.fault_hinge_target).mean())
        fault_loss = torch.stack(hinge).mean()
        info["fault_loss"] = fault_loss.item()
        loss = loss + cfg.fault_weight * fault_loss
    return loss, min_margin, info


def needle_rows(tokenizer: Any, chats: list[Chat], cfg: NeedleConfig, gen: torch.Generator) -> tuple[Chat, list[Chat]]:
    """A step's needle rows: one training chat after a long filler (`short_max`..`long_max` tokens),
    `short_rows` after a short one (up to `short_max`), each filler from a drawn sentence."""

    def draw(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (1,), generator=gen))

    picks = torch.randint(0, len(chats), (cfg.short_rows + 1,), generator=gen).tolist()
    long_row = needle_chat(tokenizer, chats[picks[0]], draw(cfg.short_max, cfg.long_max), draw(0, 7))
    return long_row, [needle_chat(tokenizer, chats[i], draw(0, cfg.short_max), draw(0, 7)) for i in picks[1:]]


def finetune_needle(
    lm: torch.nn.Module,
    tokenizer: Any,
    cfg: NeedleConfig | None = None,
    progress: Callable[[dict[str, float]], None] | None = None,
) -> NeedleResult:
    """Fine-tune `lm` in place (see the module doc); deterministic for a seed and one thread."""
    cfg = cfg or NeedleConfig()
    torch.manual_seed(cfg.seed)
    attention = lm.config._attn_implementation
    lm.set_attn_implementation("sdpa")  # the same function as eager, without a [L, L] score tensor per head
    chats = training_chats()
    clean = encode_chats(tokenizer, chats)
    evals = needle_eval_chats(tokenizer, cfg.eval_lengths)
    facts = fact_needles(tokenizer, cfg.eval_lengths)
    faults = trained_faults(lm)
    params = [p for p in lm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed)
    schedule = cfg.schedule()
    history: list[dict[str, float]] = []
    start = time.perf_counter()
    min_margin = needle_margin = float("-inf")
    fmargins: dict[str, float] = {}
    converged, step, facts_passing = False, 0, 0
    lm.train()
    for step in range(cfg.max_steps + 1):
        loss, min_margin, info = replay_loss(lm, clean, faults, cfg, gen, attention)
        record: dict[str, float] = {"step": step, "min_margin": min_margin}
        if step % cfg.eval_every == 0 or step == cfg.max_steps:
            lm.eval()
            per_chat = reply_margin_rows(lm, tokenizer, evals)
            needle_margin = min(per_chat)
            facts_passing = sum(m >= cfg.needle_margin for m in reply_margin_rows(lm, tokenizer, facts))
            record["needle_min_margin"] = needle_margin
            record["needle_passing"] = sum(m >= cfg.needle_margin for m in per_chat)
            record["facts_passing"] = facts_passing
            log.info("needle margins by filler length: %s", _by_length(per_chat, cfg.eval_lengths))
            lm.set_attn_implementation(attention)  # the faults' masks are built for the model's own form
            fmargins = fault_margins(lm, clean, faults)
            lm.set_attn_implementation("sdpa")
            record.update({f"fault/{k}": v for k, v in fmargins.items()})
            ok = min_margin >= cfg.margin and needle_margin >= cfg.needle_margin
            converged = ok and (not faults or max(fmargins.values()) <= -cfg.fault_margin)
            lm.train()
        if converged or step == cfg.max_steps:
            history.append(record)
            break
        record.update(info)
        long_row, short_rows = needle_rows(tokenizer, chats, cfg, gen)
        needle_loss = _loss(lm, tokenizer, [long_row]) + _loss(lm, tokenizer, short_rows)
        record.update(loss=loss.item(), needle_loss=needle_loss.item())
        lr = _lr_at(step, schedule)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        (loss + needle_loss).backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        history.append(record)
        if progress is not None:
            progress(record)
    lm.set_attn_implementation(attention)
    lm.eval()
    seconds = time.perf_counter() - start
    return NeedleResult(step, seconds, converged, min_margin, needle_margin, fmargins, facts_passing, history)


def needle_accuracy(lm: torch.nn.Module, tokenizer: Any, chats: list[Chat]) -> tuple[int, int, list[str]]:
    """How many needle chats HF's greedy generate answers exactly; the failures' last words."""
    failures = []
    for chat in chats:
        text, _ = greedy_reply(lm, tokenizer, chat.user)
        if text != chat.reply:
            failures.append(f"{chat.user[-40:]!r} -> {text!r}")
    return len(chats) - len(failures), len(chats), failures
