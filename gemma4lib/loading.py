"""Load a Gemma-4 text decoder: a seeded tiny random model, or a real checkpoint.

Either way the result is a `Gemma4ForCausalLM` (or the unified 12B's `Gemma4UnifiedForCausalLM`):
the text-only language model with its tied LM head. It is both the host fp32 reference and the
source of the device graph's weights.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .environment import check_transformers
from .errors import CheckpointError, GatedCheckpointError, NotGemma4Error, VariantMismatchError
from .kv_layout import KVLayout
from .variants import VARIANTS, Variant, config_kwargs

log = logging.getLogger(__name__)

GEMMA4_MODEL_TYPES = ("gemma4", "gemma4_text", "gemma4_unified", "gemma4_unified_text")


@dataclass
class LoadedModel:
    variant: Variant
    lm: nn.Module  # *ForCausalLM, eval mode: the reference and the weight source
    tokenizer: Any | None = None
    source: str = "tiny-random"

    @property
    def config(self):
        return self.lm.config

    @property
    def text_model(self) -> nn.Module:
        return self.lm.model

    @property
    def lm_head(self) -> nn.Module:
        return self.lm.lm_head

    @property
    def layout(self) -> KVLayout:
        return KVLayout.from_config(self.lm.config)

    def param_count(self) -> int:
        return sum(p.numel() for p in self.lm.parameters())


def _text_classes(variant: Variant):
    check_transformers()
    if variant.unified:
        from transformers.models.gemma4_unified import Gemma4UnifiedForCausalLM, Gemma4UnifiedTextConfig
        return Gemma4UnifiedTextConfig, Gemma4UnifiedForCausalLM
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig
    return Gemma4TextConfig, Gemma4ForCausalLM


def text_config(variant: Variant, which: str = "tiny", **overrides: Any):
    """A transformers text config for the variant ('tiny' or 'real' sizes)."""
    config_cls, _ = _text_classes(variant)
    return config_cls(**config_kwargs(variant, which, **overrides))


def _seed_layer_scalars(lm: nn.Module, seed: int) -> None:
    """Give every layer a distinct, non-trivial `layer_scalar` (released checkpoints do).

    Left at its init value of 1 a missing-buffer fault would be invisible in tests.
    """
    layers = lm.model.layers
    for i, layer in enumerate(layers):
        layer.layer_scalar.fill_(0.5 - 0.4 * i / max(1, len(layers) - 1))


def build_tiny(variant: Variant, seed: int = 0, dtype: torch.dtype = torch.float32,
               **overrides: Any) -> LoadedModel:
    """A seeded random-weight tiny model with every feature of `variant`; identical across builds."""
    config_cls, lm_cls = _text_classes(variant)
    config = config_cls(**config_kwargs(variant, "tiny", **overrides))
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        lm = lm_cls._from_config(config, dtype=dtype, attn_implementation=variant.attn_implementation)
    _seed_layer_scalars(lm, seed)
    return LoadedModel(variant, lm.eval(), None, f"tiny-random(seed={seed})")


def hf_token() -> str | None:
    """The Hugging Face token, from HF_TOKEN only (never from arguments that could be logged)."""
    return os.environ.get("HF_TOKEN") or None


def check_checkpoint_folder(path: Path) -> dict[str, Any]:
    """Validate a local checkpoint folder before any heavy loading; return its config dict."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path} has no config.json; point checkpoint at the folder that holds "
                              f"config.json, the *.safetensors weights and the tokenizer files")
    try:
        config = json.loads(config_file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{config_file} is not valid JSON ({exc}); the download was probably cut short: "
                              f"download the checkpoint again") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_file} is not a JSON object; download the checkpoint again")
    model_type = config.get("model_type")
    if model_type not in GEMMA4_MODEL_TYPES:
        raise NotGemma4Error(f"{path} holds a {model_type!r} model, not Gemma-4 "
                             f"(model_type one of {GEMMA4_MODEL_TYPES}); pick a Gemma-4 checkpoint")
    if not any(path.glob("*.safetensors")):
        raise CheckpointError(f"{path} has no *.safetensors weights; download the full checkpoint "
                              f"(e.g. `hf download <id> --local-dir {path}`)")
    return config


# Architectural features a notebook's recipe depends on: (label, config field).
FEATURES = (("per-layer embeddings (PLE)", "hidden_size_per_layer_input"),
            ("KV sharing", "num_kv_shared_layers"),
            ("attention_k_eq_v", "attention_k_eq_v"),
            ("MoE block", "enable_moe_block"))
UNIFIED = "the unified class (gemma4_unified)"


def _text_fields(config: Any) -> tuple[str | None, Any]:
    """(model_type, text config) of a config object or config.json dict, multimodal or text-only."""
    get = (lambda c, k: c.get(k)) if isinstance(config, dict) else (lambda c, k: getattr(c, k, None))
    text = get(config, "text_config") or config
    return get(config, "model_type"), (lambda k: get(text, k))


def config_features(config: Any) -> dict[str, bool]:
    """Which of `FEATURES` a config (object or config.json dict) has, plus whether it is the unified class."""
    model_type, get = _text_fields(config)
    out = {label: bool(get(name)) for label, name in FEATURES}
    out[UNIFIED] = "unified" in str(model_type or "")
    return out


def variant_features(variant: Variant) -> dict[str, bool]:
    out = {label: bool(variant.real_config.get(name)) for label, name in FEATURES}
    out[UNIFIED] = variant.unified
    return out


def check_config_matches_variant(config: Any, variant: Variant, source: str = "the checkpoint") -> None:
    """Raise `VariantMismatchError` when a Gemma-4 config lacks a feature the variant's notebook and
    recipe rely on, or has one they don't handle (e.g. an E2B checkpoint loaded as the 31B)."""
    found, wanted = config_features(config), variant_features(variant)
    diffs = [f"{label} {'present' if found[label] else 'absent'}, but the {variant.name} "
             f"{'has it' if wanted[label] else 'has none'}" for label in wanted if found[label] != wanted[label]]
    if not diffs:
        return
    _, get = _text_fields(config)
    same = [v.name for v in VARIANTS.values() if variant_features(v) == found]
    sized = [n for n in same if VARIANTS[n].real_config.get("hidden_size") == get("hidden_size")]
    guess = sized or same
    hint = (f"it looks like {' or '.join(guess)}: use variant={guess[0]!r} (its notebook) for it, or "
            if guess else "")
    raise VariantMismatchError(f"{source} is not a checkpoint of variant {variant.name!r}: {'; '.join(diffs)}; {hint}"
                               f"point checkpoint at the {variant.name} weights ({variant.hf_id})")


def _looks_like_path(checkpoint: str) -> bool:
    return checkpoint.startswith(("/", ".", "~")) or checkpoint.count("/") != 1


def load_checkpoint(variant: Variant, checkpoint: str, dtype: torch.dtype = torch.bfloat16,
                    with_tokenizer: bool = True) -> LoadedModel:
    """Load a real checkpoint (hub id or folder) and keep only the text decoder.

    The released checkpoints are multimodal `*ForConditionalGeneration`; their text decoder lives at
    `model.language_model` with the tied LM head. The token comes from `HF_TOKEN` only.
    """
    check_transformers()
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer

    path = Path(checkpoint).expanduser()
    local = path.exists()
    if local:
        check_checkpoint_folder(path)
    elif _looks_like_path(str(checkpoint)):
        raise CheckpointError(f"{checkpoint!r} is neither an existing folder nor a hub id (owner/name); "
                              f"check the path, or use a hub id such as {variant.hf_id!r}")
    token = None if local else hf_token()
    try:
        config = AutoConfig.from_pretrained(str(path) if local else checkpoint, token=token)
    except OSError as exc:  # gated repo without a token, or no network
        if not local and token is None:
            raise GatedCheckpointError(
                f"could not read {checkpoint!r} from the hub without a token; the Gemma-4 checkpoints are "
                f"gated: accept the licence on the model page, then `export HF_TOKEN=...` (never pass it "
                f"as a notebook parameter)") from None
        raise CheckpointError(f"could not read the config of {checkpoint!r}: {type(exc).__name__}; check the id "
                              f"and the network, and that the HF_TOKEN account accepted the model's licence"
                              ) from None
    if config.model_type not in GEMMA4_MODEL_TYPES:
        raise NotGemma4Error(f"{checkpoint!r} is a {config.model_type!r} model, not Gemma-4; pick a Gemma-4 "
                             f"checkpoint, e.g. {variant.hf_id!r}")
    check_config_matches_variant(config, variant, repr(checkpoint))
    source = str(path) if local else checkpoint
    log.info("loading %s (%s) in %s", source, config.model_type, dtype)
    full = AutoModelForImageTextToText.from_pretrained(
        source, token=token, dtype=dtype, attn_implementation=variant.attn_implementation)
    lm = extract_text_lm(variant, full)
    tokenizer = AutoTokenizer.from_pretrained(source, token=token) if with_tokenizer else None
    return LoadedModel(variant, lm.eval(), tokenizer, source)


def extract_text_lm(variant: Variant, full: nn.Module) -> nn.Module:
    """`*ForConditionalGeneration` → `*ForCausalLM` sharing the same tensors (no copy)."""
    _, lm_cls = _text_classes(variant)
    text_model = full.model.language_model
    with torch.device("meta"):
        lm = lm_cls(text_model.config)
    lm.model = text_model
    lm.lm_head = full.lm_head
    lm.config = text_model.config
    return lm
