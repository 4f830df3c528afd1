"""Load a released Gemma-4 checkpoint (a folder or a hub id) as the text decoder a port runs.

The checks come first and fail early with the fix in the message: the folder has what it needs,
its config is a Gemma-4 of the variant asked for (`check_config_matches_variant`), its weights
agree with the config; then the text-only language model (`extract_text_lm`) and its tokenizer.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..environment import check_transformers
from ..errors import CheckpointError, GatedCheckpointError, NotGemma4Error, NoVisionError, VariantMismatchError
from .checkpoint_identity import folder_identity
from .hub import _is_connection_error, _is_gated, _unreachable, hf_token, hub_offline, probe_hub
from .loading import LoadedModel, _text_classes
from .tokenizer import require_chat_template
from .variants import VARIANTS, Variant
from .weight_files import check_weight_files
from .weights_identity import declare_identity

log = logging.getLogger(__name__)


GEMMA4_MODEL_TYPES = ("gemma4", "gemma4_text", "gemma4_unified", "gemma4_unified_text")


def check_checkpoint_folder(path: Path) -> dict[str, Any]:
    """Validate a local checkpoint folder before any heavy loading; return its config dict."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(
            f"{path} has no config.json; point checkpoint at the folder that holds config.json, the *.safetensors "
            "weights and the tokenizer files"
        )
    try:
        config = json.loads(config_file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(
            f"{config_file} is not valid JSON ({exc}); the download was probably "
            f"cut short: download the checkpoint again"
        ) from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_file} is not a JSON object; download the checkpoint again")
    model_type = config.get("model_type")
    if model_type not in GEMMA4_MODEL_TYPES:
        raise NotGemma4Error(
            f"{path} holds a {model_type!r} model, not Gemma-4 "
            f"(model_type one of {GEMMA4_MODEL_TYPES}); pick a Gemma-4 checkpoint"
        )
    if not any(path.glob("*.safetensors")):
        raise CheckpointError(
            f"{path} has no *.safetensors weights; download the full checkpoint "
            f"(e.g. `hf download <id> --local-dir {path}`)"
        )
    return config


# Architectural features a notebook's recipe depends on: (label, config field).
FEATURES = (
    ("per-layer embeddings (PLE)", "hidden_size_per_layer_input"),
    ("KV sharing", "num_kv_shared_layers"),
    ("attention_k_eq_v", "attention_k_eq_v"),
    ("MoE block", "enable_moe_block"),
)


UNIFIED = "the unified class (gemma4_unified)"


def _text_fields(config: Any) -> tuple[str | None, Any]:
    """(model_type, text config) of a config object or config.json dict, multimodal or text-only."""
    if isinstance(config, dict):
        get = lambda c, k: c.get(k)  # noqa: E731
    else:
        get = lambda c, k: getattr(c, k, None)  # noqa: E731
    text = get(config, "text_config") or config
    return get(config, "model_type"), (lambda k: get(text, k))


def config_features(config: Any) -> dict[str, bool]:
    """Which of `FEATURES` a config (object or config.json dict) has, plus whether it is the
    unified class."""
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
    diffs = [
        f"{label} {'present' if found[label] else 'absent'}, but the {variant.name} "
        f"{'has it' if wanted[label] else 'has none'}"
        for label in wanted
        if found[label] != wanted[label]
    ]
    if not diffs:
        return
    _, get = _text_fields(config)
    same = [v.name for v in VARIANTS.values() if variant_features(v) == found]
    sized = [n for n in same if VARIANTS[n].real_config.get("hidden_size") == get("hidden_size")]
    guess = sized or same
    hint = f"it looks like {' or '.join(guess)}: use variant={guess[0]!r} (its notebook) for it, or " if guess else ""
    raise VariantMismatchError(
        f"{source} is not a checkpoint of variant {variant.name!r}: {'; '.join(diffs)}; {hint}point checkpoint at the "
        f"{variant.name} weights ({variant.hf_id})"
    )


def _looks_like_path(checkpoint: str) -> bool:
    return checkpoint.startswith(("/", ".", "~")) or checkpoint.count("/") != 1


def _inconsistent_config(checkpoint: str, exc: BaseException) -> CheckpointError:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return CheckpointError(
        f"config.json of {checkpoint!r} is inconsistent ({first}); download the checkpoint again, or fix config.json"
    )


def _read_config(checkpoint: str, local: bool, hub: dict[str, Any], offline_reason: str | None):
    """AutoConfig of a folder or hub id, every failure turned into an error that says what to do."""
    from transformers import AutoConfig

    token = hub.get("token")
    try:
        return AutoConfig.from_pretrained(checkpoint, **hub)
    except ValueError as exc:  # a config.json transformers refuses: edited, or not Gemma-4's
        raise _inconsistent_config(checkpoint, exc) from None
    except OSError as exc:
        if local:
            raise CheckpointError(
                f"could not read the config of {checkpoint!r} ({type(exc).__name__}); download the checkpoint again"
            ) from None
        if offline_reason is not None or _is_connection_error(exc):
            reason = offline_reason or "the download failed on the network"
            raise _unreachable(checkpoint, reason) from None
        if _is_gated(exc) and token is not None:
            raise GatedCheckpointError(
                f"the HF_TOKEN account has no access to {checkpoint!r} (a gated repository): accept the licence on the "
                "model page with that account, or use a token of an account that did"
            ) from None
        if token is None:  # gated repo without a token (the hub answers 401 for every Gemma-4 id)
            raise GatedCheckpointError(
                f"could not read {checkpoint!r} from the hub without a token; the Gemma-4 "
                f"checkpoints are gated: accept the licence on the model page, then "
                f"`export HF_TOKEN=...` (never pass it as a notebook parameter)"
            ) from None
        raise CheckpointError(
            f"could not read the config of {checkpoint!r}: {type(exc).__name__}; check the id and the network, and "
            "that the HF_TOKEN account accepted the model's licence"
        ) from None


def conditional_class(variant: Variant):
    """The released multimodal class of a variant (`*ForConditionalGeneration`)."""
    check_transformers()
    if variant.unified:
        from transformers.models.gemma4_unified import Gemma4UnifiedForConditionalGeneration

        return Gemma4UnifiedForConditionalGeneration
    from transformers import Gemma4ForConditionalGeneration

    return Gemma4ForConditionalGeneration


def _weights_folder(checkpoint: str, local: bool, hub: dict[str, Any]) -> Path | None:
    if local:
        return Path(checkpoint).expanduser()
    try:
        from transformers.utils import cached_file

        found = cached_file(checkpoint, "config.json", **{**hub, "local_files_only": True})
    except OSError:
        return None
    return Path(found).parent if found else None


def checkpoint_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from the safetensors headers (no tensor data is read)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            for name in handle.keys():
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes


def shape_disagreements(
    model_cls: type, config: Any, shapes: dict[str, tuple[int, ...]]
) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """(name, shape in the weights, shape config.json implies) for every tensor that differs."""
    with torch.device("meta"):
        model = model_cls(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    out = [(k, shapes[k], expected[k]) for k in sorted(expected) if k in shapes and shapes[k] != expected[k]]
    # the embedding first: its shape names hidden_size and vocab_size directly
    return sorted(out, key=lambda d: (not d[0].endswith("embed_tokens.weight"), d[0]))


def _shape_error(checkpoint: str, model_cls: type, config: Any, folder: Path | None) -> CheckpointError:
    fix = (
        "config.json was edited or belongs to another checkpoint: download the checkpoint again "
        "(or restore its config.json)"
    )
    diffs = shape_disagreements(model_cls, config, checkpoint_shapes(folder)) if folder else []
    if not diffs:
        return CheckpointError(
            f"the weights of {checkpoint!r} do not have the shapes its config.json implies (transformers' LOAD REPORT "
            f"above lists them); {fix}"
        )
    name, got, wanted = diffs[0]
    hint = ""
    if name.endswith("embed_tokens.weight") and len(got) == 2:
        _, get = _text_fields(config)
        if got[1] != wanted[1]:
            hint = f" (the weights have hidden_size {got[1]}, config.json says {get('hidden_size')})"
        elif got[0] != wanted[0]:
            hint = f" (the weights have vocab_size {got[0]}, config.json says {get('vocab_size')})"
    more = f" and {len(diffs) - 1} more tensors" if len(diffs) > 1 else ""
    return CheckpointError(
        f"config.json of {checkpoint!r} disagrees with its weights: {name} is {list(got)} in the weights but "
        f"{list(wanted)} by config.json{hint}{more}; {fix}"
    )


def _check_loading_info(info: dict[str, Any], checkpoint: str, text_prefix: str) -> None:
    """Refuse text-decoder weights that transformers would fill with random values; warn on the
    rest."""
    missing = sorted(info.get("missing_keys") or ())
    text_missing = [k for k in missing if k.startswith(text_prefix)]
    if text_missing:
        raise CheckpointError(
            f"{checkpoint!r} lacks {len(text_missing)} tensors of the text decoder (e.g. {text_missing[0]}) that its "
            "config.json asks for; transformers would fill them with random values. The download is incomplete or "
            "config.json belongs to another checkpoint: download the checkpoint again"
        )
    if missing:
        log.warning(
            "%s: %d tensors outside the text decoder are missing (unused by the port): %s",
            checkpoint,
            len(missing),
            missing[:3],
        )
    unexpected = sorted(info.get("unexpected_keys") or ())
    if unexpected:
        log.warning(
            "%s: %d tensors in the checkpoint are not part of the model: %s",
            checkpoint,
            len(unexpected),
            unexpected[:3],
        )


TEXT_MODEL_TYPES = ("gemma4_text", "gemma4_unified_text")


def _load_text_lm(
    variant: Variant, config: Any, checkpoint: str, local: bool, dtype: torch.dtype, hub: dict, media: bool = False
) -> nn.Module:
    """The `*ForCausalLM` of a text-only folder, or the text decoder of a released multimodal
    one (`media`: the whole multimodal model)."""
    text_only = config.model_type in TEXT_MODEL_TYPES
    if text_only:
        _, model_cls = _text_classes(variant)
        loader, text_prefix = model_cls, "model."
    else:
        from transformers import AutoModelForImageTextToText

        model_cls, loader = conditional_class(variant), AutoModelForImageTextToText
        text_prefix = "model.language_model."
    try:
        model, info = loader.from_pretrained(
            checkpoint, dtype=dtype, attn_implementation=variant.attn_implementation, output_loading_info=True, **hub
        )
    except RuntimeError as exc:
        if "mismatch" not in str(exc):
            raise
        folder = _weights_folder(checkpoint, local, hub)
        raise _shape_error(checkpoint, model_cls, config, folder) from None
    except ValueError as exc:  # no model can be built from config.json (e.g. layer count edited)
        raise _inconsistent_config(checkpoint, exc) from None
    except Exception as exc:
        if type(exc).__name__ != "SafetensorError":
            raise
        folder = _weights_folder(checkpoint, local, hub)
        if folder is not None:
            check_weight_files(folder, checkpoint)  # names the file
        raise CheckpointError(
            f"a weights file of {checkpoint!r} is truncated or unreadable ({exc}); download the checkpoint "
            f"again (e.g. `hf download {checkpoint} --force-download`)"
        ) from None
    _check_loading_info(info, checkpoint, text_prefix)
    if media and text_only:
        raise NoVisionError(f"{checkpoint!r} is a text-only checkpoint: send text only, or load a released one")
    return model if text_only or media else extract_text_lm(variant, model)


def _load_tokenizer(checkpoint: str, hub: dict[str, Any]):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(checkpoint, **hub)
    except (OSError, ValueError, TypeError) as exc:
        raise CheckpointError(
            f"could not load the tokenizer of {checkpoint!r} ({type(exc).__name__}); the folder needs the released "
            "tokenizer files (tokenizer.json, tokenizer_config.json, chat_template.jinja): download the checkpoint "
            "again"
        ) from None


def load_checkpoint(
    variant: Variant,
    checkpoint: str,
    dtype: torch.dtype = torch.bfloat16,
    with_tokenizer: bool = True,
    media: bool = False,
) -> LoadedModel:
    """Load a real checkpoint (hub id or folder) and keep only the text decoder (the released
    multimodal `*ForConditionalGeneration`'s `model.language_model` with the tied LM head; a text-only
    folder loads as the `*ForCausalLM` itself); `media`: the whole multimodal model as `lm` (`port` adds the
    image processor saved with it: `vision.loaded`). The token comes from `HF_TOKEN` only; offline, a hub id
    loads from the local hub cache or fails at once with `HubUnreachableError`."""
    check_transformers()
    path = Path(checkpoint).expanduser()
    local = path.exists()
    if local:
        check_checkpoint_folder(path)
    elif _looks_like_path(str(checkpoint)):
        raise CheckpointError(
            f"{checkpoint!r} is neither an existing folder nor a hub id (owner/name); check the path, or use a hub id "
            f"such as {variant.hf_id!r}"
        )
    source = str(path) if local else checkpoint
    offline_reason, hub = None, {}
    if not local:
        offline_reason = "HF_HUB_OFFLINE is set" if hub_offline() else probe_hub()
        hub = {"token": hf_token(), "local_files_only": offline_reason is not None}
    config = _read_config(source, local, hub, offline_reason)
    if offline_reason is not None:
        log.warning("hub unreachable (%s): loading %s from the local hub cache", offline_reason, source)
    if config.model_type not in GEMMA4_MODEL_TYPES:
        raise NotGemma4Error(
            f"{checkpoint!r} is a {config.model_type!r} model, not Gemma-4; pick "
            f"a Gemma-4 checkpoint, e.g. {variant.hf_id!r}"
        )
    check_config_matches_variant(config, variant, repr(checkpoint))
    if local:  # a truncated file is named now, not as a bare SafetensorError after the load began
        check_weight_files(path, checkpoint)
    log.info("loading %s (%s) in %s", source, config.model_type, dtype)
    tokenizer = None
    if with_tokenizer:  # before the weights: a tokenizer that cannot chat fails in a second
        tokenizer = _load_tokenizer(source, hub)
        require_chat_template(tokenizer, repr(checkpoint))
    lm = _load_text_lm(variant, config, source, local, dtype, hub, media)
    folder = _weights_folder(source, local, hub)
    if folder is not None:  # the files' own digests: no weight is hashed as float32 per compile
        declare_identity(lm, f"{folder_identity(folder)}:{dtype}")
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
