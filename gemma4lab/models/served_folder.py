"""A model saved as one folder that two different servers load: this project's `serve` and transformers'.

A side-by-side comparison is only fair when both servers read the same bytes, so the bench writes
each model once, as a text-only Gemma-4 folder (`config.json` of `gemma4_text`, `model.safetensors`,
the tokenizer files with the chat template): `python -m gemma4lib serve --model checkpoint
--checkpoint FOLDER` loads it as the `*ForCausalLM` itself, and `transformers serve FOLDER` loads it
as `Gemma4ForCausalLM` with its tokenizer (a released multimodal layout would make transformers look
for image and audio processor files the tiny models do not have).

- a tiny variant: its trained fixture (weights and the small tokenizer), so replies are real text;
- a medium config (`models.medium`, random weights, vocabulary 32,768): the fixture tokenizer grown
  with ordinary tokens `[ID]` up to the model's vocabulary, so every id the random model picks
  decodes to text of its own. Without them, ids past the small tokenizer's 810 decode to nothing,
  no reply would show text, and two servers' replies could not be compared.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from gemma4lab.models.medium import MEDIUM, build_medium, get_medium
from gemma4lib.errors import UnknownNameError
from gemma4lib.models.variants import VARIANTS

log = logging.getLogger(__name__)

FILLER = "[{}]"  # the ordinary token written for an id the small tokenizer has no token for


def served_models() -> tuple[str, ...]:
    """The names `save_served_folder` takes: the tiny variants and the medium configs."""
    return (*VARIANTS, *MEDIUM)


def base_variant(name: str) -> str:
    """The variant whose `serve --variant` loads the folder of `name` (a medium config's base)."""
    if name in VARIANTS:
        return name
    return get_medium(name).base_variant


def grow_vocabulary(tokenizer: Any, vocab_size: int) -> int:
    """Add ordinary tokens `[ID]` until the tokenizer has `vocab_size` ids; returns how many were added."""
    missing = vocab_size - len(tokenizer)
    if missing <= 0:
        return 0
    start = len(tokenizer)
    added = tokenizer.add_tokens([FILLER.format(i) for i in range(start, vocab_size)])
    if len(tokenizer) != vocab_size or tokenizer.convert_tokens_to_ids(FILLER.format(start)) != start:
        raise RuntimeError(f"growing the tokenizer to {vocab_size} ids put {FILLER.format(start)} at another id")
    return added


def save_served_folder(name: str, folder: str | Path) -> Path:
    """Write model `name` (a tiny variant's trained fixture, or a medium config) as a text-only
    checkpoint folder with its tokenizer; returns the folder."""
    if name not in served_models():
        raise UnknownNameError("served model", name, served_models())
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if name in VARIANTS:
        from gemma4lib.models.trained import load_trained

        model = load_trained(name)
        tokenizer = model.tokenizer
    else:
        from gemma4lib.models.fixture_paths import FIXTURES_DIR
        from gemma4lib.models.tokenizer import load_tokenizer

        model = build_medium(name)
        tokenizer = load_tokenizer(FIXTURES_DIR / "tokenizer")
        grow_vocabulary(tokenizer, model.lm.config.vocab_size)
    model.lm.save_pretrained(str(folder), safe_serialization=True)
    tokenizer.save_pretrained(str(folder))
    log.info("wrote %s (%s) to %s", name, type(model.lm).__name__, folder)
    return folder
