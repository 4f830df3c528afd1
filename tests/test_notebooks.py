"""The committed notebooks: each the copy of its jupytext source (notebooks/NN_name.py), the variant
notebooks generated from notebooks/parts/ (generating again changes nothing), at most 35 cells, outputs
stripped, one plain `parameters` cell, one kernelspec, the shared skeleton, the recipe's real calls in
the cells (public library names only, every function a cell defines used), nothing that installs,
prompts or leaks; listed in the README; the generate cell equal to the engine's `generate`; and every
one of them executed headless in the smoke profile with the checks true and the same programs, tokens
and logits as `port()`'s for the same settings."""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import subprocess
import sys
import types
from pathlib import Path

import nbformat
import pytest
from conftest import SMOKE_SHAPES

from gemma4lib.models.audio import HEARING_VARIANTS
from gemma4lib.models.variants import VARIANTS
from papermill_runs import run as pm_run

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
EXPECTED = sorted([pm_run.OVERVIEW[1], pm_run.SERVING[1], pm_run.SERVE[1], *(v.notebook for v in VARIANTS.values())])
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
SERVING_PARAMETERS = {
    "variant",
    "profile",
    "batch_size",
    "prompt",
    "expect",
    "max_new_tokens",
    "draft_tokens",
    "sweep_batches",
    "results_path",
}
SERVE_PARAMETERS = {
    "variant",
    "profile",
    "backend",
    "checkpoint",
    "batch_size",
    "prompt",
    "expect",
    "max_tokens",
    "max_queue",
    "client_levels",
    "requests_per_client",
    "level_timeout_s",
    "results_path",
}
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


def test_the_eight_notebooks_exist():
    assert [p.name for p in NOTEBOOKS] == EXPECTED


SYNC_COMMAND = ".venv/bin/jupytext --update --to ipynb notebooks/{stem}.py"
VARIANT_SECTIONS = [  # the skeleton every variant notebook follows, in this order (markdown headings)
    "### Runs on",
    "## Parameters",
    "## Setup",
    "## 1. Load the model",
    "### The host side",
    "## What makes",  # the variant's lesson, right after the load
    "## 2. Build the device graph",
    "## 3. Compile",
    "## 4. Generate on the device",
    "## 5. The reference",
    "## 6. SEQ_MATCH, LOGITS_MATCH and coherence",
    "## What the model sees",  # an image through the same engine (issue 33): the vision graph beside the others
    "## 7. Sampling, streaming and a conversation",
    "## 8. Benchmark",
    "## 9. Record",
    "## 10. Plots",
]
# 01_e2b, which teaches the shared path cell by cell (and save/load, the core by hand, §7b's long conversation)
MAX_CELLS = 43
MAX_BRIEF_CELLS = 37  # 02-05: the shared path "as in 01", the rest the variant's lesson (with its context plan)
# (both with the three cells of "What the model sees" and the two of "What the model hears", which every
# variant notebook has: the 31B and the 26B-A4B say there that they do not hear)
MIN_LESSON_SHARE = 0.50  # of a brief notebook's lines, in cells tagged `lesson` (issue 51)
SERVING_MAX_CELLS = 37  # with section 5's neuron batch cell
# Calls a learner must find in the cells themselves, not behind a helper.
REAL_CALLS = [
    "text_model.embed_tokens(",
    "DeviceGraph(",
    ".example_inputs()",
    "torch.export.export(",
    "torch._inductor.aoti_compile_and_package(",
    "torch._inductor.aoti_load_package(",
    "compile_cpu.load_weights(",
    "Engine.for_model(",
    "runtime.check(request)",
    "runtime.admit({0: request}",
    "runtime.step()",
    "runtime.release(0)",
    "checks.compare_logits(",
    "checks.expect_substring(",
    "apply_chat_template(history",  # the conversation: the template over the whole history
    "Sampling(temperature=temperature, top_p=top_p",
    "runtime.generate(",
    "on_token=",
]
NEURON_CALLS = {
    "trace": ["torch_neuronx.trace(", "input_output_aliases=module.aliases()", "move_trace_to_device("],
    "model_builder": [
        "ModelBuilder(",
        "builder.add(",
        "priority_model_idx=",
        "builder.trace(initialize_model_weights=False)",
        "builder.shard_checkpoint(",
        "nxd_model.initialize(",
    ],
}


def variant_notebooks() -> list[Path]:
    files = set(pm_run.VARIANT_NOTEBOOKS.values())
    return [p for p in NOTEBOOKS if p.name in files]


def is_brief(path: Path) -> bool:
    """02-05 run the shared path "as in 01" (`form: brief` in their parts); 01_e2b teaches it in full."""
    return "\n# -- part: form --\nbrief\n" in (NOTEBOOK_DIR / "parts" / f"{path.stem}.py").read_text()


def full_notebooks() -> list[Path]:
    return [p for p in variant_notebooks() if not is_brief(p)]


IMAGE_CALLS = [  # "What the model sees", in every variant notebook: the image path's real calls
    "image_prompt(",
    "nb.reference_masks(vision_model.multimodal",
    "build_graphs(vision_model, image_settings)",
    "compile_graphs(vision_model, image_settings, graphs=image_graphs)",
    "media=inputs.prompt",
    "reference_for(vision_model, inputs.prompt)",
    "checks.evaluate(",
]
BRIEF_CALLS = [  # the shared path as a brief notebook runs it: the library calls 01_e2b writes out
    "build_graphs(model, s)",
    "compile_graphs(model, s, graphs=graphs)",
    "runtime.generate(ids, s.max_new_tokens",
    "reference_greedy(model.lm, ids",
    "checks.evaluate(",
    "nb.run_witness(s, compiled)",
    "benchmark(runtime",
]

BRIEF_NEURON_CALLS = [  # the variant's inf2 compile cell: how each key's rank module and aliases reach NxD
    "class KeyInstance(model_builder.BaseModelInstance)",
    "return self.module, self.module.aliases()",
    "functools.partial(",
    "mb.rank_module, model.config, plan, graph.shape",
    "make_plan(model.config, tp, model.variant)",
    "expert_form=forms[phase]",
]


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
    setup = next(
        i for i, c in enumerate(nb.cells) if c.cell_type == "markdown" and re.search("^## Setup", c.source, re.M)
    )
    assert params < setup, f"{path.name}: the parameters cell comes before the setup"
    record = [c.source for c in nb.cells if c.cell_type == "code" and "nb.record(" in c.source]
    assert len(record) == 1, f"{path.name}: one cell writes the run record"
    assert (
        'extra = {"demos": demos, "roofline": ceiling, "step_logits_sha256"' in record[0] and "extra=extra" in record[0]
    )
    assert "witness=witness" in record[0]
    limit = MAX_BRIEF_CELLS if is_brief(path) else MAX_CELLS
    assert len(nb.cells) <= limit, f"{path.name} has {len(nb.cells)} cells; at most {limit}"


def lesson_share(nb) -> tuple[int, int]:
    """(lines in cells tagged `lesson`, lines in all cells): what the brief notebooks spend on their variant."""
    lines = [(len(c.source.splitlines()), "lesson" in c.metadata.get("tags", [])) for c in nb.cells]
    return sum(n for n, lesson in lines if lesson), sum(n for n, _ in lines)


@pytest.mark.parametrize("path", [p for p in variant_notebooks() if is_brief(p)], ids=lambda p: p.name)
def test_brief_notebooks_are_about_their_variant(path):
    """02-05 run the shared path in a few cells that say "as in 01_e2b" and spend at least half of their
    lines on the variant's lesson (the cells of the lesson parts, which the generator tags `lesson`: its
    inf2 compile cell among them; and the skeleton's cells tagged so itself: "What the model sees", which
    in a brief notebook holds only the variant's own vision part and links to 01_e2b for the rest),
    and the lesson reaches past the load: a lesson cell after the compile uses what was compiled."""
    nb = load(path)
    lesson, total = lesson_share(nb)
    assert lesson / total >= MIN_LESSON_SHARE, (
        f"{path.name}: lesson {lesson} of {total} lines, under {MIN_LESSON_SHARE:.0%}"
    )
    markdown = "\n".join(
        c.source for c in nb.cells if c.cell_type == "markdown" and "lesson" not in c.metadata.get("tags", [])
    )
    links = re.findall(r"As in \[`01_e2b`[^\]]*\]\(01_e2b\.ipynb#([\w-]+)\)", markdown)
    assert len(links) >= 5, f"{path.name}: the shared sections should link to where 01_e2b teaches them"
    full = "\n".join(c.source for c in load(NOTEBOOK_DIR / "01_e2b.ipynb").cells if c.cell_type == "markdown")
    missing = [a for a in links if f'<a id="{a}"></a>' not in full]
    assert not missing, f"{path.name}: links to anchors 01_e2b does not have: {missing}"
    compile_at = next(i for i, c in enumerate(nb.cells) if "compile_graphs(model, s, graphs=graphs)" in c.source)
    after = [c for c in nb.cells[compile_at + 1 :] if c.cell_type == "code" and "lesson" in c.metadata.get("tags", [])]
    assert any("decode" in c.source or "compiled" in c.source for c in after), (
        f"{path.name}: no lesson cell after the compile works on the compiled graphs"
    )


def test_the_lesson_share_check_can_fail():
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("a = 1\nb = 2"),
        nbformat.v4.new_markdown_cell("x", metadata={"tags": ["lesson"]}),
    ]
    lesson, total = lesson_share(nb)
    assert (lesson, total) == (1, 3) and lesson / total < MIN_LESSON_SHARE


@pytest.mark.parametrize("path", variant_notebooks(), ids=lambda p: p.name)
def test_the_cells_show_the_real_calls(path):
    from gemma4lib.inf2.memory_plan import neuron_recipe
    from gemma4lib.models.variants import VARIANTS

    nb = load(path)
    text = code_text(nb)
    variant = VARIANTS[parameters_of(nb)["variant"]]
    guarded = [c.source for c in nb.cells if c.cell_type == "code" and c.source.startswith("if on_inf2")]
    assert guarded, f"{path.name}: the inf2 step sits in a cell guarded by `if on_inf2 ...:`"
    skipped = 'print(f"skipped: backend={backend}"'
    assert all(skipped in c for c in guarded), f"{path.name}: an inf2 cell must say it was skipped on a CPU"
    if is_brief(path):  # the shared path through the library (01_e2b's cells are tested equal to it)
        missing = [call for call in BRIEF_CALLS + IMAGE_CALLS if call not in text]
        assert not missing, f"{path.name}: no cell shows {missing}"
        # its own inf2 compile, written out: ModelBuilder, the rank module and the K/V aliases
        (inf2,) = [c for c in guarded if "ModelBuilder(" in c]
        missing = [call for call in NEURON_CALLS["model_builder"] + BRIEF_NEURON_CALLS if call not in inf2]
        assert not missing, f"{path.name}: its inf2 cell does not show {missing}"
        return
    wanted = REAL_CALLS + IMAGE_CALLS + NEURON_CALLS[neuron_recipe(variant, variant.tp_degree)]
    if "neuron_recipe" in parameters_of(nb):  # E2B: the one-graph trace recipe is selectable too
        wanted += NEURON_CALLS["trace"]
    if variant.real_config.get("hidden_size_per_layer_input"):
        wanted += ["get_per_layer_inputs("]
    if variant.name == "e2b":  # its lesson runs the reference from the host-side inputs
        wanted += ["per_layer_inputs=per_layer_inputs"]
    missing = [call for call in wanted if call not in text]
    assert not missing, f"{path.name}: no cell shows {missing}"
    # each inf2 cell compiles (ModelBuilder or the one-graph trace) or loads a compiled bundle
    assert all("ModelBuilder(" in c or "torch_neuronx.trace(" in c or "artifacts=" in c for c in guarded)


def _generator():
    spec = importlib.util.spec_from_file_location("generate_notebooks", ROOT / "scripts" / "generate_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generating_the_variant_notebooks_again_changes_nothing():
    """notebooks/0[1-5]_*.py are generated from notebooks/parts/ (skeleton + the variant's parts)."""
    generator = _generator()
    stems = generator.variant_stems()
    assert stems == [p.stem for p in variant_notebooks()], "one notebooks/parts/NN_name.py per variant notebook"
    for stem in stems:
        committed = (NOTEBOOK_DIR / f"{stem}.py").read_text()
        assert generator.render(stem) == committed, (
            f"notebooks/{stem}.py differs from what notebooks/parts/ generate; edit the parts and run "
            ".venv/bin/python scripts/generate_notebooks.py"
        )


def test_the_generator_refuses_a_missing_or_unused_part(tmp_path, monkeypatch):
    generator = _generator()
    monkeypatch.setattr(generator, "PARTS", tmp_path)
    (tmp_path / "01_x.py").write_text("# -- part: form --\nfull\n# -- part: a --\nfilled\n# -- part: b --\nunused\n")
    monkeypatch.setattr(generator, "SKELETON", tmp_path / "skeleton.py")
    (tmp_path / "skeleton.py").write_text("x = '{{a}}'\n")
    with pytest.raises(SystemExit, match="never uses"):
        generator.render("01_x")
    (tmp_path / "skeleton.py").write_text("x = '{{a}}'\n{{b}}\n{{c}}\n")
    with pytest.raises(SystemExit, match="no part 'c'"):
        generator.render("01_x")
    (tmp_path / "skeleton.py").write_text("x = '{{a}}'\n{{b}}\n")
    assert generator.render("01_x") == "x = 'filled'\nunused\n"
    # the form keeps its own blocks; a lesson part's cells are tagged `lesson`
    (tmp_path / "skeleton.py").write_text(
        "{{#full}}\nF\n{{/full}}\n{{#brief}}\nB\n{{/brief}}\n{{a}}\n{{b}}\n{{lesson}}\n"
    )
    (tmp_path / "01_x.py").write_text(
        "# -- part: form --\nbrief\n# -- part: a --\n1\n# -- part: b --\n2\n# -- part: lesson --\n# %%\nx = 1\n"
    )
    assert generator.render("01_x") == 'B\n1\n2\n# %% tags=["lesson"]\nx = 1\n'
    (tmp_path / "01_x.py").write_text("# -- part: form --\nshort\n# -- part: a --\n1\n# -- part: b --\n2\n")
    with pytest.raises(SystemExit, match="form"):
        generator.render("01_x")


def _code_tree(nb) -> ast.Module:
    source = "\n".join(
        "\n".join(line for line in c.source.splitlines() if not line.lstrip().startswith("%"))
        for c in nb.cells
        if c.cell_type == "code"
    )
    return ast.parse(source)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_function_a_cell_defines_is_used_and_no_private_library_name(path):
    """A function shown in a cell is the one the notebook calls (no copies that never run), and the
    cells use gemma4lib's public names only, so a learner's copy of a cell runs as it stands."""
    tree = _code_tree(load(path))
    methods = {id(f) for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for f in c.body}  # called by their caller
    defined = [n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and id(n) not in methods]
    defined += [n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    unused = sorted(set(defined) - used)
    assert not unused, f"{path.name} defines functions it never uses: {unused}"
    from_library = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gemma4lib"):
            private = [a.name for a in node.names if a.name.startswith("_")]
            assert not private, f"{path.name} imports private names {private} from {node.module}"
            from_library.update({a.asname or a.name: node.module for a in node.names})
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in from_library:
            assert not node.attr.startswith("_"), f"{path.name} uses the private {node.value.id}.{node.attr}"


def test_the_private_name_check_can_fail(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("from gemma4lib.recipes import neuron_model_builder as mb\nmb._instance_class()")
    ]
    nbformat.write(nb, str(tmp_path / "x.ipynb"))
    with pytest.raises(AssertionError, match="private"):
        test_every_function_a_cell_defines_is_used_and_no_private_library_name(tmp_path / "x.ipynb")


def test_02_shards_by_hand_and_all_reduces():
    """The TP lesson is in 02's cells: column shards (rows of q/k/v, gate/up), row shards (columns of
    o_proj, down_proj), partial outputs summed (the all-reduce), checked against the unsharded layer."""
    text = code_text(load(NOTEBOOK_DIR / "02_e4b.ipynb"))
    for line in [
        "wq[mine_q], wk[mine_kv], wv[mine_kv]",
        "F.linear(heads, wo[:, mine_q])",
        "gate[mine]",
        "F.linear(inner, down[:, mine])",
        "attn_tp = torch.stack(partials).sum(0)",
        "mlp_tp = torch.stack(partials).sum(0)",
        "torch.testing.assert_close(attn_tp, attn_hf",
        "torch.testing.assert_close(mlp_tp, mlp_hf",
    ]:
        assert line in text, f"02_e4b has no cell line {line!r}"


SERVING_SECTIONS = [  # 06_serving: each feature's why, graphs, compile, generate, checks; then the shared end
    "### Runs on",
    "## Parameters",
    "## Setup",
    "## 1. Load the target",
    "## 2. Batches",
    "### Why a batch helps decode",
    "### The batched device graphs",
    "### Compile",
    "### Generate the batch",
    "### Each row against its own reference",
    "## 3. Drafting",
    "### Why verifying k + 1 tokens can cost about one decode step",
    "### How the assistant reads the target's K/V",
    "### The draft, verify and prefill graphs",
    "### Compile",
    "### Generate with drafts",
    "### Exact: plain greedy, and transformers' assisted generate",
    "## 4. Benchmark",
    "## 5. On inf2",
    "## 6. Record",
    "## 7. Plots",
]
SERVING_CALLS = [  # the recipe of both features, in the cells themselves
    "GraphShape(batch=batch_size",
    "torch.export.export(",
    "torch._inductor.aoti_compile_and_package(",
    "torch._inductor.aoti_load_package(",
    "compile_cpu.load_weights(",
    "Engine.for_model(",
    "runtime.generate_rows(requests",
    "reference_greedy(model.lm, ids",
    "checks.evaluate(",
    "run_witness(batch",
    "load_assistant(model, drafted)",
    "device_graphs(model, drafted",
    "drafter=AssistantDrafter()",
    "drafted_runtime.generate(",
    "hf_assisted(model.lm, assistant.model",
    "bench_batch_model(",
    "batch_ceilings(",
    "draft_table(",
    "build_record(",
    "plots_batch.tok_s_vs_batch(measured=sweep, computed=ceilings",
    "plots_draft.drafts_accepted(",
    'PortSettings(**common, backend="neuron", batch_size=batch_size)',  # section 5: the batch keys on neuron
    "mb.bucket_shapes(context_length, tuple(prefill_buckets), ring_kv, batch=",
    "compile_graphs(load_model(neuron_batch), neuron_batch)",
]


def test_06_serving_follows_its_sections_and_shows_the_recipe():
    nb = load(NOTEBOOK_DIR / pm_run.SERVING[1])
    assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("# 06 — Serving more")
    lines = [
        line for c in nb.cells if c.cell_type == "markdown" for line in c.source.splitlines() if line.startswith("#")
    ]
    found, at = [], 0
    for section in SERVING_SECTIONS:  # in order; "### Compile" appears once per feature
        at = next((i for i in range(at, len(lines)) if lines[i].startswith(section)), None)
        assert at is not None, f"06_serving lacks {section!r} (in this order: {SERVING_SECTIONS})"
        found.append(at)
        at += 1
    text = code_text(nb)
    missing = [call for call in SERVING_CALLS if call not in text]
    assert not missing, f"06_serving: no cell shows {missing}"
    record = [c.source for c in nb.cells if c.cell_type == "code" and "build_record(" in c.source]
    assert len(record) == 1 and "witness=witness" in record[0] and '"kind": "serving"' in record[0]
    assert len(nb.cells) <= SERVING_MAX_CELLS, f"06_serving has {len(nb.cells)} cells; at most {SERVING_MAX_CELLS}"


SERVE_SECTIONS = [  # 07_serve: why, start, the client, errors and 429, load, metrics, plots, tools, a thought
    # and a structured reply, drain, inf2, record
    "### Runs on",
    "## Parameters",
    "## Setup",
    "## 1. Why continuous batching",
    "## 2. Start the server",
    "## 3. The official `openai` client",
    "### Errors in OpenAI's shape, and why 429",
    "## 4. N concurrent clients",
    "### What the server counted",
    "## 5. Plots",
    "## 5b. An agent's tool loop, a thought and a structured reply",
    "## 6. Stop it",
    "## 7. On inf2",
    "## 8. Record",
]
SERVE_CALLS = [  # the endpoint's recipe, in the cells themselves
    "ServerProcess(args).start(",
    "OpenAI(base_url=server.url",
    "stream=True",
    "except BadRequestError",
    "run_async(",
    "run_load(",
    "nb.load_levels_table(levels)",
    "/metrics",
    "plots_serve.latency_and_throughput(levels",
    'tool_choice={"type": "function", "function": {"name": "get_capital"}}',  # the forced call
    ".message.tool_calls",  # parsed by the server
    '{"role": "tool", "tool_call_id": call_id, "content": tool_result}',  # the result sent back
    '"json_schema": {"name": "capital", "schema": schema, "strict": True}',  # the structured reply
    "jsonschema.Draft202012Validator(schema).is_valid(structured_reply)",  # validated as a client would
    'extra_body={"chat_template_kwargs": {"enable_thinking": True}}',  # thinking on, vLLM's spelling
    '.get("reasoning_content")',  # the thought, apart from the content
    "server.stop()",
    '"on the compile host, once: python -m gemma4lib export", *port_args',  # it compiles the bundle
    'args += ["--artifacts", artifacts]',  # the server on inf2 loads it
    "dataclasses.replace(settings, artifacts=artifacts)",  # and so do the replicas, never compiling
    "deploy(replica_settings, RayOptions(replicas=replicas",
    "nb.save_record(results_path, record)",
]


def test_07_serve_follows_its_sections_and_shows_the_recipe():
    nb = load(NOTEBOOK_DIR / pm_run.SERVE[1])
    assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("# 07 — Serve it")
    lines = [
        line for c in nb.cells if c.cell_type == "markdown" for line in c.source.splitlines() if line.startswith("#")
    ]
    at = 0
    for section in SERVE_SECTIONS:
        at = next((i for i in range(at, len(lines)) if lines[i].startswith(section)), None)
        assert at is not None, f"07_serve lacks {section!r} (in this order: {SERVE_SECTIONS})"
        at += 1
    text = code_text(nb)
    missing = [call for call in SERVE_CALLS if call not in text]
    assert not missing, f"07_serve: no cell shows {missing}"
    (inf2,) = [c.source for c in nb.cells if c.cell_type == "code" and "\nif on_inf2:" in "\n" + c.source]
    assert "deploy(" in inf2 and 'print(f"skipped: backend={backend}")' in inf2
    assert "server.stop()" in code_text(nb).split("\nif on_inf2:")[0], "the server stops before the inf2 cell"
    assert len(nb.cells) <= MAX_CELLS, f"07_serve has {len(nb.cells)} cells; at most {MAX_CELLS}"


def _decode_cell(nb) -> str:
    (cell,) = [c.source for c in nb.cells if c.cell_type == "code" and "runtime.admit({0: request}" in c.source]
    return cell


@pytest.mark.parametrize("path", full_notebooks(), ids=lambda p: p.name)
def test_the_decode_loop_cell_equals_the_engines_generation(path, ports):
    """The notebook's generate cell (its admit/step/release calls, executed here over a compiled
    engine) gives exactly the tokens and logits of `runtime.generate`, the engine's own route."""
    import torch

    from gemma4lab import notebook as nb_helpers
    from gemma4lib.port import eos_ids

    values = parameters_of(load(path))
    port = ports.get(values["variant"], **SMOKE_SHAPES)  # the notebook's shapes: the headless run's programs
    namespace = {"torch": torch, "runtime": port.runtime, "ids": port.ids, "s": port.settings, "model": port.model}
    from gemma4lib.runtime import Request

    namespace.update(eos_ids=eos_ids, nb=nb_helpers, Request=Request)
    exec(compile(_decode_cell(load(path)), f"{path.name}[decode loop]", "exec"), namespace)
    eos = eos_ids(port.model)
    generation = port.runtime.generate(port.ids, port.settings.max_new_tokens, eos_token_ids=eos, keep_logits=True)
    assert namespace["tokens"] == generation.tokens
    assert torch.equal(namespace["step_logits"], generation.step_logits)


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
    required = {
        pm_run.OVERVIEW[1]: OVERVIEW_PARAMETERS,
        pm_run.SERVING[1]: SERVING_PARAMETERS,
        pm_run.SERVE[1]: SERVE_PARAMETERS,
    }
    required = required.get(path.name, VARIANT_PARAMETERS)
    assert required <= set(values), f"{path.name} lacks parameters {sorted(required - set(values))}"
    if path.name == pm_run.SERVING[1]:
        assert values["profile"] == "smoke" and values["model"] == "auto" and values["batch_size"] > 1
    elif path.name == pm_run.SERVE[1]:
        assert values["profile"] == "smoke" and values["backend"] == "cpu" and values["checkpoint"] is None
        assert values["batch_size"] > 1 and max(values["client_levels"]) > values["batch_size"]
        assert values["level_timeout_s"] > 0 and values["requests_per_client"] >= 1  # every load is bounded
    elif not path.name.startswith("00"):
        assert values["profile"] == "smoke" and values["backend"] == "cpu" and values["tp_degree"] == 1
        assert values["interactive"] is False
        assert values["checkpoint"] is None  # the full profile passes it; nothing gated is a default
        assert pm_run.VARIANT_NOTEBOOKS[values["variant"]] == path.name
        shapes = {"context_length": values["context_length"], "prefill_buckets": tuple(values["prefill_buckets"])}
        assert shapes == SMOKE_SHAPES, f"{path.name}: tests/conftest.py's SMOKE_SHAPES name other shapes"


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


@pytest.mark.parametrize("path", variant_notebooks(), ids=lambda p: p.name)
def test_chat_cell_is_guarded_and_full_profile_is_written(path):
    nb = load(path)
    chat = [c for c in nb.cells if c.cell_type == "code" and "nb.chat(" in c.source]
    assert len(chat) == 1 and chat[0].source.startswith("if interactive:")
    text = "\n".join(c.source for c in nb.cells)
    assert "profile: full" in text and "backend: neuron" in text, "the full-profile command is documented"
    assert any("### Runs on" in c.source for c in nb.cells[:3]), "what it runs on, before the parameters"


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
    serving = set(parameters_of(load(NOTEBOOK_DIR / pm_run.SERVING[1])))
    assert set(pm_run.notebook_parameters(profiles, "smoke", "serving", Path("/tmp/x"), {})) <= serving
    with pytest.raises(SystemExit, match="runs no 06_serving"):  # CPU only: the full profile leaves it out
        pm_run.notebook_parameters(profiles, "full", "serving", Path("/tmp/x"), {})
    serve = set(parameters_of(load(NOTEBOOK_DIR / pm_run.SERVE[1])))
    assert set(pm_run.notebook_parameters(profiles, "smoke", "serve", Path("/tmp/x"), {})) <= serve
    with pytest.raises(SystemExit, match="runs no 07_serve"):
        pm_run.notebook_parameters(profiles, "full", "serve", Path("/tmp/x"), {})


def test_every_notebook_is_in_the_readme_table():
    readme = (ROOT / "README.md").read_text()
    rows = [line for line in readme.splitlines() if line.lstrip().startswith("|")]
    for name in EXPECTED:
        assert any(name in row for row in rows), f"README.md has no table row for notebooks/{name}"


# ---- the slow one: every notebook, headless ---------------------------------------------------------


def test_all_notebooks_run_headless_in_the_smoke_profile(tmp_path):
    """`python -m papermill_runs run --profile smoke` over all eight notebooks: exit 0, and every variant's
    record has SEQ_MATCH and LOGITS_MATCH true and (with the trained fixtures) coherence true and a
    random-weights witness whose two checks passed. Speed is not judged here
    (an empty baseline folder, --allow-missing-baseline): the machine is shared with the other tests.
    Compiled graphs come from the shared artifact cache when another test or run built them."""
    from gemma4lib.models.fixture_paths import fixture_available

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
        image = record["demos"]["image"]  # "What the model sees": the red circle through the vision graph
        assert image["seq_match"] and image["logits_match"] and image["coherent"], f"{file}: {image}"
        assert "red circle" in image["answer"].lower() and image["soft_tokens"] == [16], f"{file}: {image}"
        if parameters_of(load(NOTEBOOK_DIR / file))["clip"]:  # "What the model hears": transcribed, then answered
            assert name in HEARING_VARIANTS, f"{file}: a clip for a variant without an audio part"
            heard = record["demos"]["audio"]["tasks"]
            for task, result in heard.items():
                assert result["seq_match"] and result["logits_match"] and result["coherent"], f"{file} {task}: {result}"
            assert "capital of france" in heard["transcribe"]["answer"].lower(), f"{file}: {heard}"
            assert "paris" in heard["spoken question"]["answer"].lower(), f"{file}: {heard}"
        else:
            assert "audio" not in record["demos"], f"{file}: the audio section ran without a clip"
        assert (out / "notebooks" / file).is_file()
        _same_as_port(name, file, record)
        executed = load(out / "notebooks" / file)
        plot_cells = [c for c in executed.cells if c.cell_type == "code" and _last_line(c).startswith("plots.")]
        blank = [_last_line(c) for c in plot_cells if not _has_image(c)]
        assert plot_cells and not blank, f"{file}: plot cells drew no image: {blank}"
    _serving_checked(out)
    _serve_checked(out)
    overview = json.loads((out / "results" / "overview.json").read_text())
    assert sorted(overview["variants_found"]) == sorted(pm_run.VARIANT_NOTEBOOKS)
    for name in ("summary.md", "summary.csv", "family_metrics.png", "checks.png", "trend_decode_tok_s.png"):
        assert (out / name).is_file(), name
    assert "decode tok/s" in done.stdout and "verdict" in done.stdout


def _serve_checked(out: Path) -> None:
    """07_serve's record: every one of its checks passed (Paris, stream equal to plain, the 400, the 429,
    every load level complete and unmixed, SIGTERM's clean exit), one level per `client_levels`, bounded
    in requests; the plot cell drew its figure; and the inf2 cell said it skipped on CPU."""
    file = pm_run.SERVE[1]
    record = json.loads((out / "results" / "serve.json").read_text())
    assert record["kind"] == "serve" and record["checks_passed"] is True, f"{file}: {record['failed_checks']}"
    values = parameters_of(load(NOTEBOOK_DIR / file))
    assert [level["clients"] for level in record["levels"]] == values["client_levels"]
    for level in record["levels"]:
        assert level["requests"] == level["clients"] * values["requests_per_client"], level
        assert level["complete"] and level["mixed"] == 0 and level["tokens"] > 0, level
    assert values["expect"] in record["answer"] and record["streamed"] == record["answer"]
    # compile_s is what the server reports: 0 when an earlier notebook compiled these shapes, more on a cold cache
    assert record["burst_statuses"].get("429", 0) > 0 and record["compile_s"] >= 0
    executed = load(out / "notebooks" / file)
    (plot,) = [c for c in executed.cells if c.cell_type == "code" and _last_line(c).startswith("plots_serve.")]
    assert _has_image(plot), f"{file}: the plot cell drew no image"
    (inf2,) = [
        c
        for c in executed.cells
        if c.cell_type == "code" and any(line.startswith("if on_inf2:  # inf2-only") for line in c.source.splitlines())
    ]  # the cell may print the compile host's command before its guard
    printed = "".join(o.get("text", "") for o in inf2.get("outputs", []))
    assert "skipped: backend=cpu" in printed, f"{file}: the inf2 cell printed {printed!r}"


def _serving_checked(out: Path) -> None:
    """06_serving's record: every batch row and the drafted answer passed their three checks, the
    drafted tokens equal transformers' assisted generate, drafts were accepted, the plots drew; and
    its cells produced what the library's own runs produce for the same settings (the batch's rows
    and the drafted tokens and acceptance through `port.run_device`, the engine `port()` runs)."""
    from gemma4lib.port import PortSettings, eos_ids, load_model, prompt_rows, requests_for, run_device

    file = pm_run.SERVING[1]
    record = json.loads((out / "results" / "serving.json").read_text())
    assert record["kind"] == "serving" and record["checks_passed"] is True, f"{file}: {record['failed_checks']}"
    values = parameters_of(load(NOTEBOOK_DIR / file))
    assert len(record["rows"]) == values["batch_size"]
    for row in record["rows"]:
        assert row["seq_match"] and row["logits_match"] and row["coherent"], f"{file}: row {row}"
    assert record["draft_seq_match"] and record["draft_logits_match"] and record["draft_coherent"]
    assert record["hf_assisted_match"] is True and record["accepted_per_step"] > 1
    assert record["witness"]["passed"] is True
    executed = load(out / "notebooks" / file)
    (plots,) = [c for c in executed.cells if c.cell_type == "code" and _last_line(c).startswith("plots_")]
    images = sum("image/png" in (o.get("data") or {}) for o in plots.get("outputs", []))
    assert images == 2, f"{file}: the plots cell drew {images} images, not tok/s against B and drafts per step"
    common = dict(variant=values["variant"], max_new_tokens=values["max_new_tokens"], witness=False)
    common.update(context_length=values["context_length"], prefill_buckets=tuple(values["prefill_buckets"]))
    batch = PortSettings(**common, batch_size=values["batch_size"])
    model = load_model(batch)
    eos = eos_ids(model)
    run = run_device(model, batch, requests_for(prompt_rows(model, batch), batch, eos), bench=False)
    assert [r.tokens for r in run.rows] == [r["tokens"] for r in record["rows"]], f"{file}: batch rows differ"
    drafted = PortSettings(**common, prompt=values["prompt"], draft="assistant", draft_tokens=values["draft_tokens"])
    run = run_device(model, drafted, requests_for(prompt_rows(model, drafted), drafted, eos), bench=False)
    assert run.tokens == record["draft_tokens_out"], f"{file}: drafted tokens differ from the port's"
    assert run.details["drafts_accepted"] == record["drafts_accepted"], f"{file}: acceptance differs"


def _same_as_port(name: str, file: str, record: dict) -> None:
    """What the notebook's cells ran equals what `port()` runs for the same settings: the same
    compiled programs (artifact keys), tokens and step logits (sha256 of their float32 bytes)."""
    import torch

    from gemma4lab import notebook as nb_helpers
    from gemma4lib.port import PortSettings, eos_ids, load_model, prompt_rows, requests_for, run_device

    values = parameters_of(load(NOTEBOOK_DIR / file))
    keys = ("variant", "model", "weights", "max_new_tokens", "context_length", "ring_kv", "decode_experts")
    chosen = {k: values[k] for k in keys if k in values}
    settings = PortSettings(**chosen, prompt=values["prompt"], prefill_buckets=tuple(values["prefill_buckets"]))
    threads = torch.get_num_threads()
    torch.set_num_threads(values["threads"])  # the notebook's thread count: the same kernels, the same bits
    try:
        model = load_model(settings)
        run = run_device(
            model, settings, requests_for(prompt_rows(model, settings), settings, eos_ids(model)), bench=False
        )
    finally:
        torch.set_num_threads(threads)
    assert _programs(record["artifacts"]) == _programs(run.artifacts), f"{file}: its cells compiled other programs"
    assert record["tokens"] == run.tokens, f"{file}: tokens differ from port()'s"
    assert record["step_logits_sha256"] == nb_helpers.tensor_digest(run.step_logits), f"{file}: logits differ"


def _programs(artifacts: dict[str, str]) -> dict[str, tuple[str, str]]:
    """Each graph's (program key, folded values) from its cache entry: the same pair is the same
    compiled program with the same folded weights, whichever cache key the entry sits at (a model
    whose folded values differ from the first compiler's gets an entry of its own)."""
    out = {}
    for name, path in artifacts.items():
        meta = json.loads((Path(path) / "meta.json").read_text())
        out[name] = (meta.get("program_key") or meta["key"], meta.get("folded_digest"))
    return out


def _last_line(cell) -> str:
    return cell.source.strip().split("\n")[-1]


def _has_image(cell) -> bool:
    return any("image/png" in (output.get("data") or {}) for output in cell.get("outputs", []))


# ---- the helpers the notebooks call (fast: released configs are built without weights) ---------


def test_kv_head_replication_arithmetic_31b():
    from gemma4lab import notebook as nb

    table = nb.kv_heads_under_tp("31b", 8)
    rows = {row[0]: dict(zip(table.columns, row, strict=False)) for row in table.rows}
    assert rows["sliding"]["KV mode"] == "shard" and rows["sliding"]["KV heads per rank"] == 2
    full = rows["full"]
    assert full["KV mode"] == "replicate" and full["Q per KV"] == 8 and full["copies of each KV head"] == "2×"
    assert full["KV head(s) on rank 0..N-1"] == str([[r // 2] for r in range(8)])


def test_memory_figures_match_the_design_notes():
    from gemma4lab import notebook as nb

    assert abs(nb.device_bytes("e2b")["device_gb"] - 4.6) < 0.1  # PLE table on the host
    assert abs(nb.device_bytes("31b")["device_gb"] - 61.4) < 0.1
    moe = nb.device_bytes("26b-a4b")
    assert abs(moe["device_gb"] - 50.5) < 0.2 and abs(moe["decode_read_gb"] - 7.6) < 0.1
    fits = {row[0]: row[3] for row in nb.tp_fit("31b").rows}
    assert fits[1] == "no" and fits[8] == "yes"


def test_table_and_plots_render_headless():
    from matplotlib.figure import Figure

    from gemma4lab import notebook as nb
    from gemma4lab.notebook import plots

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


def _cell_starting(nb, prefix: str) -> str:
    (cell,) = [c.source for c in nb.cells if c.cell_type == "code" and c.source.startswith(prefix)]
    return cell


class _FakeLoaded:
    """What `torch.jit.load` gives back for a ModelBuilder artifact, recording `initialize`."""

    def __init__(self, calls):
        self.calls = calls
        self.nxd_model = types.SimpleNamespace(initialize=self.initialize)

    def initialize(self, weights, start_rank):
        self.calls.append(
            ("initialize", {"ranks": [w["rank"].tolist() for w in weights], "start": start_rank.tolist()})
        )


MODEL_BUILDER_CELLS = {  # each variant notebook's inf2 compile cell, by how it starts
    "01_e2b.ipynb": 'if on_inf2 and s.neuron_recipe != "trace"',
    **{p.name: "if on_inf2:  # inf2-only: NxD ModelBuilder" for p in variant_notebooks() if is_brief(p)},
}


@pytest.mark.parametrize("path", [NOTEBOOK_DIR / name for name in MODEL_BUILDER_CELLS], ids=lambda p: p.name)
def test_the_model_builder_cell_makes_the_recipes_calls(path, tmp_path, monkeypatch):
    """Each variant's inf2 cell, run here at TP=2 on its tiny model against recording stand-ins for
    NxD's model_builder and the artifact's save and load, makes the calls `backends.neuron.compile`
    (what `port(backend="neuron")` runs) makes, in the same order: a fresh compiler work directory
    and a private current directory around the compile, the same ModelBuilder keys, example inputs,
    compiler arguments and priorities (a prefill key per bucket), the checkpoint built only when
    `shard_checkpoint` asks, the same free-space estimate for the cache, and the cores guard before
    the load with the claim after it. Each key's model instance builds the same rank module (built
    here with the CPU twins of NxD's layers), and its `get()` returns that module with the same K/V
    aliases (the K/V parameters, output 1 onwards)."""
    import contextlib
    import dataclasses

    import torch
    from test_neuron_recipes import _Recorder

    from gemma4lab import notebook as nb_helpers
    from gemma4lib.backends import neuron
    from gemma4lib.backends.base import CompiledGraphs
    from gemma4lib.cache.artifacts import ArtifactCache
    from gemma4lib.port import PortSettings, build_graphs, load_model
    from gemma4lib.recipes import cores, neuron_env
    from gemma4lib.recipes import neuron_model_builder as mb
    from gemma4lib.runtime import Engine, Steps
    from gemma4lib.tp.rank_graph import CpuParallelFactory

    values = parameters_of(load(path))
    tp = 2
    settings = PortSettings(
        variant=values["variant"], tp_degree=tp, decode_experts=values.get("decode_experts", "dense"),
        cache_dir=str(tmp_path / "library-cache"), prefill_buckets=(16, 64),
    )  # fmt: skip
    model = load_model(dataclasses.replace(settings, tp_degree=1))
    graphs = build_graphs(model, dataclasses.replace(settings, tp_degree=1))
    prefill, decode = graphs.prefill, graphs.decode
    guards = {name: getattr(neuron, name) for name in ("compiler_workdir", "own_directory")}
    runs = []
    for run in ("cell", "library"):
        recorder = _Recorder(stop_at_trace=False)
        calls = recorder.calls
        monkeypatch.setattr(neuron_env, "require", lambda module, purpose="", r=recorder: r.module)
        for name, guard in guards.items():

            @contextlib.contextmanager
            def recording(*args, name=name, guard=guard, calls=calls, **kwargs):
                calls.append((name, {}))
                with guard(*args, **kwargs) as value:
                    yield value

            monkeypatch.setattr(neuron, name, recording)
        monkeypatch.setattr(cores, "check_free", lambda first, n, label, c=calls: c.append(("check_free", [first, n])))
        monkeypatch.setattr(cores, "claim", lambda m, first, n, label, c=calls: c.append(("claim", [first, n])) or m)
        monkeypatch.setattr(torch.jit, "save", lambda traced, p, c=calls: c.append(("save", Path(p).name)))
        monkeypatch.setattr(torch.jit, "load", lambda p, c=calls: c.append(("load", Path(p).name)) or _FakeLoaded(c))
        _record_need_bytes(monkeypatch, ArtifactCache, calls)
        if run == "cell":
            namespace = dict(
                backend="neuron", on_inf2=True, s=settings, model=model, prefill=prefill, decode=decode, torch=torch
            )
            namespace.update(nb=nb_helpers, time=__import__("time"), cache=ArtifactCache(tmp_path / "cell-cache"))
            namespace.update(Engine=Engine, Steps=Steps, CompiledGraphs=CompiledGraphs, has_ple=False)
            namespace.update(display=lambda *shown: None)
            namespace["s"] = dataclasses.replace(settings, cache_dir=str(tmp_path / "cell-cache"))  # brief cells' own
            cell = _cell_starting(load(path), MODEL_BUILDER_CELLS[path.name])
            exec(compile(cell, f"{path.name}[ModelBuilder cell]", "exec"), namespace)
            runtime = namespace["compiled"]
        else:
            runtime = neuron.compile(build_graphs(model, settings, inplace=False), model, settings)
        runs.append((calls, recorder.checkpoint(), runtime, recorder.instances))
    (
        (cell_calls, cell_checkpoint, cell_runtime, cell_keys),
        (library_calls, library_checkpoint, library_runtime, keys),
    ) = runs
    for ours, theirs in zip(cell_keys, keys, strict=True):  # the rank module and aliases of each key
        built = []
        for instance in (ours, theirs):
            build = instance.module_cls  # functools.partial(rank_module, config, plan, shape, dtype, ...)
            assert build.func is mb.rank_module
            instance.module = build.func(*build.args, **{**build.keywords, "factory": CpuParallelFactory(tp)})
            module, aliases = instance.get(0)
            assert module is instance.module and sorted(aliases.values()) == list(range(1, 1 + len(module.kv)))
            built.append((build.args[1:], build.keywords, [name for name, _ in module.named_parameters()]))
        assert built[0] == built[1]
    kinds = [kind for kind, _ in cell_calls]
    assert kinds == [kind for kind, _ in library_calls]
    assert kinds[:3] == ["get_or_build", "compiler_workdir", "own_directory"] and kinds[-4:] == [
        "check_free",
        "load",
        "initialize",
        "claim",
    ]
    assert kinds[3:9] == ["init", "add", "add", "add", "trace", "save"] and "shard_checkpoint" in kinds
    assert [args["key"] for kind, args in cell_calls if kind == "add"] == ["prefill16", "prefill64", "decode"]
    assert cell_calls[0][1] > 0  # the disk check's estimate: the shards
    for (kind, ours), (_, theirs) in zip(cell_calls, library_calls, strict=True):
        assert ours == theirs, f"{kind}: the cell asked {ours}, the backend {theirs}"
    assert cell_checkpoint.keys() == library_checkpoint.keys()
    assert all(torch.equal(cell_checkpoint[k], library_checkpoint[k]) for k in cell_checkpoint)
    assert list(cell_runtime.steps.prefill) == list(library_runtime.steps.prefill) == [16, 64]  # K/V on the device


def _record_need_bytes(monkeypatch, cache_class, calls):
    """Record the free-space estimate every artifact-cache build is handed (`need_bytes`)."""
    real = getattr(cache_class.get_or_build, "__wrapped__", cache_class.get_or_build)  # not an earlier run's

    def get_or_build(self, key, build, describe=None, need_bytes=0):
        calls.append(("get_or_build", need_bytes))
        return real(self, key, build, describe, need_bytes)

    get_or_build.__wrapped__ = real
    monkeypatch.setattr(cache_class, "get_or_build", get_or_build)


@pytest.mark.parametrize("path", variant_notebooks(), ids=lambda p: p.name)
def test_runs_on_states_the_serving_host_plan(path):
    """Each variant's "Runs on" gives the serving host's planned peak (`memory_plan.serving_host_plan`)
    at its TP degree on its instance, so the figure a reader sees is the one `doctor` and
    `PortSettings` use."""
    from gemma4lab.notebook.status import StatusBox
    from gemma4lib.inf2.memory_plan import serving_host_plan

    variant = VARIANTS[parameters_of(load(path))["variant"]]
    plan = serving_host_plan(variant, variant.tp_degree, variant.instance_type)
    status = [c.source for c in load(path).cells if c.cell_type == "code" and "nb.status_box(" in c.source]
    assert status == [load(path).cells[1].source], f"{path.name}: the status box is the first code cell"
    assert f'nb.status_box("{variant.name}")' in status[0]
    (row,) = [line for line in StatusBox(variant.name).markdown().splitlines() if line.startswith("| serving host RAM")]
    assert f"~{plan.peak_gb:.1f} GB peak of {plan.available_gb:.1f} GB" in row and plan.instance in row


def test_serving_tables_and_draft_plot_render_headless():
    """06_serving's tables over the library's real outputs (computed ceilings, the draft table) and
    its drafts-per-step plot; the row table marks a failed row as it is."""
    from matplotlib.figure import Figure

    from gemma4lab import notebook as nb
    from gemma4lab.inf2.batch_roofline import batch_ceilings
    from gemma4lab.inf2.mtp_roofline import draft_table
    from gemma4lab.notebook import plots_draft

    ceilings = nb.batch_ceilings_table(batch_ceilings("e2b", (1, 4, 16)))
    assert [row[-1] for row in ceilings.rows] == ["47.3", "157", "443"]  # the field report's, beside the computed
    assert "unverified" in ceilings.note
    effect = nb.draft_effect_table(draft_table({"e2b": 3.5}, 4, ["e2b"]))
    assert effect.rows[0][0] == "e2b" and effect.rows[0][-1].endswith("x") and "unverified" in effect.note
    row = {"row": 0, "prompt": "q?", "prompt_tokens": 5, "answer": "x", "seq_match": False, "logits_match": True}
    table = nb.batch_rows_table([{**row, "logits_max_err": 1e-6, "logits_tolerance": 1e-5, "coherent": None}])
    assert table.rows[0][4] is False and table.rows[0][6] == "1e-06 / 1e-05"
    assert isinstance(plots_draft.drafts_accepted([4, 2, 0], [4, 4, 4], [5, 3, 1]), Figure)


def test_serve_table_and_plot_render_headless():
    """07_serve's load table and latency/throughput figure over `run_load`'s levels (objects or the
    record's dicts): each level's ratio to one client, the N x one-client line for scale."""
    from matplotlib.figure import Figure

    from gemma4lab import notebook as nb
    from gemma4lab.notebook import plots_serve
    from gemma4lab.serving.load import Level

    levels = [
        Level(n, 2 * n, 0, True, 0, 0.05 * n, 0.07 * n, 16 * n, 1.0, 80.0 * min(n, 4), replies=[]) for n in (1, 2, 4, 8)
    ]
    table = nb.load_levels_table(levels)
    assert [row[-1] for row in table.rows] == ["1.00x", "2.00x", "4.00x", "4.00x"] and table.rows[0][5] == "50.0"
    assert nb.load_levels_table([level.as_dict() for level in levels]).rows == table.rows
    figure = plots_serve.latency_and_throughput([level.as_dict() for level in levels])
    assert isinstance(figure, Figure) and len(figure.axes) == 2
    assert len(figure.axes[1].lines) == 2  # measured, and N x one client
    capped = plots_serve.latency_and_throughput([level.as_dict() for level in levels], batch_rows=4)
    ideal = capped.axes[1].lines[1]  # perfect batching flattens once every row is busy
    assert list(ideal.get_ydata()) == [80.0, 160.0, 320.0, 320.0] and "4 rows" in ideal.get_label()


def test_the_trace_cell_makes_the_backends_calls(tmp_path, monkeypatch):
    """E2B's one-graph cell, against recording stand-ins for torch_neuronx and the artifact's save
    and load, makes the calls `backends.neuron.compile` makes with `neuron_recipe="trace"`: the
    backend's work directory and private current directory around the trace, the same example
    inputs, aliases and compiler arguments, the same free-space estimate for the cache, the cores guard
    around the load and the load inside `torch_neuronx.neuron_cores_context` (the fake knows no other
    placement name)."""
    import contextlib

    import torch

    from gemma4lab import notebook as nb_helpers
    from gemma4lib.backends import neuron
    from gemma4lib.backends.base import CompiledGraphs
    from gemma4lib.cache.artifacts import ArtifactCache
    from gemma4lib.device.graph import DeviceGraph, GraphShape
    from gemma4lib.port import PortSettings, build_graphs, load_model
    from gemma4lib.recipes import cores, neuron_env
    from gemma4lib.runtime import Engine, Steps

    path = NOTEBOOK_DIR / "01_e2b.ipynb"
    settings = PortSettings(variant="e2b", neuron_recipe="trace", cache_dir=str(tmp_path / "library-cache"))
    model = load_model(settings)
    graphs = build_graphs(model, settings)
    prefill, decode = graphs.prefill, graphs.decode
    guards = {name: getattr(neuron, name) for name in ("compiler_workdir", "own_directory")}
    runs = []
    for run in ("cell", "library"):
        calls = []

        def trace(module, example_inputs, *, input_output_aliases, compiler_workdir, calls=calls, **kwargs):
            inputs = [(tuple(t.shape), t.dtype) for t in example_inputs]
            calls.append(("trace", {"inputs": inputs, "aliases": sorted(input_output_aliases.values()), **kwargs}))
            return module

        @contextlib.contextmanager
        def placed(start_nc, nc_count, calls=calls):
            calls.append(("placed", [start_nc, nc_count]))
            yield
            calls.append(("unplaced", []))

        sdk = types.SimpleNamespace(
            trace=trace,
            move_trace_to_device=lambda traced, core, c=calls: c.append(("move", core)),
            neuron_cores_context=placed,
        )
        monkeypatch.setattr(neuron_env, "require", lambda module, purpose="", sdk=sdk: sdk)
        for name, guard in guards.items():

            @contextlib.contextmanager
            def recording(*args, name=name, guard=guard, calls=calls, **kwargs):
                calls.append((name, {}))
                with guard(*args, **kwargs) as value:
                    yield value

            monkeypatch.setattr(neuron, name, recording)
        monkeypatch.setattr(cores, "check_free", lambda first, n, label, c=calls: c.append(("check_free", [first, n])))
        monkeypatch.setattr(cores, "claim", lambda m, first, n, label, c=calls: c.append(("claim", [first, n])) or m)

        def save(traced, p, c=calls):
            c.append(("save", Path(p).name))
            Path(p).write_bytes(b"stand-in")

        monkeypatch.setattr(torch.jit, "save", save)
        monkeypatch.setattr(torch.jit, "load", lambda p, c=calls: c.append(("load", Path(p).name)) or _FakeLoaded(c))
        _record_need_bytes(monkeypatch, ArtifactCache, calls)
        if run == "cell":
            namespace = dict(
                backend="neuron", on_inf2=True, s=settings, model=model, prefill=prefill, decode=decode, torch=torch
            )
            namespace.update(nb=nb_helpers, time=__import__("time"), cache=ArtifactCache(tmp_path / "cell-cache"))
            namespace.update(Engine=Engine, Steps=Steps, CompiledGraphs=CompiledGraphs, GraphShape=GraphShape)
            namespace.update(DeviceGraph=DeviceGraph)
            namespace.update(display=lambda *shown: None)
            cell = _cell_starting(load(path), 'if on_inf2 and s.neuron_recipe == "trace"')
            exec(compile(cell, f"{path.name}[trace cell]", "exec"), namespace)
            runtime = namespace["compiled"]
        else:
            runtime = neuron.compile(build_graphs(model, settings, inplace=False), model, settings)
        runs.append((calls, runtime))
    (cell_calls, cell_runtime), (library_calls, library_runtime) = runs
    kinds = [kind for kind, _ in cell_calls]
    assert kinds == [
        *("get_or_build", "compiler_workdir", "own_directory", "trace", "save", "check_free"),
        *("placed", "load", "unplaced", "move", "claim"),
    ]
    assert cell_calls[0][1] > 0 and cell_calls[6][1] == [0, 1]  # the estimate; core 0, one core
    assert kinds == [kind for kind, _ in library_calls]
    for (kind, ours), (_, theirs) in zip(cell_calls, library_calls, strict=True):
        assert ours == theirs, f"{kind}: the cell asked {ours}, the backend {theirs}"
    assert cell_runtime.steps.prefill == library_runtime.steps.prefill == {}  # the prompt through decode
