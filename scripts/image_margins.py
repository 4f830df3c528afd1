#!/usr/bin/env python
"""Per-image answer margins of a vision fixture's held-out images (train_vision's `held_out` set: fresh
shapes of seed + 1000, then the shipped samples), teacher-forced on the bf16 weights as they ship: how
close each answer is to flipping. Shows whether images a later stage loses were marginal to begin with
(docs/measurements/hearing_12b_unshipped_2026-12-06.json).

    python scripts/image_margins.py --variant 12b gemma4lib/fixtures/vision /tmp/a-trained-copy
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gemma4lab.training import vision as vision_training  # noqa: E402
from gemma4lab.training.audio import audio_tokenizer  # noqa: E402
from gemma4lab.training.shapes import ShapeImage, shape_images  # noqa: E402
from gemma4lab.training.text import reply_margins  # noqa: E402
from gemma4lib.images import load_image  # noqa: E402
from gemma4lib.models import vision  # noqa: E402
from gemma4lib.models.shapes import SAMPLES  # noqa: E402
from gemma4lib.models.trained import load_trained  # noqa: E402


def margins(root: Path, variant: str, seed: int) -> list[tuple[str, float]]:
    """(answer, margin) per held-out image, smallest first; a margin <= 0 is a wrong answer."""
    tokenizer = audio_tokenizer(load_trained(variant).tokenizer)
    fresh = shape_images(4, seed=seed + 1000)
    samples = [ShapeImage(load_image(vision.VISION_DIR / "images" / f"{c}_{s}.png"), c, s) for c, s in SAMPLES]
    examples = fresh + samples
    fixture = vision.load_vision_fixture(variant, root=root)
    model = fixture.multimodal.to(torch.bfloat16).to(torch.float32).eval()
    batch = vision_training.encode_examples(tokenizer, fixture.processor, examples)
    with torch.no_grad():
        logits = vision_training.logits_of(model, batch, torch.arange(len(examples))).float()
    worst = torch.nan_to_num(reply_margins(logits, batch["labels"]), nan=float("inf")).amin(-1)
    return sorted(((e.answer, round(float(m), 3)) for e, m in zip(examples, worst, strict=True)), key=lambda x: x[1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("roots", nargs="+", help="vision fixture folders (gemma4lib/fixtures/vision or a trained copy)")
    p.add_argument("--variant", default="12b")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--show", type=int, default=6, help="the smallest margins shown per folder")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    for root in args.roots:
        got = margins(Path(root), args.variant, args.seed)
        print(f"{root}: {sum(m <= 0 for _, m in got)} wrong of {len(got)}; smallest {got[: args.show]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
