"""The Neuron recipes where the Neuron SDK is absent: clean imports, documented errors, the
environment fixes, the doctor, and the recipes' host side run on CPU over the exact modules a
Neuron compiler would receive."""

from __future__ import annotations

import importlib
import math
import subprocess
import sys
import types

import pytest
import torch

from gemma4lib.device.graph import GraphShape
from gemma4lib.errors import EnvironmentMismatchError, NeuronSDKMissingError
from gemma4lib.models.loading import build_tiny
from gemma4lib.models.variants import get_variant
from gemma4lib.recipes import NEURON_ENTRY_POINTS, RECIPE_MODULES, neuron_env

SDK_MODULES = ("torch_neuronx", "neuronx_distributed", "libneuronxla", "torch_xla")


def tiny(name):
    v = get_variant(name)
    return build_tiny(v, seed=v.tiny_seed)


def prompt(name, n=20):
    v = get_variant(name)
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(v.tiny_seed + 1)).tolist()


def test_recipe_modules_import_without_the_sdk():
    code = (
        "import sys, importlib\n"
        f"for m in {sorted(RECIPE_MODULES.values()) + ['gemma4lib.recipes.neuron_env', 'gemma4lib.inf2.doctor']!r}:\n"
        "    importlib.import_module(m)\n"
        f"loaded = [m for m in {SDK_MODULES!r} if m in sys.modules]\n"
        "assert not loaded, loaded\n"
        "assert 'transformers.utils.fx' not in sys.modules\n"
        "print('clean')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "clean" in out.stdout, out.stderr[-2000:]


def _call(entry):
    """Call an entry point with placeholder arguments: the SDK check must come before any use of them."""
    placeholders = {
        "compile_trace": lambda f: f(None, 64),
        "load": lambda f: f("/nonexistent/model.pt"),
        "compile_tp_alias": lambda f: f(None, "/nonexistent", context_length=64),
        "load_tp_alias": lambda f: f("/nonexistent"),
        "seed_device_kv": lambda f: f(None, "/nonexistent", []),
        "compile_model_builder": lambda f: f(None, 8, "/nonexistent", context_length=64, prefill_len=32),
        "load_model_builder": lambda f: f("/nonexistent", 8),
        "NxDParallelFactory": lambda f: f(8),
    }
    return placeholders[entry.__name__](entry)


@pytest.mark.parametrize("module,entry", [(m, e) for m, entries in NEURON_ENTRY_POINTS.items() for e in entries])
def test_neuron_entry_points_raise_the_documented_error(module, entry):
    if neuron_env.sdk_present():
        pytest.skip("Neuron SDK installed")
    fn = getattr(importlib.import_module(module), entry)
    with pytest.raises(NeuronSDKMissingError) as info:
        _call(fn)
    message = str(info.value)
    assert "Neuron SDK package" in message and "is not installed here" in message
    assert any(dist in message for dist in neuron_env.SDK_PINS)
    assert neuron_env.DLAMI_VENV in message and neuron_env.NEURON_PIP_INDEX in message
    assert isinstance(info.value, ImportError)  # callers catching ImportError keep working


def test_neuron_backend_raises_before_compiling():
    from gemma4lib.backends import neuron

    m = tiny("e2b")
    settings = types.SimpleNamespace(
        tp_degree=1, cache_dir=None, context_length=64, ring_kv=False, prefill_buckets=(32,), decode_experts="dense"
    )
    with pytest.raises(NeuronSDKMissingError, match="torch-neuronx"):
        neuron.compile(m, settings)


def test_installed_but_broken_sdk_is_a_mismatch_not_missing(monkeypatch):
    monkeypatch.setattr(neuron_env, "metadata_version", lambda dist: "2.9.0.2.12.22436")
    monkeypatch.setattr(neuron_env, "apply_path_fix", lambda *a, **k: {})
    monkeypatch.setitem(sys.modules, "torch_neuronx", None)  # import fails although "installed"
    with pytest.raises(EnvironmentMismatchError, match="installed but failed to import"):
        neuron_env.require("torch_neuronx")


# ---- versions and the doctor ---------------------------------------------------------------------


def test_version_checks_against_the_pins(monkeypatch):
    found = {
        "torch-neuronx": "2.9.0.2.12.22436",
        "neuronx-cc": "2.23.6484.0+0a1b2c3",
        "neuronx-distributed": "0.16.0",
        "libneuronxla": None,
        "transformers": neuron_env.TRANSFORMERS_PIN,
    }
    monkeypatch.setattr(neuron_env, "metadata_version", found.get)
    rows = {r["package"]: r for r in neuron_env.check_versions()}
    assert rows["torch-neuronx"]["ok"] and rows["neuronx-cc"]["ok"] and rows["transformers"]["ok"]
    assert not rows["neuronx-distributed"]["ok"] and not rows["libneuronxla"]["ok"]
    assert rows["neuronx-distributed"]["pinned"] == ["0.17.26814"]


def test_doctor_reports_the_sdk_missing():
    from gemma4lib.inf2.doctor import format_doctor, run_doctor

    if neuron_env.sdk_present():
        pytest.skip("Neuron SDK installed")
    report = run_doctor()
    assert report["sdk_present"] is False and report["ok"] is False
    assert any(r["package"] == "torch-neuronx" and r["found"] is None for r in report["versions"])
    assert any("Neuron SDK not found" in w for w in report["warnings"])
    text = format_doctor(report)
    assert "torch-neuronx" in text and "missing" in text and "CPU profile only" in text


def test_doctor_with_a_simulated_sdk(monkeypatch):
    from gemma4lib.inf2 import doctor

    pins = {d: v[0] for d, v in neuron_env.SDK_PINS.items()} | {"transformers": neuron_env.TRANSFORMERS_PIN}
    pins["neuronx-distributed"] = "0.16.0"
    monkeypatch.setattr(neuron_env, "metadata_version", pins.get)
    monkeypatch.setattr(
        doctor,
        "neuron_devices",
        lambda: {"dev_nodes": [], "devices": 6, "cores": 12, "neuron_ls": None, "source": "test"},
    )
    monkeypatch.setattr(doctor, "host_ram_bytes", lambda: 128 * 2**30)
    report = doctor.run_doctor("31b", 8)
    assert report["sdk_present"]
    assert any("neuronx-distributed 0.16.0 is not the pinned 0.17.26814" in w for w in report["warnings"])
    assert any("will likely be killed" in w and "inf2.24xlarge" in w for w in report["warnings"])
    assert report["tp"] == {"degree": 8, "ok": True}
    report = doctor.run_doctor("26b-a4b", 3)
    assert not report["tp"]["ok"] and "use tp_degree 1 or 2 or 4 or 8" in report["tp"]["error"]


def test_compile_peak_estimate_is_calibrated_to_the_field_report():
    from gemma4lib.inf2.doctor import estimate_compile_peak_gb

    est = estimate_compile_peak_gb("31b", 8)
    assert abs(est["peak_gb"] - 182) / 182 < 0.05
    assert est["smallest_instance_with_headroom"] == "inf2.24xlarge"
    # E2B's trace keeps the weights out of the NEFF: the host model + one device copy fit an inf2.xlarge;
    # its default ModelBuilder compile needs a larger host
    e2b = estimate_compile_peak_gb("e2b", recipe="trace")
    assert e2b["recipe"] == "trace" and e2b["peak_gb"] < 16 * 2**30 / 1e9
    assert e2b["smallest_instance_with_headroom"] == "inf2.xlarge"
    e2b_mb = estimate_compile_peak_gb("e2b")
    assert e2b_mb["recipe"] == "model_builder" and e2b_mb["peak_gb"] > 16 * 2**30 / 1e9
    assert e2b_mb["smallest_instance_with_headroom"] == "inf2.8xlarge"


# ---- the environment fixes -----------------------------------------------------------------------


def test_fx_shim_installs_only_when_needed():
    utils = types.ModuleType("transformers.utils")
    namespace = {"transformers.utils": utils}
    assert neuron_env.fx_shim_status(namespace) == "needed"
    assert neuron_env.install_fx_shim(namespace) == "shim"
    shim = namespace["transformers.utils.fx"]
    assert utils.fx is shim and neuron_env.install_fx_shim(namespace) == "shim"  # idempotent

    # the way neuronx_distributed uses it: class HFTracerWrapper(NxDTracer, HFTracer)
    class NxDTracer(torch.fx.Tracer):
        pass

    class HFTracerWrapper(NxDTracer, shim.HFTracer):
        def __init__(self, **config):
            super().__init__(
                autowrap_modules=config["autowrap_modules"], autowrap_functions=config["autowrap_functions"]
            )

    graph = HFTracerWrapper(autowrap_modules=(math,), autowrap_functions=()).trace(torch.nn.Linear(2, 2))
    assert [node.op for node in graph.nodes][0] == "placeholder" and "linear" in str(graph)

    real = types.ModuleType("transformers.utils.fx")
    real.HFTracer = object
    namespace = {"transformers.utils": types.ModuleType("transformers.utils"), "transformers.utils.fx": real}
    assert neuron_env.install_fx_shim(namespace) == "real"
    assert namespace["transformers.utils.fx"] is real
    assert neuron_env.install_fx_shim({}) == "no-transformers"


def test_fx_shim_status_of_this_environment():
    # transformers 5.23 has no transformers.utils.fx: the shim would be needed (and is not installed
    # by merely importing the library)
    assert neuron_env.fx_shim_status() in ("needed", "shim")


def test_path_fix(tmp_path):
    (tmp_path / "bin").mkdir()
    env = {"PATH": "/usr/bin"}
    result = neuron_env.apply_path_fix(env, prefix=str(tmp_path))
    assert env["PATH"].split(":")[0] == str(tmp_path / "bin") and result["added"] == [str(tmp_path / "bin")]
    assert neuron_env.apply_path_fix(env, prefix=str(tmp_path))["added"] == []  # only once


def test_compiler_args_and_pins_are_single_sourced():
    assert neuron_env.compiler_args("prefill")[-1] == "-O1" and neuron_env.compiler_args("decode")[-1] == "-O2"
    assert "--enable-mixed-precision-accumulation" in neuron_env.compiler_args("decode")
    assert neuron_env.SDK_PINS["neuronx-distributed"] == ("0.17.26814",)


# ---- the recipes' host side on CPU ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["e2b", "e4b"])
def test_trace_recipe_module_and_host_loop_on_cpu(name):
    """The module that torch_neuronx.trace would get, driven with device aliasing emulated."""
    from gemma4lib.recipes import neuron_trace
    from gemma4lib.reference import reference_greedy

    m = tiny(name)
    module = neuron_trace.build_kv_module(m, 64)
    aliases = module.aliases()
    assert sorted(aliases.values()) == list(range(1, 1 + len(module.kv)))
    assert all(isinstance(p, torch.nn.Parameter) and not p.requires_grad for p in aliases)
    ids = prompt(name)
    result = neuron_trace.cpu_check(m, ids, 16, 64)
    assert result["prefill_mode"] == "decode-steps"
    assert result["tokens"] == reference_greedy(m.lm, ids, 16)


def test_host_runtime_over_device_steps():
    """The glue the `neuron` backend puts between the runtime and a device module."""
    from gemma4lib.recipes import neuron_trace
    from gemma4lib.recipes.common import AliasEmulator, DeviceStep, StepwisePrefill
    from gemma4lib.reference import reference_greedy
    from gemma4lib.runtime import HostRuntime

    m = tiny("e2b")
    module = neuron_trace.build_kv_module(m, 64)
    step = DeviceStep(AliasEmulator(module), module.num_inputs)
    runtime = HostRuntime(m, {32: StepwisePrefill(step, module.num_inputs)}, step, [], 64)
    ids = prompt("e2b")
    assert runtime.generate(ids, 12).tokens == reference_greedy(m.lm, ids, 12)


def test_model_builder_checkpoint_names_match_the_compiled_module():
    """NxD matches checkpoint keys to the traced module's parameter names: check them on CPU."""
    from gemma4lib.recipes import neuron_model_builder as mb
    from gemma4lib.recipes.common import graph_example_inputs
    from gemma4lib.tp import make_plan
    from gemma4lib.tp.rank_graph import CpuParallelFactory

    m = tiny("26b-a4b")
    plan = make_plan(m.config, 8, m.variant)
    checkpoint = mb.nxd_checkpoint(m, plan, torch.float32)
    forms = mb.bucket_expert_forms("selective")
    assert forms == {"prefill": "dense", "decode": "selective"}
    for key, shape in mb.bucket_shapes(64, 32).items():
        module = mb.rank_module(
            m.config, plan, shape, torch.float32, factory=CpuParallelFactory(8), expert_form=forms[key]
        )
        assert module.graph.expert_form == forms[key]
        assert all(e.form == forms[key] for e in module.graph._rank_users)
        names = {k for k in module.state_dict() if not k.startswith("kv.")}
        assert names == set(checkpoint)  # one checkpoint for both expert forms
        assert [tuple(t.shape) for t in module.example_inputs()] == [
            tuple(t.shape) for t in graph_example_inputs(m.config, shape, torch.float32)
        ]
        assert {f"kv.{i}" for i in range(len(module.kv))} == set(module.state_dict()) - names
    assert checkpoint["graph.spmd_rank.rank"].tolist() == list(range(8))
    assert any(k.endswith("layer_scalar") for k in checkpoint)


def test_neuron_cache_key_tracks_what_changes_the_artifact():
    from gemma4lib.backends.neuron import neuron_cache_key

    m = tiny("12b")
    shapes = {"decode": GraphShape(1, 1, 64), "prefill": GraphShape(1, 32, 64)}
    key, parts = neuron_cache_key(m, "model_builder", 2, shapes, neuron_env.COMPILER_ARGS, torch.bfloat16)
    assert key == neuron_cache_key(m, "model_builder", 2, shapes, neuron_env.COMPILER_ARGS, torch.bfloat16)[0]
    assert key != neuron_cache_key(m, "model_builder", 4, shapes, neuron_env.COMPILER_ARGS, torch.bfloat16)[0]
    other_shapes = {**shapes, "prefill": GraphShape(1, 64, 64)}
    assert key != neuron_cache_key(m, "model_builder", 2, other_shapes, neuron_env.COMPILER_ARGS, torch.bfloat16)[0]
    args = {**neuron_env.COMPILER_ARGS, "decode": "-O1"}
    assert key != neuron_cache_key(m, "model_builder", 2, shapes, args, torch.bfloat16)[0]
    # the decode graph's expert form: dense keeps the old key, selective is another artifact
    assert (
        key
        == neuron_cache_key(
            m, "model_builder", 2, shapes, neuron_env.COMPILER_ARGS, torch.bfloat16, decode_experts="dense"
        )[0]
    )
    selective, selective_parts = neuron_cache_key(
        m, "model_builder", 2, shapes, neuron_env.COMPILER_ARGS, torch.bfloat16, decode_experts="selective"
    )
    assert selective != key and selective_parts["decode_experts"] == "selective"
    assert set(parts["sdk"]) >= set(neuron_env.SDK_PINS)


# ---- dispatch and the ModelBuilder calls, with the SDK stood in by recording fakes -----------------


class _Recorder:
    """Stands in for `neuronx_distributed.trace.model_builder`: records what the recipe asks of it."""

    def __init__(self):
        self.calls = []
        recorder = self

        class BaseModelInstance:
            def __init__(self, module_cls, input_output_aliases):
                self.module_cls, self.input_output_aliases = module_cls, input_output_aliases

        class ModelBuilder:
            def __init__(self, router, tp_degree, checkpoint_loader, compiler_workdir=None):
                recorder.calls.append(
                    ("init", {"router": router, "tp_degree": tp_degree, "checkpoint": checkpoint_loader()})
                )

            def add(
                self,
                key,
                model_instance,
                example_inputs,
                compiler_args=None,
                bucket_config=None,
                priority_model_idx=None,
            ):
                recorder.calls.append(
                    (
                        "add",
                        {
                            "key": key,
                            "inputs": [tuple(t.shape) for t in example_inputs[0]],
                            "compiler_args": compiler_args,
                            "priority": priority_model_idx,
                        },
                    )
                )

            def trace(self, initialize_model_weights=True, dry_run=False):
                recorder.calls.append(("trace", {"initialize_model_weights": initialize_model_weights}))
                raise RuntimeError("stop: no Neuron compiler here")

        self.module = types.SimpleNamespace(BaseModelInstance=BaseModelInstance, ModelBuilder=ModelBuilder)


@pytest.mark.parametrize("name,tp", [("e2b", 1), ("e4b", 2), ("26b-a4b", 2)])
def test_model_builder_recipe_calls(name, tp, tmp_path, monkeypatch):
    """E2B (TP=1) and E4B go through ModelBuilder like the big variants: two keys over one set of K/V
    states, PLE as a fourth host input, the decode key as the priority model (weight layout
    optimisation)."""
    from gemma4lib.recipes import neuron_model_builder

    recorder = _Recorder()
    monkeypatch.setattr(neuron_env, "require", lambda module, purpose="": recorder.module)
    model = tiny(name)
    with pytest.raises(RuntimeError, match="stop: no Neuron compiler here"):
        neuron_model_builder.compile_model_builder(
            model,
            tp,
            tmp_path,
            context_length=64,
            prefill_len=16,
            decode_experts="selective" if model.variant.is_moe else "dense",
        )
    kinds = [kind for kind, _ in recorder.calls]
    assert kinds == ["init", "add", "add", "trace"]
    init, prefill, decode, trace = (args for _, args in recorder.calls)
    assert init["tp_degree"] == tp and init["router"] is None
    assert init["checkpoint"]["graph.spmd_rank.rank"].tolist() == list(range(tp))
    assert (prefill["key"], prefill["priority"]) == ("prefill", None)
    assert (decode["key"], decode["priority"]) == ("decode", 0)
    hidden = model.config.hidden_size
    expected_decode = [(1, 1, hidden)]
    if name in ("e2b", "e4b"):  # the per-layer inputs are computed on the host and passed in
        expected_decode.append((1, 1, model.config.num_hidden_layers, model.config.hidden_size_per_layer_input))
    assert decode["inputs"] == expected_decode + [(1,), (1,)]
    assert prefill["inputs"][0] == (1, 16, hidden)
    assert "-O2" in decode["compiler_args"] and "-O1" in prefill["compiler_args"]
    assert trace == {"initialize_model_weights": False}


def test_model_builder_recipe_calls_with_a_batch(tmp_path, monkeypatch):
    """A batch of 3: both keys' example inputs carry 3 rows and one start/length per row."""
    from gemma4lib.recipes import neuron_model_builder

    recorder = _Recorder()
    monkeypatch.setattr(neuron_env, "require", lambda module, purpose="": recorder.module)
    model = tiny("e2b")
    with pytest.raises(RuntimeError, match="stop: no Neuron compiler here"):
        neuron_model_builder.compile_model_builder(model, 1, tmp_path, context_length=64, prefill_len=16, batch=3)
    _, prefill, decode, _ = (args for _, args in recorder.calls)
    cfg = model.config
    ple = (3, 1, cfg.num_hidden_layers, cfg.hidden_size_per_layer_input)
    assert decode["inputs"] == [(3, 1, cfg.hidden_size), ple, (3,), (3,)]
    assert prefill["inputs"][0] == (3, 16, cfg.hidden_size) and prefill["inputs"][-2:] == [(3,), (3,)]


@pytest.mark.parametrize(
    "name,tp,recipe",
    [
        ("e2b", 1, "model_builder"),
        ("e2b", 2, "model_builder"),
        ("e4b", 2, "model_builder"),
        ("12b", 2, "model_builder"),
        ("31b", 8, "model_builder"),
    ],
)
def test_backend_neuron_uses_the_neuron_recipe_at_every_tp(name, tp, recipe, monkeypatch):
    """`port(backend="neuron")` never falls back to the CPU gloo runner: at TP > 1 it compiles with
    ModelBuilder, and what ran is named by the record's recipe."""
    from gemma4lib import port as port_module
    from gemma4lib.inf2.memory_plan import neuron_recipe
    from gemma4lib.recipes import neuron_model_builder, neuron_trace
    from gemma4lib.tp import cpu_gloo

    assert neuron_recipe(get_variant(name), tp) == recipe
    monkeypatch.setenv("GEMMA4LIB_INSTANCE_TYPE", "inf2.24xlarge")
    monkeypatch.setattr(neuron_env, "require_sdk", lambda *a, **k: None)
    monkeypatch.setattr(neuron_env, "require", lambda *a, **k: None)
    monkeypatch.setattr(cpu_gloo, "run_tp_port", lambda *a, **k: pytest.fail("ran on CPU gloo ranks"))
    reached = []

    def stopper(label):
        def compile_stub(*args, **kwargs):
            reached.append(label)
            raise RuntimeError("stop: compile reached")

        return compile_stub

    monkeypatch.setattr(neuron_model_builder, "compile_model_builder", stopper("mb"))
    monkeypatch.setattr(neuron_trace, "compile_trace", stopper("trace"))
    settings = port_module.PortSettings(variant=name, model="random", backend="neuron", tp_degree=tp, cache_dir=None)
    with pytest.raises(RuntimeError, match="stop: compile reached"):
        port_module.port(settings)
    assert reached[0] == ("trace" if recipe == "trace" else "mb")


def test_trace_recipe_stays_selectable_at_tp_1(monkeypatch):
    """`neuron_recipe="trace"` reaches `torch_neuronx.trace`; it is refused at TP > 1 and by name."""
    from gemma4lib import port as port_module
    from gemma4lib.errors import TensorParallelError, UnknownNameError
    from gemma4lib.inf2.memory_plan import neuron_recipe
    from gemma4lib.recipes import neuron_model_builder, neuron_trace

    e2b = get_variant("e2b")
    assert neuron_recipe(e2b, 1) == "model_builder" and neuron_recipe(e2b, 1, "trace") == "trace"
    with pytest.raises(TensorParallelError, match="neuron_recipe='model_builder'"):
        port_module.PortSettings(variant="e2b", model="random", tp_degree=2, neuron_recipe="trace")
    with pytest.raises(UnknownNameError):
        port_module.PortSettings(variant="e2b", model="random", neuron_recipe="parallel_model_trace")
    monkeypatch.setenv("GEMMA4LIB_INSTANCE_TYPE", "inf2.xlarge")
    monkeypatch.setattr(neuron_env, "require_sdk", lambda *a, **k: None)
    monkeypatch.setattr(neuron_env, "require", lambda *a, **k: None)
    reached = []

    def stop(label):
        def compile_stub(*args, **kwargs):
            reached.append(label)
            raise RuntimeError("stop: compile reached")

        return compile_stub

    monkeypatch.setattr(neuron_model_builder, "compile_model_builder", stop("mb"))
    monkeypatch.setattr(neuron_trace, "compile_trace", stop("trace"))
    for requested, label in ((None, "mb"), ("trace", "trace")):
        settings = port_module.PortSettings(
            variant="e2b", model="random", backend="neuron", cache_dir=None, neuron_recipe=requested
        )
        with pytest.raises(RuntimeError, match="stop: compile reached"):
            port_module.port(settings)
        assert reached[-1] == label


def test_e2b_model_builder_prefill_and_decode_share_kv_on_cpu():
    """E2B's ModelBuilder modules at TP=1 (CPU layers for NxD's), loaded from the checkpoint the
    loader returns: one prefill call of the prompt writes the K/V that the decode module reads
    (one set of parameters), and the tokens equal the reference's."""
    from gemma4lib.recipes import neuron_model_builder as mb
    from gemma4lib.recipes.common import AliasEmulator, greedy_generate
    from gemma4lib.reference import reference_greedy
    from gemma4lib.tp import make_plan
    from gemma4lib.tp.rank_graph import CpuParallelFactory

    m = tiny("e2b")
    plan = make_plan(m.config, 1, m.variant)
    checkpoint = mb.nxd_checkpoint(m, plan, torch.float32)
    shapes = mb.bucket_shapes(64, 32)
    modules = {
        key: mb.rank_module(m.config, plan, shape, torch.float32, factory=CpuParallelFactory(1))
        for key, shape in shapes.items()
    }
    decode = modules["prefill"].sharing(modules["decode"].graph)
    for module in (modules["prefill"], decode):
        missing, unexpected = module.load_state_dict(checkpoint, strict=False)
        assert not unexpected and all(k.startswith("kv.") for k in missing)
    assert all(a is b for a, b in zip(decode.kv, modules["prefill"].kv, strict=True))
    assert decode.num_inputs == 4  # PLE is a host input, as for E4B
    from gemma4lib.device.embedder import HostEmbedder

    ids = prompt("e2b")
    result = greedy_generate(
        AliasEmulator(decode),
        HostEmbedder.from_text_model(m.text_model),
        ids,
        16,
        prefill=AliasEmulator(modules["prefill"]),
        prefill_len=32,
    )
    assert result["prefill_mode"] == "graph"
    assert result["tokens"] == reference_greedy(m.lm, ids, 16)


def test_e2b_memory_plan_names_where_each_recipe_compiles():
    """ModelBuilder's compile of E2B does not fit an inf2.xlarge's host RAM, the trace's does: the
    plan still fits (compile elsewhere, same chip) and says so."""
    from gemma4lib.inf2.hardware import GB, GIB, INSTANCES
    from gemma4lib.inf2.memory_plan import plan_core_memory

    mb = plan_core_memory("e2b")
    assert mb.recipe == "model_builder" and mb.instance == "inf2.xlarge" and mb.fits
    assert mb.compile_peak_gb * GB > INSTANCES["inf2.xlarge"].host_ram_gib * GIB
    assert mb.compile_host not in (None, "inf2.xlarge") and "compile on an" in mb.summary()
    trace = plan_core_memory("e2b", recipe="trace")
    assert trace.recipe == "trace" and trace.compile_host == "inf2.xlarge" and trace.fits
    assert trace.compile_peak_gb < mb.compile_peak_gb and "compile on an" not in trace.summary()
    assert trace.weights_gib == mb.weights_gib  # same device weights per core either way


def test_prefill_estimate_from_flops_and_bytes():
    """The computed floor of a prefill call: compute at the datasheet peak vs bytes at HBM speed,
    and what token-by-token decode steps would cost instead (E2B's trace recipe)."""
    from gemma4lib.inf2 import prefill
    from gemma4lib.inf2.hardware import BF16_FLOPS_PER_CORE, INSTANCES

    e2b = prefill.prefill_estimate("e2b", 128)
    assert e2b.compute_ms == pytest.approx(e2b.flops / BF16_FLOPS_PER_CORE * 1e3)
    assert e2b.memory_ms == pytest.approx(e2b.bytes / INSTANCES["inf2.xlarge"].bandwidth_bytes_s(1) * 1e3)
    assert e2b.expected_ms == max(e2b.compute_ms, e2b.memory_ms)
    longer = prefill.prefill_estimate("e2b", 512)
    assert 3.5 < longer.flops / e2b.flops < 4.5 and longer.bytes == e2b.bytes  # weights read once per call
    assert e2b.stepwise_ms == pytest.approx(128 * 1e3 / get_variant("e2b").field_report.decode_tok_s)
    assert e2b.stepwise_ms > 50 * e2b.expected_ms
    rows = prefill.prefill_table(128)
    assert {r["variant"] for r in rows} >= {"e2b", "12b", "31b", "26b-a4b"}
    reported = [r for r in rows if r["field_report_prefill_ms"]]
    assert reported and all(r["expected_ms"] < r["field_report_prefill_ms"] for r in reported)  # a floor
    assert "e2b" in prefill.format_prefill_table(rows)
