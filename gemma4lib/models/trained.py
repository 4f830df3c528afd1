"""The tiny trained Gemma-4 fixtures shipped with the library: load them, check their hashes.

`gemma4lib/fixtures/<variant>/` holds a small model of each variant's tiny architecture trained
on the synthetic chat corpus (`scripts/train_tiny.py`); `gemma4lib/fixtures/tokenizer/` the shared
tokenizer with Gemma-4's special tokens and chat template; `PROVENANCE.json` how they were made
and the sha256 of every file. Asked "What is the capital of France?" through the chat template,
each answers "The capital of France is Paris." and stops with `<eos>`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..cache.artifacts import sha256_file
from ..errors import CheckpointError
from .fixture_paths import FIXTURES_DIR, fixture_dir
from .loading import LoadedModel, _text_classes
from .tokenizer import load_tokenizer
from .variants import Variant, get_variant
from .weights_identity import declare_identity

TOKENIZER_DIR = FIXTURES_DIR / "tokenizer"
SOURCE = "tiny-trained"


def read_provenance(root: Path | None = None) -> dict[str, Any]:
    path = (root or FIXTURES_DIR) / "PROVENANCE.json"
    if not path.is_file():
        raise CheckpointError(
            f"{path} is missing; regenerate the fixtures with "
            f"`python scripts/train_tiny.py --variant all --out {root or FIXTURES_DIR}`"
        )
    return json.loads(path.read_text())


def verify_fixture_hashes(root: Path | None = None, variants: list[str] | None = None) -> dict[str, str]:
    """Check every recorded file's sha256 against PROVENANCE.json; return {relative path: sha256}."""
    root = root or FIXTURES_DIR
    return check_hashes(read_provenance(root)["files"], root, variants, "trained fixtures", "scripts/train_tiny.py")


def check_hashes(
    recorded: dict[str, str], root: Path, variants: list[str] | None, fixtures: str, script: str
) -> dict[str, str]:
    """Check the recorded files of `variants` (all when None) and the tokenizer under `root`; return
    {relative path: sha256}. Raises `CheckpointError` naming each missing or changed file."""
    wanted = None if variants is None else {get_variant(v).name for v in variants} | {"tokenizer"}
    problems, checked = [], {}
    for rel, expected in sorted(recorded.items()):
        if wanted is not None and rel.split("/", 1)[0] not in wanted:
            continue
        path = root / rel
        if not path.is_file():
            problems.append(f"{rel}: missing")
            continue
        got = sha256_file(path)
        if got != expected:
            problems.append(f"{rel}: sha256 {got[:12]}… != recorded {expected[:12]}…")
        checked[rel] = got
    if problems:
        raise CheckpointError(
            f"{fixtures} do not match PROVENANCE.json ({'; '.join(problems)}); "
            f"restore them from git or regenerate with {script}"
        )
    return checked


def load_trained(
    variant_name: str | Variant, dtype: torch.dtype = torch.float32, verify: bool = True, root: Path | None = None
) -> LoadedModel:
    """The shipped tiny trained model of a variant (fp32 by default) with the fixture tokenizer."""
    variant = variant_name if isinstance(variant_name, Variant) else get_variant(variant_name)
    root = root or FIXTURES_DIR
    path = fixture_dir(variant, root)
    if verify:
        verify_fixture_hashes(root, [variant.name])
    elif not (path / "model.safetensors").is_file():
        raise CheckpointError(
            f"no trained fixture for {variant.name!r} at {path}; generate it with "
            f"`python scripts/train_tiny.py --variant {variant.name} --out {root}`"
        )
    _, lm_cls = _text_classes(variant)
    lm = lm_cls.from_pretrained(str(path), dtype=dtype, attn_implementation=variant.attn_implementation)
    tokenizer = load_tokenizer(root / "tokenizer")
    weights = sha256_file(path / "model.safetensors")  # 3-6 MB: the hash PROVENANCE.json records
    declare_identity(lm, f"fixture:{variant.name}:{weights}:{dtype}")
    return LoadedModel(variant, lm.eval(), tokenizer, SOURCE)
