"""Gemma-4's own drafter (the MTP assistant) as a member of the family: which one, how to load it.

An assistant (`Gemma4AssistantForCausalLM`, the 12B's `Gemma4UnifiedAssistantForCausalLM`) has no
K/V of its own: every layer reads the target's K/V of the last non-shared layer of its attention type
(docs/DRAFTING.md). Two things in transformers 5.23.0 need a hand here, both narrow:
- a config with every layer KV-shared (what an assistant is) raises in `kv_sharing_modes`, although
  only module construction reads it: `fully_shared_construction()` answers "reuse" for every layer
  while a model is built;
- a target without KV sharing (31B, 26B-A4B, 12B) marks no layer "store", so it returns no
  `shared_kv_states` and `generate(assistant_model=...)` fails: `store_for_assistant` sets
  `store_full_length_kv` on the last layer of each attention type, the layers the assistant reads.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..device.kv_layout import FULL, SLIDING, KVLayout
from ..errors import CheckpointError, SettingsError
from .variants import Variant, get_variant

log = logging.getLogger(__name__)

ASSISTANT_DIR = "assistant"  # gemma4lib/fixtures/<variant>/assistant/
SOURCE_TRAINED = "tiny-trained-assistant"
SOURCE_RANDOM = "tiny-random-assistant"
SOURCE_CHECKPOINT = "checkpoint-assistant"

# The tiny assistant's own width; its attention widths follow the target's K/V (they must).
TINY_ASSISTANT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2)


@dataclass(frozen=True)
class AssistantSpec:
    """A variant's drafter: where the released one lives and which class loads it."""

    hub_id: str
    model_class: str
    verified: bool  # the hub id is the one transformers documents (others follow its naming)


def assistant_spec(variant: Variant | str) -> AssistantSpec:
    """The released assistant of a variant. transformers 5.23.0 documents `google/gemma-4-e2b-it-assistant`
    (the hub resolves repo ids case-insensitively); the others follow the same `<target>-assistant`
    naming, unverified here (no hub access)."""
    v = variant if isinstance(variant, Variant) else get_variant(variant)
    cls = "Gemma4UnifiedAssistantForCausalLM" if v.unified else "Gemma4AssistantForCausalLM"
    return AssistantSpec(f"{v.hf_id}-assistant", cls, verified=v.name == "e2b")


def _classes(variant: Variant):
    import transformers

    spec = assistant_spec(variant)
    model_cls = getattr(transformers, spec.model_class, None)
    if model_cls is None:
        raise CheckpointError(f"transformers {transformers.__version__} has no {spec.model_class}; install the pin")
    config_cls = getattr(transformers, spec.model_class.replace("ForCausalLM", "Config"))
    return config_cls, model_cls


@contextlib.contextmanager
def fully_shared_construction() -> Iterator[None]:
    """While a model is built: a config whose every layer is KV-shared answers "reuse" for each
    layer instead of raising (transformers 5.23.0; `kv_sharing_modes` is read only at construction)."""
    from transformers.models.gemma4 import configuration_gemma4 as c4

    classes: list[type] = [c4.Gemma4TextConfig]
    with contextlib.suppress(ImportError):
        from transformers.models.gemma4_unified import configuration_gemma4_unified as cu

        classes.append(cu.Gemma4UnifiedTextConfig)
    saved = {cls: cls.__dict__["kv_sharing_modes"] for cls in classes if "kv_sharing_modes" in cls.__dict__}
    try:
        for cls, prop in saved.items():
            cls.kv_sharing_modes = property(_all_reuse(prop))
        yield
    finally:
        for cls, prop in saved.items():
            cls.kv_sharing_modes = prop


def _all_reuse(prop: property) -> Any:
    def modes(self):
        if self.num_kv_shared_layers and self.num_kv_shared_layers == self.num_hidden_layers:
            return ["reuse"] * self.num_hidden_layers
        return prop.fget(self)

    return modes


def read_layers(layout: KVLayout) -> dict[str, int]:
    """The target layer whose K/V the assistant reads, per attention type: the last producer."""
    return {t: max(layer.index for layer in layout.producers if layer.layer_type == t) for t in (SLIDING, FULL)}


def store_for_assistant(lm: nn.Module) -> dict[str, int]:
    """Make the target return the K/V the assistant reads (`shared_kv_states`); see the module doc."""
    layout = KVLayout.from_config(lm.config)
    layers = read_layers(layout)
    for index in layers.values():
        lm.model.layers[index].self_attn.store_full_length_kv = True
    return layers


def tiny_assistant_config(target_config: Any, variant: Variant):
    """An assistant config sized for a tiny target: one sliding and one full layer whose attention
    widths match the target's K/V (head counts and head dims of each type)."""
    config_cls, _ = _classes(variant)
    layout = KVLayout.from_config(target_config)
    by_type = {t: next(layer for layer in layout.layers if layer.layer_type == t) for t in (SLIDING, FULL)}
    kv_s, kv_f = by_type[SLIDING].kv_heads, by_type[FULL].kv_heads
    text_cls = type(target_config)
    text = text_cls(
        **TINY_ASSISTANT,
        layer_types=[SLIDING, FULL],
        num_attention_heads=2 * max(kv_s, kv_f),
        num_key_value_heads=kv_s,
        head_dim=by_type[SLIDING].head_dim,
        global_head_dim=by_type[FULL].head_dim,
        **({"num_global_key_value_heads": kv_f} if kv_f != kv_s or target_config.attention_k_eq_v else {}),
        attention_k_eq_v=bool(target_config.attention_k_eq_v),
        sliding_window=int(target_config.sliding_window),
        vocab_size=int(target_config.vocab_size),
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
        final_logit_softcapping=target_config.final_logit_softcapping,
        initializer_range=0.1,
        max_position_embeddings=int(target_config.max_position_embeddings),
        num_kv_shared_layers=TINY_ASSISTANT["num_hidden_layers"],
    )
    return config_cls(text_config=text, backbone_hidden_size=int(target_config.hidden_size))


def configure_drafting(assistant: nn.Module, draft_tokens: int) -> nn.Module:
    """k drafts per round, constant (transformers reads these from the assistant's generation config)."""
    assistant.generation_config.num_assistant_tokens = int(draft_tokens)
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    return assistant


def build_tiny_assistant(target_config: Any, variant: Variant | str, seed: int = 0) -> nn.Module:
    """A seeded random tiny assistant for a tiny target (training starts here; the witness uses it)."""
    v = variant if isinstance(variant, Variant) else get_variant(variant)
    _, model_cls = _classes(v)
    config = tiny_assistant_config(target_config, v)
    torch.manual_seed(seed)
    with fully_shared_construction():
        model = model_cls._from_config(config, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def assistant_dir(variant: Variant | str, root: Path | None = None) -> Path:
    from .trained import fixture_dir

    return fixture_dir(variant, root) / ASSISTANT_DIR


def load_assistant_folder(path: str | Path, variant: Variant | str, dtype: torch.dtype = torch.float32) -> nn.Module:
    """An assistant from a local folder or a hub id (`from_pretrained`)."""
    v = variant if isinstance(variant, Variant) else get_variant(variant)
    _, model_cls = _classes(v)
    with fully_shared_construction():
        model = model_cls.from_pretrained(str(path), dtype=dtype, attn_implementation="eager")
    return model.eval()


@dataclass
class LoadedAssistant:
    model: nn.Module
    source: str
    read_layers: dict[str, int]  # target layer index read per attention type


def load_assistant(target: Any, settings: Any) -> LoadedAssistant:
    """The assistant for a loaded target and the port's settings: the shipped tiny trained one for a
    trained fixture, a seeded random one for random weights (the witness), the hub's (or
    `settings.assistant_checkpoint`'s folder) for a checkpoint. Also makes the target return
    the K/V the assistant reads (`store_for_assistant`)."""
    variant = target.variant
    layers = store_for_assistant(target.lm)
    if target.source == "tiny-trained":
        from .trained import verify_fixture_hashes

        path = assistant_dir(variant)
        if not (path / "model.safetensors").is_file():
            raise CheckpointError(
                f"no trained assistant for {variant.name!r} at {path}; train it with "
                f"`python scripts/train_assistants.py --variant {variant.name}`"
            )
        verify_fixture_hashes(None, [variant.name])
        model, source = load_assistant_folder(path, variant), SOURCE_TRAINED
    elif target.source.startswith("tiny"):
        model, source = build_tiny_assistant(target.config, variant, seed=int(settings.seed)), SOURCE_RANDOM
    else:
        where = getattr(settings, "assistant_checkpoint", None) or assistant_spec(variant).hub_id
        dtype = next(target.lm.parameters()).dtype
        model, source = load_assistant_folder(where, variant, dtype), SOURCE_CHECKPOINT
    check_pair(target.config, model.config)
    return LoadedAssistant(configure_drafting(model, settings.draft_tokens), source, layers)


def check_pair(target_config: Any, assistant_config: Any) -> None:
    """The assistant must have been made for this target: its backbone width and vocabulary."""
    text = assistant_config.get_text_config()
    if int(assistant_config.backbone_hidden_size) != int(target_config.hidden_size):
        raise SettingsError(
            f"the assistant was made for a target of hidden size {assistant_config.backbone_hidden_size}, "
            f"this target has {target_config.hidden_size}; load the assistant of this variant"
        )
    target = KVLayout.from_config(target_config)
    heads = int(text.num_attention_heads)
    for i, layer_type in enumerate(text.layer_types):
        head_dim = int(text.per_layer_config[i].head_dim)
        read = next(t for t in target.producers if t.layer_type == layer_type)
        if head_dim != read.head_dim or heads % read.kv_heads:
            raise SettingsError(
                f"the assistant's {layer_type} layers (head_dim {head_dim}, {heads} query heads) cannot attend "
                f"over this target's K/V (head_dim {read.head_dim}, {read.kv_heads} K/V heads); load the "
                f"assistant of this variant"
            )
    if int(text.vocab_size) != int(target_config.vocab_size):
        raise SettingsError(
            f"assistant vocabulary {text.vocab_size} != target vocabulary {target_config.vocab_size}; "
            f"load the assistant of this variant"
        )
