"""The 12B's image processor without torchvision: an image to the merged patches its encoder-free
`Gemma4UnifiedVisionEmbedder` reads.

transformers 5.23.0 ships `Gemma4UnifiedImageProcessor` on its torchvision backend only, and no
torchvision build imports beside the pinned CPU torch here (docs/IMAGES.md, "The 12B"). Where
torchvision is installed `load_unified_processor` returns transformers' own; elsewhere this one, which
reads and writes the same `preprocessor_config.json` and gives the same bytes (held by
`tests/test_images.py` to hashes transformers' processor wrote).

Per image, with `do_resize=False`: pixels in [0, 1] (`x * rescale_factor`), cut into `patch_size`
patches merged `pooling_kernel_size`-square into one model patch each (flattened row by row, channels
last), in row-major order of the merged grid with its (x, y) position; padded with zeros and position
(-1, -1) to `max_soft_tokens`. Resizing is torchvision's: this class refuses it with what to do.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import ImageInputError

CONFIG_NAME = "preprocessor_config.json"
PROCESSOR_TYPE = "Gemma4UnifiedImageProcessor"  # the class transformers loads from the same file
SUPPORTED_SOFT_TOKENS = (70, 140, 280, 560, 1120)  # the budgets transformers' processor accepts


@dataclass(frozen=True)
class UnifiedPatchProcessor:
    """`processor(images=[PIL images], return_tensors="pt")` -> `pixel_values [n, max_soft_tokens,
    3 (k p)^2]`, `image_position_ids [n, max_soft_tokens, 2]` (int64, -1 padding) and
    `num_soft_tokens_per_image` (module docstring)."""

    patch_size: int = 16
    pooling_kernel_size: int = 3
    max_soft_tokens: int = 280
    rescale_factor: float = 1 / 255
    do_resize: bool = True

    def __post_init__(self):
        if self.max_soft_tokens not in SUPPORTED_SOFT_TOKENS:
            raise ValueError(f"max_soft_tokens must be one of {SUPPORTED_SOFT_TOKENS}, got {self.max_soft_tokens}")

    @property
    def side(self) -> int:
        """Pixels per side of one merged (model) patch."""
        return self.patch_size * self.pooling_kernel_size

    def patches(self, image: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """One RGB PIL image -> (merged patches `[n, 3 side^2]` float32, positions `[n, 2]` (x, y))."""
        import numpy as np

        pixels = torch.from_numpy(np.asarray(image.convert("RGB"), dtype=np.uint8).copy())  # [H, W, 3]
        height, width = int(pixels.shape[0]), int(pixels.shape[1])
        side = self.side
        if height % side or width % side:
            raise ImageInputError(
                f"a {width}x{height} image does not cut into {side}x{side} patches, and this processor does not "
                f"resize (transformers' Gemma4UnifiedImageProcessor does, with torchvision); pass an image whose "
                f"sides are multiples of {side}, or install torchvision to use transformers' processor"
            )
        rows, cols = height // side, width // side
        if rows * cols > self.max_soft_tokens:
            raise ImageInputError(
                f"a {width}x{height} image is {rows * cols} patches, over the budget of {self.max_soft_tokens}; "
                f"pass a smaller image"
            )
        values = pixels.to(torch.float32) * self.rescale_factor
        blocks = values.reshape(rows, side, cols, side, 3).permute(0, 2, 1, 3, 4).reshape(rows * cols, -1)
        grid_y, grid_x = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
        positions = torch.stack([grid_x.reshape(-1), grid_y.reshape(-1)], -1)
        return blocks, positions

    def __call__(self, images: Any = None, return_tensors: str | None = "pt", **_: Any) -> dict[str, Any]:
        if self.do_resize:
            raise ImageInputError(
                "this checkpoint's image processor resizes (do_resize=true), which transformers does with "
                "torchvision; install torchvision (transformers' Gemma4UnifiedImageProcessor then loads) or use a "
                "processor config with do_resize=false"
            )
        images = images if isinstance(images, (list, tuple)) else [images]
        budget = self.max_soft_tokens
        pixel_values = torch.zeros(len(images), budget, 3 * self.side**2)
        position_ids = torch.full((len(images), budget, 2), -1, dtype=torch.long)
        counts = []
        for i, image in enumerate(images):
            blocks, positions = self.patches(image)
            pixel_values[i, : len(blocks)] = blocks
            position_ids[i, : len(blocks)] = positions
            counts.append(len(blocks))
        if return_tensors is not None:  # as transformers' BatchFeature converts it
            counts = torch.tensor(counts)
        return {"pixel_values": pixel_values, "image_position_ids": position_ids, "num_soft_tokens_per_image": counts}

    def to_dict(self) -> dict[str, Any]:
        """The fields transformers' processor saves, so either class loads the file."""
        fixed = {"do_convert_rgb": True, "do_rescale": True, "do_normalize": False, "resample": 3}
        return {
            "image_processor_type": PROCESSOR_TYPE,
            **fixed,
            "image_mean": [0.0] * 3,
            "image_std": [1.0] * 3,
            **asdict(self),
        }

    def save_pretrained(self, folder: str | Path) -> None:
        path = Path(folder) / CONFIG_NAME
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> UnifiedPatchProcessor:
        if config.get("do_normalize"):
            raise ImageInputError(
                "this processor config normalises (do_normalize=true), which the torchvision-free processor does "
                "not; install torchvision so transformers' Gemma4UnifiedImageProcessor loads it"
            )
        fields = {k: config[k] for k in ("patch_size", "pooling_kernel_size", "max_soft_tokens") if k in config}
        return cls(
            **fields,
            rescale_factor=float(config.get("rescale_factor", 1 / 255)) if config.get("do_rescale", True) else 1.0,
            do_resize=bool(config.get("do_resize", True)),
        )


def load_unified_processor(folder: str | Path | None = None, **kwargs: Any):
    """transformers' `Gemma4UnifiedImageProcessor` where torchvision imports, else
    `UnifiedPatchProcessor`; from `folder`'s `preprocessor_config.json`, or from `kwargs`."""
    from transformers.utils import is_torchvision_available

    if not is_torchvision_available():  # transformers' class is then a placeholder that raises (module docstring)
        if folder is not None:
            return UnifiedPatchProcessor.from_dict(json.loads((Path(folder) / CONFIG_NAME).read_text()))
        return UnifiedPatchProcessor(**kwargs)
    from transformers.models.gemma4_unified import Gemma4UnifiedImageProcessor

    if folder is not None:
        return Gemma4UnifiedImageProcessor.from_pretrained(str(folder))
    return Gemma4UnifiedImageProcessor(**kwargs)
