"""Where the shipped tiny trained fixtures live, and whether one is there: paths only, so that
`settings` can resolve `model="auto"` without loading torch or a model (`trained` loads them)."""

from __future__ import annotations

from pathlib import Path

from .variants import Variant, get_variant

FIXTURES_DIR = Path(__file__).resolve().parent.parent / "fixtures"


def fixture_dir(variant: Variant | str, root: Path | None = None) -> Path:
    v = variant if isinstance(variant, Variant) else get_variant(variant)
    return (root or FIXTURES_DIR) / v.name


def fixture_available(variant_name: str | Variant, root: Path | None = None) -> bool:
    """Whether a trained fixture (weights and tokenizer) is present for the variant."""
    root = root or FIXTURES_DIR
    try:
        path = fixture_dir(variant_name, root)
    except Exception:
        return False
    return (path / "model.safetensors").is_file() and (root / "tokenizer" / "tokenizer.json").is_file()
