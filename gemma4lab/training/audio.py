"""Audio on the host side, for the tests and the coming audio fixtures (issue 50): the tiny vision
tokenizer with Gemma-4's three audio tokens, and transformers' own processor built around it, so
`gemma4lib.models.audio`'s placeholders can be compared with what transformers makes of the same messages.

The token strings are the released ones (google/gemma-4-*-it tokenizer_config.json: `boa_token`
"<|audio>", `audio_token` "<|audio|>", `eoa_token` "<audio|>"; Google's Gemma 4 prompt-formatting
page); the tiny tokenizer has no such tokens, so fillers 6, 7, 8 are renamed, as vision renamed 3, 4, 5.
"""

from __future__ import annotations

from typing import Any

from gemma4lab.training.vision import rename_fillers, vision_tokenizer
from gemma4lib.models.tokenizer import BOS, EOS, PAD
from gemma4lib.models.vision import IMAGE_TOKEN

BOA, EOA, AUDIO_TOKEN = "<|audio>", "<audio|>", "<|audio|>"
BOA_ID, EOA_ID, AUDIO_TOKEN_ID = 6, 7, 8

# the vision template (`VISION_CHAT_TEMPLATE`) with audio parts rendered as the audio token, as the
# released template does; the processor step expands it to boa + soft tokens + eoa
AUDIO_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<|turn>' + role + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '" + IMAGE_TOKEN + "' }}"
    "{% elif part['type'] == 'audio' %}{{ '" + AUDIO_TOKEN + "' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<turn|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|turn>model\\n' }}{% endif %}"
)


def audio_tokenizer(text_tokenizer) -> Any:
    """The vision tokenizer (`vision_tokenizer`) with fillers 6, 7, 8 renamed to the audio tokens and
    the audio template; every other id unchanged."""
    from transformers import PreTrainedTokenizerFast

    base = vision_tokenizer(text_tokenizer)
    renames = {f"<unused{BOA_ID}>": BOA, f"<unused{EOA_ID}>": EOA, f"<unused{AUDIO_TOKEN_ID}>": AUDIO_TOKEN}
    special = {"image_token": base.image_token, "boi_token": base.boi_token, "eoi_token": base.eoi_token}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=rename_fillers(base, renames),
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=None,
        padding_side="left",
        model_max_length=4096,
        chat_template=AUDIO_CHAT_TEMPLATE,
        extra_special_tokens={**special, "audio_token": AUDIO_TOKEN, "boa_token": BOA, "eoa_token": EOA},
    )
    for token, expected in ((BOA, BOA_ID), (EOA, EOA_ID), (AUDIO_TOKEN, AUDIO_TOKEN_ID)):
        if tokenizer.convert_tokens_to_ids(token) != expected:
            raise AssertionError(f"{token} is not at id {expected}")
    return tokenizer


def transformers_processor(tokenizer, unified: bool = False) -> Any:
    """transformers' own `Gemma4Processor` (the 12B: `Gemma4UnifiedProcessor` with its raw-frame
    extractor) around `tokenizer`, with the default audio feature extractor; no video processor."""
    if unified:
        from transformers.models.gemma4_unified import processing_gemma4_unified as processing
        from transformers.models.gemma4_unified.feature_extraction_gemma4_unified import (
            Gemma4UnifiedAudioFeatureExtractor as Extractor,
        )
    else:
        from transformers.models.gemma4 import processing_gemma4 as processing
        from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor as Extractor
    from transformers import Gemma4ImageProcessorPil

    base = processing.Gemma4UnifiedProcessor if unified else processing.Gemma4Processor

    class Processor(base):  # no video processor: its class check needs torchvision, not installed here
        def check_argument_for_proper_class(self, name: str, arg: Any) -> Any:
            return None if name == "video_processor" else super().check_argument_for_proper_class(name, arg)

    return Processor(Extractor(), Gemma4ImageProcessorPil(), tokenizer, None, chat_template=tokenizer.chat_template)


# A conformer small enough for seconds-long tests: 2 layers of hidden 32. The first subsampling conv keeps
# 128 channels: transformers sizes the projection after it as (channels[0] // 4) * channels[1], which is
# the mel bins after two stride-2 convs only when channels[0] == 128 (the released config's value).
TINY_AUDIO = {
    "hidden_size": 32,
    "num_attention_heads": 2,
    "num_hidden_layers": 2,
    "subsampling_conv_channels": [128, 4],
    "output_proj_dims": 32,
}


def build_random_hearing(variant: str = "e2b", seed: int = 0) -> Any:
    """A seeded random-weight tiny multimodal model that hears: `build_random_multimodal`'s (text and
    vision weights unchanged) with an audio part added: E2B/E4B the `TINY_AUDIO` conformer, the 12B its
    encoder-free 640-sample frame embedder; the audio token ids are this module's. Its `tokenizer` is
    `audio_tokenizer` over the trained fixture's."""
    from gemma4lib.models import vision
    from gemma4lib.models.trained import load_trained
    from gemma4lib.models.weights_identity import declare_identity

    base = vision.build_random_multimodal(variant, seed=seed)
    full = with_hearing(base.variant, base.multimodal, seed)
    tokenizer = audio_tokenizer(load_trained(base.variant.name).tokenizer)
    model = vision.loaded(base.variant, full.eval(), tokenizer, base.processor, f"tiny-random-audio(seed={seed})")
    declare_identity(model.lm, f"tiny-random-audio-lm:{base.variant.name}:{seed}")
    return model


def with_hearing(variant, multimodal, seed: int = 0) -> Any:
    """`multimodal` (a tiny vision model: fixture or random) rebuilt with an audio part, its text and
    vision weights copied unchanged: E2B/E4B the `TINY_AUDIO` conformer, the 12B its encoder-free
    640-sample frame embedder, seeded by `seed`; the audio token ids are this module's."""
    import torch
    from torch import nn

    from gemma4lib.models.checkpoint import conditional_class

    config = multimodal.config.to_dict()
    if variant.unified:
        from transformers.models.gemma4_unified import Gemma4UnifiedAudioConfig, Gemma4UnifiedConfig

        config["audio_config"], config_cls = Gemma4UnifiedAudioConfig().to_dict(), Gemma4UnifiedConfig
    else:
        from transformers import Gemma4AudioConfig, Gemma4Config

        config["audio_config"], config_cls = Gemma4AudioConfig(**TINY_AUDIO).to_dict(), Gemma4Config
    config.update(audio_token_id=AUDIO_TOKEN_ID, boa_token_id=BOA_ID, eoa_token_id=EOA_ID, eoa_token_index=EOA_ID)
    with torch.random.fork_rng():
        torch.manual_seed(seed + 1000)
        full = conditional_class(variant)._from_config(
            config_cls(**config), dtype=torch.float32, attn_implementation=variant.attn_implementation
        )
        projection = full.model.embed_audio.embedding_projection  # soft tokens at the word embeddings' size
        nn.init.normal_(projection.weight, std=2.0 / projection.in_features**0.5)
    missing, unexpected = full.load_state_dict(multimodal.state_dict(), strict=False)
    if unexpected or any("audio" not in name for name in missing):
        raise AssertionError(f"the hearing model lost weights: {unexpected[:3]} {missing[:3]}")
    full.tie_weights()
    return full
