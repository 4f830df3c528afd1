"""Figures, shapes and tokens written the way people write them, for tables, plot labels and legends.

One place decides it, so the notebooks' tables, the record summary and the plots agree: `64` and
`64, 128` rather than `(64,)`, `2.6 ms` and `2,110 tok/s` rather than `2.6012` and `2110.3`, and a
token as its text (`Paris`, `<eos>`, `⟨E2 80⟩` for bytes that are not text on their own)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any

MAX_ITEMS = 24  # a longer list is cut, with its length said


def format_number(value: float | int) -> str:
    """A figure with thousands separated and no more digits than mean something: `2,110`, `681`,
    `16.8`, `2.6`, `0.123`, `3.1e-06`. Integers are written whole (`1536`: ids, sizes, counts)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if math.isnan(value) or math.isinf(value):
        return str(value)
    size = abs(value)
    if size >= 1000:
        return f"{value:,.0f}"
    if size >= 100:
        return f"{value:.0f}"
    if size >= 1:
        return f"{value:.1f}"
    if size == 0:
        return "0"
    if size >= 1e-3:
        return f"{value:.3g}"
    return f"{value:.2g}"


def with_unit(value: float | int | None, unit: str) -> str:
    """`2.6 ms`, `2,110 tok/s`; `—` when there is no figure."""
    if value is None:
        return "—"
    return f"{format_number(value)} {unit}".rstrip()


def format_value(value: Any) -> str:
    """Any table cell: None as `—`, a float by `format_number` (4 significant digits below 1,000),
    a tuple or list of scalars comma-separated (`64`, `64, 128`), a long one cut with its length."""
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 and math.isfinite(value) else f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        if not all(isinstance(v, (int, float, str, bool)) or v is None for v in value):
            return ", ".join(format_value(v) for v in value)
        shown = ", ".join(format_value(v) for v in value[:MAX_ITEMS])
        return shown if len(value) <= MAX_ITEMS else f"{shown} … ({len(value)} items)"
    return mark_undecodable(str(value))


NOT_TEXT = "⟨not text⟩"


def mark_undecodable(text: str) -> str:
    """Each run of U+FFFD (what a decoder prints for bytes that are not a whole character) as
    `⟨not text⟩`, so a model's byte-level nonsense does not look like a rendering bug."""
    return re.sub("\ufffd+", NOT_TEXT, text)


def format_shape(shape: Sequence[int]) -> str:
    """A tensor shape as `1×64×32` (a scalar-like `(1,)` as `1`)."""
    return "×".join(str(int(d)) for d in shape) or "scalar"


@cache
def _byte_of_char() -> dict[str, int]:
    """The inverse of byte-level BPE's byte → printable-character table (the GPT-2 mapping the
    Gemma-4 fixtures' tokenizer uses), so a piece like `âĢ` can be shown as its bytes `E2 80`."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _piece_bytes(piece: str) -> bytes | None:
    if piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:  # SentencePiece byte fallback
        return bytes([int(piece[3:5], 16)])
    table = _byte_of_char()
    if piece and all(c in table for c in piece):
        return bytes(table[c] for c in piece)
    return None


def token_label(tokenizer: Any, token_id: int) -> str:
    """One token as a reader can see it: its text (`Paris`, `capital`), a special token by name
    (`<eos>`, `<|turn>`), a newline as `\\n`, a lone space as `␣`, and a piece that is part of a
    multi-byte character (what a decoder prints as U+FFFD) as its bytes, `⟨E2 80⟩`."""
    if tokenizer is None:
        return str(token_id)
    text = tokenizer.decode([int(token_id)])
    if "\ufffd" in text:
        piece = tokenizer.convert_ids_to_tokens(int(token_id))
        raw = _piece_bytes(piece) if isinstance(piece, str) else None
        return f"⟨{raw.hex(' ').upper()}⟩" if raw else f"⟨id {int(token_id)}⟩"
    text = text.replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")
    if not text:
        return f"⟨id {int(token_id)}⟩"
    if not text.strip():
        return text.replace(" ", "␣")
    return text.strip()


def token_labels(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    return [token_label(tokenizer, i) for i in ids]


def readable_tokens(tokenizer: Any, ids: Sequence[int], sep: str = " · ") -> str:
    """Generated tokens one by one (`Athens · ⟨E2 80⟩ · Iran`): nonsense reads as nonsense, and
    bytes that are not text on their own are shown as bytes rather than as U+FFFD marks."""
    return sep.join(token_labels(tokenizer, ids))


HEADLINE_UNITS = {"prefill_ms": "ms", "decode_tok_s": "tok/s", "compile_s": "s"}


def headline(result: Mapping[str, Any], keys: Sequence[str]) -> dict[str, str]:
    """`keys` of a run record as display strings: checks as `yes`/`NO`, timings with their units
    (`2.6 ms`, `2,110 tok/s`), and a compile of 0 s said to come from the cache."""
    out: dict[str, str] = {}
    for key in keys:
        value = result.get(key)
        if key == "compile_s" and value is not None:
            hits = [bool(h) for h in result.get("cache_hits") or []]
            out[key] = (
                f"{with_unit(value, 's')} (all {len(hits)} graphs cached)"
                if hits and all(hits)
                else with_unit(value, "s")
            )
        elif key in HEADLINE_UNITS:
            out[key] = with_unit(value, HEADLINE_UNITS[key])
        elif isinstance(value, bool):
            out[key] = "yes" if value else "NO"
        else:
            out[key] = format_value(value)
    return out
