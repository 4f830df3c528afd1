"""One engine: every combination of batch, drafting, sampling and backend runs through one graph
builder, one loop and one backend contract, or is refused before anything compiles.

The composition table: {B = 1, B = 3 with prompts of different lengths} x {no draft, Gemma-4's
assistant k = 3} x {greedy, sampled} x {cpu, eager, xla, gloo TP = 2, neuron with the SDK stood in,
a toy backend registered here alone}. A greedy cell passes SEQ_MATCH, LOGITS_MATCH and coherence on
every row; a sampled cell samples with a nucleus of one token (top-p 1e-6), which must reproduce the
greedy tokens exactly, and its logits must pass LOGITS_MATCH along them (the distribution of real
samples is tests/test_rejection.py's). The table the test checks is docs/ENGINE.md's.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from gemma4lib import checks
from gemma4lib.backends import registry
from gemma4lib.backends.base import Backend, CompiledGraphs
from gemma4lib.errors import BadPromptError, PromptTooLongError, SettingsError
from gemma4lib.port import PortSettings, eos_ids, load_model, prompt_rows, requests_for
from gemma4lib.reference import reference_greedy
from gemma4lib.runtime import Request, Sampling

DOC = Path(__file__).resolve().parent.parent / "docs" / "ENGINE.md"
K, NEW = 3, 12
SHAPES = dict(context_length=64, prefill_buckets=(32,), max_new_tokens=NEW, warmup=0, iters=1)
NUCLEUS = Sampling(temperature=1.0, top_p=1e-6, seed=4)  # keeps only the argmax: greedy, through the sampler
BACKENDS = ("cpu", "eager", "xla", "gloo", "neuron", "toy")
REFUSED = {("gloo", "draft", "sampled"): "backend 'gloo'", ("neuron", "draft", "sampled"): "backend 'neuron'"}


def cells():
    for backend in BACKENDS:
        for batch in (1, 3):
            for draft in ("plain", "draft"):
                for sampling in ("greedy", "sampled"):
                    yield backend, batch, draft, sampling


def outcome(backend: str, batch: int, draft: str, sampling: str) -> str:
    """What this file does with a cell (the table's last column)."""
    refused = REFUSED.get((backend, draft, sampling))
    if refused:
        return f"refused before compiling (SettingsError: {refused})"
    if backend == "cpu":
        for cell in AOT:
            values = getattr(cell, "values", cell)
            if tuple(values) == (batch, draft, sampling):
                slow = "" if values is cell else ", `-m slow`"
                return f"every row checked (AOTInductor{slow})"
        return "the eager cell's graphs, AOTInductor-compiled in the cells above (not run as a cell)"
    if backend == "xla":
        if (batch, draft, sampling) in XLA:
            return "every row checked (the XLA lane, .venv-xla)"
        return "not run"
    return "every row checked"


def table() -> str:
    """docs/ENGINE.md's composition table, from `cells()`, `REFUSED`, `AOT` and `XLA`."""
    lines = ["| backend | batch | draft | sampling | outcome |", "|---|---|---|---|---|"]
    for backend, batch, draft, sampling in cells():
        result = outcome(backend, batch, draft, sampling)
        name = {"gloo": "gloo (cpu, TP=2)", "neuron": "neuron (SDK stood in)", "toy": "toy (registered in a test)"}
        draft_name = "assistant, k=3" if draft == "draft" else "none"
        lines.append(f"| {name.get(backend, backend)} | {batch} | {draft_name} | {sampling} | {result} |")
    return "\n".join(lines)


def test_the_docs_carry_the_table_this_test_checks():
    text = DOC.read_text()
    found = re.search(r"<!-- composition table -->\n(.*?)\n<!-- end -->", text, re.S)
    assert found, "docs/ENGINE.md lost its composition table markers"
    assert found.group(1).strip() == table(), "docs/ENGINE.md's table is stale: paste tests/test_engine.table()"


# ---- the neuron backend with the SDK stood in ------------------------------------------------------


class _NxDStandIn:
    """What `load_model_builder` returns on inf2, emulated on CPU over the port's functional graphs: one
    set of K/V states shared by every key, routed by the input shapes (a key per bucket, decode or
    verify, draft), the states written back as the aliased outputs are on the device."""

    def __init__(self, graphs):
        self.graphs, self.kv = graphs, graphs.new_kv()
        self.nxd_model = self
        self.shapes: list[tuple[tuple[int, ...], ...]] = []

    def _graph(self, inputs):
        if len(inputs) == 2:  # the assistant's draft key: (inputs_embeds, position)
            return self.graphs.draft
        tokens = inputs[0].shape[1]
        target = self.graphs.target
        return target if tokens == target.shape.tokens else self.graphs.prefill[tokens]

    def forward(self, inputs):
        self.shapes.append(tuple(tuple(t.shape) for t in inputs))
        assert all(t.dtype == torch.int32 for t in inputs[-2 if len(inputs) > 2 else -1 :]), "index inputs int32"
        graph = self._graph(list(inputs))
        with torch.no_grad():
            out = graph(*inputs, *self.kv)
        out = out if isinstance(out, tuple) else (out,)
        if graph is self.graphs.draft:
            return out
        n = len(out) - len(self.kv)
        for old, new in zip(self.kv, out[n:], strict=True):
            old.copy_(new)
        return out[:n]

    def __call__(self, *inputs):
        return self.forward(inputs)[0]


@pytest.fixture
def neuron_stand_in(monkeypatch, tmp_path):
    """backend 'neuron' on CPU: the SDK checks pass, the compile writes nothing, the load returns the
    stand-in above (built from the very graphs the backend was handed); a cache of its own, so no
    empty entry is ever found by a real load."""
    from gemma4lib.backends import neuron
    from gemma4lib.recipes import cores, neuron_drafting, neuron_env, neuron_model_builder

    monkeypatch.setenv("GEMMA4LIB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("GEMMA4LIB_INSTANCE_TYPE", "inf2.8xlarge")
    monkeypatch.setattr(neuron_env, "require_sdk", lambda *a, **k: None)
    monkeypatch.setattr(neuron_env, "require", lambda *a, **k: None)
    monkeypatch.setattr(neuron_env, "check_versions", lambda: [])
    monkeypatch.setattr(neuron_model_builder, "compile_model_builder", lambda *a, **k: None)
    monkeypatch.setattr(neuron_drafting, "compile_drafting", lambda *a, **k: None)
    monkeypatch.setattr(cores, "claim", lambda module, *a, **k: module)
    loaded = []
    real = neuron.compile

    def compile_with_stand_in(graphs, model, settings, progress=False):
        stand_in = _NxDStandIn(graphs)
        loaded.append(stand_in)
        monkeypatch.setattr(neuron_model_builder, "load_model_builder", lambda *a, **k: stand_in)
        return real(graphs, model, settings, progress)

    row = registry.BACKENDS["neuron"]
    monkeypatch.setitem(registry.BACKENDS, "neuron", dataclasses.replace(row, compile=compile_with_stand_in))
    return loaded


@pytest.fixture
def toy_backend(monkeypatch):
    """A backend this test suite registers alone: a module-less `compile` (eager steps, counted) and one
    row in the table. Nothing else in the library knows it."""
    from gemma4lib.backends import eager

    compiled: list[list[str]] = []

    def compile_toy(graphs, model, settings, progress=False) -> CompiledGraphs:
        compiled.append(list(graphs.named()))
        out = eager.compile(graphs, model, settings, progress)
        return dataclasses.replace(out, compiler="toy")

    monkeypatch.setitem(registry.BACKENDS, "toy", Backend("toy", "a test's", "any CPU", compile=compile_toy))
    return compiled


# ---- the cells -------------------------------------------------------------------------------------


def _settings(backend: str, batch: int, draft: str) -> PortSettings:
    drafting = dict(draft="assistant", draft_tokens=K) if draft == "draft" else {}
    on = {"gloo": dict(backend="eager", tp_degree=2)}.get(backend, dict(backend=backend))
    return PortSettings(variant="e2b", batch_size=batch, **on, **drafting, **SHAPES)


def _run_cell(backend, batch, draft, sampling):
    settings = _settings(backend, batch, draft)
    model = load_model(settings)
    rows, eos = prompt_rows(model, settings), eos_ids(model)
    assert len(rows) == batch and (batch == 1 or len({len(r.ids) for r in rows}) > 1)  # different lengths
    requests = requests_for(rows, settings, eos)
    if sampling == "sampled":
        requests = [dataclasses.replace(r, sampling=NUCLEUS) for r in requests]
    refused = REFUSED.get((backend, draft, sampling))
    if refused:
        with pytest.raises(SettingsError, match=refused):
            registry.run_device(model, settings, requests, bench=False)
        return None
    run = registry.run_device(model, settings, requests, bench=False)
    assert len(run.rows) == batch
    for row, result in zip(rows, run.rows, strict=True):
        reference = reference_greedy(model.lm, row.ids, NEW, eos)
        report = checks.evaluate(
            model.lm,
            model.tokenizer,
            row.ids,
            result.tokens,
            reference,
            expect=row.expect,
            step_logits=result.step_logits,
        )
        assert report.seq_match, (backend, batch, draft, sampling, result.tokens, reference)
        assert report.logits_match, report.logits.explain()
        assert report.coherent, (row.text, report.answer)
        if draft == "draft":
            assert result.accepted_per_step and result.accepted_per_step > 1.0, result.emitted
    return run


SINGLE = [c for c in cells() if c[0] in ("eager", "toy")]


@pytest.mark.parametrize("backend,batch,draft,sampling", SINGLE)
def test_every_cell_on_the_cpu_engines(backend, batch, draft, sampling, toy_backend):
    _run_cell(backend, batch, draft, sampling)
    if backend == "toy":  # the toy backend compiled the graphs the settings name, through the contract
        names = toy_backend[-1]
        drafted = draft == "draft"
        assert ("verify" in names, "draft" in names, "decode" in names) == (drafted, drafted, not drafted)


# CI compiles the drafted batch (tests/test_bundle.py's drafted bundle is these programs: SHAPES and K); the
# two plain graph sets are batch-1 and batch-3 programs the other suites compile: slow-marked here.
AOT = [
    pytest.param(1, "plain", "greedy", marks=pytest.mark.slow),
    pytest.param(3, "plain", "sampled", marks=pytest.mark.slow),
    (3, "draft", "greedy"),
]


@pytest.mark.parametrize("batch,draft,sampling", AOT)
def test_cells_through_aotinductor(batch, draft, sampling):
    """The cpu backend (torch.export + AOTInductor): one cell of each graph set it compiles; the
    eager cells above run the same graphs uncompiled."""
    run = _run_cell("cpu", batch, draft, sampling)
    assert run.compiler == "cpu-aotinductor" and len(run.cache_hits) == (3 if draft == "draft" else 2)


@pytest.mark.parametrize("batch,draft,sampling", [c[1:] for c in cells() if c[0] == "gloo"])
def test_every_cell_on_the_gloo_ranks(batch, draft, sampling):
    run = _run_cell("gloo", batch, draft, sampling)
    if run is not None:
        assert run.details["ranks_agree"] and run.compiler == "cpu-gloo-tp"


@pytest.mark.parametrize("batch,draft,sampling", [c[1:] for c in cells() if c[0] == "neuron"])
def test_every_cell_on_the_neuron_backend_with_the_sdk_stood_in(batch, draft, sampling, neuron_stand_in):
    run = _run_cell("neuron", batch, draft, sampling)
    if run is None:
        assert not neuron_stand_in  # refused before any compile or load
        return
    (stand_in,) = neuron_stand_in
    assert {shape[0][0] for shape in stand_in.shapes} == {batch}  # every key called at the compiled batch


def test_a_drafted_neuron_port_loads_its_assistant_once(neuron_stand_in, monkeypatch):
    """The drafting keys compile the assistant `compile_graphs` loaded with the graphs, not another."""
    import gemma4lib.models.assistant as assistant_module

    loads, real = [], assistant_module.load_assistant
    monkeypatch.setattr(assistant_module, "load_assistant", lambda *a, **k: loads.append(a) or real(*a, **k))
    _run_cell("neuron", 1, "draft", "greedy")
    assert len(loads) == 1


XLA = [(1, "plain", "greedy"), (3, "draft", "greedy"), (3, "plain", "sampled"), (1, "draft", "sampled")]


@pytest.mark.parametrize("batch,draft,sampling", XLA)
def test_xla_cells_run_in_the_xla_lane(batch, draft, sampling):
    pytest.importorskip("torch_xla", reason="the XLA lane's cells run in .venv-xla (.ci/run's XLA lane)")
    run = _run_cell("xla", batch, draft, sampling)
    assert run.details["xla_fallbacks"] == 0 and set(run.details["xla_compilations"].values()) == {1}


# ---- every input check of the plain path, on every path -------------------------------------------


PATHS = {
    "plain": dict(backend="eager"),
    "batched": dict(backend="eager", batch_size=3),
    "drafted": dict(backend="eager", draft="assistant", draft_tokens=K),
    "batched + drafted": dict(backend="eager", batch_size=3, draft="assistant", draft_tokens=K),
    "prompt lookup": dict(backend="eager", draft="prompt_lookup", draft_tokens=K),
}
BAD = {
    "prompt longer than the context": (
        lambda n: Request(list(range(3, 3 + 70)), 1),
        PromptTooLongError,
        "prompt \\(70 tokens\\).*more than the compiled context length 64",
    ),
    "prompt + new tokens over the context": (
        lambda n: Request(list(range(3, 17)), 64 - 14 + 2),  # 14 + 52 - 1 = 65 positions
        PromptTooLongError,
        "K/V positions .*more than the compiled context length 64",
    ),
    "max_new_tokens 0": (lambda n: Request([5, 6, 7], 0), SettingsError, "max_new_tokens must be a whole number >= 1"),
    "empty prompt": (lambda n: Request([], 4), BadPromptError, "prompt has no tokens"),
    "out-of-vocabulary id": (lambda n: Request([5, n + 7], 4), BadPromptError, "outside this model's vocabulary"),
}


@pytest.fixture(scope="module")
def engines():
    out = {}
    for name, kwargs in PATHS.items():
        settings = PortSettings(variant="e2b", model="random", **kwargs, **SHAPES)
        model = load_model(settings)
        out[name] = (model, registry.compile_graphs(model, settings).runtime)
    return out


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bad", BAD)
def test_every_input_check_holds_on_every_path(engines, path, bad):
    model, engine = engines[path]
    make, error, words = BAD[bad]

    def forbidden(*args, **kwargs):
        raise AssertionError("a device step ran for a request that cannot run")

    steps = engine.steps
    saved = dict(vars(steps))
    for name in ("decode", "verify", "draft"):
        if getattr(steps, name) is not None:
            setattr(steps, name, forbidden)
    steps.prefill = {b: forbidden for b in steps.prefill}
    try:
        with pytest.raises(error, match=words):
            engine.generate_rows([make(int(model.config.vocab_size))])
    finally:
        vars(steps).update(saved)
    assert not engine.rows  # nothing admitted, nothing lost


def test_a_drafted_context_counts_the_draft_slots(engines):
    """Drafting writes k slots past the last kept token: the fit check counts them, so a request that
    fits plain decode exactly is refused with drafting, naming the draft slots."""
    _, plain = engines["plain"]
    _, drafted = engines["drafted"]
    fits = Request(list(range(3, 17)), 64 - 14 + 1 - K)
    plain.check(fits)
    drafted.check(fits)
    one_more = dataclasses.replace(fits, max_new_tokens=fits.max_new_tokens + 1)
    plain.check(one_more)
    with pytest.raises(PromptTooLongError, match=f"{K} draft slots"):
        drafted.check(one_more)


def test_prompts_at_batch_one_answer_those_prompts():
    settings = PortSettings(variant="e2b", prompts=("What is the capital of Spain?",), expects=("Madrid",))
    rows = prompt_rows(load_model(settings), settings)
    assert len(rows) == 1 and rows[0].expect == "Madrid" and rows[0].text.endswith("Spain?")


@pytest.mark.parametrize("draft", [None, "assistant"])
@pytest.mark.parametrize("bad", BAD)
def test_every_input_check_holds_on_the_tp_ranks(bad, draft, monkeypatch):
    """The gloo ranks' engine checks each request with the same engine check before any rank runs a step."""
    from gemma4lib.backends import gloo

    drafting = dict(draft=draft, draft_tokens=K) if draft else {}
    settings = PortSettings(variant="e2b", model="random", backend="eager", tp_degree=2, **drafting, **SHAPES)
    model = load_model(settings)
    monkeypatch.setattr(gloo.RankWorld, "call", lambda *a, **k: pytest.fail("the ranks ran a step for a bad request"))
    make, error, words = BAD[bad]
    with pytest.raises(error, match=words):
        registry.run_device(model, settings, [make(int(model.config.vocab_size))], bench=False)
