"""The committed notebooks: each the copy of its jupytext source (notebooks/NN_name.py), outputs
stripped, one plain `parameters` cell, one kernelspec, the shared skeleton, the recipe's real calls in
the cells (copies of library functions equal to the library's), nothing that installs, prompts or
leaks; listed in the README; and, in the slow test, every one of them executed headless in the smoke
profile with both checks true."""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from gemma4lib.models.variants import VARIANTS
from papermill_runs import run as pm_run

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
EXPECTED = sorted([pm_run.OVERVIEW[1], *(v.notebook for v in VARIANTS.values())])  # one per variant
KERNELSPEC = {"name": "python3", "display_name": "Python 3", "language": "python"}
VARIANT_PARAMETERS = {
    "variant",
    "profile",
    "checkpoint",
    "backend",
    "tp_degree",
    "prompt",
    "expect",
    "max_new_tokens",
    "context_length",
    "prefill_buckets",
    "warmup",
    "iters",
    "results_path",
    "interactive",
}
OVERVIEW_PARAMETERS = {"profile", "results_dir", "results_path"}
FORBIDDEN = [
    (re.compile(r"^\s*[!%]\s*(pip|conda|uv)\b", re.M), "installs packages from a cell"),
    (re.compile(r"\binput\s*\("), "waits for keyboard input"),
    (re.compile(r"\bgetpass\b"), "asks for a secret"),
    (re.compile(r"\bhf_[A-Za-z0-9]{20,}"), "contains what looks like a Hugging Face token"),
    (re.compile(r"(HF_TOKEN|token)\s*=\s*['\"]"), "assigns a token literal"),
    (re.compile(r"notebook_login|huggingface_hub\.login"), "logs in interactively"),
]


def load(path: Path):
    return nbformat.read(str(path), as_version=4)


def parameters_cells(nb):
    return [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]


def parameters_of(nb) -> dict:
    (cell,) = parameters_cells(nb)
    values = {}
    for node in ast.parse(cell.source).body:
        assert isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name), (
            f"parameters cell may hold only `name = literal` lines, found: {ast.unparse(node)}"
        )
        values[node.targets[0].id] = ast.literal_eval(node.value)  # raises on anything but a plain value
    return values


def test_the_six_notebooks_exist():
    assert [p.name for p in NOTEBOOKS] == EXPECTED


SYNC_COMMAND = ".venv/bin/jupytext --update --to ipynb notebooks/{stem}.py"
VARIANT_SECTIONS = [  # the skeleton every variant notebook follows, in this order (markdown headings)
    "### Runs on",
    "## Parameters",
    "## Setup",
    "## 1. Load the model",
    "### The host side",
    "## What makes",
    "## 2. Build the device graph",
    "## 3. Compile",
    "## 4. Generate on the device",
    "## 5. The reference",
    "## 6. SEQ_MATCH, LOGITS_MATCH and coherence",
    "## 7. Benchmark",
    "## 8. Record",
    "## 9. Plots",
]
# Calls a learner must find in the cells themselves, not behind a helper.
REAL_CALLS = [
    "text_model.embed_tokens(",
    "DeviceGraph(",
    ".example_inputs()",
    "torch.export.export(",
    "aoti_compile_and_package(",
    "runtime.prefill[bucket](",
    "runtime.decode(",
    "checks.compare_logits(",
    "checks.expect_substring(",
]
NEURON_CALLS = {
    "trace": ["torch_neuronx.trace(", "input_output_aliases=", "move_trace_to_device("],
    "model_builder": ["ModelBuilder(", "builder.add(", "builder.trace(", "builder.shard_checkpoint(", ".initialize("],
}
LIBRARY_MARK = re.compile(r"^# library: ([\w.]+)$", re.M)


def variant_notebooks() -> list[Path]:
    return [p for p in NOTEBOOKS if not p.name.startswith("00")]


def code_text(nb) -> str:
    return "\n".join(c.source for c in nb.cells if c.cell_type == "code")


def test_each_notebook_has_its_source_and_they_agree():
    """The .py (jupytext percent format) is what contributors edit; the .ipynb must be its conversion."""
    jupytext = pytest.importorskip("jupytext", reason="in the notebooks/test extras: run scripts/setup_env.sh")
    sources = sorted(p.name for p in NOTEBOOK_DIR.glob("*.py"))
    assert sources == [name.replace(".ipynb", ".py") for name in EXPECTED], "one notebooks/NN_name.py per notebook"
    for path in NOTEBOOKS:
        source = jupytext.read(path.with_suffix(".py"))
        committed = load(path)
        fix = SYNC_COMMAND.format(stem=path.stem)
        assert len(source.cells) == len(committed.cells), f"{path.name} and its .py differ in cell count; run {fix}"
        for i, (a, b) in enumerate(zip(source.cells, committed.cells, strict=True)):
            tags_a, tags_b = a.metadata.get("tags", []), b.metadata.get("tags", [])
            assert (a.cell_type, a.source, tags_a) == (b.cell_type, b.source, tags_b), (
                f"{path.name} cell {i} differs from {path.stem}.py; edit the .py and run {fix}"
            )


@pytest.mark.parametrize("path", variant_notebooks(), ids=lambda p: p.name)
def test_variant_notebooks_follow_the_skeleton(path):
    nb = load(path)
    assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("# Gemma-4 ")
    markdown = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    lines = [line for line in markdown.splitlines() if line.startswith("#")]
    found = [next((i for i, line in enumerate(lines) if line.startswith(s)), None) for s in VARIANT_SECTIONS]
    missing = [s for s, i in zip(VARIANT_SECTIONS, found, strict=True) if i is None]
    assert not missing, f"{path.name} lacks the sections {missing}"
    assert found == sorted(found), f"{path.name}: sections out of order; want {VARIANT_SECTIONS}"
    params = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    setup = next(i for i, c in enumerate(nb.cells) if c.cell_type == "markdown" and c.source.startswith("## Setup"))
    assert params < setup, f"{path.name}: the parameters cell comes before the setup"
    record = [c.source for c in nb.cells if c.cell_type == "code" and "nb.record(" in c.source]
    assert len(record) == 1, f"{path.name}: one cell writes the run record"
    assert 'extra={"demos": demos, "roofline": ceiling}' in record[0] and "witness=witness" in record[0]


@pytest.mark.parametrize("path", variant_notebooks(), ids=lambda p: p.name)
def test_the_cells_show_the_real_calls(path):
    from gemma4lib.inf2.memory_plan import neuron_recipe
    from gemma4lib.models.variants import VARIANTS

    nb = load(path)
    text = code_text(nb)
    variant = VARIANTS[parameters_of(nb)["variant"]]
    wanted = REAL_CALLS + NEURON_CALLS[neuron_recipe(variant, variant.tp_degree)]
    if variant.real_config.get("hidden_size_per_layer_input"):
        wanted += ["get_per_layer_inputs(", "per_layer_inputs=per_layer_inputs"]
    missing = [call for call in wanted if call not in text]
    assert not missing, f"{path.name}: no cell shows {missing}"
    guarded = [c.source for c in nb.cells if c.cell_type == "code" and 'if backend == "neuron":' in c.source]
    assert guarded, f'{path.name}: the inf2 step sits in a cell guarded by `if backend == "neuron":`'


def _normalised(function: ast.FunctionDef) -> str:
    """A function's AST without its docstring and annotations: what it does, not how it is documented."""
    node = ast.parse(ast.unparse(function)).body[0]
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        body = body[1:]
    node.body, node.returns = body, None
    for arg in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs, node.args.vararg, node.args.kwarg]:
        if arg is not None:
            arg.annotation = None
    return ast.dump(node)


def library_copies(path: Path) -> list[tuple[int, str, ast.FunctionDef]]:
    """(cell index, module, function) for every function a `# library: <module>` cell defines."""
    copies = []
    for i, cell in enumerate(load(path).cells):
        mark = LIBRARY_MARK.search(cell.source) if cell.cell_type == "code" else None
        if mark:
            source = "\n".join(line for line in cell.source.splitlines() if not line.lstrip().startswith("%"))
            functions = [n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)]
            assert functions, f"{path.name} cell {i} names {mark.group(1)} but defines no function"
            copies += [(i, mark.group(1), f) for f in functions]
    return copies


@pytest.mark.parametrize("path", variant_notebooks(), ids=lambda p: p.name)
def test_library_copies_in_cells_equal_the_library(path):
    """A cell that shows a library function's lines (`# library: module`, then `def name(...)`) must
    hold exactly that function's code, so the cell cannot drift from what the port runs."""
    copies = library_copies(path)
    assert {m for _, m, _ in copies} >= {"gemma4lib.backends.compile_cpu"}, f"{path.name} shows no compiler lines"
    for i, module_name, function in copies:
        module = importlib.import_module(module_name)
        library = getattr(module, function.name, None)
        assert library is not None, f"{path.name} cell {i}: {module_name} has no {function.name}; update the cell"
        (expected,) = ast.parse(inspect.getsource(library)).body
        assert _normalised(function) == _normalised(expected), (
            f"{path.name} cell {i}: {function.name} differs from {module_name}.{function.name}; run "
            f".venv/bin/python scripts/sync_notebook_copies.py {path.stem} (re-copies the library's lines)"
        )


def test_library_copy_check_can_fail():
    """The comparison sees a changed argument, not only a changed name."""
    from gemma4lib.backends import compile_cpu

    (library,) = ast.parse(inspect.getsource(compile_cpu.export_graph)).body
    changed = ast.parse(inspect.getsource(compile_cpu.export_graph).replace("strict=False", "strict=True")).body[0]
    assert _normalised(library) != _normalised(changed)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_outputs_stripped_and_kernelspec_normalised(path):
    nb = load(path)
    nbformat.validate(nb)
    assert nb.metadata.get("kernelspec") == KERNELSPEC
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name} cell {i} has outputs"
        assert "papermill" not in cell.get("metadata", {}), f"{path.name} cell {i} carries papermill metadata"
    assert "papermill" not in nb.metadata


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_one_parameters_cell_with_plain_values(path):
    nb = load(path)
    assert len(parameters_cells(nb)) == 1, f"{path.name}: exactly one cell must be tagged `parameters`"
    values = parameters_of(nb)
    required = OVERVIEW_PARAMETERS if path.name.startswith("00") else VARIANT_PARAMETERS
    assert required <= set(values), f"{path.name} lacks parameters {sorted(required - set(values))}"
    if not path.name.startswith("00"):
        assert values["profile"] == "smoke" and values["backend"] == "cpu" and values["tp_degree"] == 1
        assert values["interactive"] is False
        assert values["checkpoint"] is None  # the full profile passes it; nothing gated is a default
        assert pm_run.VARIANT_NOTEBOOKS[values["variant"]] == path.name


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_installs_prompts_or_secrets(path):
    nb = load(path)
    for i, cell in enumerate(nb.cells):
        for pattern, why in FORBIDDEN:
            assert not pattern.search(cell.source), f"{path.name} cell {i} {why}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_code_cells_are_valid_python(path):
    for i, cell in enumerate(load(path).cells):
        if cell.cell_type == "code":
            source = "\n".join(line for line in cell.source.splitlines() if not line.lstrip().startswith("%"))
            compile(source, f"{path.name}[{i}]", "exec")


@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if not p.name.startswith("00")], ids=lambda p: p.name)
def test_chat_cell_is_guarded_and_full_profile_is_written(path):
    nb = load(path)
    chat = [c for c in nb.cells if c.cell_type == "code" and "nb.chat(" in c.source]
    assert len(chat) == 1 and chat[0].source.startswith("if interactive:")
    text = "\n".join(c.source for c in nb.cells)
    assert "profile: full" in text and "backend: neuron" in text, "the full-profile command is documented"
    assert "### Runs on" in nb.cells[0].source


def test_profiles_only_pass_parameters_the_notebooks_declare():
    profiles = pm_run.load_profiles()
    for name, file in pm_run.VARIANT_NOTEBOOKS.items():
        declared = set(parameters_of(load(NOTEBOOK_DIR / file)))
        for profile in ("smoke", "full"):
            params = pm_run.notebook_parameters(profiles, profile, name, Path("/tmp/x"), {})
            extra = set(params) - declared - {"tp_demo"}  # tp_demo: E2B has no TP demonstration
            assert not extra, f"{profile} profile passes {sorted(extra)} that {file} does not declare"
    overview = set(parameters_of(load(NOTEBOOK_DIR / "00_overview.ipynb")))
    assert set(pm_run.notebook_parameters(profiles, "full", "overview", Path("/tmp/x"), {})) <= overview


def test_every_notebook_is_in_the_readme_table():
    readme = (ROOT / "README.md").read_text()
    rows = [line for line in readme.splitlines() if line.lstrip().startswith("|")]
    for name in EXPECTED:
        assert any(name in row for row in rows), f"README.md has no table row for notebooks/{name}"


# ---- the slow one: every notebook, headless ---------------------------------------------------------


def test_all_notebooks_run_headless_in_the_smoke_profile(tmp_path):
    """`python -m papermill_runs run --profile smoke` over all six notebooks: exit 0, and every variant's
    record has SEQ_MATCH and LOGITS_MATCH true and (with the trained fixtures) coherence true and a
    random-weights witness whose two checks passed. Speed is not judged here
    (an empty baseline folder, --allow-missing-baseline): the machine is shared with the other tests.
    Compiled graphs come from the shared artifact cache when another test or run built them."""
    from gemma4lib.models.trained import fixture_available

    out = tmp_path / "out"
    command = [
        sys.executable,
        "-m",
        "papermill_runs",
        "run",
        "--profile",
        "smoke",
        "--out",
        str(out),
        "--baseline-dir",
        str(tmp_path / "no-baselines"),
        "--allow-missing-baseline",
        "--history",
        str(tmp_path / "history.jsonl"),
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=4 * 3600)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    summary = json.loads((out / "results.json").read_text())
    assert summary["notebooks"]["overview"]["status"] == "ok"
    for name, file in pm_run.VARIANT_NOTEBOOKS.items():
        record = json.loads((out / "results" / f"{name}.json").read_text())
        assert record["seq_match"] is True, f"{file}: {record.get('first_mismatch')}"
        assert record["logits_match"] is True, f"{file}: {record.get('logits_explain')}"
        if fixture_available(name):
            assert record["coherent"] is True, f"{file}: {record.get('answer')!r}"
            assert record["witness"]["passed"] is True, f"{file}: {record['witness']}"
        assert (out / "notebooks" / file).is_file()
        executed = load(out / "notebooks" / file)
        plot_cells = [c for c in executed.cells if c.cell_type == "code" and _last_line(c).startswith("plots.")]
        blank = [_last_line(c) for c in plot_cells if not _has_image(c)]
        assert plot_cells and not blank, f"{file}: plot cells drew no image: {blank}"
    overview = json.loads((out / "results" / "overview.json").read_text())
    assert sorted(overview["variants_found"]) == sorted(pm_run.VARIANT_NOTEBOOKS)
    for name in ("summary.md", "summary.csv", "family_metrics.png", "checks.png", "trend_decode_tok_s.png"):
        assert (out / name).is_file(), name
    assert "decode tok/s" in done.stdout and "verdict" in done.stdout


def _last_line(cell) -> str:
    return cell.source.strip().split("\n")[-1]


def _has_image(cell) -> bool:
    return any("image/png" in (output.get("data") or {}) for output in cell.get("outputs", []))


# ---- the helpers the notebooks call (fast: released configs are built without weights) ---------


def test_kv_head_replication_arithmetic_31b():
    from gemma4lib import notebook as nb

    table = nb.kv_heads_under_tp("31b", 8)
    rows = {row[0]: dict(zip(table.columns, row, strict=False)) for row in table.rows}
    assert rows["sliding"]["KV mode"] == "shard" and rows["sliding"]["KV heads per rank"] == 2
    full = rows["full"]
    assert full["KV mode"] == "replicate" and full["Q per KV"] == 8 and full["copies of each KV head"] == "2×"
    assert full["KV head(s) on rank 0..N-1"] == str([[r // 2] for r in range(8)])


def test_memory_figures_match_the_design_notes():
    from gemma4lib import notebook as nb

    assert abs(nb.device_bytes("e2b")["device_gb"] - 4.6) < 0.1  # PLE table on the host
    assert abs(nb.device_bytes("31b")["device_gb"] - 61.4) < 0.1
    moe = nb.device_bytes("26b-a4b")
    assert abs(moe["device_gb"] - 50.5) < 0.2 and abs(moe["decode_read_gb"] - 7.6) < 0.1
    fits = {row[0]: row[3] for row in nb.tp_fit("31b").rows}
    assert fits[1] == "no" and fits[8] == "yes"


def test_table_and_plots_render_headless():
    from matplotlib.figure import Figure

    from gemma4lib import notebook as nb
    from gemma4lib.notebook import plots

    table = nb.Table(["a", "b"], [[1, 0.123456], ["x|y", None]], "t")
    assert "0.1235" in str(table) and "<table>" in table._repr_html_() and "x\\|y" in table.to_markdown()
    result = {
        "variant": "e2b",
        "profile": "smoke",
        "seq_match": True,
        "coherent": True,
        "tokens": [5, 6, 7],
        "reference_tokens": [5, 6, 8],
        "prefill_ms": 3.0,
        "decode_tok_s": 100.0,
        "compile_s": 1.0,
        "bench": {"prefill_ms_runs": [3.0, 3.1], "decode_tok_s_runs": [99.0, 101.0], "threads": 1, "warmup": 1},
    }
    figures = [
        plots.token_match(result),
        plots.bench_runs(result),
        plots.family_metrics({"e2b": result}),
        plots.checks_grid([result]),
        plots.family_metrics({}),
        plots.trend([], "prefill_ms"),
        plots.trend([{"variant": "e2b", "metrics": {"prefill_ms": 3.0}}] * 2, "prefill_ms"),
        plots.memory_budget(nb.memory_rows()),
        plots.kv_layout(nb.real_layout("e2b")),
        plots.baseline_comparison([{"variant": "e2b", "value": 3.0, "baseline": 2.0, "limit": 4.0}], "prefill_ms"),
    ]
    assert all(isinstance(f, Figure) for f in figures)
