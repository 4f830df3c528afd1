"""Train a tiny assistant against a tiny trained target: distilled on the corpus, so that it drafts
what the target would say.

Why: a random assistant drafts nonsense (acceptance 0: still exact, but it shows nothing about
drafting), and no released assistant fits a tiny target. This one reads the frozen target's K/V
and hidden states exactly as the draft graph does (`drafting.draft_masks`: committed positions
before the last seen token, window + 1 of them on sliding layers, a constant position) and learns
the target's own greedy token at each of k draft steps.

Recipe (deterministic: seeded, one thread): one teacher-forced target forward over the 128
training chats gives the K/V of the layers the assistant reads, the final hidden states and the
target's argmax at every position. Every position p of a reply is a draft round whose last seen
token is x_p: step 1 takes (embedding of x_p, target hidden at p - 1), step j > 1 (embedding of
x_{p+j-1}, the assistant's own projected hidden of step j - 1), and the label of step j is the
target's argmax at p + j - 1. All positions train at once (each row attends only to the target's
K/V, never to another row). Full-batch AdamW; stop when every step-1 label is the argmax and the
mean over the k steps reaches `stop_accuracy`.

A target taught tools (`gemma4lab.training.tools`) says more than the plain answers: its calls, its answers
after a tool turn, its thoughts. With `tool_chats_every` n > 0 every n-th chat of the tool set
(`tool_eval_chats` with `tool_kinds`, the kinds the target was taught: thinking too, when it was) is
distilled as well, rendered as the server renders it, in buckets by prompt length whose rows draft from
the shortest prompt's end on (a declared tool makes a prompt of ~140 tokens, a reply is ~10-50); one loss
and one accuracy over all of them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from gemma4lab.training.corpus import held_out_chats, training_chats
from gemma4lab.training.text import IGNORE, Batch, encode_chats
from gemma4lab.training.tools import HELD_OUT_COUNTRIES, encode_tool_chats, tool_eval_chats
from gemma4lib.device.graph import additive_mask
from gemma4lib.device.kv_layout import FULL, SLIDING
from gemma4lib.models.assistant import build_tiny_assistant, store_for_assistant
from gemma4lib.models.loading import LoadedModel

log = logging.getLogger(__name__)


@dataclass
class AssistantTrainConfig:
    seed: int = 0
    draft_tokens: int = 4
    lr: float = 3e-3
    weight_decay: float = 0.01
    max_steps: int = 600
    warmup_steps: int = 20
    stop_accuracy: float = 0.97  # mean over the k draft steps, training chats
    tool_chats_every: int = 0  # 0: the plain training chats only; n: also every n-th tool chat (a target taught tools)
    tool_kinds: tuple[tuple[str, float], ...] = ()  # the kinds the target was taught (its tool run's `kind_shares`)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class AssistantTrainResult:
    assistant: torch.nn.Module
    steps: int
    seconds: float
    train_accuracy: list[float]  # per draft step
    held_out_accuracy: list[float]
    history: list[dict[str, float]] = field(default_factory=list)


def _masks(length: int, window: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Row p sees target positions < p (sliding: also >= p - 1 - window), as `draft_masks` does."""
    p = torch.arange(length)[:, None]
    q = torch.arange(length)[None, :]
    full = q <= p - 1
    sliding = full & (q >= p - 1 - window)
    return {FULL: additive_mask(full, dtype)[None, None], SLIDING: additive_mask(sliding, dtype)[None, None]}


@torch.no_grad()
def target_views(target: LoadedModel, batch: Batch) -> dict[str, Any]:
    """What the assistant reads from the frozen target, for every position of every encoded chat."""
    store_for_assistant(target.lm)
    # output_hidden_states: keeps every position through the KV-shared layers (no `logits_to_keep` slicing)
    out = target.lm.model(
        input_ids=batch.input_ids, use_cache=False, return_shared_kv_states=True, output_hidden_states=True
    )
    hidden = out.last_hidden_state
    predicted = target.lm.lm_head(hidden).argmax(-1)
    shared = {t: (k.detach(), v.detach()) for t, (k, v) in out.shared_kv_states.items()}
    return {
        "ids": batch.input_ids,
        "embeds": target.lm.model.embed_tokens(batch.input_ids),
        "hidden": hidden,
        "predicted": predicted,
        "on_reply": batch.labels != IGNORE,  # position t predicts a reply token (or the closing eos)
        "prompt_lengths": batch.prompt_lengths,
        "shared": shared,
    }


def draft_labels(views: dict[str, Any], k: int) -> list[torch.Tensor]:
    """Label of draft step j (1..k) at round position p: the target's argmax at p + j - 1, where that
    position predicts a reply token and p is a generated position (p >= prompt length)."""
    ids, predicted, on_reply = views["ids"], views["predicted"], views["on_reply"]
    n, length = ids.shape
    generated = torch.arange(length)[None, :] >= torch.tensor(views["prompt_lengths"])[:, None]
    labels = []
    for j in range(1, k + 1):
        label = torch.full((n, length), IGNORE, dtype=torch.long)
        src = slice(j - 1, length)
        dst = slice(0, length - j + 1)
        label[:, dst] = torch.where(on_reply[:, src], predicted[:, src], torch.full_like(predicted[:, src], IGNORE))
        labels.append(torch.where(generated, label, torch.full_like(label, IGNORE)))
    return labels


def draft_inputs(views: dict[str, Any], k: int) -> list[torch.Tensor]:
    """Token embedding of draft step j at round position p: that of x_{p+j-1} (zeros past the end)."""
    embeds = views["embeds"]
    out = []
    for j in range(1, k + 1):
        shifted = torch.zeros_like(embeds)
        shifted[:, : embeds.shape[1] - j + 1] = embeds[:, j - 1 :]
        out.append(shifted)
    return out


def unroll(assistant, views: dict[str, Any], inputs: list[torch.Tensor], masks, start: int = 0) -> list[torch.Tensor]:
    """k draft steps at every position from `start` on at once (the rows before it draft nothing: prompt); the
    logits of each step. Every row still reads the target's K/V of the whole chat."""
    n, length = views["ids"].shape
    hidden = torch.zeros_like(views["hidden"])
    hidden[:, 1:] = views["hidden"][:, :-1]  # step 1 at p: the target's hidden state at p - 1
    hidden = hidden[:, start:]
    positions = torch.arange(length)[None, start:].expand(n, -1)
    masks = {t: m[:, :, start:] for t, m in masks.items()}
    logits = []
    for x in inputs:
        x = x[:, start:]
        h = assistant.pre_projection(torch.cat([x, hidden], dim=-1))
        out = assistant.model(
            inputs_embeds=h,
            attention_mask=masks,
            position_ids=positions,
            shared_kv_states=views["shared"],
            use_cache=False,
            output_hidden_states=True,  # many rows at once: skips the KV-shared slicing (5.23.0 breaks there)
        ).last_hidden_state
        logits.append(assistant.lm_head(out))
        hidden = assistant.post_projection(out)
    return logits


def accuracy(logits: list[torch.Tensor], labels: list[torch.Tensor]) -> list[float]:
    out = []
    for lg, lb in zip(logits, labels, strict=True):
        keep = lb != IGNORE
        out.append(float((lg.argmax(-1)[keep] == lb[keep]).float().mean()) if keep.any() else 1.0)
    return out


@dataclass
class DraftSet:
    """One batch of chats as the assistant trains on it: the target's views, the masks, and each draft step's
    inputs and labels."""

    views: dict[str, Any]
    masks: dict[str, torch.Tensor]
    inputs: list[torch.Tensor]
    labels: list[torch.Tensor]  # from `start` on
    start: int  # the first position that drafts (the shortest prompt's length); 0 for the plain chats

    @classmethod
    def of(cls, target: LoadedModel, batch: Batch, k: int, skip_prompts: bool = False) -> DraftSet:
        views = target_views(target, batch)
        masks = _masks(views["ids"].shape[1], int(target.config.sliding_window), torch.float32)
        start = min(batch.prompt_lengths) if skip_prompts else 0
        return cls(views, masks, draft_inputs(views, k), [lb[:, start:] for lb in draft_labels(views, k)], start)


TOOL_BUCKETS = 4  # tool chats by prompt length: each bucket pads to its own length and drafts from its own start


def draft_sets(target: LoadedModel, config: AssistantTrainConfig, held_out: bool) -> list[DraftSet]:
    """The training (or held-out) chats, and with `tool_chats_every` the tool chats (or the held-out countries'),
    in `TOOL_BUCKETS` sets by prompt length."""
    tokenizer, k = target.tokenizer, config.draft_tokens
    sets = [DraftSet.of(target, encode_chats(tokenizer, held_out_chats() if held_out else training_chats()), k)]
    if config.tool_chats_every:
        tools = (
            tool_eval_chats(2, HELD_OUT_COUNTRIES, shares=config.tool_kinds)
            if held_out
            else tool_eval_chats(shares=config.tool_kinds)
        )[:: config.tool_chats_every]
        lengths = encode_tool_chats(tokenizer, tools).prompt_lengths
        by_length = [i for _, i in sorted(zip(lengths, range(len(tools)), strict=True))]  # chat indices
        size = -(-len(tools) // TOOL_BUCKETS)
        for first in range(0, len(tools), size):
            bucket = encode_tool_chats(tokenizer, [tools[i] for i in by_length[first : first + size]])
            sets.append(DraftSet.of(target, bucket, k, skip_prompts=True))
    return sets


def unrolled(assistant, sets: list[DraftSet]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each draft step's logits and labels over every set, flattened into one row of positions."""
    outs = [unroll(assistant, s.views, s.inputs, s.masks, s.start) for s in sets]
    steps = range(len(sets[0].labels))
    logits = [torch.cat([o[j].reshape(-1, o[j].shape[-1]) for o in outs]) for j in steps]
    labels = [torch.cat([s.labels[j].reshape(-1) for s in sets]) for j in steps]
    return logits, labels


def train_assistant(target: LoadedModel, config: AssistantTrainConfig | None = None) -> AssistantTrainResult:
    """Distil a tiny assistant for `target` (a tiny trained fixture); see the module docstring."""
    config = config or AssistantTrainConfig()
    k = config.draft_tokens
    torch.manual_seed(config.seed)
    assistant = build_tiny_assistant(target.config, target.variant, seed=config.seed).train()
    for p in target.lm.parameters():
        p.requires_grad_(False)
    sets, held = draft_sets(target, config, held_out=False), draft_sets(target, config, held_out=True)
    params = [p for p in assistant.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.98))
    started = time.perf_counter()
    history: list[dict[str, float]] = []
    step, acc = 0, [0.0] * k
    for step in range(1, config.max_steps + 1):
        for group in opt.param_groups:
            group["lr"] = config.lr * min(1.0, step / config.warmup_steps)
        logits, labels = unrolled(assistant, sets)
        loss = sum(F.cross_entropy(lg, lb, ignore_index=IGNORE) for lg, lb in zip(logits, labels, strict=True)) / k
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        acc = accuracy([lg.detach() for lg in logits], labels)
        history.append({"step": step, "loss": float(loss.detach()), "accuracy": sum(acc) / k})
        if acc[0] == 1.0 and sum(acc) / k >= config.stop_accuracy:
            break
    assistant.eval()
    with torch.no_grad():
        acc = accuracy(*unrolled(assistant, sets))
        held_acc = accuracy(*unrolled(assistant, held))
    seconds = time.perf_counter() - started
    log.info("assistant for %s: %d steps, %.1f s, accuracy %s", target.variant.name, step, seconds, acc)
    return AssistantTrainResult(assistant, step, seconds, acc, held_acc, history)


__all__ = ["AssistantTrainConfig", "AssistantTrainResult", "draft_labels", "target_views", "train_assistant"]
