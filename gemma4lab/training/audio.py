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
from gemma4lib.models.audio import AUDIO_TOKEN_ID, BOA_ID, EOA_ID, TINY_AUDIO, with_hearing  # noqa: F401 (the tests' names)
from gemma4lib.models.tokenizer import BOS, EOS, PAD
from gemma4lib.models.vision import IMAGE_TOKEN

BOA, EOA, AUDIO_TOKEN = "<|audio>", "<audio|>", "<|audio|>"

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


def build_random_hearing(variant: str = "e2b", seed: int = 0) -> Any:
    """`gemma4lib.models.audio.build_random_hearing` with a tokenizer: `audio_tokenizer` over the trained
    fixture's (the library's has none, as every random model's)."""
    from dataclasses import replace

    from gemma4lib.models import audio
    from gemma4lib.models.trained import load_trained

    model = audio.build_random_hearing(variant, seed)
    return replace(model, tokenizer=audio_tokenizer(load_trained(model.variant.name).tokenizer))
