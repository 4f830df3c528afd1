"""Synthetic images for the tiny vision fixtures: one coloured shape on a plain background.

Deterministic by construction (a seeded `random.Random`, PIL drawing, no anti-aliasing), so the
same seed gives byte-identical images on every machine. The label is the answer the trained
fixtures give to "What is in the image?" ("A red circle."): the colour and the shape are the two
things the model must read from the pixels, so a coherent answer means the model looked.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "blue": (30, 60, 220),
    "green": (30, 170, 50),
    "yellow": (235, 215, 30),
}
SHAPES = ("circle", "square", "triangle")
BACKGROUNDS: tuple[tuple[int, int, int], ...] = ((255, 255, 255), (0, 0, 0), (128, 128, 128))
IMAGE_SIZE = 32  # the tiny fixtures' processors take 32x32 images as they are (do_resize false): 16 soft tokens
QUESTION = "What is in the image?"


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


# The sample images shipped in fixtures/vision/images/ (`write_samples`): held out from training
# (their own seed), what `port --image` and the tests show the model.
SAMPLES = (("red", "circle"), ("blue", "square"), ("green", "triangle"), ("yellow", "circle"))
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


def describe(image) -> tuple[str, str]:
    """The colour and shape an image shows, read from its pixels without any model: the background
    is the corners' colour, the shape's colour the nearest named colour to its pixels' mean, and its
    kind the share of its bounding box it fills (square ~1, circle ~pi/4, triangle ~1/2). What the
    port's coherence check compares a model's answer with, so "coherent" means "names what is there"."""
    import numpy as np

    pixels = np.asarray(image.convert("RGB"), dtype=np.int32)
    corners = np.stack([pixels[0, 0], pixels[0, -1], pixels[-1, 0], pixels[-1, -1]])
    background = np.median(corners, axis=0)
    foreground = np.abs(pixels - background).sum(-1) > 60
    if not foreground.any():
        raise ValueError("the image shows no shape on a plain background")
    mean = pixels[foreground].mean(0)
    colour = min(COLOURS, key=lambda c: float(((np.array(COLOURS[c]) - mean) ** 2).sum()))
    rows, cols = np.nonzero(foreground)
    box = (rows.max() - rows.min() + 1) * (cols.max() - cols.min() + 1)
    fill = foreground.sum() / box
    shape = "square" if fill > 0.92 else "circle" if fill > 0.66 else "triangle"
    return colour, shape


def parse_answer(text: str) -> tuple[str | None, str | None]:
    """The colour and shape an answer names (None where it names none)."""
    words = text.lower().replace(".", " ").split()
    colour = next((w for w in words if w in COLOURS), None)
    shape = next((w for w in words if w in SHAPES), None)
    return colour, shape
