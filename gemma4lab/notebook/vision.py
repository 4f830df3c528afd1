"""What a notebook section "What the model sees" calls: the image, its patches, where its soft
tokens land in the prompt, and the prefill attention mask over them. Every plot returns a
matplotlib `Figure` (no pyplot, as `plots.py`); the tables are lists of dicts.

The data comes from the port's own objects (`images.MediaInputs`, the model's configs) and, for the
mask, from transformers' own mask functions (what the reference runs), so the pictures show what
runs, not a drawing of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from matplotlib.figure import Figure

from gemma4lab.notebook.display import Table
from gemma4lab.notebook.formatting import mark_undecodable
from gemma4lab.notebook.records import report_checks


def show_image(image: Any, title: str | None = None) -> Figure:
    """The image as the model gets it (a path or a PIL image)."""
    from gemma4lib.images import load_image

    picture = load_image(image)
    fig = Figure(figsize=(2.5, 2.5))
    ax = fig.add_subplot()
    ax.imshow(picture, interpolation="nearest")
    ax.set_axis_off()
    ax.set_title(title or f"{picture.width} x {picture.height} pixels", fontsize=9)
    return fig


def patch_picture(image: Any, patch_size: int, pooling: int) -> Figure:
    """The image cut into the vision tower's patches (thin lines) and the pooled soft-token cells
    (thick lines, one soft token each): pixels -> patches -> soft tokens."""
    from gemma4lib.images import load_image

    picture = load_image(image)
    fig = Figure(figsize=(3, 3))
    ax = fig.add_subplot()
    ax.imshow(picture, interpolation="nearest")
    for step, width in ((patch_size, 0.4), (patch_size * pooling, 1.6)):
        for x in range(0, picture.width + 1, step):
            ax.axvline(x - 0.5, color="white", linewidth=width)
        for y in range(0, picture.height + 1, step):
            ax.axhline(y - 0.5, color="white", linewidth=width)
    patches = (picture.width // patch_size) * (picture.height // patch_size)
    ax.set_title(f"{patches} patches of {patch_size}x{patch_size} -> {patches // pooling**2} soft tokens", fontsize=9)
    ax.set_axis_off()
    return fig


def prompt_layout(ids: Sequence[int], positions: Sequence[int], tokenizer: Any = None) -> list[dict[str, Any]]:
    """The prompt as runs of text and soft tokens: one dict per run with its first and last
    position, how many tokens, and its kind ("text", or "soft tokens" where the image's embeddings
    replace the token's), plus the text of a text run when a tokenizer is given."""
    marked = set(int(p) for p in positions)
    runs: list[dict[str, Any]] = []
    for i, token in enumerate(ids):
        kind = "soft tokens" if i in marked else "text"
        if runs and runs[-1]["kind"] == kind:
            runs[-1]["last"] = i
            runs[-1]["tokens"] += 1
            runs[-1]["ids"].append(int(token))
        else:
            runs.append({"kind": kind, "first": i, "last": i, "tokens": 1, "ids": [int(token)]})
    for run in runs:
        ids_of = run.pop("ids")
        if tokenizer is not None and run["kind"] == "text":
            run["text"] = tokenizer.decode(ids_of)
    return runs


def layout_table(ids: Sequence[int], positions: Sequence[int], tokenizer: Any = None) -> Table:
    """`prompt_layout` as a table: one line per run of text or soft tokens, with its positions."""
    runs = prompt_layout(ids, positions, tokenizer)
    rows = [
        [run["kind"], f"{run['first']}..{run['last']}", run["tokens"], _one_line(run.get("text", ""))] for run in runs
    ]
    return Table(["kind", "positions", "tokens", "text"], rows, "The prompt the prefill sees")


def _one_line(text: str) -> str:
    """A run's text on one table line: newlines written as `\\n`, undecodable bytes marked."""
    return mark_undecodable(text).replace("\n", "\\n")


def image_demo(settings: Any, inputs: Any, report: Any, compiled: Any) -> dict[str, Any]:
    """What the run record keeps of the notebook's image section: the image, where its soft tokens
    sat, the vision graph's input, the three checks and the compile time of the graphs it used."""
    from gemma4lib.images import SAMPLES_DIR

    image = settings.images[0]
    shipped = isinstance(image, (str, Path)) and Path(image).resolve().parent == SAMPLES_DIR
    return {
        "image": Path(image).name if shipped else str(image),  # a shipped sample by name: no machine path
        "soft_tokens": list(inputs.prompt.counts),
        "positions": [inputs.prompt.positions[0], inputs.prompt.positions[-1]],
        "prompt_tokens": len(inputs.ids),
        "vision_input": list(inputs.pixel_values.shape[1:]),
        **report_checks(report),
        "compile_s": compiled.compile_s,
        "cache_hits": list(compiled.cache_hits),
    }


def reference_masks(multimodal: Any, ids: Sequence[int], positions: Sequence[int]) -> dict[str, torch.Tensor]:
    """transformers' own prefill masks for this prompt `{layer type: bool [tokens, tokens]}` (True:
    may attend): `create_masks_for_generate` of the model's class, given the image's
    `mm_token_type_ids`, so a config with `use_bidirectional_attention="vision"` shows the image's
    tokens seeing each other both ways on the sliding layers, and every other config the causal mask."""
    n = len(ids)
    embeds = torch.zeros(1, n, multimodal.config.get_text_config().hidden_size)
    types = torch.zeros(1, n, dtype=torch.long)
    types[0, list(positions)] = 1
    masks = multimodal.create_masks_for_generate(
        config=multimodal.config,
        inputs_embeds=embeds,
        attention_mask=torch.ones(1, n, dtype=torch.long),
        past_key_values=None,
        position_ids=torch.arange(n)[None],
        mm_token_type_ids=types,
    )
    out = {}
    for layer_type, mask in masks.items():
        if mask is None:  # sdpa/flash without padding: plain causal
            mask = torch.ones(n, n).tril().bool()
        elif mask.dtype != torch.bool:
            mask = mask[0, 0] == 0
        else:
            mask = mask[0, 0]
        out[layer_type] = mask
    return out


def mask_picture(masks: dict[str, torch.Tensor], positions: Sequence[int]) -> Figure:
    """Each layer type's prefill mask as a picture (dark: may attend), the image's rows and columns
    outlined."""
    fig = Figure(figsize=(3.2 * len(masks), 3.2))
    first, last = (min(positions), max(positions)) if positions else (None, None)
    for i, (layer_type, mask) in enumerate(sorted(masks.items())):
        ax = fig.add_subplot(1, len(masks), i + 1)
        ax.imshow(mask.float().numpy(), cmap="Greys", vmin=0, vmax=1, interpolation="nearest")
        if first is not None:
            from matplotlib.patches import Rectangle

            size = last - first + 1
            ax.add_patch(Rectangle((first - 0.5, first - 0.5), size, size, fill=False, edgecolor="#ef6c00", lw=1.5))
        ax.set_title(layer_type.replace("_", " "), fontsize=9)
        ax.set_xlabel("key position", fontsize=8)
        ax.set_ylabel("query position", fontsize=8)
    return fig


__all__ = [
    "image_demo",
    "layout_table",
    "mask_picture",
    "patch_picture",
    "prompt_layout",
    "reference_masks",
    "show_image",
]
