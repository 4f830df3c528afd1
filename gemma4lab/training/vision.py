"""Training the tiny vision fixtures (`scripts/train_vision.py`): the vision tower probe-pretrained on
the shape images, then the decoder taught to describe them with the text corpus rehearsed."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gemma4lab.training.shapes import ShapeImage, shape_images
from gemma4lib.cache.artifacts import sha256_file
from gemma4lib.models.image_attention import generate_kwargs, intended_masks
from gemma4lib.models.shapes import QUESTION
from gemma4lib.models.tokenizer import BOS, EOS, PAD
from gemma4lib.models.vision import (
    BOI,
    BOI_ID,
    EOI,
    EOI_ID,
    IMAGE_TOKEN,
    IMAGE_TOKEN_ID,
    expand_image_tokens,
    image_messages,
    token_types,
)

log = logging.getLogger(__name__)


# ---- training ----------------------------------------------------------------------------------
@dataclass
class VisionTrainConfig:
    seed: int = 0
    per_class: int = 16  # 12 classes: 192 training images
    held_out_per_class: int = 4
    lr: float = 3e-3
    vision_lr: float = 1e-2  # the vision part starts from scratch: a larger step than the decoder's
    batch: int = 32
    # the joint stage's steps draw this many fresh images per class (36 a step) instead of a batch of
    # the 192 above, which stay the set the stopping rule judges; 0: batches of the 192
    fresh_per_class: int = 3
    # text chats of the text fixture's corpus rehearsed per step (its 128 training chats): without them
    # the decoder forgot its text answers ("What is the capital of France?" -> "A blueurcle.")
    text_batch: int = 16
    max_steps: int = 600  # 200 was not enough here (docs/IMAGES.md: colour learnt, shape 50-83 % held out)
    # no stop before this: a decoder that just reached the margin on the 192 still misread about one
    # held-out image in 50 (e4b stopped at step 140 with "A yellow circle." -> "A green circle.")
    min_steps: int = 400
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1  # cosine decay to this share of the peak by max_steps (a constant rate oscillated)
    eval_every: int = 20
    margin: float = 0.5  # stop when every reply token of every training image wins by this much
    weight_decay: float = 0.0
    # the frozen text decoder could not be steered to new words in minutes (loss 7.9 -> 6.7 in 100
    # steps on E2B): the decoder is fine-tuned with the vision part, in a copy of its own
    freeze_text: bool = False
    # stage one (`pretrain_vision`): the vision part alone, through a linear probe on its soft
    # tokens, on many more images than the joint stage sees (the joint stage alone learnt the colour
    # and missed the shape on 17-50 % of held-out images after 200 steps: docs/IMAGES.md)
    pretrain_per_class: int = 8  # fresh images every step: 96, seeded by the step
    pretrain_steps: int = 1500  # all of them: stopping at the first 100 % left the shape fragile (e4b)
    pretrain_lr: float = 3e-3
    # the joint stage keeps stage one's vision part (encoder and embedder): only the decoder moves. With
    # the embedder trained too, e2b misread one held-out image in 52 ("A blue circle." -> "A blue square.")
    freeze_vision: bool = True
    pretrain_held_out_per_class: int = 8  # 96 images the encoder never trains on
    pretrain_target: float = 1.0  # held-out accuracy of the probe at the end (colour and shape both right)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class VisionTrainResult:
    steps: int
    converged: bool
    final_min_margin: float
    seconds: float
    history: list[dict[str, float]] = field(default_factory=list)


def process(processor, images: list) -> dict[str, torch.Tensor]:
    """The processor's tensors for a list of PIL images."""
    return processor(images=images, return_tensors="pt")


def encode_examples(tokenizer, processor, examples: list[ShapeImage]) -> dict[str, torch.Tensor]:
    """Chat prompt with one image + the answer + eos, labels on the answer only (as the text training)."""
    data = process(processor, [e.image for e in examples])
    rows = []
    for i, example in enumerate(examples):
        prompt = tokenizer.apply_chat_template(
            image_messages(QUESTION), add_generation_prompt=True, tokenize=True, return_dict=False
        )
        prompt = expand_image_tokens(list(prompt), [int(data["num_soft_tokens_per_image"][i])])
        reply = tokenizer(example.answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append((prompt, reply))
    length = max(len(p) + len(r) for p, r in rows)
    ids = torch.full((len(rows), length), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), length), -100, dtype=torch.long)
    attention = torch.zeros((len(rows), length), dtype=torch.long)
    for i, (prompt, reply) in enumerate(rows):
        seq = prompt + reply
        ids[i, : len(seq)] = torch.tensor(seq)
        attention[i, : len(seq)] = 1
        labels[i, len(prompt) - 1 : len(seq) - 1] = torch.tensor(reply)
    return {
        "input_ids": ids,
        "labels": labels,
        "attention_mask": attention,
        "mm_token_type_ids": (ids == IMAGE_TOKEN_ID).long(),
        "pixel_values": data["pixel_values"],
        "image_position_ids": data["image_position_ids"],
    }


def vision_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters outside the language model: the vision tower (if any) and the image embedder."""
    return [p for n, p in model.named_parameters() if not n.startswith(("model.language_model.", "lm_head."))]


def logits_of(model: nn.Module, batch: dict[str, torch.Tensor], index: torch.Tensor) -> torch.Tensor:
    """Teacher-forced logits of the examples `index`, under the model's intended image masks."""
    keys = ("input_ids", "attention_mask", "mm_token_type_ids")
    sub = {k: batch[k][index] for k in keys}
    masks = intended_masks(model, sub["input_ids"], sub["attention_mask"], sub["mm_token_type_ids"])
    if masks is not None:
        sub["attention_mask"] = masks
    return model(
        **sub,
        pixel_values=batch["pixel_values"][index],
        image_position_ids=batch["image_position_ids"][index],
        use_cache=False,
    ).logits


def min_margin(model: nn.Module, batch: dict[str, torch.Tensor], chunk: int = 96) -> float:
    """The smallest reply-token margin (target minus best other) over every example."""
    from gemma4lab.training.text import reply_margins

    worst = float("inf")
    with torch.no_grad():
        for s in range(0, batch["input_ids"].shape[0], chunk):
            index = torch.arange(s, min(s + chunk, batch["input_ids"].shape[0]))
            margins = reply_margins(logits_of(model, batch, index).float(), batch["labels"][index])
            worst = min(worst, float(torch.nan_to_num(margins, nan=float("inf")).min()))
    return worst


def lr_factor(step: int, cfg: VisionTrainConfig, total: int | None = None) -> float:
    """Linear warm-up, then cosine decay to `min_lr_ratio` at `total` (default `max_steps`)."""
    import math

    total = cfg.max_steps if total is None else total
    if step <= cfg.warmup_steps:
        return step / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


@dataclass
class PretrainResult:
    steps: int
    held_out_accuracy: float
    seconds: float
    history: list[dict[str, float]] = field(default_factory=list)


def _probe_inputs(processor, examples: list[ShapeImage]) -> tuple[torch.Tensor, ...]:
    """The processor's tensors cut to the patches the images fill (the processor pads every image to
    the compiled budget at the end; the encoder masks the padding and the pooler gives padding no
    weight, so the valid soft tokens are the same, at a fifth of the cost), and the labels."""
    from gemma4lib.models.shapes import COLOURS, SHAPES

    data = process(processor, [e.image for e in examples])
    positions = data["image_position_ids"].to(torch.int32)
    used = int((positions[..., 0] >= 0).sum(-1).max())
    colours = torch.tensor([list(COLOURS).index(e.colour) for e in examples])
    shapes = torch.tensor([SHAPES.index(e.shape) for e in examples])
    counts = data["num_soft_tokens_per_image"].long()
    return data["pixel_values"][:, :used], positions[:, :used], counts, colours, shapes


def pretrain_vision(model: nn.Module, processor, cfg: VisionTrainConfig) -> PretrainResult:
    """Stage one: train the vision tower and embedder (the decoder untouched) so that the mean of
    an image's soft tokens alone tells its colour and shape, through a linear probe thrown away
    afterwards. Why: jointly with the decoder, on the 192 images the reply loss sees, the shape was
    learnt late and badly; here every step draws fresh images (seeded by the step), so the encoder
    cannot memorise, and only the small vision graph runs. Deterministic on one thread."""
    from gemma4lib.device.vision import vision_graph
    from gemma4lib.models.shapes import COLOURS, SHAPES

    torch.manual_seed(cfg.seed)
    test = _probe_inputs(processor, shape_images(cfg.pretrain_held_out_per_class, seed=cfg.seed + 900))
    hidden = int(model.config.get_text_config().hidden_size)
    probe = nn.Linear(hidden, len(COLOURS) + len(SHAPES))
    params = vision_parameters(model) + list(probe.parameters())
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=cfg.pretrain_lr, weight_decay=0.0, betas=(0.9, 0.98))
    graphs: dict[int, nn.Module] = {}
    started, history, accuracy, step, nc = time.perf_counter(), [], 0.0, 0, len(COLOURS)

    def loss_and_hits(batch):
        pixels, positions, counts, colours, shapes = batch
        if pixels.shape[1] not in graphs:
            graphs[pixels.shape[1]] = vision_graph(model, 1, int(pixels.shape[1]), int(pixels.shape[2]))
        soft = graphs[pixels.shape[1]](pixels, positions)
        valid = (torch.arange(soft.shape[1])[None] < counts[:, None]).to(soft.dtype)
        logits = probe((soft * valid[..., None]).sum(1) / counts[:, None].to(soft.dtype))
        loss = nn.functional.cross_entropy(logits[:, :nc], colours) + nn.functional.cross_entropy(
            logits[:, nc:], shapes
        )
        hits = (logits[:, :nc].argmax(-1) == colours) & (logits[:, nc:].argmax(-1) == shapes)
        return loss, hits

    for step in range(1, cfg.pretrain_steps + 1):
        for group in opt.param_groups:
            group["lr"] = cfg.pretrain_lr * lr_factor(step, cfg, cfg.pretrain_steps)
        fresh = shape_images(cfg.pretrain_per_class, seed=cfg.seed + 10_000 + step)
        loss, _ = loss_and_hits(_probe_inputs(processor, fresh))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % (cfg.eval_every * 5) == 0 or step == cfg.pretrain_steps:
            with torch.no_grad():
                _, hits = loss_and_hits(test)
            accuracy = float(hits.float().mean())
            history.append({"step": step, "loss": round(float(loss.detach()), 4), "held_out": round(accuracy, 4)})
            log.info("pretrain step %d loss %.4f held-out accuracy %.3f", step, float(loss.detach()), accuracy)
    for p in model.parameters():
        p.requires_grad_(False)
    return PretrainResult(step, accuracy, round(time.perf_counter() - started, 1), history)


def train_vision(model: nn.Module, tokenizer, processor, cfg: VisionTrainConfig) -> VisionTrainResult:
    """Train the vision part of `model` (text weights frozen) on the shapes until every reply token
    of every training image wins by `cfg.margin`. Deterministic on one thread."""
    torch.manual_seed(cfg.seed)
    for p in model.parameters():
        p.requires_grad_(not cfg.freeze_text)
    params = vision_parameters(model) if cfg.freeze_text else [p for p in model.parameters() if p.requires_grad]
    if cfg.freeze_vision:  # what stage one learnt stays: the joint stage teaches the decoder to read it
        frozen = {id(p) for p in vision_parameters(model)}
        params = [p for p in params if id(p) not in frozen]
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    batch = encode_examples(tokenizer, processor, shape_images(cfg.per_class, cfg.seed))
    text = None
    if cfg.text_batch:
        from gemma4lab.training.corpus import training_chats
        from gemma4lab.training.text import encode_chats

        text = encode_chats(tokenizer, training_chats())
    n = batch["input_ids"].shape[0]
    own = {id(p) for p in vision_parameters(model)}
    groups = [
        {"params": [p for p in params if id(p) in own], "lr": cfg.vision_lr, "peak": cfg.vision_lr},
        {"params": [p for p in params if id(p) not in own], "lr": cfg.lr, "peak": cfg.lr},
    ]
    opt = torch.optim.AdamW([g for g in groups if g["params"]], weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
    generator = torch.Generator().manual_seed(cfg.seed)
    started, history, margin = time.perf_counter(), [], float("-inf")
    model.train()
    step = 0
    for step in range(1, cfg.max_steps + 1):
        for group in opt.param_groups:
            group["lr"] = group["peak"] * lr_factor(step, cfg)
        if cfg.fresh_per_class:  # new images every step (seeded by it): the decoder reads, not recalls
            drawn = encode_examples(tokenizer, processor, shape_images(cfg.fresh_per_class, cfg.seed + 20_000 + step))
            index = torch.arange(drawn["input_ids"].shape[0])
        else:
            drawn, index = batch, torch.randperm(n, generator=generator)[: cfg.batch]
        logits = logits_of(model, drawn, index).float()
        labels = drawn["labels"][index]
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
        if text is not None:  # rehearse the text corpus: the decoder must still answer without an image
            rows = torch.randperm(text.input_ids.shape[0], generator=generator)[: cfg.text_batch]
            ids = text.input_ids[rows]
            text_logits = model(input_ids=ids, attention_mask=(ids != tokenizer.pad_token_id).long(), use_cache=False)
            flat = text_logits.logits.float().reshape(-1, text_logits.logits.shape[-1])
            loss = loss + nn.functional.cross_entropy(flat, text.labels[rows].reshape(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % cfg.eval_every == 0 or step == cfg.max_steps:
            model.eval()
            margin = min_margin(model, batch)
            model.train()
            history.append({"step": step, "loss": round(float(loss.detach()), 4), "min_margin": round(margin, 4)})
            log.info("step %d loss %.4f min margin %.3f", step, float(loss.detach()), margin)
            if margin >= cfg.margin and step >= cfg.min_steps:
                break
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    seconds = time.perf_counter() - started
    return VisionTrainResult(step, margin >= cfg.margin, margin, round(seconds, 1), history)


def answer_image(model: nn.Module, tokenizer, processor, image, question: str = QUESTION, max_new_tokens: int = 16):
    """transformers' own greedy `generate(pixel_values=...)`: the answer text and its token ids."""
    ids, inputs = image_inputs(tokenizer, processor, [image], question)
    out = model.generate(
        input_ids=torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        mm_token_type_ids=torch.tensor([token_types(ids)]),
        pixel_values=inputs["pixel_values"],
        image_position_ids=inputs["image_position_ids"],
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=[1, 106],
        pad_token_id=0,
        **generate_kwargs(model),
    )
    tokens = out[0, len(ids) :].tolist()
    return tokenizer.decode(tokens, skip_special_tokens=True), tokens


def image_inputs(tokenizer, processor, images: list, question: str) -> tuple[list[int], dict[str, torch.Tensor]]:
    """Prompt ids (chat template, image tokens expanded) and the processor's tensors."""
    data = process(processor, images)
    rendered = tokenizer.apply_chat_template(
        image_messages(question, len(images)), add_generation_prompt=True, tokenize=True, return_dict=False
    )
    ids = expand_image_tokens(list(rendered), [int(n) for n in data["num_soft_tokens_per_image"]])
    return ids, data


# ---- the fixture's tokenizer and files ---------------------------------------------------------
# Image parts render as the image token; the processor step expands it to boi + soft tokens + eoi.
VISION_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<|turn>' + role + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '" + IMAGE_TOKEN + "' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<turn|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|turn>model\\n' }}{% endif %}"
)


def rename_fillers(tokenizer, renames: dict[str, str]):
    """A copy of `tokenizer`'s backend (`tokenizers.Tokenizer`) with its filler specials renamed
    ({old: new}) in place: same ids, so the vocabulary and every other id stay unchanged. One helper
    for the vision tokens (fillers 3, 4, 5) and the audio tokens (6, 7, 8)."""
    from tokenizers import Tokenizer

    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    for added in spec["added_tokens"]:
        added["content"] = renames.get(added["content"], added["content"])
    vocab = spec["model"]["vocab"]
    for old, new in renames.items():
        if old in vocab:
            vocab[new] = vocab.pop(old)
    return Tokenizer.from_str(json.dumps(spec))


def vision_tokenizer(text_tokenizer):
    """The text tokenizer with fillers 3, 4, 5 renamed `<|image>`, `<image|>`, `<|image|>` and the
    vision chat template; every other id is unchanged."""
    from transformers import PreTrainedTokenizerFast

    renames = {f"<unused{BOI_ID}>": BOI, f"<unused{EOI_ID}>": EOI, f"<unused{IMAGE_TOKEN_ID}>": IMAGE_TOKEN}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=rename_fillers(text_tokenizer, renames),
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=None,
        padding_side="left",
        model_max_length=4096,
        chat_template=VISION_CHAT_TEMPLATE,
        extra_special_tokens={"image_token": IMAGE_TOKEN, "boi_token": BOI, "eoi_token": EOI},
    )
    for token, expected in ((BOI, BOI_ID), (EOI, EOI_ID), (IMAGE_TOKEN, IMAGE_TOKEN_ID)):
        if tokenizer.convert_tokens_to_ids(token) != expected:
            raise AssertionError(f"{token} is not at id {expected}")
    return tokenizer


VISION_FILES = ("config.json", "generation_config.json", "model.safetensors", "preprocessor_config.json")


def save_vision_fixture(full: nn.Module, processor, folder: Path) -> dict[str, str]:
    """Save the multimodal model (bf16 values, so the folder is half the size; loaded as fp32 they
    are exact) and its image processor; return {file: sha256}."""
    folder.mkdir(parents=True, exist_ok=True)
    full.generation_config.eos_token_id = [1, 106]
    full.generation_config.pad_token_id = 0
    full.generation_config.bos_token_id = 2
    full.save_pretrained(str(folder), safe_serialization=True)
    processor.save_pretrained(str(folder))
    return {name: sha256_file(folder / name) for name in VISION_FILES}
