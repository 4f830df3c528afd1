"""A vision-only repair after hearing (issue 50, the 12B): the decoder, fine-tuned to hear, moved under a
vision part that did not, and flipped a few image answers. This phase trains only what image soft tokens
depend on (the vision tower, where there is one, and `embed_vision`) on train_vision's fresh shape images
and answer loss, with everything else frozen: every text and audio output is then bit-unchanged by
construction, and `frozen_sha256` before and after proves it on the weights."""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)

# the only parameters image soft tokens depend on (transformers' gemma4 / gemma4_unified: the 12B has no
# tower, its `embed_vision` patch-embeds and projects); `embed_audio` and the decoder are never touched
VISION_PREFIXES = ("model.vision_tower.", "model.embed_vision.")


def repair_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for n, p in model.named_parameters() if n.startswith(VISION_PREFIXES)]


def frozen_sha256(model: nn.Module) -> str:
    """sha256 over every state-dict entry outside the vision part (name, dtype, shape, bytes): equal
    before and after the repair means the text and audio paths were not touched."""
    digest = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        if name.startswith(VISION_PREFIXES):
            continue
        tensor = value.detach().contiguous().cpu()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


@dataclass
class RepairResult:
    steps: int  # steps run
    kept_step: int  # the evaluated step kept (0: the state before the repair)
    images: int  # held-out images right at the kept step
    seconds: float
    history: list[dict[str, Any]] = field(default_factory=list)


def repair_vision(
    model: nn.Module,
    tokenizer,
    processor,
    steps: int,
    lr: float,
    every: int,
    seed: int,
    image_check: Callable[[nn.Module], int],
    target: int,
    per_class: int = 3,
) -> RepairResult:
    """Train the vision part alone (AdamW at `lr`, warm-up then cosine to a tenth) on `per_class` fresh
    images per class a step (train_vision's joint-stage draw, seed + 20,000 + step), judging `image_check`
    (the held-out images) every `every` steps; stop at `target` or after `steps`, keeping the best state
    judged (the earliest of equals). Deterministic on one thread."""
    import copy
    import math

    from gemma4lab.training import vision as vision_training
    from gemma4lab.training.shapes import shape_images

    params = repair_parameters(model)
    if not params:
        raise ValueError(f"no parameter under {VISION_PREFIXES}: not a multimodal model with a vision part")
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    started = time.perf_counter()
    model.eval()  # no dropout anyway; eval keeps the frozen decoder's behaviour exactly as judged
    best = image_check(model)
    kept_step, kept = 0, copy.deepcopy([p.detach() for p in params])
    history: list[dict[str, Any]] = [{"step": 0, "images": best}]
    log.info("vision repair: step 0 images %d/%d", best, target)
    warmup, step = 10, 0
    for step in range(1, steps + 1 if best < target else 1):
        progress = max(0.0, (step - warmup) / max(1, steps - warmup))
        factor = step / warmup if step <= warmup else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
        for g in opt.param_groups:
            g["lr"] = lr * factor
        drawn = vision_training.encode_examples(tokenizer, processor, shape_images(per_class, seed + 20_000 + step))
        index = torch.arange(drawn["input_ids"].shape[0])
        logits = vision_training.logits_of(model, drawn, index).float()
        loss = nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), drawn["labels"].reshape(-1), ignore_index=-100
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % every == 0 or step == steps:
            checked = time.perf_counter()
            right = image_check(model)
            row = {"step": step, "loss": round(float(loss.detach()), 4), "images": right}
            row["image_check_seconds"] = round(time.perf_counter() - checked, 1)
            history.append(row)
            log.info("vision repair (%.0f s): %s", time.perf_counter() - started, row)
            if right > best:
                best, kept_step, kept = right, step, copy.deepcopy([p.detach() for p in params])
            if best >= target:
                break
    with torch.no_grad():
        for p, value in zip(params, kept, strict=True):
            p.copy_(value)
    for p in model.parameters():
        p.requires_grad_(False)
    return RepairResult(step, kept_step, best, round(time.perf_counter() - started, 1), history)
