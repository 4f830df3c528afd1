"""docs/notebooks/: the overview, each variant notebook, 06_serving and 07_serve as the main job executed it
(scripts/publish_notebooks.py), with the digest of the source it ran from, which must match the committed notebook;
and every link between the copies lands on a copy (the glossary and the field report live in 00)."""

from __future__ import annotations

import importlib.util
import re
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
        if cell.source.startswith(("if on_inf2", 'if backend == "neuron"')):  # the guard, before and after facts
            shown = [o.get("text", "") if o.get("name") == "stdout" else o.output_type for o in cell.outputs]
            assert shown == ["skipped: backend=cpu\n"], f"{copy_path.name}: an inf2 cell printed {shown}"
    # the status box, filled in with this run's figures by the record cell (variant notebooks only)
    if path.name not in ("06_serving.ipynb", "07_serve.ipynb"):
        box = "".join((o.get("data") or {}).get("text/markdown", "") for o in code[0].outputs)
        assert "**Ran here** (this run, measured on this CPU" in box, (
            f"{copy_path.name}: the status box was not filled in"
        )


LINK = re.compile(r"\]\((0\d_[a-z0-9_]+\.ipynb)(#[^)\s]*)?\)")


def test_the_overview_copy_is_from_its_source_and_every_link_between_copies_lands():
    """00_overview holds the glossary and the field-report appendix the other notebooks link to: a
    reader of docs/notebooks/ must find it there, current, with the anchors the links name."""
    publisher = _publisher()
    overview = ROOT / "docs" / "notebooks" / "00_overview.ipynb"
    assert overview.is_file(), "no docs/notebooks/00_overview.ipynb; run scripts/run_smoke.sh, then publish it"
    copy = load(overview)
    assert copy.metadata["gemma4lib"]["source_sha256"] == publisher.source_digest(load(NOTEBOOK_DIR / overview.name))
    copies = {p.name: load(p) for p in sorted((ROOT / "docs" / "notebooks").glob("0*.ipynb"))}
    dead = []
    for name, nb in copies.items():
        for cell in nb.cells:
            if cell.cell_type != "markdown":
                continue
            for target, anchor in LINK.findall(cell.source):
                if target not in copies:
                    dead.append(f"{name} -> {target}")
                elif anchor and not _has_anchor(copies[target], anchor[1:]):
                    dead.append(f"{name} -> {target}{anchor}")
    assert not dead, f"links that land nowhere: {sorted(set(dead))}"


def _has_anchor(nb, anchor: str) -> bool:
    """An explicit `<a id=...>` / `<a name=...>` or a heading whose GitHub-style slug is the anchor."""
    for cell in nb.cells:
        if cell.cell_type != "markdown":
            continue
        if re.search(rf"<a\s+(?:id|name)=[\"']{re.escape(anchor)}[\"']", cell.source):
            return True
        for heading in re.findall(r"^#+\s+(.*)$", cell.source, re.M):
            slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
            if slug == anchor:
                return True
    return False
