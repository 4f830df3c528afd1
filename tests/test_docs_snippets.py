"""The Python snippets in docs/*.md import what exists, and the standalone ones run as written.

README's snippets are run by tests/test_readme.py. Here every ```python block of docs/*.md has its
`gemma4lib` imports resolved (a module moved or a name dropped fails here, as issue 34 found in
docs/ROOFLINE.md), and every block runs, in a fresh namespace in a temporary folder, unless the
line before it is an HTML comment `<!-- not run alone: why -->` (a notebook's lines, a minutes-long
compile that another test runs, a reader's own settings).
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"(?:^(<!-- not run alone:[^\n]*-->)\n)?^```python\n(.*?)^```", re.S | re.M)
SNIPPETS = [
    (path, index, code, bool(marker))
    for path in sorted((ROOT / "docs").glob("*.md"))
    for index, (marker, code) in enumerate(BLOCK.findall(path.read_text()))
]


def _id(snippet) -> str:
    path, index, _, alone = snippet
    return f"{path.name}[{index}]{'' if not alone else '-not-run'}"


def test_the_docs_have_snippets():
    assert any(path.name == "ROOFLINE.md" and not marked for path, _, _, marked in SNIPPETS)


@pytest.mark.parametrize("snippet", SNIPPETS, ids=_id)
def test_docs_snippet_imports_resolve(snippet):
    path, index, code, _ = snippet
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gemma4lib"):
            module = importlib.import_module(node.module)
            missing = [
                a.name for a in node.names if not hasattr(module, a.name) and not _submodule(node.module, a.name)
            ]
            assert not missing, f"{path.name} snippet {index}: {node.module} has no {missing}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("gemma4lib"):
                    importlib.import_module(alias.name)


def _submodule(package: str, name: str) -> bool:
    try:
        importlib.import_module(f"{package}.{name}")
    except ModuleNotFoundError:
        return False
    return True


@pytest.mark.parametrize("snippet", [s for s in SNIPPETS if not s[3]], ids=_id)
def test_docs_snippet_runs(snippet, tmp_path, monkeypatch):
    path, index, code, _ = snippet
    monkeypatch.chdir(tmp_path)
    exec(compile(code, f"{path.name} snippet {index}", "exec"), {})
