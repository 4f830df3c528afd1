"""Synthetic images for the tiny vision fixtures: one coloured shape on a plain background.

Deterministic by construction (a seeded `random.Random`, PIL drawing, no anti-aliasing), so the
same seed gives byte-identical images on every machine. The colours, shapes, question and the
pixel reader (`describe`) the library checks answers with are `gemma4lib.models.shapes`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from gemma4lib.models.shapes import COLOURS, SAMPLES, SHAPES

BACKGROUNDS: tuple[tuple[int, int, int], ...] = ((255, 255, 255), (0, 0, 0), (128, 128, 128))
IMAGE_SIZE = 32  # the tiny fixtures' processors take 32x32 images as they are (do_resize false): 16 soft tokens


@dataclass(frozen=True)
class ShapeImage:
    """One synthetic image and what it shows."""

    image: object  # PIL.Image.Image (typed loosely: PIL is imported lazily)
    colour: str
    shape: str

    @property
    def answer(self) -> str:
        return f"A {self.colour} {self.shape}."


def draw(colour: str, shape: str, rng: random.Random, size: int = IMAGE_SIZE):
    """A `size` x `size` RGB image of one shape, its size, place and background drawn from `rng`."""
    from PIL import Image, ImageDraw

    background = BACKGROUNDS[rng.randrange(len(BACKGROUNDS))]
    image = Image.new("RGB", (size, size), background)
    pen = ImageDraw.Draw(image)
    extent = rng.randint(size * 6 // 10, size * 85 // 100)
    x0 = rng.randint(1, size - extent - 1)
    y0 = rng.randint(1, size - extent - 1)
    box = (x0, y0, x0 + extent, y0 + extent)
    fill = COLOURS[colour]
    if shape == "circle":
        pen.ellipse(box, fill=fill)
    elif shape == "square":
        pen.rectangle(box, fill=fill)
    elif shape == "triangle":
        pen.polygon([(x0 + extent // 2, y0), (x0, y0 + extent), (x0 + extent, y0 + extent)], fill=fill)
    else:
        raise ValueError(f"unknown shape {shape!r}; one of {SHAPES}")
    return image


def shape_images(per_class: int, seed: int = 0) -> list[ShapeImage]:
    """`per_class` images of every (colour, shape), in a fixed order, from one seeded generator."""
    rng = random.Random(seed)
    out = []
    for _ in range(per_class):
        for colour in COLOURS:
            for shape in SHAPES:
                out.append(ShapeImage(draw(colour, shape, rng), colour, shape))
    return out


SAMPLE_SEED = 4242


def write_samples(folder) -> list:
    """Write the sample images as PNG (`<colour>_<shape>.png`); their paths."""
    from pathlib import Path

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(SAMPLE_SEED)
    paths = []
    for colour, shape in SAMPLES:
        path = folder / f"{colour}_{shape}.png"
        draw(colour, shape, rng).save(path, format="PNG", optimize=False)
        paths.append(path)
    return paths
