"""docs/notebooks/: each variant notebook, 06_serving and 07_serve as the main job executed it
(scripts/publish_notebooks.py), with the digest of the source it ran from, which must match the committed notebook."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = ROOT / "notebooks"
VARIANT_NOTEBOOKS = sorted(p for p in NOTEBOOK_DIR.glob("0[1-9]_*.ipynb"))


def load(path: Path):
    return nbformat.read(str(path), as_version=4)


def _publisher():
    spec = importlib.util.spec_from_file_location("publish_notebooks", ROOT / "scripts" / "publish_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", VARIANT_NOTEBOOKS, ids=lambda p: p.name)
def test_docs_hold_an_executed_copy_from_the_committed_source(path):
    """docs/notebooks/ holds each variant notebook as the main job executed it (scripts/publish_notebooks.py),
    with the digest of the source it ran from; a changed notebook makes its copy stale here."""
    publisher = _publisher()
    copy_path = ROOT / "docs" / "notebooks" / path.name
    assert copy_path.is_file(), f"no {copy_path.relative_to(ROOT)}; run scripts/run_smoke.sh, then publish_notebooks.py"
    copy = load(copy_path)
    meta = copy.metadata["gemma4lib"]
    fix = "rerun bash scripts/run_smoke.sh, then .venv/bin/python scripts/publish_notebooks.py"
    assert meta["source_sha256"] == publisher.source_digest(load(path)), f"{copy_path.name} is stale; {fix}"
    assert publisher.source_digest(copy) == meta["source_sha256"], f"{copy_path.name} was edited after publishing"
    code = [c for c in copy.cells if c.cell_type == "code"]
    assert all(c.execution_count for c in code), f"{copy_path.name} has cells that did not run"
    images = sum("image/png" in (o.get("data") or {}) for c in code for o in c.outputs)
    # 06: tok/s against B, drafts per verify step; 07: latency and throughput against clients (one figure);
    # a variant: its timed runs and decode against the ceilings (the token grid only where a token differs,
    # which in a passing run it does not)
    wanted = {"07_serve.ipynb": 1}.get(path.name, 2)
    assert images >= wanted, f"{copy_path.name} shows {images} plots; the plots section draws {wanted}"
    printed = "".join(o.get("text", "") for c in code for o in c.outputs)
    passed = "SEQ_MATCH True  LOGITS_MATCH True  coherent True"
    passed = "failed checks: none" if path.name == "07_serve.ipynb" else passed
    assert passed in printed, f"{copy_path.name}: a check failed there"
    assert copy_path.stat().st_size < 1_000_000, f"{copy_path.name} is {copy_path.stat().st_size} bytes; shrink it"
    stderr = [c.source.splitlines()[0] for c in code for o in c.outputs if o.get("name") == "stderr"]
    assert not stderr, (
        f"{copy_path.name}: cells wrote to stderr (a warning a reader sees; fix it at its source): {stderr}"
    )
    for cell in code:  # an inf2 cell on the CPU says it was skipped, and shows nothing the CPU ran
        if cell.source.startswith('if backend == "neuron"'):
            shown = [o.get("text", "") if o.get("name") == "stdout" else o.output_type for o in cell.outputs]
            assert shown == ["skipped: backend=cpu\n"], f"{copy_path.name}: an inf2 cell printed {shown}"
    # the status box, filled in with this run's figures by the record cell (variant notebooks only)
    if path.name not in ("06_serving.ipynb", "07_serve.ipynb"):
        box = "".join((o.get("data") or {}).get("text/markdown", "") for o in code[0].outputs)
        assert "**Ran here** (this run, measured on this CPU" in box, (
            f"{copy_path.name}: the status box was not filled in"
        )
