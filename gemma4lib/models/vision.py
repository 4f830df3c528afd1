"""The tiny multimodal fixtures: each variant's trained text decoder with a tiny vision part of the
variant's real classes, trained on synthetic shapes (`shapes.py`) with the text weights frozen, so
the text fixture stays byte-identical and the vision part must steer a decoder that never saw an
image (docs/IMAGES.md, "The tiny multimodal fixtures").

E2B, E4B, 31B and 26B-A4B carry `Gemma4VisionModel` and a `Gemma4MultimodalEmbedder`; the 12B's
unified class is encoder-free (`Gemma4UnifiedVisionEmbedder`) and asks for bidirectional attention
among an image's tokens on its sliding layers. `fixtures/vision/<variant>/` holds the multimodal
config, the vision weights and the image processor's config (the loader puts the text fixture's
weights under it); `fixtures/vision/tokenizer/` is the text tokenizer with three filler specials
renamed to Gemma-4's image tokens and a chat template that renders image parts.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..environment import check_transformers
from ..errors import CheckpointError, NoVisionError
from .variants import VARIANTS, Variant, get_variant

log = logging.getLogger(__name__)

# Filler specials of the text tokenizer (`<unused3>`..`<unused5>`) renamed to Gemma-4's image tokens.
BOI, EOI, IMAGE_TOKEN = "<|image>", "<image|>", "<|image|>"
BOI_ID, EOI_ID, IMAGE_TOKEN_ID = 3, 4, 5
# The smallest soft-token budget transformers' Gemma-4 image processors accept (70, 140, ... 1120).
MAX_SOFT_TOKENS = 70


def vision_configs(variant: Variant | str, text_hidden: int) -> Any:
    """The tiny vision sub-config of the variant's released kind: patch 4, 2x2 pooling, so a 32x32
    image is 64 patches and 16 soft tokens (padded to the processors' smallest budget, 70)."""
    variant = variant if isinstance(variant, Variant) else get_variant(variant)
    check_transformers()
    if variant.unified:
        from transformers.models.gemma4_unified import Gemma4UnifiedVisionConfig

        return Gemma4UnifiedVisionConfig(
            patch_size=4, pooling_kernel_size=2, mm_embed_dim=64, mm_posemb_size=64, output_proj_dims=64
        )
    from transformers import Gemma4VisionConfig

    return Gemma4VisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        patch_size=4,
        pooling_kernel_size=2,
        position_embedding_size=64,
    )


def multimodal_config(variant: Variant | str, text_config: Any) -> Any:
    """`Gemma4Config` / `Gemma4UnifiedConfig` around the text fixture's config, with the vision
    sub-config and the image token ids of the vision tokenizer; no audio part."""
    variant = variant if isinstance(variant, Variant) else get_variant(variant)
    drop = ("architectures", "_name_or_path", "dtype", "torch_dtype", "transformers_version")
    text = {k: v for k, v in text_config.to_dict().items() if k not in drop}
    if variant.unified:
        from transformers.models.gemma4_unified import Gemma4UnifiedConfig as config_cls
    else:
        from transformers import Gemma4Config as config_cls
    config = config_cls(
        text_config=text,
        vision_config=vision_configs(variant, text_config.hidden_size),
        audio_config=None,
        image_token_id=IMAGE_TOKEN_ID,
        boi_token_id=BOI_ID,
        eoi_token_id=EOI_ID,
    )
    config.eos_token_id = [1, 106]
    return config


def image_processor(variant: Variant | str):
    """The variant's transformers image processor at the tiny vision config's patch and pooling.

    `do_resize=False`: the processors resize every image to fill `max_soft_tokens` (at least 70:
    ~64 soft tokens), which made an image prompt ~100 tokens and training 2x slower; the fixtures
    take 32x32 images as they are (16 soft tokens, padded to the 280-patch budget the graph is
    compiled for). Other sizes are refused by `images.image_prompt` with what to do."""
    variant = variant if isinstance(variant, Variant) else get_variant(variant)
    kwargs = dict(patch_size=4, pooling_kernel_size=2, max_soft_tokens=MAX_SOFT_TOKENS, do_resize=False)
    if variant.unified:  # transformers' needs torchvision (no PIL backend): ours where it is missing
        from .unified_patches import load_unified_processor

        return load_unified_processor(**kwargs)
    # the PIL backend: the torchvision one is the same math, and torchvision is not a pinned dependency
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    return Gemma4ImageProcessorPil(**kwargs)


# ---- prompts with images ------------------------------------------------------------------------
def image_messages(question: str, n_images: int = 1, n_audio: int = 0) -> list[dict[str, Any]]:
    """One user turn: `n_images` image parts, `n_audio` audio parts, then the question."""
    parts: list[dict[str, Any]] = [{"type": "image"}] * n_images + [{"type": "audio"}] * n_audio
    return [{"role": "user", "content": [*parts, {"type": "text", "text": question}]}]


def expand_image_tokens(
    ids: list[int], soft_tokens: list[int], token_id: int = IMAGE_TOKEN_ID, begin: int = BOI_ID, end: int = EOI_ID
) -> list[int]:
    """Each image token of the rendered prompt becomes boi + that image's soft tokens + eoi, as the
    transformers processor's `replace_image_token` does to the text (an audio clip's: given its ids)."""
    out, image = [], 0
    for token in ids:
        if token == token_id:
            out += [begin] + [token_id] * int(soft_tokens[image]) + [end]
            image += 1
        else:
            out.append(token)
    return out


def token_types(ids: list[int]) -> list[int]:
    """transformers' `mm_token_type_ids`: 1 on an image's soft tokens, 0 elsewhere."""
    return [1 if t == IMAGE_TOKEN_ID else 0 for t in ids]


def build_multimodal(variant: Variant | str, text_lm: nn.Module, seed: int = 0) -> nn.Module:
    """The variant's `*ForConditionalGeneration` around `text_lm` (weights and buffers copied), the
    vision part seeded; eager attention as the text fixtures use."""
    from .checkpoint import conditional_class

    variant = variant if isinstance(variant, Variant) else get_variant(variant)
    config = multimodal_config(variant, text_lm.config)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        full = conditional_class(variant)._from_config(
            config, dtype=torch.float32, attn_implementation=variant.attn_implementation
        )
        widen_vision_init(full)
    full.model.language_model.load_state_dict(text_lm.model.state_dict(), strict=True)
    full.tie_weights()
    return full.eval()


def widen_vision_init(full: nn.Module) -> None:
    """Start the soft tokens at the size of the decoder's word embeddings (which are scaled by
    sqrt(hidden)): at transformers' 0.02 init they are ~14x smaller and barely differ between
    images, and the decoder learnt to ignore them (E2B: "A red square." for every image after 150
    steps). The input patch projection is widened the same way, so two images' features differ."""
    inner = full.model
    embedder = inner.embed_vision
    projection = getattr(embedder, "multimodal_embedder", embedder).embedding_projection  # the 12B nests it
    nn.init.normal_(projection.weight, std=1.0 / projection.in_features**0.5 * 2.0)
    tower = getattr(inner, "vision_tower", None)
    if tower is not None:
        patch = tower.patch_embedder.input_proj
        nn.init.normal_(patch.weight, std=1.0 / patch.in_features**0.5)
        nn.init.normal_(tower.patch_embedder.position_embedding_table, std=0.5)


# ---- the fixture folders, and LoadedModel over a multimodal model ------------------------------------
VISION_DIR = Path(__file__).resolve().parent.parent / "fixtures" / "vision"
# every variant: the four with a vision encoder and the 12B's encoder-free unified path
VISION_VARIANTS = tuple(VARIANTS)
SOURCE = "tiny-trained-vision"


def lm_over(variant: Variant, multimodal: nn.Module) -> nn.Module:
    """A `*ForCausalLM` whose decoder and head ARE the multimodal model's (shared modules, no copy):
    every text path of the library (graphs, host tables, reference) reads it as it reads a text
    checkpoint."""
    from .loading import _text_classes

    _, lm_cls = _text_classes(variant)
    text_config = multimodal.config.get_text_config()
    with torch.device("meta"):
        lm = lm_cls(text_config)
    lm.model = multimodal.model.language_model
    lm.lm_head = multimodal.lm_head
    lm.generation_config = multimodal.generation_config
    return lm.eval()


def loaded(variant: Variant, multimodal: nn.Module, tokenizer, processor, source: str):
    from .loading import LoadedModel

    return LoadedModel(variant, lm_over(variant, multimodal), tokenizer, source, multimodal.eval(), processor)


def vision_fixture_dir(variant: Variant | str, root: Path | None = None) -> Path:
    v = variant if isinstance(variant, Variant) else get_variant(variant)
    return (root or VISION_DIR) / v.name


def verify_vision_hashes(root: Path | None = None, variants: list[str] | None = None) -> dict[str, str]:
    """Check the vision fixtures' files against `fixtures/vision/PROVENANCE.json`."""
    from .trained import check_hashes

    root = root or VISION_DIR
    path = root / "PROVENANCE.json"
    if not path.is_file():
        raise CheckpointError(f"{path} is missing; regenerate with `python scripts/train_vision.py --variant all`")
    recorded = json.loads(path.read_text())["files"]
    return check_hashes(recorded, root, variants, "vision fixtures", "scripts/train_vision.py")


def load_vision_fixture(variant: Variant | str, root: Path | None = None, verify: bool = True):
    """The tiny multimodal fixture of a variant as a `LoadedModel` (fp32, `multimodal` and the image
    processor set; the tokenizer is the vision tokenizer)."""
    from .checkpoint import conditional_class
    from .tokenizer import load_tokenizer
    from .weights_identity import declare_identity

    variant = variant if isinstance(variant, Variant) else get_variant(variant)
    root = root or VISION_DIR
    folder = vision_fixture_dir(variant, root)
    if not (folder / "model.safetensors").is_file():
        raise NoVisionError(
            f"no tiny vision fixture for {variant.name!r} (at {folder}); train one with "
            f"`python scripts/train_vision.py --variant {variant.name}` (variants {', '.join(VISION_VARIANTS)}), "
            f"or run the random-weight multimodal model (model='random')"
        )
    if verify:
        verify_vision_hashes(root, [variant.name])
    full = conditional_class(variant).from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation=variant.attn_implementation
    )
    processor, tokenizer = folder_processor(variant, str(folder)), load_tokenizer(root / "tokenizer")
    from ..cache.artifacts import sha256_file

    declare_identity(full, f"vision-fixture:{variant.name}:{sha256_file(folder / 'model.safetensors')}")
    model = loaded(variant, full, tokenizer, processor, SOURCE)
    declare_identity(model.lm, f"vision-fixture-lm:{variant.name}:{sha256_file(folder / 'model.safetensors')}")
    return model


def folder_processor(variant: Variant, source: str, **hub: Any):
    """The image processor saved with a model (a folder, or a hub id: huggingface_hub reads `HF_TOKEN` itself)."""
    from transformers import AutoImageProcessor

    if variant.unified:  # AutoImageProcessor would import transformers' torchvision-only class
        from transformers.utils import cached_file

        from .unified_patches import CONFIG_NAME, load_unified_processor

        return load_unified_processor(Path(cached_file(source, CONFIG_NAME, **hub)).parent)  # a hub id: its cache
    return AutoImageProcessor.from_pretrained(source, **hub)


def build_random_multimodal(variant: Variant | str, seed: int = 0):
    """A seeded random-weight tiny multimodal model of the variant (the witness, the held-out checks):
    the tiny text config of `build_tiny` with the vision part of the fixtures."""
    from .loading import build_tiny

    variant = variant if isinstance(variant, Variant) else get_variant(variant)
    text = build_tiny(variant, seed=seed)
    full = build_multimodal(variant, text.lm, seed=seed)
    from .weights_identity import declare_identity

    processor = image_processor(variant)
    model = loaded(variant, full, None, processor, f"tiny-random-vision(seed={seed})")
    declare_identity(model.lm, f"tiny-random-vision-lm:{variant.name}:{seed}")
    return model
