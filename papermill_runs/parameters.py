"""The parameters a notebook declares, and `-p` values checked against them before it runs.

Papermill injects any name it is given: a misspelt `-p max_new_token=16` became a variable no cell
reads (the run silently used the default), and `-p prefill_buckets=64` reached cell 6 as an int
(`TypeError: 'int' object is not iterable`). So before a notebook runs:

- every `-p` name must be declared by the `parameters` cell of at least one selected notebook,
  else the run stops and names the closest declared name;
- a scalar given for a parameter whose default is a list (or tuple) is taken as a one-element list
  (`-p prefill_buckets=64` means `[64]`, as `PortSettings(prefill_buckets=64)` already does), and
  a note says so.

The `parameters` cell is read with `ast` (top-level assignments), not papermill's line parser,
which skips a line whose comment holds quotes (and with it the parameter).
"""

from __future__ import annotations

import ast
import difflib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

_UNKNOWN = object()  # a default that is not a literal (an expression): its type is unknown


def declared_parameters(notebook: Path) -> dict[str, Any]:
    """name -> default value (a literal; `_UNKNOWN` otherwise) of the notebook's `parameters` cell."""
    cells = json.loads(Path(notebook).read_text(encoding="utf-8")).get("cells", [])
    for cell in cells:
        if cell.get("cell_type") == "code" and "parameters" in (cell.get("metadata", {}).get("tags") or []):
            source = cell.get("source", "")
            tree = ast.parse("".join(source) if isinstance(source, list) else source)
            out: dict[str, Any] = {}
            for node in tree.body:
                targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
                value = getattr(node, "value", None)
                for target in targets:
                    if isinstance(target, ast.Name):
                        try:
                            out[target.id] = ast.literal_eval(value) if value is not None else None
                        except ValueError:
                            out[target.id] = _UNKNOWN
            return out
    return {}


def is_list_default(value: Any) -> bool:
    return isinstance(value, (list, tuple))


def check_overrides(overrides: dict[str, Any], notebooks: Iterable[Path]) -> tuple[dict[str, Any], list[str]]:
    """(`overrides` with scalars for list parameters wrapped, notes) or `SystemExit` naming an
    unknown name and the closest declared one."""
    declared: dict[str, Any] = {}
    for notebook in notebooks:
        for name, default in declared_parameters(notebook).items():
            declared.setdefault(name, default)
    out, notes = {}, []
    for name, value in overrides.items():
        if name not in declared:
            close = difflib.get_close_matches(name, list(declared), n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise SystemExit(
                f"error: -p {name}=...: no selected notebook declares a parameter {name!r}; {hint}"
                f"the parameters are: {', '.join(sorted(declared))}"
            )
        out[name], note = coerce(name, value, declared[name])
        if note:
            notes.append(note)
    return out, notes


def coerce(name: str, value: Any, default: Any) -> tuple[Any, str | None]:
    """A scalar for a list-valued parameter as a one-element list (with a note saying so)."""
    if is_list_default(default) and not isinstance(value, (list, tuple)) and value is not None:
        return [value], f"{name}={value!r} taken as the one-element list [{value!r}] (its default is {default!r})"
    return value, None


__all__ = ["check_overrides", "coerce", "declared_parameters"]
