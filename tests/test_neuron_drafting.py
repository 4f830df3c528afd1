"""Drafting in the ModelBuilder recipe with the SDK stood in: the keys, their example inputs, the K/V
states every key aliases, the checkpoint with the assistant, and the keys' modules run on CPU
(CPU layers for NxD's) through the host loop that drives them on inf2."""

from __future__ import annotations

import types

import pytest
import torch

from gemma4lib.errors import SettingsError
from gemma4lib.models.assistant import load_assistant
from gemma4lib.port import PortSettings, load_model, prompt_ids
from gemma4lib.recipes import neuron_drafting, neuron_env
from gemma4lib.reference import reference_greedy
from gemma4lib.tp.draft_rank_graph import KVDraftStep
from gemma4lib.tp.plan import make_plan
from gemma4lib.tp.rank_graph import CpuParallelFactory

K = 4


def _pair(variant):
    settings = PortSettings(variant=variant, draft="assistant", draft_tokens=K)
    model = load_model(settings)
    return settings, model, load_assistant(model, settings)


class _Recorder:
    """Stands in for `neuronx_distributed.trace.model_builder`."""

    def __init__(self):
        self.calls = []
        recorder = self

        class BaseModelInstance:
            def __init__(self, module_cls, input_output_aliases):
                self.module_cls, self.input_output_aliases = module_cls, input_output_aliases

        class ModelBuilder:
            def __init__(self, router, tp_degree, checkpoint_loader, compiler_workdir=None):
                recorder.loader = checkpoint_loader  # called by NxD only in shard_checkpoint
                recorder.calls.append(("init", {"tp_degree": tp_degree}))

            def add(self, key, model_instance, example_inputs, compiler_args=None, priority_model_idx=None):
                inputs = [tuple(t.shape) for t in example_inputs[0]]
                recorder.calls.append(
                    (
                        "add",
                        {
                            "key": key,
                            "instance": model_instance,
                            "inputs": inputs,
                            "dtypes": [t.dtype for t in example_inputs[0]],
                            "compiler_args": compiler_args,
                            "priority": priority_model_idx,
                        },
                    )
                )

            def trace(self, initialize_model_weights=True):
                recorder.calls.append(("trace", {"initialize_model_weights": initialize_model_weights}))
                raise RuntimeError("stop: no Neuron compiler here")

        self.module = types.SimpleNamespace(BaseModelInstance=BaseModelInstance, ModelBuilder=ModelBuilder)


@pytest.mark.parametrize("variant,tp", [("e4b", 2), ("26b-a4b", 2)])
def test_model_builder_drafting_keys(variant, tp, tmp_path, monkeypatch):
    settings, model, assistant = _pair(variant)
    recorder = _Recorder()
    monkeypatch.setattr(neuron_env, "require", lambda module, purpose="": recorder.module)
    with pytest.raises(RuntimeError, match="stop: no Neuron compiler here"):
        neuron_drafting.compile_drafting(
            model, assistant, tp, tmp_path, context_length=128, buckets=(64,), draft_tokens=K, ring=True
        )
    kinds = [kind for kind, _ in recorder.calls]
    assert kinds == ["init", "add", "add", "add", "trace"]
    init, *adds, trace = (args for _, args in recorder.calls)
    assert [a["key"] for a in adds] == ["prefill64", "verify", "draft"]
    assert all(a["priority"] is None for a in adds) and trace == {"initialize_model_weights": False}
    hidden = model.config.hidden_size
    by_key = {a["key"]: a for a in adds}
    assert by_key["draft"]["inputs"] == [(1, 1, 2 * hidden), (1,)]
    assert by_key["verify"]["inputs"][0] == (1, K + 1, hidden) and by_key["prefill64"]["inputs"][0] == (1, 64, hidden)
    assert "-O2" in by_key["verify"]["compiler_args"] and "-O1" in by_key["prefill64"]["compiler_args"]
    # verify is NxD Inference's k-token speculation model: tiling 2 at -O2; the draft step decode's tiling 1
    assert "--cc-pipeline-tiling-factor=2" in by_key["verify"]["compiler_args"]
    assert by_key["draft"]["compiler_args"] == neuron_env.COMPILER_ARGS["decode"]
    assert "--cc-pipeline-tiling-factor=1" in by_key["draft"]["compiler_args"]
    # the draft position takes the target graph's index dtype, whatever the graph gives
    assert by_key["draft"]["dtypes"][-1] == by_key["verify"]["dtypes"][-1]
    # every key's module (CPU layers for NxD's, same shapes) has the checkpoint's names plus the K/V
    # states, and aliases the same K/V parameters to outputs 2.. (the draft key: unchanged)
    checkpoint = recorder.loader()  # the lazy loader: built when NxD's shard_checkpoint calls it
    assert any(k.startswith("assistant.model.layers.") for k in checkpoint) and init["tp_degree"] == tp
    for a in adds:
        build = a["instance"].module_cls  # the key's module builder, handed to NxD's BaseModelInstance
        assert build.func is neuron_drafting.key_module
        config, aconfig, plan, read_layers, shapes, k, name, dtype = build.args
        module = neuron_drafting.key_module(
            config, aconfig, plan, read_layers, shapes, k, name, torch.float32, factory=CpuParallelFactory(tp)
        )
        names = set(module.state_dict())
        assert {n for n in names if not n.startswith("kv.")} == set(checkpoint)
        assert sorted(module.aliases().values()) == list(range(2, 2 + len(module.kv)))
        assert {f"kv.{i}" for i in range(len(module.kv))} <= names


def test_the_drafting_keys_run_on_cpu_from_the_nxd_checkpoint():
    """E2B at TP=1: the keys' modules loaded from the checkpoint the loader returns, driven by the
    host loop: tokens equal the reference, drafts accepted."""
    settings, model, assistant = _pair("e2b")
    plan = make_plan(model.config, 1, model.variant)
    checkpoint = neuron_drafting.drafting_checkpoint(model, assistant, plan, torch.float32)
    shapes = neuron_drafting.drafting_shapes(128, (64,), K, True)
    modules = neuron_drafting.build_drafting_modules(
        model.config, assistant.model.config, plan, assistant.read_layers, shapes, K, factory=CpuParallelFactory(1)
    )
    missing, unexpected = modules["verify"].load_state_dict(checkpoint, strict=False)
    assert not unexpected and all(m.startswith("kv.") for m in missing)
    from gemma4lib.generation.drafters import AssistantDrafter
    from gemma4lib.runtime import Engine, Steps

    steps = Steps(
        {64: KVDraftStep(modules["prefill64"])},
        verify=KVDraftStep(modules["verify"]),
        draft=KVDraftStep(modules["draft"]),
    )
    runtime = Engine.for_model(model, steps, batch=1, context_length=128, draft_tokens=K, drafter=AssistantDrafter())
    ids = prompt_ids(model, settings)
    generation = runtime.generate(ids, 24)
    assert generation.tokens == reference_greedy(model.lm, ids, 24)
    assert generation.accepted_per_step > 1.0


def test_a_drafted_batch_compiles_a_join_key_per_bucket(tmp_path, monkeypatch):
    """With joins (a server's drafted batch on neuron): a `row_prefill<bucket>` key per bucket at one
    row, its int32 row index first, with the prefill compiler set and the same K/V states as the other
    keys; it never routes like another key (one input more)."""
    _, model, assistant = _pair("e2b")
    recorder = _Recorder()
    monkeypatch.setattr(neuron_env, "require", lambda module, purpose="": recorder.module)
    with pytest.raises(RuntimeError, match="stop: no Neuron compiler here"):
        neuron_drafting.compile_drafting(
            model, assistant, 1, tmp_path, context_length=128, buckets=(16, 64), draft_tokens=K, batch=2, joins=True
        )
    adds = {args["key"]: args for kind, args in recorder.calls if kind == "add"}
    assert list(adds) == ["prefill16", "prefill64", "verify", "draft", "row_prefill16", "row_prefill64"]
    for bucket in (16, 64):
        join, batched = adds[f"row_prefill{bucket}"], adds[f"prefill{bucket}"]
        assert join["inputs"][0] == (1,) and join["dtypes"][0] == torch.int32
        assert join["inputs"][1][:2] == (1, bucket) and batched["inputs"][0][:2] == (2, bucket)
        assert join["compiler_args"] == batched["compiler_args"]
    shapes = [[tuple(s) for s in a["inputs"]] for a in adds.values()]
    assert len({str(s) for s in shapes}) == len(shapes)  # NxD's router tells every key apart


def test_a_drafting_join_writes_one_row_and_equals_the_batch_prefill():
    """The join key's module on CPU (TP 1, CPU layers): a prompt joined into row 1 of a batch of 2
    writes only row 1's K/V, the other row's stays bit-identical, and its logits and hidden state
    equal the batch-shaped prefill's for that row."""
    settings, model, assistant = _pair("e2b")
    plan = make_plan(model.config, 1, model.variant)
    shapes = neuron_drafting.drafting_shapes(64, (16,), K, True, batch=2, joins=True)
    modules = neuron_drafting.build_drafting_modules(
        model.config, assistant.model.config, plan, assistant.read_layers, shapes, K, factory=CpuParallelFactory(1)
    )
    checkpoint = neuron_drafting.drafting_checkpoint(model, assistant, plan, torch.float32)
    modules["prefill16"].load_state_dict(checkpoint, strict=False)
    join, batched = modules["row_prefill16"], modules["prefill16"]
    assert join.kv is batched.kv and join.num_inputs == batched.num_inputs + 1
    from gemma4lib.device.embedder import HostEmbedder

    ids = list(prompt_ids(model, settings))[:12]
    embeds, ple = HostEmbedder.from_text_model(model.text_model).inputs(torch.tensor([ids]), pad_to=16)
    start, length = torch.tensor([0], dtype=torch.int32), torch.tensor([12], dtype=torch.int32)
    for t in join.kv:
        t.data.normal_()  # row 0 holds another request's K/V
    before = [t.detach().clone() for t in join.kv]
    logits, hidden = KVDraftStep(join)(torch.tensor([1], dtype=torch.int32), embeds, ple, start, length)
    for old, new in zip(before, join.kv, strict=True):
        assert torch.equal(old[0], new[0]) and not torch.equal(old[1], new[1])
    both = KVDraftStep(batched)(embeds.expand(2, -1, -1), ple.expand(2, -1, -1, -1), start.repeat(2), length.repeat(2))
    torch.testing.assert_close(logits[0], both[0][1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(hidden[0], both[1][1], rtol=1e-4, atol=1e-4)


def test_the_host_calls_the_key_by_its_inputs():
    from gemma4lib.backends.neuron import drafting_steps

    calls = []
    traced = types.SimpleNamespace(
        nxd_model=types.SimpleNamespace(
            forward=lambda inputs: calls.append(inputs) or (torch.ones(1, 8), torch.zeros(1, 4))
        )
    )
    steps = drafting_steps(traced, (64,), has_ple=True, joins=True)
    logits, hidden = steps.draft(torch.zeros(1, 1, 8), torch.tensor([3]))
    steps.verify(*[torch.zeros(1)] * 4, torch.zeros(2))  # host K/V arguments (none here) are dropped
    steps.row_prefill[64](1, *[torch.zeros(1)] * 4)  # a join: its row index goes first, as int32
    assert [len(c) for c in calls] == [2, 4, 5] and logits.dtype == torch.float32
    assert calls[2][0].tolist() == [1] and calls[2][0].dtype == torch.int32
    assert drafting_steps(traced, (64,), has_ple=True).row_prefill == {}
    calls.clear()
    forward = lambda inputs: calls.append(inputs) or (torch.tensor([7], dtype=torch.int32), torch.zeros(1, 4))  # noqa: E731
    ids = drafting_steps(
        types.SimpleNamespace(nxd_model=types.SimpleNamespace(forward=forward)), (64,), True, chooses=True
    )
    assert ids.draft is None and ids.draft_ids is not None and ids.verify is not None
    verdict, _ = ids.verify_ids(*[torch.zeros(1)] * 4, torch.zeros(1, K, dtype=torch.int32), torch.zeros(2))
    token, _ = ids.draft_ids(torch.zeros(1, 1, 8), torch.tensor([3]))
    assert [len(c) for c in calls] == [5, 2]  # the drafts go to the verify key, the host's K/V do not
    assert token.dtype == verdict.dtype == torch.int32  # as the device gave them, not cast to float


def test_a_prefill_bucket_shaped_like_verify_is_refused():
    with pytest.raises(SettingsError, match="routes keys by shape"):
        neuron_drafting.drafting_shapes(128, (K + 1, 64), K, True)


def test_backend_neuron_drafting_reaches_the_drafting_compile(monkeypatch):
    from gemma4lib import port as port_module
    from gemma4lib.recipes import neuron_model_builder

    monkeypatch.setenv("GEMMA4LIB_INSTANCE_TYPE", "inf2.8xlarge")
    monkeypatch.setattr(neuron_env, "require_sdk", lambda *a, **k: None)
    monkeypatch.setattr(neuron_env, "require", lambda *a, **k: None)
    monkeypatch.setattr(neuron_model_builder, "compile_model_builder", lambda *a, **k: pytest.fail("plain keys"))
    reached = []

    def stop(*args, **kwargs):
        reached.append(kwargs)
        raise RuntimeError("stop: compile reached")

    monkeypatch.setattr(neuron_drafting, "compile_drafting", stop)
    settings = PortSettings(
        variant="e4b", backend="neuron", tp_degree=2, draft="assistant", draft_tokens=K, cache_dir=None
    )
    with pytest.raises(RuntimeError, match="stop: compile reached"):
        port_module.port(settings)
    assert reached[0]["draft_tokens"] == K and reached[0]["buckets"] == tuple(settings.prefill_buckets)
    assert reached[0]["chooses"] is True  # neuron's logits would cross a bus: the ids keys are built


def test_the_ids_keys_route_by_their_inputs_and_return_ids(tmp_path, monkeypatch):
    """With `chooses` (backend neuron): `verify_ids` beside verify, its drafts `[B, k]` int32 last (one
    input more: NxD routes it apart), the verify compiler set; `draft_ids` in place of draft."""
    settings, model, assistant = _pair("e4b")
    recorder = _Recorder()
    monkeypatch.setattr(neuron_env, "require", lambda module, purpose="": recorder.module)
    with pytest.raises(RuntimeError, match="stop: no Neuron compiler here"):
        neuron_drafting.compile_drafting(
            model, assistant, 2, tmp_path, context_length=128, buckets=(64,), draft_tokens=K, ring=True, chooses=True
        )
    adds = {args["key"]: args for kind, args in recorder.calls if kind == "add"}
    assert list(adds) == ["prefill64", "verify", "verify_ids", "draft_ids"]
    assert adds["verify_ids"]["inputs"] == [*adds["verify"]["inputs"], (1, K)]
    assert adds["verify_ids"]["dtypes"][-1] == torch.int32
    assert adds["verify_ids"]["compiler_args"] == adds["verify"]["compiler_args"]
    assert adds["draft_ids"]["inputs"] == [(1, 1, 2 * model.config.hidden_size), (1,)]
    shapes = [tuple(a["inputs"]) for a in adds.values()]
    assert len(set(shapes)) == len(shapes)  # no two keys share their input shapes


def test_the_ids_keys_run_on_cpu_and_return_bytes():
    """E2B at TP = 1, the ids keys' modules from the NxD checkpoint through the host loop: the tokens
    are the reference's, drafts kept, the verdict `k + 2` int32 a row and the draft's argmax 4 bytes."""
    settings, model, assistant = _pair("e2b")
    plan = make_plan(model.config, 1, model.variant)
    checkpoint = neuron_drafting.drafting_checkpoint(model, assistant, plan, torch.float32)
    shapes = neuron_drafting.drafting_shapes(128, (64,), K, True, chooses=True)
    modules = neuron_drafting.build_drafting_modules(
        model.config, assistant.model.config, plan, assistant.read_layers, shapes, K, factory=CpuParallelFactory(1)
    )
    missing, unexpected = modules["verify_ids"].load_state_dict(checkpoint, strict=False)
    assert not unexpected and all(m.startswith("kv.") for m in missing)
    from gemma4lib.generation.drafters import AssistantDrafter
    from gemma4lib.runtime import Engine, Steps

    returned = []

    def watched(step):
        def call(*args):
            out = step(*args)
            returned.append(out[0])
            return out

        return call

    steps = Steps(
        {64: KVDraftStep(modules["prefill64"])},
        verify=KVDraftStep(modules["verify"]),
        verify_ids=watched(KVDraftStep(modules["verify_ids"])),
        draft_ids=watched(KVDraftStep(modules["draft_ids"])),
    )
    runtime = Engine.for_model(model, steps, batch=1, context_length=128, draft_tokens=K, drafter=AssistantDrafter())
    ids = prompt_ids(model, settings)
    generation = runtime.generate(ids, 24)
    assert generation.tokens == reference_greedy(model.lm, ids, 24)
    assert generation.accepted_per_step > 1.0
    assert {tuple(t.shape) for t in returned} == {(1, K + 2), (1,)} and all(t.dtype == torch.int32 for t in returned)


def test_the_memory_plan_counts_the_assistant_per_core():
    from gemma4lib.inf2.memory_plan import plan_core_memory
    from gemma4lib.inf2.mtp_roofline import assistant_rank_bytes
    from gemma4lib.inf2.params import meta_model

    plain, drafted = plan_core_memory("31b"), plan_core_memory("31b", draft_tokens=K)
    assert plain.assistant_gib == 0.0 and drafted.weights_gib == plain.weights_gib
    assert drafted.assistant_gib == pytest.approx(assistant_rank_bytes(meta_model("31b"), 8) / 2**30)
    assert drafted.kv_gib > plain.kv_gib  # the rings' k + 1 extra slots
    assert drafted.total_gib == pytest.approx(plain.total_gib + drafted.assistant_gib + drafted.kv_gib - plain.kv_gib)
    # the split parts shrink with TP, the replicated scoring table does not
    assert assistant_rank_bytes(meta_model("31b"), 8) < assistant_rank_bytes(meta_model("31b"), 4)


def test_the_drafting_checkpoint_is_built_only_when_nxd_shards(tmp_path, monkeypatch):
    """The target + assistant checkpoint is not alive during `trace` (NxD v2.28.0 calls the loader
    only in `shard_checkpoint`)."""
    settings, model, assistant = _pair("e2b")
    recorder = _Recorder()
    monkeypatch.setattr(neuron_env, "require", lambda module, purpose="": recorder.module)
    monkeypatch.setattr(neuron_drafting, "drafting_checkpoint", lambda *a: recorder.calls.append(("checkpoint", {})))
    with pytest.raises(RuntimeError, match="stop: no Neuron compiler here"):
        neuron_drafting.compile_drafting(
            model, assistant, 1, tmp_path, context_length=128, buckets=(64,), draft_tokens=K
        )
    assert [kind for kind, _ in recorder.calls] == ["init", "add", "add", "add", "trace"]
    recorder.loader()
    assert recorder.calls[-1][0] == "checkpoint"


def test_the_draft_position_follows_the_graphs_index_dtype(tmp_path, monkeypatch):
    from test_neuron_recipes import int32_graph_inputs

    int32_graph_inputs(monkeypatch)
    settings, model, assistant = _pair("e2b")
    recorder = _Recorder()
    monkeypatch.setattr(neuron_env, "require", lambda module, purpose="": recorder.module)
    with pytest.raises(RuntimeError, match="stop: no Neuron compiler here"):
        neuron_drafting.compile_drafting(
            model, assistant, 1, tmp_path, context_length=128, buckets=(64,), draft_tokens=K
        )
    adds = {a["key"]: a for kind, a in recorder.calls if kind == "add"}
    assert adds["draft"]["dtypes"][-1] == torch.int32
    assert all(adds[k]["dtypes"][-2:] == [torch.int32, torch.int32] for k in ("prefill64", "verify"))


class _RoutedDrafting:
    """A loaded drafting model on CPU: `neuron_drafting`'s own key modules (CPU layers, its checkpoint)
    over one set of K/V parameters, each call routed by its inputs' shapes as NxD routes it."""

    def __init__(self, model, assistant, shapes):
        plan = make_plan(model.config, 1, model.variant)
        checkpoint = neuron_drafting.drafting_checkpoint(model, assistant, plan, torch.float32)
        modules = neuron_drafting.build_drafting_modules(
            model.config, assistant.model.config, plan, assistant.read_layers, shapes, K,
            factory=CpuParallelFactory(1), keyed=True,
        )  # fmt: skip
        next(iter(modules.values())).load_state_dict(checkpoint, strict=False)
        self.routes, self.keys = {}, []
        for name, shape in shapes.items():
            inputs = neuron_drafting.key_example_inputs(model, name, shape, torch.float32)
            self.routes[tuple(tuple(t.shape) for t in inputs)] = (name, KVDraftStep(modules[name]))
        self.nxd_model = types.SimpleNamespace(forward=self.forward)

    def forward(self, inputs):
        name, step = self.routes[tuple(tuple(t.shape) for t in inputs)]
        self.keys.append(name)
        return step(*inputs)


def test_drafting_keys_of_each_context_bucket_route_by_their_positions(tmp_path, monkeypatch):
    """`backend="neuron"`, drafting with buckets (32, 64) in a 128-token context: the bucket keys
    (`prefill16@32`, `verify@32`, `verify_ids@64`, ...) take their read positions first, so every key
    routes apart; a row's verifies climb the buckets, with logits kept (the check) and as the greedy
    verdict (a server's rows), and both runs equal HF's greedy tokens."""
    from gemma4lib.port import compile_graphs
    from gemma4lib.recipes import neuron_model_builder

    monkeypatch.setenv("GEMMA4LIB_INSTANCE_TYPE", "inf2.8xlarge")
    monkeypatch.setattr(neuron_env, "require_sdk", lambda *a, **k: None)
    monkeypatch.setattr(neuron_env, "require", lambda *a, **k: None)
    settings = PortSettings(
        variant="e2b", backend="neuron", draft="assistant", draft_tokens=K, context_length=128,
        prefill_buckets=(16,), context_buckets=(32, 64), cache_dir=str(tmp_path),
    )  # fmt: skip
    model = load_model(settings)
    loaded = {}

    def compile_stub(m, assistant, tp, folder, **kw):
        shapes = neuron_drafting.drafting_shapes(
            kw["context_length"], kw["buckets"], kw["draft_tokens"], kw["ring"], kw["batch"], kw["joins"],
            kw["chooses"], kw["contexts"],
        )  # fmt: skip
        loaded["model"] = _RoutedDrafting(m, assistant, shapes)
        (folder / "manifest.json").write_text("{}")

    monkeypatch.setattr(neuron_drafting, "compile_drafting", compile_stub)
    monkeypatch.setattr(neuron_model_builder, "load_model_builder", lambda path, tp: loaded["model"])
    engine = compile_graphs(model, settings).runtime
    routed = loaded["model"]
    assert {"prefill16@32", "verify@32", "verify@64", "verify_ids@32", "verify_ids@64", "draft_ids@32"} <= {
        n for _, (n, _) in routed.routes.items()
    }
    assert len(routed.routes) == len({n for n, _ in routed.routes.values()})  # no two keys share input shapes
    ids = prompt_ids(model, settings)
    new = 60 - len(ids)  # from inside the first bucket to past the second
    reference = reference_greedy(model.lm, ids, new)
    for keep_logits, verify in ((True, "verify"), (False, "verify_ids")):
        routed.keys.clear()
        assert engine.generate(ids, new, keep_logits=keep_logits).tokens == reference
        for graph in (verify, "draft_ids"):  # the verifies and the assistant's drafts climb the buckets
            ran = [k for k in routed.keys if k.partition("@")[0] == graph]
            assert ran[0] == f"{graph}@32" and f"{graph}@64" in ran, routed.keys
