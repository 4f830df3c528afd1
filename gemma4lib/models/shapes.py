"""What the tiny vision fixtures are shown: one coloured shape on a plain background (drawn by
`gemma4lab.training.shapes`), and how an answer about it is judged.

The label is the answer the trained fixtures give to "What is in the image?" ("A red circle."):
the colour and the shape are the two things the model must read from the pixels, so a coherent
answer means the model looked.
"""

from __future__ import annotations

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "blue": (30, 60, 220),
    "green": (30, 170, 50),
    "yellow": (235, 215, 30),
}
SHAPES = ("circle", "square", "triangle")
QUESTION = "What is in the image?"
# The sample images shipped in fixtures/vision/images/ (`gemma4lab.training.shapes.write_samples`):
# held out from training (their own seed), what `port --image` and the tests show the model.
SAMPLES = (("red", "circle"), ("blue", "square"), ("green", "triangle"), ("yellow", "circle"))


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
