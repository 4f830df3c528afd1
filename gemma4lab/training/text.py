"""Train the tiny Gemma-4 fixtures: one small model per variant that really answers the corpus.

Why: equality tests (device graph == host reference) prove a compiler is faithful, not that the
reference is right. A model that answers "The capital of France is Paris." makes the coherence
check real on any CPU, and lets the seed's bug classes (wrong chat tokens, embedding scale,
`layer_scalar` left at init, sliding window ignored, PLE wiring) be reproduced in CI.

Recipe (deterministic: seeded, one thread, same weights byte for byte on every run):
- the variant's own tiny config (`build_tiny`, with its non-trivial `layer_scalar`s), vocabulary
  from the corpus tokenizer;
- full-batch AdamW over the 128 training chats, linear warm-up then cosine decay, loss on the
  reply tokens (and the closing `<eos>`) only;
- stop when every reply token of every chat is the argmax with a margin >= 2 (softcapped logits).

PLE variants (E2B, E4B) get one more term. Plainly trained, the tiny E2B still answered with
"Paris" under some host-runtime faults (PLE token table zeroed, PLE or main embedding scale
missing, sliding window ignored), so a text check could not tell a broken runtime from a working
one. So each step also runs a few chats under every fault in `PLE_TRAINED_FAULTS` — applied where
the host runtime would make it: in the embeddings passed as `inputs_embeds=` /
`per_layer_inputs=`, or in the masks passed as `attention_mask={...}` — and a hinge pushes every
reply token's margin under the fault below -`fault_hinge_target`. Training stops only when,
additionally, every chat's reply breaks under every such fault (some reply token at margin
<= -`fault_margin`). Dense and MoE variants trained plainly already break under each fault.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from gemma4lab.training.corpus import Chat, held_out_chats, training_chats
from gemma4lib.cache.artifacts import sha256_file
from gemma4lib.errors import CheckpointError, UnknownNameError
from gemma4lib.models.loading import LoadedModel, build_tiny
from gemma4lib.models.variants import Variant

log = logging.getLogger(__name__)

MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors")  # what a fixture's hashes cover

IGNORE = -100

# Faults a host runtime can make, applied in `forward_segments`:
#   embed_unscaled          inputs_embeds without the sqrt(hidden) scale
#   ple_zeroed              per_layer_inputs all zero (PLE token table never loaded)
#   ple_unscaled            per_layer_inputs without the sqrt(hidden_per_layer) scale
#   sliding_window_ignored  sliding layers attend over the whole causal prefix
ALL_FAULTS = ("embed_unscaled", "ple_zeroed", "ple_unscaled", "sliding_window_ignored")
# The ones PLE models are trained to break under (the hinge term). Plainly trained, the tiny E2B
# still answered with Paris under several of them.
PLE_TRAINED_FAULTS = ALL_FAULTS


@dataclass
class TrainConfig:
    seed: int = 0
    lr: float = 3e-3
    warmup_steps: int = 20
    max_steps: int = 1500
    cosine_steps: int = 800  # horizon of the cosine decay (to `min_lr_ratio` × lr), then flat
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.98)
    grad_clip: float = 1.0
    margin: float = 2.0  # clean: every reply token is the argmax by at least this
    fault_margin: float = 2.0  # under each trained fault some reply token of every chat loses by this
    fault_hinge_target: float = 2.5  # the hinge pushes each reply token below -this
    fault_weight: float = 1.0
    fault_rows: int = 32  # chats per fault per step (rotating); the stop check uses all of them
    train_faults: bool | None = None  # None: PLE variants only (`trained_faults`); True/False: force

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


@dataclass
class Batch:
    input_ids: torch.Tensor  # [N, L], right-padded with <pad>
    labels: torch.Tensor  # [N, L], the token to predict at each position (IGNORE off the reply)
    prompt_lengths: list[int]


@dataclass
class TrainResult:
    loaded: LoadedModel
    steps: int
    seconds: float
    min_margin: float
    fault_margins: dict[str, float] = field(default_factory=dict)  # max over chats of the min reply margin
    converged: bool = True
    history: list[dict[str, float]] = field(default_factory=list)


def encode_chats(tokenizer, chats: list[Chat]) -> Batch:
    """Prompt (rendered by the chat template, with the generation prompt) + reply + `<eos>`."""
    rows = []
    for chat in chats:
        reply = tokenizer(chat.reply, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append((chat_prompt_ids(tokenizer, chat.user), reply))
    return pad_rows(rows, tokenizer.pad_token_id)


def pad_rows(rows: list[tuple[list[int], list[int]]], pad_id: int) -> Batch:
    """(prompt, reply) id rows right-padded with `pad_id` into a `Batch`, labels on the reply tokens only."""
    length = max(len(p) + len(r) for p, r in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), length), IGNORE, dtype=torch.long)
    for i, (prompt, reply) in enumerate(rows):
        seq = prompt + reply
        ids[i, : len(seq)] = torch.tensor(seq)
        # position t predicts token t+1: the last prompt position predicts the first reply token
        labels[i, len(prompt) - 1 : len(seq) - 1] = torch.tensor(reply)
    return Batch(ids, labels, [len(p) for p, _ in rows])


def chat_prompt_ids(tokenizer, user: str) -> list[int]:
    """Token ids of a one-turn chat prompt, rendered by the tokenizer's own chat template."""
    enc = tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True, tokenize=True)
    return list(enc["input_ids"] if hasattr(enc, "keys") else enc)


def reply_margins(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[N, L] margin of the target over the best other token (NaN off the reply)."""
    mask = labels != IGNORE
    safe = labels.clamp(min=0)
    target = logits.gather(-1, safe[..., None]).squeeze(-1)
    others = logits.scatter(-1, safe[..., None], float("-inf")).amax(-1)
    margin = target - others
    return torch.where(mask, margin, torch.full_like(margin, float("nan")))


def host_embeddings(lm, ids: torch.Tensor, fault: str | None = None):
    """Host-side embeddings as the device runtime computes them, optionally with one fault.

    Returns (inputs_embeds, per_layer_inputs); the latter is None for models without PLE.
    """
    tm = lm.model
    if fault == "embed_unscaled":  # sqrt(hidden) forgotten
        embeds = F.embedding(ids, tm.embed_tokens.weight)
    else:
        embeds = tm.embed_tokens(ids)
    if not lm.config.hidden_size_per_layer_input:
        return embeds, None
    if fault == "ple_unscaled":  # sqrt(hidden_per_layer) forgotten
        ple = F.embedding(ids, tm.embed_tokens_per_layer.weight).reshape(
            *ids.shape, tm.config.num_hidden_layers, tm.hidden_size_per_layer_input
        )
    else:
        ple = tm.get_per_layer_inputs(ids)
    if fault == "ple_zeroed":  # token table never loaded
        ple = torch.zeros_like(ple)
    return embeds, ple


def forward_segments(lm, segments: list[tuple[str | None, torch.Tensor]]) -> torch.Tensor:
    """One forward over several row blocks, each under its own fault (None = clean).

    `segments` is [(fault, ids [n_i, L]), ...]; returns logits [sum n_i, L, V] in that order. The
    embeddings are computed on the host and passed as `inputs_embeds=` / `per_layer_inputs=`; the
    masks are built here and passed as a dict, so a row can see the sliding window ignored.
    """
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    unknown = {f for f, _ in segments} - set(ALL_FAULTS) - {None}
    if unknown:
        raise UnknownNameError("training fault", sorted(unknown), ALL_FAULTS)
    parts = [host_embeddings(lm, ids, f) for f, ids in segments]
    embeds = torch.cat([p[0] for p in parts])
    ple = torch.cat([p[1] for p in parts]) if parts[0][1] is not None else None
    length = embeds.shape[1]
    mask_kwargs = dict(
        config=lm.config,
        inputs_embeds=embeds,
        past_key_values=None,
        attention_mask=torch.ones(embeds.shape[:2], dtype=torch.long),
        position_ids=torch.arange(length)[None],
    )
    full = create_causal_mask(**mask_kwargs)
    sliding = create_sliding_window_causal_mask(**mask_kwargs)
    start = 0
    for f, ids in segments:
        if f == "sliding_window_ignored":
            sliding = sliding.clone()
            sliding[start : start + ids.shape[0]] = full[start : start + ids.shape[0]]
        start += ids.shape[0]
    kwargs = {"per_layer_inputs": ple} if ple is not None else {}
    return lm(
        inputs_embeds=embeds,
        attention_mask={"full_attention": full, "sliding_attention": sliding},
        use_cache=False,
        **kwargs,
    ).logits


def trained_faults(lm) -> tuple[str, ...]:
    """The faults the training hinge breaks for this model (PLE models only; see the module doc)."""
    return PLE_TRAINED_FAULTS if lm.config.hidden_size_per_layer_input else ()


def _lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    t = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.cosine_steps - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


@torch.no_grad()
def fault_margins(lm, batch: Batch, faults: tuple[str, ...] | None = None) -> dict[str, float]:
    """Per fault: the largest (over chats) of the smallest reply-token margin; < 0 means every
    chat's teacher-forced reply has a wrong token under that fault."""
    out = {}
    for f in trained_faults(lm) if faults is None else faults:
        m = reply_margins(forward_segments(lm, [(f, batch.input_ids)]), batch.labels)
        out[f] = float(torch.nan_to_num(m, nan=float("inf")).amin(-1).amax())
    return out


def train_variant(
    variant: Variant,
    tokenizer,
    cfg: TrainConfig | None = None,
    progress: Callable[[dict[str, float]], None] | None = None,
) -> TrainResult:
    """Train the tiny config of `variant` on the corpus; deterministic for a given seed and thread count."""
    cfg = cfg or TrainConfig()
    torch.manual_seed(cfg.seed)
    loaded = build_tiny(
        variant,
        cfg.seed,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    lm = loaded.lm
    if variant.is_moe:  # the data-dependent eager loop trains fastest on CPU (batched_mm ~7x slower)
        lm.set_experts_implementation("eager")
    if cfg.train_faults is None:
        faults = trained_faults(lm)
    elif cfg.train_faults:
        ple = bool(lm.config.hidden_size_per_layer_input)
        faults = tuple(f for f in ALL_FAULTS if ple or not f.startswith("ple_"))
    else:
        faults = ()
    batch = encode_chats(tokenizer, training_chats())
    n = batch.input_ids.shape[0]
    params = [p for p in lm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed)
    history: list[dict[str, float]] = []
    start = time.perf_counter()
    lm.train()
    min_margin, fmargins, step, converged = float("-inf"), {}, 0, False
    k_rows = cfg.fault_rows
    for step in range(cfg.max_steps + 1):
        if faults:
            # the clean batch, then `fault_rows` different chats under each fault (a fresh draw each step)
            rows = torch.randperm(n, generator=gen)[: k_rows * len(faults)]
            subs = [rows[k * k_rows : (k + 1) * k_rows] for k in range(len(faults))]
            segments = [(None, batch.input_ids)] + [
                (f, batch.input_ids[sub]) for f, sub in zip(faults, subs, strict=True)
            ]
            logits = forward_segments(lm, segments)
        else:
            logits = lm(input_ids=batch.input_ids, use_cache=False).logits
        clean = logits[:n]
        with torch.no_grad():
            margins = reply_margins(clean.detach(), batch.labels)
            min_margin = float(torch.nan_to_num(margins, nan=float("inf")).min())
        record = {"step": step, "min_margin": min_margin}
        if min_margin >= cfg.margin:
            if faults:
                lm.eval()
                fmargins = fault_margins(lm, batch, faults)
                lm.train()
                record.update({f"fault/{k}": v for k, v in fmargins.items()})
            if not faults or max(fmargins.values()) <= -cfg.fault_margin:
                converged = True
                history.append(record)
                break
        if step == cfg.max_steps:
            break
        loss = F.cross_entropy(
            clean.reshape(-1, clean.shape[-1]).float(), batch.labels.reshape(-1), ignore_index=IGNORE
        )
        record["loss"] = loss.item()
        if faults:
            hinge = []
            for k, sub in enumerate(subs):
                m = reply_margins(logits[n + k * k_rows : n + (k + 1) * k_rows], batch.labels[sub])
                valid = ~torch.isnan(m)
                hinge.append(F.relu(m[valid] + cfg.fault_hinge_target).mean())
            fault_loss = torch.stack(hinge).mean()
            record["fault_loss"] = fault_loss.item()
            loss = loss + cfg.fault_weight * fault_loss
        lr = _lr_at(step, cfg)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        record["lr"] = lr
        history.append(record)
        if progress is not None:
            progress(record)
    seconds = time.perf_counter() - start
    if variant.is_moe:
        lm.set_experts_implementation("grouped_mm")  # back to the library default for inference
    lm.eval()
    if faults and not fmargins:
        fmargins = fault_margins(lm, batch, faults)
    loaded.tokenizer = tokenizer
    loaded.source = f"tiny-trained(seed={cfg.seed})"
    return TrainResult(loaded, step, seconds, min_margin, fmargins, converged, history)


@torch.no_grad()
def greedy_reply(lm, tokenizer, user: str, max_new_tokens: int = 16) -> tuple[str, list[int]]:
    """HF greedy `generate` on the chat prompt; the reply text (special tokens dropped) and its ids."""
    ids = torch.tensor([chat_prompt_ids(tokenizer, user)])
    out = lm.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    new = out[0, ids.shape[1] :].tolist()
    return tokenizer.decode(new, skip_special_tokens=True), new


def held_out_accuracy(lm, tokenizer) -> tuple[int, int, list[str]]:
    """How many held-out prompts are answered exactly (then `<eos>`); the failures' prompts."""
    failures = []
    chats = held_out_chats()
    for chat in chats:
        text, ids = greedy_reply(lm, tokenizer, chat.user)
        if text != chat.reply or ids[-1:] != [tokenizer.eos_token_id]:
            failures.append(chat.user)
    return len(chats) - len(failures), len(chats), failures


def state_sha256(lm) -> str:
    """A fingerprint of every tensor of the state dict (parameters and persistent buffers)."""
    h = hashlib.sha256()
    for name, t in sorted(lm.state_dict().items()):
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


@torch.no_grad()
def greedy_under_fault(lm, tokenizer, prompt_ids: list[int], fault: str | None, max_new_tokens: int = 12) -> str:
    """Greedy reply (no KV cache, full recompute each step) with one host-runtime fault applied."""
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        logits = forward_segments(lm, [(fault, torch.tensor([ids]))])
        nxt = int(logits[0, -1].argmax())
        ids.append(nxt)
        if nxt == tokenizer.eos_token_id:
            break
    return tokenizer.decode(ids[len(prompt_ids) :], skip_special_tokens=True)


@torch.no_grad()
def fault_answers(lm, tokenizer, user: str | None = None) -> dict[str, str]:
    """What the model answers to the canonical prompt under each fault the seed hit (for provenance).

    Keys: "clean", each applicable fault of `ALL_FAULTS`, "layer_scalar_at_init" (every
    `layer_scalar` back at 1.0) and "gemma3_chat_markers" (the prompt written with Gemma 3's
    `<start_of_turn>` markers, which a Gemma-4 tokenizer splits into ordinary pieces).
    """
    from gemma4lab.training.corpus import CANONICAL_PROMPT

    user = user or CANONICAL_PROMPT
    prompt = chat_prompt_ids(tokenizer, user)
    ple = bool(lm.config.hidden_size_per_layer_input)
    out = {"clean": greedy_under_fault(lm, tokenizer, prompt, None)}
    for f in ALL_FAULTS:
        if ple or not f.startswith("ple_"):
            out[f] = greedy_under_fault(lm, tokenizer, prompt, f)
    saved = [layer.layer_scalar.clone() for layer in lm.model.layers]
    try:
        for layer in lm.model.layers:
            layer.layer_scalar.fill_(1.0)
        out["layer_scalar_at_init"] = greedy_under_fault(lm, tokenizer, prompt, None)
    finally:
        for layer, s in zip(lm.model.layers, saved, strict=True):
            layer.layer_scalar.copy_(s)
    gemma3 = tokenizer(f"<start_of_turn>user\n{user}<end_of_turn>\n<start_of_turn>model\n")["input_ids"]
    out["gemma3_chat_markers"] = greedy_under_fault(lm, tokenizer, gemma3, None)
    return out


def save_fixture(lm: torch.nn.Module, path: Path) -> dict[str, str]:
    """Save a model as a fixture folder and check it reloads with identical tensors (buffers included)."""
    path.mkdir(parents=True, exist_ok=True)
    lm.save_pretrained(str(path), safe_serialization=True)
    reloaded = type(lm).from_pretrained(
        str(path), dtype=torch.float32, attn_implementation=lm.config._attn_implementation
    )
    before, after = lm.state_dict(), reloaded.state_dict()
    if before.keys() != after.keys():
        raise CheckpointError(f"fixture {path} reloads with different tensors: {sorted(set(before) ^ set(after))}")
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    if changed:
        raise CheckpointError(f"fixture {path} reloads with different values for {changed}")
    return {name: sha256_file(path / name) for name in MODEL_FILES}
