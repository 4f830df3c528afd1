"""Write a checkpoint folder in the layout Google releases, around a text decoder of our own.

The `full` profile loads a real checkpoint: a multimodal `*ForConditionalGeneration`
(`Gemma4ForConditionalGeneration`, or `Gemma4UnifiedForConditionalGeneration` for the 12B) whose
text decoder sits at `model.language_model`, next to vision (and on some variants audio) parts the
cookbook never runs. Nothing can be downloaded here or in CI, so `save_released_layout` builds that
folder offline: the given text LM (e.g. a tiny trained fixture, so "Paris" is a real answer) inside
the multimodal class with tiny seeded vision/audio parts, saved with `save_pretrained`, plus a
tokenizer with the Gemma-4 chat template. The real loader (`checkpoint.load_checkpoint`) then walks the
same path it walks for `google/gemma-4-*-it`.

Which parts each variant carries follows the released `config.json` files: vision on all five;
audio on E2B and E4B (a conformer tower) and on the 12B (the unified class's encoder-free audio
embedder); none on the 31B and 26B-A4B. Only their sizes are ours (tiny).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gemma4lib.environment import check_transformers
from gemma4lib.errors import CheckpointError
from gemma4lib.models.audio import HEARING_VARIANTS
from gemma4lib.models.checkpoint import conditional_class
from gemma4lib.models.variants import Variant, get_variant

log = logging.getLogger(__name__)

# Variants whose released checkpoint has an audio part (the others: audio_config null).
AUDIO_VARIANTS = HEARING_VARIANTS
# The released generation_config stops on <eos> and on <turn|> (the end of the model's turn).
EOS_IDS = [1, 106]
# Bookkeeping of the text config that a released text_config does not carry.
_TEXT_CONFIG_DROP = ("architectures", "_name_or_path", "dtype", "torch_dtype", "transformers_version")


def _sub_configs(variant: Variant, hidden_size: int) -> tuple[Any, Any | None]:
    """Tiny vision and audio configs of the kinds the variant's released config.json names."""
    check_transformers()
    with_audio = variant.name in AUDIO_VARIANTS
    if variant.unified:
        from transformers.models.gemma4_unified import Gemma4UnifiedAudioConfig, Gemma4UnifiedVisionConfig

        vision = Gemma4UnifiedVisionConfig(
            patch_size=4, pooling_kernel_size=2, mm_embed_dim=32, mm_posemb_size=16, output_proj_dims=hidden_size
        )
        audio = Gemma4UnifiedAudioConfig(audio_embed_dim=16) if with_audio else None
        return vision, audio
    from transformers import Gemma4AudioConfig, Gemma4VisionConfig

    vision = Gemma4VisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        patch_size=4,
        position_embedding_size=64,
    )
    audio = (
        Gemma4AudioConfig(
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            subsampling_conv_channels=[8, 4],
            output_proj_dims=32,
        )
        if with_audio
        else None
    )
    return vision, audio


def released_config(variant: Variant | str, text_config: Any):
    """The multimodal config (`Gemma4Config` / `Gemma4UnifiedConfig`) around a text config."""
    variant = variant if isinstance(variant, Variant) else get_variant(variant)
    check_transformers()
    text = {k: v for k, v in text_config.to_dict().items() if k not in _TEXT_CONFIG_DROP}
    vision, audio = _sub_configs(variant, text_config.hidden_size)
    if variant.unified:
        from transformers.models.gemma4_unified import Gemma4UnifiedConfig as config_cls
    else:
        from transformers import Gemma4Config as config_cls
    config = config_cls(text_config=text, vision_config=vision, audio_config=audio)
    config.eos_token_id = list(EOS_IDS)
    return config


def build_released_model(variant: Variant | str, text_lm: nn.Module, seed: int = 0) -> nn.Module:
    """The variant's `*ForConditionalGeneration` holding `text_lm`'s decoder (copied, buffers too).

    The vision/audio parts are seeded random weights: the text port never runs them, and a fixed
    seed keeps the saved folder byte-identical across builds.
    """
    variant = variant if isinstance(variant, Variant) else get_variant(variant)
    lm_class_name = type(text_lm).__name__
    if variant.unified != lm_class_name.startswith("Gemma4Unified"):
        raise CheckpointError(
            f"a {lm_class_name} cannot go inside the {variant.name} checkpoint "
            f"({variant.model_class}); pass the {variant.name} text model"
        )
    config = released_config(variant, text_lm.config)
    dtype = next(text_lm.parameters()).dtype
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        full = conditional_class(variant)._from_config(config, dtype=dtype)
    # strict: every text tensor (layer_scalar buffers included) must land somewhere
    full.model.language_model.load_state_dict(text_lm.model.state_dict(), strict=True)
    full.tie_weights()
    if not torch.equal(full.lm_head.weight, text_lm.lm_head.weight):
        raise CheckpointError("the released layout's LM head is not the text model's (tied) head")
    return full.eval()


def save_released_layout(
    variant: Variant | str, folder: str | Path, text_lm: nn.Module, tokenizer: Any, seed: int = 0
) -> Path:
    """Write `folder` as a released Gemma-4 checkpoint: config.json (multimodal, with text, vision
    and audio sub-configs), generation_config.json, model.safetensors and the tokenizer files.

    Returns the folder, which
    `port(PortSettings(variant, profile="full", checkpoint=str(folder)))` loads.
    """
    variant = variant if isinstance(variant, Variant) else get_variant(variant)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    full = build_released_model(variant, text_lm, seed)
    full.generation_config.eos_token_id = list(EOS_IDS)
    full.generation_config.pad_token_id = 0
    full.generation_config.bos_token_id = 2
    full.save_pretrained(str(folder), safe_serialization=True)
    tokenizer.save_pretrained(str(folder))
    log.info("wrote a %s checkpoint in the released layout (%s) to %s", variant.name, variant.model_class, folder)
    return folder
