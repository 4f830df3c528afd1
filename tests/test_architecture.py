"""The library's shape, checked: no import cycles, and nothing below `port` imports it.

Imports inside functions count too: a lazy import hides a cycle from Python, not from a reader.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "gemma4lib"


def import_graph() -> dict[str, set[str]]:
    """module -> gemma4lib modules it imports (top level or inside functions; TYPE_CHECKING excluded)."""
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text())
        skipped = {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)
        }
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for candidate in [target] + [f"{target}.{alias.name}" for alias in node.names]:
                    if candidate in modules and candidate != name:
                        edges[name].add(candidate)
            elif isinstance(node, ast.Import):
                edges[name].update(a.name for a in node.names if a.name in modules and a.name != name)
    return {name: edges[name] for name in modules}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_checker_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_gemma4lib_has_no_import_cycles():
    assert cycles(import_graph()) == []


def test_nothing_below_port_imports_it():
    graph = import_graph()
    importers = sorted(name for name, targets in graph.items() if "gemma4lib.port" in targets)
    allowed = {
        "gemma4lib.cli",
        "gemma4lib.tools.faults",
        "gemma4lib.benchmarks.suite",
        "gemma4lib.notebook.chat",
        "gemma4lib.notebook.experiments",
        "gemma4lib.notebook.records",
    }
    assert set(importers) <= allowed, importers


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module `start` imports, directly or through others."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_benchmark_timing_sits_below_port():
    # `port` times its runs with `benchmarks.timing`; only the suite compares against `port`
    graph = import_graph()
    for module in ("gemma4lib.timing", "gemma4lib.benchmarks.hf", "gemma4lib.benchmarks.report"):
        assert "gemma4lib.port" not in reachable(graph, module), module
    assert "gemma4lib.port" in reachable(graph, "gemma4lib.benchmarks.suite")


def test_hardware_facts_are_a_leaf():
    assert import_graph()["gemma4lib.inf2.hardware"] == set()
