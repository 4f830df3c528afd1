"""Hash what transformers' own `Gemma4UnifiedImageProcessor` makes of the fixture images, for the
test that holds the torchvision-free `gemma4lib.models.unified_patches` to it.

Runs in a venv with torchvision (transformers 5.23.0's processor has no other backend), which the
project's CPU venv cannot have (docs/IMAGES.md). Needs only transformers, torch, torchvision and
Pillow, not gemma4lib. On x86-64 here:

    python3 -m venv /tmp/tvenv
    /tmp/tvenv/bin/pip install torch==2.14.1 torchvision==0.29.1 transformers==5.23.0 pillow
    /tmp/tvenv/bin/python scripts/unified_processor_golden.py

writes `gemma4lib/fixtures/vision/12b/processor_golden.json`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
IMAGES = ROOT / "gemma4lib" / "fixtures" / "vision" / "images"
OUT = ROOT / "gemma4lib" / "fixtures" / "vision" / "12b" / "processor_golden.json"
# the fixture's processor settings (gemma4lib/models/vision.py `image_processor`)
SETTINGS = {"patch_size": 4, "pooling_kernel_size": 2, "max_soft_tokens": 70, "do_resize": False}


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().numpy().tobytes()).hexdigest()


def wide(a: Image.Image, b: Image.Image) -> Image.Image:
    """Two 32x32 samples side by side (64x32): a non-square grid, so x and y cannot be swapped unseen."""
    out = Image.new("RGB", (a.width + b.width, a.height))
    out.paste(a, (0, 0))
    out.paste(b, (a.width, 0))
    return out


def main() -> None:
    import torchvision
    import transformers
    from transformers.models.gemma4_unified import Gemma4UnifiedImageProcessor

    processor = Gemma4UnifiedImageProcessor(**SETTINGS)
    samples = {p.name: Image.open(p).convert("RGB") for p in sorted(IMAGES.glob("*.png"))}
    cases = dict(samples)
    cases["red_circle+blue_square (64x32)"] = wide(samples["red_circle.png"], samples["blue_square.png"])
    golden = {}
    for name, image in cases.items():
        data = processor(images=[image], return_tensors="pt")
        golden[name] = {
            "size": list(image.size),
            "pixel_values_sha256": digest(data["pixel_values"].to(torch.float32)),
            "image_position_ids_sha256": digest(data["image_position_ids"].to(torch.int64)),
            "num_soft_tokens": [int(n) for n in data["num_soft_tokens_per_image"]],
            "shape": list(data["pixel_values"].shape),
        }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "made_by": "scripts/unified_processor_golden.py",
        "processor": "transformers.models.gemma4_unified.Gemma4UnifiedImageProcessor",
        "settings": SETTINGS,
        "versions": {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "torchvision": torchvision.__version__,
        },
        "cases": golden,
    }
    OUT.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {OUT} ({len(golden)} images)")


if __name__ == "__main__":
    main()
