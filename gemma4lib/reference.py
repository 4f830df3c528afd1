"""The host reference: Hugging Face's own greedy `generate` on the same prompt ids, and its logits
for a given token sequence (teacher forcing), with the numerical spread of those logits.

The spread is what makes the logit check's tolerance a property of the model instead of a
constant: the same forward run in float64 (float32 for a bf16/fp16 model, whose own rounding
dwarfs float32's), one module widened at a time, shows how far the reference's own arithmetic is from
exact on that very sequence. A faithful compiled graph rounds differently but no worse.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .errors import AudioInputError, SettingsError
from .models.image_attention import generate_kwargs, intended_masks
from .models.upcast import upcast_forward

log = logging.getLogger(__name__)


class MediaBound(nn.Module):
    """transformers' multimodal model with one prompt's images and audio bound, called and generated like a
    text LM (`forward` and `generate` pass the processor's tensors: `pixel_values` and `mm_token_type_ids`,
    `input_features` and their mask from transformers' own feature extractor on the raw clips, never the host's
    features), so every reference function here runs HF's own image and audio path on the prompt the device ran."""

    def __init__(self, multimodal: nn.Module, media: Any):
        super().__init__()
        self.multimodal, self.media = multimodal, media
        self.positions = tuple(int(p) for p in media.positions)
        self.config = multimodal.config.get_text_config()
        parts = [getattr(multimodal.model, n, None) for n in ("audio_tower", "embed_audio")] if media.audio else []
        self.narrow_modules = tuple(m for m in parts if m is not None)  # the spread's wide forward keeps them
        self.audio = self._audio_features() if media.clips else {}  # once: the spread calls forward dozens of times

    def _image_kwargs(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        types = torch.zeros_like(ids)
        types[:, list(self.positions)] = 1
        dtype, media = next(self.multimodal.parameters()).dtype, self.media
        out = {"mm_token_type_ids": types}
        if media.pixel_values is not None:
            out.update(pixel_values=media.pixel_values.to(dtype), image_position_ids=media.position_ids)
        if self.audio:
            out.update(input_features=self.audio["input_features"].to(dtype), input_features_mask=self.audio["mask"])
        return out

    def _audio_features(self) -> dict[str, torch.Tensor]:
        """transformers' extractor on the raw samples (a host extractor bug is then the device's alone: LOGITS_MATCH
        sees it); a soft-token count unlike the prompt's is refused, as transformers' model would fail on it."""
        from transformers.models.gemma4 import feature_extraction_gemma4 as mel
        from transformers.models.gemma4_unified import feature_extraction_gemma4_unified as frames

        unified = self.config.model_type.startswith("gemma4_unified")
        extractor = frames.Gemma4UnifiedAudioFeatureExtractor() if unified else mel.Gemma4AudioFeatureExtractor()
        data = extractor([c.astype("float32") for c in self.media.clips], return_tensors="pt")
        counts = data["input_features_mask"][:, :: 1 if unified else 4].sum(1).tolist()
        if tuple(counts) != tuple(self.media.audio_counts):
            raise AudioInputError(
                f"transformers' feature extractor gives {counts} soft tokens for the clips where the prompt holds "
                f"{list(self.media.audio_counts)}: the host's audio features are not transformers' (docs/AUDIO.md)"
            )
        return {"input_features": data["input_features"], "mask": data["input_features_mask"]}

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs: Any):
        image = self._image_kwargs(input_ids)
        masks = intended_masks(self.multimodal, input_ids, attention_mask, image["mm_token_type_ids"])
        return self.multimodal(
            input_ids=input_ids, attention_mask=masks if masks is not None else attention_mask, **image, **kwargs
        )

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, **kwargs: Any):
        """transformers' `generate` over the image, its masks the model's intended ones
        (`models.image_attention`: a static cache where the config is bidirectional over images)."""
        kwargs = {**generate_kwargs(self.multimodal), **kwargs}
        return self.multimodal.generate(input_ids, **self._image_kwargs(input_ids), **kwargs)

    def set_experts_implementation(self, experts: str) -> None:
        """The multimodal model's (`upcast.upcast_forward` switches the MoE experts' form)."""
        self.multimodal.set_experts_implementation(experts)


def reference_for(model: Any, media: Any = None) -> nn.Module:
    """What a prompt is judged against: `model.lm` (the text LM) for text, or with `media` (a
    `runtime.MediaPrompt`) transformers' own multimodal model with its images and audio bound (`MediaBound`)."""
    if media is None:
        return model.lm
    return MediaBound(model.multimodal, media)


def random_prompt(vocab_size: int, n: int, seed: int) -> list[int]:
    """A seeded prompt for a model without a tokenizer; ids >= 3 avoid pad, eos and bos."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (n,), generator=generator).tolist()


@torch.no_grad()
def hf_greedy(
    lm: nn.Module,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    eos_token_ids: Sequence[int] = (),
    *,
    exact: bool = False,
    keep_logits: bool = False,
    **generate_kwargs: Any,
) -> tuple[list[int], torch.Tensor | None]:
    """Hugging Face's greedy `generate` on `prompt_ids`, the one call every HF-side path makes (the
    reference, the real-width check, the benchmark's HF paths): (tokens, per-step logits or None).

    eos switched off when none is given; `exact`: exactly `max_new_tokens` (the benchmark's runs
    compare); `keep_logits`: the raw logits of every step, float32 [new_tokens, vocab];
    `generate_kwargs` go to `generate` (a logits processor, a static cache)."""
    ids = torch.as_tensor(list(prompt_ids), dtype=torch.long)[None]
    eos = list(eos_token_ids) or None
    if exact:
        generate_kwargs["min_new_tokens"] = max_new_tokens
    if keep_logits:
        generate_kwargs.update(output_logits=True, return_dict_in_generate=True)
    out = lm.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
        use_cache=True,
        **generate_kwargs,
    )
    sequences = out.sequences if keep_logits else out
    tokens = sequences[0, ids.shape[1] :].tolist()
    logits = torch.stack([step[0].float() for step in out.logits]) if keep_logits else None
    if eos:  # generate pads after eos when stopping early in a batch; keep up to and including eos
        for i, token in enumerate(tokens):
            if token in eos:
                return tokens[: i + 1], None if logits is None else logits[: i + 1]
    return tokens, logits


def reference_greedy(
    lm: nn.Module, prompt_ids: Sequence[int], max_new_tokens: int, eos_token_ids: Sequence[int] = ()
) -> list[int]:
    """Greedy tokens from `lm.generate` with the dynamic cache; eos switched off when none is given."""
    return hf_greedy(lm, prompt_ids, max_new_tokens, eos_token_ids)[0]


@torch.no_grad()
def reference_last_logits(lm: nn.Module, prompt_ids: Sequence[int]) -> torch.Tensor:
    """Softcapped logits of the last prompt token from a plain forward (what prefill must match)."""
    ids = torch.as_tensor(list(prompt_ids), dtype=torch.long)[None]
    return lm(ids).logits[0, -1].float()


@torch.no_grad()
def teacher_forced_logits(lm: nn.Module, prompt_ids: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
    """HF's softcapped logits for each of `tokens` given everything before it: one forward over
    prompt + tokens[:-1]; row i is what predicted tokens[i] (row 0: the last prompt token's).

    `[len(tokens), vocab]` in float64 (exact for a float32 or bf16 model)."""
    if not tokens:
        raise SettingsError("teacher forcing needs at least one generated token; pass the tokens the device generated")
    ids = torch.as_tensor([*prompt_ids, *tokens[:-1]], dtype=torch.long)[None]
    logits = lm(ids, attention_mask=torch.ones_like(ids)).logits[0]
    return logits[len(prompt_ids) - 1 :].to(torch.float64)


def precise_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype that measures `dtype`'s rounding: float64 for float32, float32 for 16-bit ones
    (half the memory of float64, and its error is invisible next to bf16's)."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else torch.float64


@torch.no_grad()
def logits_spread(
    lm: nn.Module, prompt_ids: Sequence[int], tokens: Sequence[int], reference: torch.Tensor | None = None
) -> tuple[float, str]:
    """Max |HF logits in the model's dtype − HF logits of the same forward in a higher precision|
    over the same teacher-forced rows (softcapped both). Returns (spread, the precise dtype name).
    The precise forward widens one module at a time (`upcast.upcast_forward`), not a deep copy."""
    if reference is None:
        reference = teacher_forced_logits(lm, prompt_ids, tokens)
    dtype = next(lm.parameters()).dtype
    high = precise_dtype(dtype)
    with upcast_forward(lm, high):
        exact = teacher_forced_logits(lm, prompt_ids, tokens)
    spread = float((reference - exact).abs().max())
    log.info("reference logits spread %s vs %s: %.3g", dtype, high, spread)
    return spread, str(high).replace("torch.", "")


@torch.no_grad()
def hf_assisted(
    lm: nn.Module, assistant: nn.Module, prompt_ids: Sequence[int], max_new_tokens: int, eos: Sequence[int]
) -> tuple[list[int], int]:
    """transformers' own `generate(assistant_model=...)` (greedy): its tokens and the number of
    target verify steps it ran (target forward calls after the prefill)."""
    calls = []
    # a `MediaBound` generates through its multimodal model: count that model's forward calls
    hook = getattr(lm, "multimodal", lm).register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        tokens, _ = hf_greedy(lm, prompt_ids, max_new_tokens, eos, assistant_model=assistant)
    finally:
        hook.remove()
    return tokens, len(calls) - 1
