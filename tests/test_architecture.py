"""The library's shape, checked: no import cycles, nothing below `port` imports it, a small top level.

Imports inside functions count too: a lazy import hides a cycle from Python, not from a reader; so
do type-only imports (`if TYPE_CHECKING:`): a module that names another's types depends on it. So
does a package: importing `a.b.c` runs `a/__init__.py` and `a/b/__init__.py` first, so an import
also counts as an import of every package above the module (a package that imports its own
submodules, or resolves names lazily, is in the graph as what it is).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "gemma4lib"


def import_graph() -> dict[str, set[str]]:
    """module -> gemma4lib modules it imports (top level, inside functions, or for type names only)."""
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for candidate in [target] + [f"{target}.{alias.name}" for alias in node.names]:
                    if candidate in modules:
                        edges[name].update(_with_packages(candidate, modules))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in modules:
                        edges[name].update(_with_packages(alias.name, modules))
        edges[name].discard(name)
        # a module's own packages run before it: they are not its imports
        edges[name] -= {p for p in _with_packages(name, modules) if p != name}
    return {name: edges[name] for name in modules}


def _with_packages(module: str, modules: dict[str, Path]) -> set[str]:
    """`module` and every package above it that is a module of the library (`gemma4lib` itself aside)."""
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(2, len(parts) + 1) if ".".join(parts[:i]) in modules}


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


# The layers above `port`: they run ports (the command line, the fault lab, the benchmark suite,
# the notebook helpers). Everything else is below `port` and must not reach it.
ABOVE_PORT = (
    "gemma4lib.cli",
    "gemma4lib.export",
    "gemma4lab.tools.faults",
    "gemma4lab.benchmarks",
    "gemma4lab.notebook",
)


def above_port(module: str) -> bool:
    return any(module == top or module.startswith(top + ".") for top in ABOVE_PORT)


def test_nothing_below_port_imports_it():
    graph = import_graph()
    importers = sorted(name for name, targets in graph.items() if "gemma4lib.port" in targets)
    assert [name for name in importers if not above_port(name)] == []


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module `start` imports, directly or through others."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_port_reaches_no_layer_above_it():
    graph = import_graph()
    assert sorted(m for m in reachable(graph, "gemma4lib.port") if above_port(m)) == []
    assert "gemma4lib.timing" in reachable(graph, "gemma4lib.port")  # port times its runs below itself


def test_an_import_counts_its_packages():
    # importing gemma4lib.server.launch runs server/__init__.py first
    graph = import_graph()
    assert "gemma4lib.server" in graph["gemma4lib.cli"]
    assert "gemma4lib.device" in graph["gemma4lib.port"]


def test_the_top_level_is_a_short_table_of_contents():
    modules = sorted(p.stem for p in ROOT.glob("*.py") if p.stem not in ("__init__", "__main__"))
    assert len(modules) <= 12, modules


def test_hardware_facts_are_a_leaf():
    assert import_graph()["gemma4lib.inf2.hardware"] == set()


def test_a_variant_has_one_home():
    # the MoE member's name is written in the variants table; every list of variants derives from it
    repo = ROOT.parent
    code = [
        p
        for d in ("gemma4lib", "gemma4lab", "papermill_runs", "scripts")
        for p in (repo / d).rglob("*")
        if p.suffix in (".py", ".sh")
    ]
    naming = sorted(str(p.relative_to(repo)) for p in code if "26b-a4b" in p.read_text())
    assert naming == ["gemma4lib/models/variants.py"]


def test_settings_are_a_plain_value_that_loads_almost_nothing():
    """`import gemma4lib.settings` loads the leaves it checks values against (errors, the variants
    table, the backends' facts), not the backends, planners or SDK checks (`backends.preflight`)."""
    code = "import sys, gemma4lib.settings; print(sorted(m for m in sys.modules if m.startswith('gemma4lib')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT.parent)
    loaded = ast.literal_eval(out.stdout.strip())
    assert len(loaded) <= 10, loaded


def test_backend_facts_are_a_leaf():
    assert import_graph()["gemma4lib.backends.facts"] <= {"gemma4lib.errors", "gemma4lib.backends"}


# A backend's name compared as a string: `== "neuron"`, `"cpu" !=`, `in ("xla", ...)`. Backends are
# told apart by their facts rows (`gemma4lib/backends/facts.py`); only `gemma4lib/backends/` may
# name them in a comparison.
BACKEND_NAME = r"""["'](?:cpu|eager|xla|neuron|gloo)["']"""
COMPARED = re.compile(rf"(?:==|!=)\s*{BACKEND_NAME}|{BACKEND_NAME}\s*(?:==|!=)|\bin\s*[(\[{{][^)\]}}]*{BACKEND_NAME}")
NOT_A_BACKEND = re.compile(r"\bdevice(?:\.type)?\s*(?:==|!=)")  # a torch device's type, the roofline's "cpu"
OUTSIDE_BACKENDS = ("gemma4lib", "gemma4lab", "notebooks", "papermill_runs", "scripts")  # notebooks: parts and sources


def backend_name_comparisons(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if COMPARED.search(line) and not NOT_A_BACKEND.search(line)]


def test_the_backend_name_grep_sees_a_comparison():
    assert backend_name_comparisons('if settings.backend == "neuron":\nx = b in ("xla", "cpu")\nok = 1') == [
        'if settings.backend == "neuron":',
        'x = b in ("xla", "cpu")',
    ]
    assert backend_name_comparisons('t.device.type != "cpu"\nbackend="cpu"\nif on_inf2:') == []


def test_no_backend_name_is_compared_outside_the_backends():
    repo = ROOT.parent
    found = {
        str(path.relative_to(repo)): hits
        for folder in OUTSIDE_BACKENDS
        for path in sorted((repo / folder).rglob("*.py"))
        if not path.is_relative_to(ROOT / "backends")
        and (hits := backend_name_comparisons(path.read_text(encoding="utf-8")))
    }
    assert found == {}, f"compare the backend's facts row instead (gemma4lib/backends/facts.py): {found}"


# ---- one composition root ---------------------------------------------------------------------------

# Where the engine and its steps may be built: the backends (`backends.engine.engine_over`, the one
# function that puts an engine over compiled steps, and the backends' own `Steps`) and the runtime.
ENGINE_BUILDERS = (
    "gemma4lib/backends/",
    "gemma4lib/runtime.py",
)


def calls_to(names: set[str], *, skip: tuple[str, ...] = ()) -> list[str]:
    """`path:line` of every call of a function named in `names` (`Engine.for_model` by its dotted
    tail) in the library and the lab, outside the paths in `skip`."""
    repo = ROOT.parent
    found = []
    for top in ("gemma4lib", "gemma4lab"):
        for path in sorted((repo / top).rglob("*.py")):
            where = path.relative_to(repo).as_posix()
            if where.startswith(skip):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.Call):
                    continue
                func = node.func
                name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
                if isinstance(func, ast.Attribute) and isinstance(func.value, (ast.Name, ast.Attribute)):
                    owner = func.value.id if isinstance(func.value, ast.Name) else func.value.attr
                    name = f"{owner}.{func.attr}" if f"{owner}.{func.attr}" in names else name
                if name in names:
                    found.append(f"{where}:{node.lineno}")
    return found


def test_the_checker_sees_engine_constructions():
    found = calls_to({"Steps", "Engine", "Engine.for_model"})
    assert any(f.startswith("gemma4lib/backends/engine.py:") for f in found)
    assert any(f.startswith("gemma4lib/backends/neuron.py:") for f in found)


def test_only_the_backends_build_steps_and_the_engine():
    assert calls_to({"Steps", "Engine", "Engine.for_model"}, skip=ENGINE_BUILDERS) == []


def test_the_assistant_is_loaded_in_one_place():
    # `registry.compile_graphs` loads it with the graphs; every backend reads it from there. The gloo
    # backend's `rank_graphs` loads it only when a caller (the fault lab, the TP demo) builds the rank
    # graphs without a graph set; a port hands it the registry's.
    assert sorted({f.split(":")[0] for f in calls_to({"load_assistant"})}) == [
        "gemma4lib/backends/gloo.py",
        "gemma4lib/backends/registry.py",
    ]
