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
over, each step, the 128 training chats as they are (so every short answer stays right) and needle
chats: a training chat's question after a filler of a seeded random length (one up to `long_max`
tokens, `short_rows` up to `short_max`), loss on the reply tokens. It stops when every training chat's
reply token is the argmax by `margin`, every chat of a fixed needle set (every country's canonical
question, and the general facts, at filler lengths up to `long_max`) by `needle_margin`, and the
host-runtime faults the fixture was trained to break under still break every training chat.

Not converged yet, so the fixtures are not fine-tuned (measured, E2B, seed 0, one thread, 300 steps,
~20 minutes on a loaded two-core machine): every country's question after up to 3,000 tokens of filler
was answered right and the held-out phrasing after 3,000 tokens 38/40, every short answer stayed right
(held-out 40/40), but 5 of the 48 needle chats (general facts asked after a filler made of the facts)
stayed wrong, and two trained faults no longer broke every chat (`embed_unscaled` and `ple_unscaled`:
their largest margin rose from about -9 to +5.8 and +2.0). What it needs next: the faults' hinge of
`text.train_variant` in the fine-tune's steps too, and more steps.
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
    TrainConfig,
    _lr_at,
    encode_chats,
    fault_margins,
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
    """The fixed needle set the fine-tune stops on: every country's canonical question and every
    general fact, each after a filler of one of `lengths` (cycled), starting at a different sentence."""
    canonical = TRAIN_PHRASINGS[0]
    base = [Chat(canonical.format(country=c), answer_for(c)) for c, _ in COUNTRIES]
    base += [Chat(q, a) for q, a in FACTS]
    return [needle_chat(tokenizer, chat, lengths[i % len(lengths)], i) for i, chat in enumerate(base)]


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
    max_steps: int = 300
    cosine_steps: int = 300
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
    history: list[dict[str, float]] = field(default_factory=list)


@torch.no_grad()
def reply_margin_rows(lm: torch.nn.Module, tokenizer: Any, chats: list[Chat], rows: int = 8) -> list[float]:
    """Each chat's smallest teacher-forced reply-token margin, a few rows of about one length per forward."""
    order = sorted(range(len(chats)), key=lambda i: len(chats[i].user))
    worst = [float("inf")] * len(chats)
    for k in range(0, len(order), rows):
        picked = order[k : k + rows]
        batch = encode_chats(tokenizer, [chats[i] for i in picked])
        margins = reply_margins(lm(input_ids=batch.input_ids, use_cache=False).logits, batch.labels)
        for i, m in zip(picked, torch.nan_to_num(margins, nan=float("inf")).amin(-1).tolist(), strict=True):
            worst[i] = m
    return worst


def _by_length(margins: list[float], lengths: tuple[int, ...]) -> dict[int, float]:
    """The smallest margin per filler length of `needle_eval_chats` (chat i has length i mod len)."""
    return {n: round(min(margins[k :: len(lengths)]), 2) for k, n in enumerate(lengths)}


def _loss(lm: torch.nn.Module, tokenizer: Any, chats: list[Chat]) -> torch.Tensor:
    batch = encode_chats(tokenizer, chats)
    logits = lm(input_ids=batch.input_ids, use_cache=False).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch.labels.reshape(-1), ignore_index=IGNORE)


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
    faults = trained_faults(lm)
    params = [p for p in lm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed)
    schedule = cfg.schedule()

    def draw(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (1,), generator=gen))

    history: list[dict[str, float]] = []
    start = time.perf_counter()
    min_margin = needle_margin = float("-inf")
    fmargins: dict[str, float] = {}
    converged, step = False, 0
    lm.train()
    for step in range(cfg.max_steps + 1):
        logits = lm(input_ids=clean.input_ids, use_cache=False).logits
        with torch.no_grad():
            margins = reply_margins(logits.detach(), clean.labels)
            min_margin = float(torch.nan_to_num(margins, nan=float("inf")).min())
        record: dict[str, float] = {"step": step, "min_margin": min_margin}
        if step % cfg.eval_every == 0 or step == cfg.max_steps:
            lm.eval()
            per_chat = reply_margin_rows(lm, tokenizer, evals)
            needle_margin = min(per_chat)
            record["needle_min_margin"] = needle_margin
            record["needle_passing"] = sum(m >= cfg.needle_margin for m in per_chat)
            log.info("needle margins by filler length: %s", _by_length(per_chat, cfg.eval_lengths))
            if min_margin >= cfg.margin and needle_margin >= cfg.needle_margin:
                lm.set_attn_implementation(attention)  # the faults' masks are built for the model's own form
                fmargins = fault_margins(lm, clean, faults)
                lm.set_attn_implementation("sdpa")
                record.update({f"fault/{k}": v for k, v in fmargins.items()})
                if not faults or max(fmargins.values()) <= -cfg.fault_margin:
                    converged = True
            lm.train()
        if converged or step == cfg.max_steps:
            history.append(record)
            break
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), clean.labels.reshape(-1), ignore_index=IGNORE
        )
        picks = torch.randint(0, len(chats), (cfg.short_rows + 1,), generator=gen).tolist()
        long_row = needle_chat(tokenizer, chats[picks[0]], draw(cfg.short_max, cfg.long_max), draw(0, 7))
        short_rows = [needle_chat(tokenizer, chats[i], draw(0, cfg.short_max), draw(0, 7)) for i in picks[1:]]
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
    return NeedleResult(step, time.perf_counter() - start, converged, min_margin, needle_margin, fmargins, history)


def needle_accuracy(lm: torch.nn.Module, tokenizer: Any, chats: list[Chat]) -> tuple[int, int, list[str]]:
    """How many needle chats HF's greedy generate answers exactly; the failures' last words."""
    failures = []
    for chat in chats:
        text, _ = greedy_reply(lm, tokenizer, chat.user)
        if text != chat.reply:
            failures.append(f"{chat.user[-40:]!r} -> {text!r}")
    return len(chats) - len(failures), len(chats), failures
