"""Re-copy the library functions a notebook shows into its source, after the library changed.

A notebook cell marked `# library: <module>` holds copies of that module's functions (without
their docstrings and annotations, so the cell reads as a recipe); `tests/test_notebooks.py` fails
when a copy and the library differ. This script rewrites each copy from the library's current
source, keeping the comments inside the body, then re-syncs the `.ipynb` and formats the source:

    .venv/bin/python scripts/sync_notebook_copies.py            # every notebook
    .venv/bin/python scripts/sync_notebook_copies.py 01_e2b     # one
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
CELL = re.compile(r"^# %%.*$", re.M)
MARK = re.compile(r"^# library: ([\w.]+)\s*$", re.M)


def plain_copy(function) -> str:
    """The library function's source without docstring or annotations; body comments kept."""
    source = inspect.getsource(function)
    lines = source.splitlines()
    header = ast.parse(source).body[0]
    body = header.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    first = body[0].lineno  # read before the header is cut down to its signature below
    header.body, header.returns, header.decorator_list = [ast.Pass()], None, []
    for arg in [*header.args.posonlyargs, *header.args.args, *header.args.kwonlyargs]:
        arg.annotation = None
    for arg in (header.args.vararg, header.args.kwarg):
        if arg is not None:
            arg.annotation = None
    signature = ast.unparse(header).splitlines()[0]
    # comments just above the first statement that survives (after a removed docstring) stay too
    while first > 1 and lines[first - 2].strip().startswith("#"):
        first -= 1
    return "\n".join([signature, *lines[first - 1 :]])


def sync_cell(cell: str) -> str:
    mark = MARK.search(cell)
    if not mark:
        return cell
    module = importlib.import_module(mark.group(1))
    lines = cell.split("\n")
    functions = [n for n in ast.parse(cell).body if isinstance(n, ast.FunctionDef)]
    for node in sorted(functions, key=lambda n: n.lineno, reverse=True):
        fresh = plain_copy(getattr(module, node.name)).split("\n")
        lines[node.lineno - 1 : node.end_lineno] = fresh
    return "\n".join(lines)


def sync(path: Path) -> bool:
    text = path.read_text()
    starts = [m.start() for m in CELL.finditer(text)]
    pieces = [text[: starts[0]]] + [text[a:b] for a, b in zip(starts, [*starts[1:], len(text)], strict=True)]
    new = "".join(sync_cell(p) if MARK.search(p) else p for p in pieces)
    if new == text:
        return False
    path.write_text(new)
    subprocess.run([sys.executable, "-m", "ruff", "format", "--quiet", str(path)], check=True)
    if path.read_text() == text:  # the copy differed only in line wrapping, which the formatter restores
        return False
    subprocess.run([sys.executable, "-m", "jupytext", "--update", "--to", "ipynb", "--quiet", str(path)], check=True)
    return True


def main(names: list[str]) -> int:
    paths = [NOTEBOOKS / f"{n}.py" for n in names] if names else sorted(NOTEBOOKS.glob("[0-9][0-9]_*.py"))
    for path in paths:
        print(f"{path.name}: {'re-copied' if sync(path) else 'already equal'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
