"""The host side of a prompt with images and audio: read the images and clips, run the checkpoint's
image processor and the audio features (`models.audio`), render the chat messages with image and audio
parts through the tokenizer's chat template, expand each part to its soft tokens, and hand the engine a
`runtime.MediaPrompt`.

Every bad input stops here with a library error that says what to do (`errors.ImageInputError`,
`NoVisionError`, `TooManyImagesError`); a prompt too long for the compiled context is the engine's
one fit check (`Engine.check`), which counts the image's soft tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .errors import ImageInputError, NoVisionError, TooManyImagesError
from .runtime import MediaPrompt

log = logging.getLogger(__name__)

# the shipped sample images: coloured shapes like those the tiny vision fixtures were trained on
SAMPLES_DIR = Path(__file__).resolve().parent / "fixtures" / "vision" / "images"


def load_image(image: Any):
    """A PIL RGB image from a path or a PIL image; `ImageInputError` for a missing file or one that
    is not an image."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if not isinstance(image, (str, Path)):
        raise ImageInputError(f"an image is a file path or a PIL.Image.Image, got {type(image).__name__}")
    path = Path(image)
    if not path.is_file():
        raise ImageInputError(f"image file {str(path)!r} does not exist; pass the path of a PNG or JPEG file")
    try:
        with Image.open(path) as opened:
            return opened.convert("RGB")
    except (UnidentifiedImageError, OSError) as error:
        raise ImageInputError(
            f"{str(path)!r} is not an image PIL can read ({error.__class__.__name__}); pass a PNG or JPEG file"
        ) from None


def find_image(image: Any) -> Any:
    """`image` itself when it is a PIL image or an existing file, else the shipped sample of that
    file name (`SAMPLES_DIR`: "red_circle.png", "blue_square.png", ...), so a notebook parameter
    can name either; `ImageInputError` naming the samples when it is neither."""
    if not isinstance(image, (str, Path)) or Path(image).is_file():
        return image
    sample = SAMPLES_DIR / str(image)
    if sample.is_file():
        return sample
    names = ", ".join(sorted(p.name for p in SAMPLES_DIR.glob("*.png")))
    raise ImageInputError(
        f"image {str(image)!r} is neither a file nor a shipped sample ({names}); pass a path to a PNG or JPEG"
    )


@dataclass(frozen=True)
class MediaInputs:
    """What the host made of one prompt with images or audio: the prompt ids (parts expanded), the image
    processor's tensors (None without images), and the `MediaPrompt` the engine places."""

    ids: list[int]
    pixel_values: torch.Tensor | None
    position_ids: torch.Tensor | None
    prompt: MediaPrompt

    @property
    def token_types(self) -> list[int]:
        """transformers' `mm_token_type_ids`: 1 on the image soft tokens."""
        marked = set(self.prompt.positions)
        return [1 if i in marked else 0 for i in range(len(self.ids))]


def require_vision(multimodal: Any, processor: Any, source: str = "this checkpoint") -> None:
    """Refuse images for a model without a vision part or image processor."""
    from .device.vision import has_vision
    from .models.vision import VISION_VARIANTS

    if not has_vision(multimodal) or processor is None:
        raise NoVisionError(
            f"{source} has no vision part (no vision_config / embed_vision, or no image processor); "
            f"send text only, or load a checkpoint with one (e.g. the random-weight multimodal model of "
            f"{', '.join(VISION_VARIANTS)}: model='random', or a vision fixture trained by scripts/train_vision.py)"
        )


def media_prompt(
    tokenizer: Any,
    processor: Any,
    images: Sequence[Any],
    question: str,
    *,
    image_token_id: int,
    audio: Sequence[Any] = (),
    messages: list[dict[str, Any]] | None = None,
    rendered: Sequence[int] | None = None,
    unified: bool = False,
) -> MediaInputs:
    """Render `messages` (default: one user turn with an image part per image, an audio part per clip,
    then `question`) through the chat template, expand every image part to boi + soft tokens + eoi and
    every audio part to boa + soft tokens + eoa as transformers' processor does (`rendered`: the
    template's ids, if encoded already), run the image processor, and take each clip's features
    (`audio`: 16 kHz samples, `models.audio.read_wav`; `unified`: the 12B's raw frames). More images than
    image parts (or fewer) is a `TooManyImagesError`, clips and audio parts an `AudioInputError`."""
    from .models import audio as hearing
    from .models.vision import expand_image_tokens, image_messages

    pictures = [load_image(i) for i in images]
    messages = messages if messages is not None else image_messages(question, len(pictures), len(audio))
    if rendered is None:
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    rendered = list(rendered["input_ids"] if isinstance(rendered, dict) else rendered)
    parts = rendered.count(image_token_id)
    if parts != len(pictures):
        raise TooManyImagesError(
            f"{len(pictures)} images for {parts} image parts in the prompt; give one "
            f'{{"type": "image"}} content part per image (or pass fewer images)'
        )
    data = processor(images=pictures, return_tensors="pt") if pictures else {}
    ids = expand_image_tokens(rendered, [int(n) for n in data.get("num_soft_tokens_per_image", ())])
    ids = hearing.expand_audio(tokenizer, ids, audio, unified) if audio else ids
    token = tokenizer.convert_tokens_to_ids(tokenizer.audio_token) if audio else -1
    media = media_of(ids, data, image_token_id, audio, token, unified)
    return MediaInputs(ids, media.pixel_values, media.position_ids, media)


def media_of(
    ids: list[int], data: Any, image_token: int, clips=(), audio_token: int = -1, unified=False
) -> MediaPrompt:
    """The `MediaPrompt` of expanded `ids`: the image processor's `data`, the clips' features and counts."""
    from .models import audio as hearing

    def at(token: int) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(ids) if t == token)

    heard = tuple(tuple(torch.from_numpy(x) for x in hearing.features(c, unified)) for c in clips)
    counts = tuple(int(n) for n in data.get("num_soft_tokens_per_image", ()))
    audio_counts = tuple(hearing.soft_tokens(c, unified) for c in clips)
    pixels, positions = data.get("pixel_values"), data.get("image_position_ids")
    return MediaPrompt(pixels, positions, counts, at(image_token), heard, audio_counts, at(audio_token), tuple(clips))


image_prompt = media_prompt  # images only: the notebooks' name
