"""Copy the main job's executed notebooks into docs/notebooks/, for reading without running.

`bash scripts/run_smoke.sh` executes every notebook headless into runs/smoke/notebooks/; this script
takes the overview, the five variant notebooks, 06_serving and 07_serve from there, keeps their outputs (tables,
answers, plots), drops what renders as nothing outside a live Jupyter (widget state), shrinks the plots, and records in
each copy's metadata the digest of the source it was executed from (`source_digest`: the cells of
the notebook as committed, the parameters papermill injected left out). tests/test_notebooks.py
fails when a copy's digest no longer matches its committed notebook: rerun the main job, then this.

    bash scripts/run_smoke.sh && .venv/bin/python scripts/publish_notebooks.py   # --run runs/smoke
    .venv/bin/python scripts/publish_notebooks.py 07_serve     # only the named ones (e.g. after `--variant 07`)
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "notebooks"
VARIANT_NOTEBOOKS = ["01_e2b.ipynb", "02_e4b.ipynb", "03_12b.ipynb", "04_31b.ipynb", "05_26b_a4b.ipynb"]
# 00 too: the others link to its glossary and field-report appendix
NOTEBOOKS = ["00_overview.ipynb", *VARIANT_NOTEBOOKS, "06_serving.ipynb", "07_serve.ipynb"]
MAX_WIDTH = 640  # px: plots stay legible on GitHub and a copy stays small
WIDGET = "application/vnd.jupyter.widget-view+json"


def source_digest(nb) -> str:
    """sha256 over the cell types and sources, papermill's injected-parameters cell left out."""
    digest = hashlib.sha256()
    for cell in nb.cells:
        if "injected-parameters" in cell.get("metadata", {}).get("tags", []):
            continue
        digest.update(json.dumps([cell.cell_type, cell.source]).encode())
    return digest.hexdigest()


def shrink_png(data: str) -> str:
    """A PNG (base64) scaled down to MAX_WIDTH and re-encoded with a 64-colour palette."""
    from PIL import Image

    image = Image.open(io.BytesIO(base64.b64decode(data)))
    if image.width > MAX_WIDTH:
        image = image.resize((MAX_WIDTH, round(image.height * MAX_WIDTH / image.width)), Image.LANCZOS)
    out = io.BytesIO()
    image.convert("RGB").quantize(colors=64).save(out, format="PNG", optimize=True)
    return base64.b64encode(out.getvalue()).decode()


def _without_local_paths(output):
    """The output with this clone's absolute path written as `.` (a reader's copy names no machine)."""
    for key, value in list(output.get("data", {}).items()):
        if key.startswith("text/") and isinstance(value, str):
            output["data"][key] = value.replace(str(ROOT), ".")
    if isinstance(output.get("text"), str):
        output["text"] = output["text"].replace(str(ROOT), ".")
    return output


def reader_copy(executed_path: Path):
    nb = nbformat.read(str(executed_path), as_version=4)
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        kept = []
        for output in cell.outputs:
            data = output.get("data", {})
            if WIDGET in data:  # a progress bar: only a live front end draws it
                data.pop(WIDGET)
                if set(data) <= {"text/plain"}:
                    continue
            if "image/png" in data:
                data["image/png"] = shrink_png(data["image/png"])
            kept.append(_without_local_paths(output))
        cell.outputs = kept
        if "injected-parameters" in cell.metadata.get("tags", []):
            cell.source = cell.source.replace(str(ROOT), ".")
        cell.metadata.pop("papermill", None)
        cell.metadata.pop("execution", None)
    nb.metadata.pop("widgets", None)
    papermill = nb.metadata.pop("papermill", {})
    nb.metadata["gemma4lib"] = {
        "source": f"notebooks/{executed_path.name}",
        "source_sha256": source_digest(nb),
        "executed": papermill.get("end_time"),
        "parameters": {
            k: v.replace(str(ROOT), ".") if isinstance(v, str) else v
            for k, v in papermill.get("parameters", {}).items()
        },
        "written_by": "scripts/publish_notebooks.py from the main job's output (scripts/run_smoke.sh)",
    }
    return nb


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", default=str(ROOT / "runs" / "smoke"), help="the main job's --out folder")
    parser.add_argument("names", nargs="*", help="only these notebooks (e.g. 07_serve; default: all of them)")
    args = parser.parse_args(argv)
    executed = Path(args.run) / "notebooks"
    wanted = [n if n.endswith(".ipynb") else f"{n}.ipynb" for n in args.names] or NOTEBOOKS
    unknown = sorted(set(wanted) - set(NOTEBOOKS))
    if unknown:
        print(f"not published here: {unknown}; choose from {NOTEBOOKS}", file=sys.stderr)
        return 2
    missing = [name for name in wanted if not (executed / name).is_file()]
    if missing:
        print(f"no executed {missing} in {executed}: run bash scripts/run_smoke.sh first", file=sys.stderr)
        return 1
    DOCS.mkdir(parents=True, exist_ok=True)
    for name in wanted:
        nb = reader_copy(executed / name)
        committed = nbformat.read(str(ROOT / "notebooks" / name), as_version=4)
        if source_digest(committed) != nb.metadata["gemma4lib"]["source_sha256"]:
            print(f"{name}: executed from another source than notebooks/{name}; rerun the main job", file=sys.stderr)
            return 1
        nbformat.write(nb, str(DOCS / name))
        print(f"docs/notebooks/{name}: {(DOCS / name).stat().st_size / 1e3:.0f} kB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
