"""The Neuron recipes where the Neuron SDK is absent: clean imports, documented errors, the
environment fixes, the doctor, and the recipes' host side run on CPU over the exact modules a
Neuron compiler would receive."""

from __future__ import annotations

import importlib
import math
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from gemma4lib.backends import registry
from gemma4lib.backends.preflight import preflight
from gemma4lib.device.graph import GraphShape
from gemma4lib.errors import EnvironmentMismatchError, NeuronSDKMissingError
from gemma4lib.models.loading import build_tiny
from gemma4lib.models.variants import get_variant
from gemma4lib.port import PortSettings
from gemma4lib.recipes import RECIPE_MODULES, neuron_env

SDK_MODULES = ("torch_neuronx", "neuronx_distributed", "libneuronxla", "torch_xla")


def tiny(name):
    v = get_variant(name)
    return build_tiny(v, seed=v.tiny_seed)


def prompt(name, n=20):
    v = get_variant(name)
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(v.tiny_seed + 1)).tolist()


# besides the recipes: modules that must import without the SDK too (the vision graph's recipe included)
CLEAN_IMPORTS = [
    "gemma4lib.recipes.neuron_env",
    "gemma4lib.inf2.compile_ram",
    "gemma4lab.tools.doctor",
    "gemma4lib.recipes.neuron_vision",
]


def test_recipe_modules_import_without_the_sdk():
    code = (
        "import sys, importlib\n"
        f"for m in {sorted(RECIPE_MODULES.values()) + CLEAN_IMPORTS!r}:\n"
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
        "compile_model_builder": lambda f: f(None, 8, "/nonexistent", context_length=64, buckets=(32,)),
        "load_model_builder": lambda f: f("/nonexistent", 8),
        "NxDParallelFactory": lambda f: f(8),
    }
    return placeholders[entry.__name__](entry)


# Neuron-only entry points per module (each raises NeuronSDKMissingError without the SDK)
NEURON_ENTRY_POINTS = {
    "gemma4lib.recipes.neuron_trace": ("compile_trace", "load"),
    "gemma4lib.recipes.neuron_model_builder": ("compile_model_builder", "load_model_builder", "NxDParallelFactory"),
}


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
    from gemma4lib.device.build import device_graphs

    m = tiny("e2b")
    settings = PortSettings(variant="e2b", model="random", context_length=64, ring_kv=False, prefill_buckets=(32,))
    with pytest.raises(NeuronSDKMissingError, match="torch-neuronx"):  # the backend's first line, before any work
        neuron.compile(device_graphs(m, settings, inplace=False), m, settings)


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
    from gemma4lab.tools.doctor import format_doctor, run_doctor

    if neuron_env.sdk_present():
        pytest.skip("Neuron SDK installed")
    report = run_doctor()
    assert report["sdk_present"] is False and report["ok"] is False
    assert any(r["package"] == "torch-neuronx" and r["found"] is None for r in report["versions"])
    assert any("Neuron SDK not found" in w for w in report["warnings"])
    text = format_doctor(report)
    assert "torch-neuronx" in text and "missing" in text and "CPU profile only" in text


def test_doctor_with_a_simulated_sdk(monkeypatch):
    from gemma4lab.tools import doctor

    pins = {d: v[0] for d, v in neuron_env.SDK_PINS.items()} | {"transformers": neuron_env.TRANSFORMERS_PIN}
    pins["neuronx-distributed"] = "0.16.0"
    monkeypatch.setattr(neuron_env, "metadata_version", pins.get)
    monkeypatch.setattr(
        doctor,
        "neuron_devices",
        lambda: {"dev_nodes": [], "devices": 6, "cores": 12, "neuron_ls": None, "source": "test"},
    )
    monkeypatch.setattr(doctor, "host_ram_bytes", lambda: 64 * 2**30)
    report = doctor.run_doctor("31b", 8)
    assert report["sdk_present"]
    assert any("neuronx-distributed 0.16.0 is not the pinned 0.17.26814" in w for w in report["warnings"])
    assert any("will likely be killed" in w and "inf2.24xlarge" in w for w in report["warnings"])
    monkeypatch.setattr(doctor, "host_ram_bytes", lambda: 128 * 2**30)  # an inf2.8xlarge: ~134 GB planned
    assert any(w.startswith("tight: estimated compile peak") for w in doctor.run_doctor("31b", 8)["warnings"])
    assert report["tp"] == {"degree": 8, "ok": True}
    report = doctor.run_doctor("26b-a4b", 3)
    assert not report["tp"]["ok"] and "use tp_degree 1 or 2 or 4 or 8" in report["tp"]["error"]


def test_compile_peak_estimate_is_the_compile_host_plan():
    """The doctor's compile estimate is the compile host's plan (`inf2.compile_host`): the host
    model, the keys' modules and the lazily built NxD checkpoint, below the field report's 182 GB,
    which its own port measured while building three copies of the weights."""
    from gemma4lib.inf2.compile_host import compile_host_plan
    from gemma4lib.inf2.compile_ram import estimate_compile_peak_gb
    from gemma4lib.inf2.memory_plan import COMPILE_CALIBRATION

    est = estimate_compile_peak_gb("31b", 8)
    plan = compile_host_plan("31b", 8, "model_builder")
    assert est["peak_gb"] == round(plan.peak_gb, 1) and plan.peak_step == "shard_checkpoint"
    assert plan.model_gb * 2 < plan.peak_gb < COMPILE_CALIBRATION["measured_peak_gb"]  # about two copies, not three
    assert est["smallest_instance_with_headroom"] == "inf2.24xlarge"
    # E2B's trace keeps the weights out of the NEFF: the host model + one device copy fit an inf2.xlarge;
    # its default ModelBuilder compile needs a larger host
    e2b = estimate_compile_peak_gb("e2b", recipe="trace")
    assert e2b["recipe"] == "trace" and e2b["peak_gb"] < 16 * 2**30 / 1e9
    assert e2b["smallest_instance_with_headroom"] == "inf2.xlarge"
    e2b_mb = estimate_compile_peak_gb("e2b")
    assert e2b_mb["recipe"] == "model_builder" and e2b_mb["peak_gb"] > 16 * 2**30 / 1e9
    assert e2b_mb["smallest_instance_with_headroom"] == "inf2.8xlarge"
    # every prefill bucket is a key of its own: two buckets hold one more rank module at every step
    wider = compile_host_plan("31b", 8, "model_builder", keys=3)
    for step, gb in plan.steps.items():
        assert wider.steps[step] == pytest.approx(gb + plan.rank_gb), step
    assert estimate_compile_peak_gb("31b", 8, keys=3)["peak_gb"] == round(wider.peak_gb, 1) > est["peak_gb"]


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
    from gemma4lib.backends.engine import engine_over
    from gemma4lib.recipes import neuron_trace
    from gemma4lib.recipes.common import AliasEmulator
    from gemma4lib.reference import reference_greedy

    m = tiny(name)
    module = neuron_trace.build_kv_module(m, 64)
    aliases = module.aliases()
    assert sorted(aliases.values()) == list(range(1, 1 + len(module.kv)))
    assert all(isinstance(p, torch.nn.Parameter) and not p.requires_grad for p in aliases)
    ids = prompt(name)
    engine = engine_over(m, {"decode": AliasEmulator(module)}, batch=1, context_length=64, dtype=m.lm_head.weight.dtype)
    assert engine.buckets == []  # no prefill graph: the prompt runs through the decode graph token by token
    assert engine.generate(ids, 16).tokens == reference_greedy(m.lm, ids, 16)


def test_host_runtime_over_device_steps():
    """The glue the `neuron` backend puts between the runtime and a device module."""
    from gemma4lib.recipes import neuron_trace
    from gemma4lib.recipes.common import AliasEmulator, DeviceStep
    from gemma4lib.reference import reference_greedy
    from gemma4lib.runtime import Engine, Steps

    m = tiny("e2b")
    module = neuron_trace.build_kv_module(m, 64)
    step = DeviceStep(AliasEmulator(module), module.num_inputs)
    runtime = Engine.for_model(m, Steps(decode=step), batch=1, context_length=64)  # the prompt token by token
    ids = prompt("e2b")
    assert runtime.generate(ids, 12).tokens == reference_greedy(m.lm, ids, 12)


def test_model_builder_checkpoint_names_match_the_compiled_module():
    """NxD matches checkpoint keys to the traced module's parameter names: check them on CPU."""
    from gemma4lib.recipes import neuron_model_builder as mb
    from gemma4lib.recipes.common import key_inputs
    from gemma4lib.tp.plan import make_plan
    from gemma4lib.tp.rank_graph import CpuParallelFactory

    m = tiny("26b-a4b")
    plan = make_plan(m.config, 8, m.variant)
    checkpoint = mb.nxd_checkpoint(m, plan, torch.float32)
    forms = mb.bucket_expert_forms("selective")
    assert forms == {"prefill": "dense", "decode": "selective"}
    for key, shape in mb.bucket_shapes(64, (32,)).items():
        form = forms[shape.phase]
        module = mb.rank_module(m.config, plan, shape, torch.float32, factory=CpuParallelFactory(8), expert_form=form)
        assert module.graph.expert_form == form
        assert all(e.form == form for e in module.graph._rank_users)
        names = {k for k in module.state_dict() if not k.startswith("kv.")}
        assert names == set(checkpoint)  # one checkpoint for both expert forms
        # the rank graph takes the inputs of the device graph the key's example inputs come from
        host_graph = mb.key_graphs(m, {key: shape})[key]
        assert [(tuple(t.shape), t.dtype) for t in module.example_inputs()] == [
            (tuple(t.shape), t.dtype) for t in key_inputs(host_graph, dtype=torch.float32)
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
    """Stands in for `neuronx_distributed.trace.model_builder`: records what the recipe asks of it.

    The loader is counted, never called by the constructor (NxD v2.28.0 calls it only in
    `shard_checkpoint`); `trace` records how often it had been called by then. `stop_at_trace`:
    `trace` raises (no compiler here); otherwise it returns a stand-in and `shard_checkpoint` runs
    the loader the way NxD does (once, then one file per rank)."""

    def __init__(self, stop_at_trace: bool = True):
        self.calls = []
        self.instances = []  # every key's model_instance, in `add` order
        self.loader_calls = 0
        self.raw_loader = None
        recorder = self

        class BaseModelInstance:
            def __init__(self, module_cls, input_output_aliases):
                self.module_cls, self.input_output_aliases = module_cls, input_output_aliases

        class ModelBuilder:
            def __init__(self, router, tp_degree, checkpoint_loader, compiler_workdir=None):
                recorder.raw_loader, recorder.tp = checkpoint_loader, tp_degree
                recorder.calls.append(("init", {"router": router, "tp_degree": tp_degree}))

            def add(
                self,
                key,
                model_instance,
                example_inputs,
                compiler_args=None,
                bucket_config=None,
                priority_model_idx=None,
            ):
                recorder.instances.append(model_instance)
                recorder.calls.append(
                    (
                        "add",
                        {
                            "key": key,
                            "inputs": [tuple(t.shape) for t in example_inputs[0]],
                            "dtypes": [t.dtype for t in example_inputs[0]],
                            "compiler_args": compiler_args,
                            "priority": priority_model_idx,
                        },
                    )
                )

            def trace(self, initialize_model_weights=True, dry_run=False):
                recorder.calls.append(
                    (
                        "trace",
                        {"initialize_model_weights": initialize_model_weights, "loader_calls": recorder.loader_calls},
                    )
                )
                if stop_at_trace:
                    raise RuntimeError("stop: no Neuron compiler here")
                return types.SimpleNamespace(stand_in="traced")

            def shard_checkpoint(self, serialize_path=None):
                recorder.loader_calls += 1
                checkpoint = recorder.raw_loader()
                name = Path(serialize_path).name if serialize_path else None
                recorder.calls.append(("shard_checkpoint", {"path": name, "keys": len(checkpoint)}))
                if serialize_path:  # one (stand-in) file per rank, where NxD writes them
                    Path(serialize_path).mkdir(parents=True, exist_ok=True)
                    for rank in range(recorder.tp):
                        path = Path(serialize_path) / f"tp{rank}_sharded_checkpoint.safetensors"
                        save_file({"rank": torch.tensor([rank])}, str(path))
                return [checkpoint]

        self.module = types.SimpleNamespace(BaseModelInstance=BaseModelInstance, ModelBuilder=ModelBuilder)

    def checkpoint(self):
        """What the recipe's loader returns (called here, after the recorded calls)."""
        return self.raw_loader()


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
            buckets=(16,),
            decode_experts="selective" if model.variant.is_moe else "dense",
        )
    kinds = [kind for kind, _ in recorder.calls]
    assert kinds == ["init", "add", "add", "trace"]
    init, prefill, decode, trace = (args for _, args in recorder.calls)
    assert init["tp_degree"] == tp and init["router"] is None
    assert recorder.checkpoint()["graph.spmd_rank.rank"].tolist() == list(range(tp))
    assert (prefill["key"], prefill["priority"]) == ("prefill16", None)
    assert (decode["key"], decode["priority"]) == ("decode", 0)
    hidden = model.config.hidden_size
    expected_decode = [(1, 1, hidden)]
    if name in ("e2b", "e4b"):  # the per-layer inputs are computed on the host and passed in
        expected_decode.append((1, 1, model.config.num_hidden_layers, model.config.hidden_size_per_layer_input))
    assert decode["inputs"] == expected_decode + [(1,), (1,)]
    assert prefill["inputs"][0] == (1, 16, hidden)
    assert "-O2" in decode["compiler_args"] and "-O1" in prefill["compiler_args"]
    assert trace == {"initialize_model_weights": False, "loader_calls": 0}


def test_model_builder_recipe_calls_with_a_batch(tmp_path, monkeypatch):
    """A batch of 3: both keys' example inputs carry 3 rows and one start/length per row."""
    from gemma4lib.recipes import neuron_model_builder

    recorder = _Recorder()
    monkeypatch.setattr(neuron_env, "require", lambda module, purpose="": recorder.module)
    model = tiny("e2b")
    with pytest.raises(RuntimeError, match="stop: no Neuron compiler here"):
        neuron_model_builder.compile_model_builder(model, 1, tmp_path, context_length=64, buckets=(16,), batch=3)
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
    from gemma4lib.backends import gloo
    from gemma4lib.inf2.memory_plan import neuron_recipe
    from gemma4lib.recipes import neuron_model_builder, neuron_trace

    assert neuron_recipe(get_variant(name), tp) == recipe
    monkeypatch.setenv("GEMMA4LIB_INSTANCE_TYPE", "inf2.24xlarge")
    monkeypatch.setattr(neuron_env, "require_sdk", lambda *a, **k: None)
    monkeypatch.setattr(neuron_env, "require", lambda *a, **k: None)
    monkeypatch.setattr(gloo.RankWorld, "__init__", lambda *a, **k: pytest.fail("ran on CPU gloo ranks"))
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
        preflight(port_module.PortSettings(variant="e2b", model="random", tp_degree=2, neuron_recipe="trace"))
    with pytest.raises(UnknownNameError):
        preflight(port_module.PortSettings(variant="e2b", model="random", neuron_recipe="parallel_model_trace"))
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
    from gemma4lib.backends.engine import engine_over
    from gemma4lib.recipes import neuron_model_builder as mb
    from gemma4lib.recipes.common import AliasEmulator
    from gemma4lib.reference import reference_greedy
    from gemma4lib.tp.plan import make_plan
    from gemma4lib.tp.rank_graph import CpuParallelFactory

    m = tiny("e2b")
    plan = make_plan(m.config, 1, m.variant)
    checkpoint = mb.nxd_checkpoint(m, plan, torch.float32)
    shapes = mb.bucket_shapes(64, (32,))
    modules = {
        key: mb.rank_module(m.config, plan, shape, torch.float32, factory=CpuParallelFactory(1))
        for key, shape in shapes.items()
    }
    decode = modules["prefill32"].sharing(modules["decode"].graph)
    for module in (modules["prefill32"], decode):
        missing, unexpected = module.load_state_dict(checkpoint, strict=False)
        assert not unexpected and all(k.startswith("kv.") for k in missing)
    assert all(a is b for a, b in zip(decode.kv, modules["prefill32"].kv, strict=True))
    assert decode.num_inputs == 4  # PLE is a host input, as for E4B
    ids = prompt("e2b")
    steps = {"prefill32": AliasEmulator(modules["prefill32"]), "decode": AliasEmulator(decode)}
    engine = engine_over(m, steps, batch=1, context_length=len(ids) + 16)
    assert engine.buckets == [32]  # the prompt is one prefill graph call
    assert engine.generate(ids, 16).tokens == reference_greedy(m.lm, ids, 16)


def test_e2b_memory_plan_names_where_each_recipe_compiles():
    """ModelBuilder's compile of E2B does not fit an inf2.xlarge's host RAM, the trace's does: the
    plan still fits (compile elsewhere, same chip) and says so."""
    from gemma4lab.inf2.plans import core_summary
    from gemma4lib.inf2.hardware import GB, GIB, INSTANCES
    from gemma4lib.inf2.memory_plan import plan_core_memory

    mb = plan_core_memory("e2b")
    assert mb.recipe == "model_builder" and mb.instance == "inf2.xlarge" and mb.fits
    assert mb.compile_peak_gb * GB > INSTANCES["inf2.xlarge"].host_ram_gib * GIB
    assert mb.compile_host not in (None, "inf2.xlarge") and "compile on an" in core_summary(mb)
    trace = plan_core_memory("e2b", recipe="trace")
    assert trace.recipe == "trace" and trace.compile_host == "inf2.xlarge" and trace.fits
    assert trace.compile_peak_gb < mb.compile_peak_gb and "compile on an" not in core_summary(trace)
    assert trace.weights_gib == mb.weights_gib  # same device weights per core either way


def test_prefill_estimate_from_flops_and_bytes():
    """The computed floor of a prefill call: compute at the datasheet peak vs bytes at HBM speed,
    and what token-by-token decode steps would cost instead (E2B's trace recipe)."""
    from gemma4lab.inf2 import prefill
    from gemma4lab.tools import inf2_tables
    from gemma4lib.inf2.hardware import BF16_FLOPS_PER_CORE, INSTANCES

    e2b = prefill.prefill_estimate("e2b", 128)
    assert e2b.compute_ms == pytest.approx(e2b.flops / BF16_FLOPS_PER_CORE * 1e3)
    assert e2b.memory_ms == pytest.approx(e2b.bytes / INSTANCES["inf2.xlarge"].bandwidth_bytes_s(1) * 1e3)
    assert e2b.expected_ms == max(e2b.compute_ms, e2b.memory_ms)
    longer = prefill.prefill_estimate("e2b", 512)
    assert 3.5 < longer.flops / e2b.flops < 4.5 and longer.bytes == e2b.bytes  # weights read once per call
    assert e2b.stepwise_ms == pytest.approx(128 * 1e3 / get_variant("e2b").field_report.decode_tok_s)
    assert e2b.stepwise_ms > 50 * e2b.expected_ms
    rows = inf2_tables.prefill_table(128)
    assert {r["variant"] for r in rows} >= {"e2b", "12b", "31b", "26b-a4b"}
    reported = [r for r in rows if r["field_report_prefill_ms"]]
    assert reported and all(r["expected_ms"] < r["field_report_prefill_ms"] for r in reported)  # a floor
    assert "e2b" in inf2_tables.format_prefill_table(rows)


# ---- issue 30: what the SDK 2.28 audit found ---------------------------------------------------------


def test_model_builder_builds_the_checkpoint_only_when_shard_checkpoint_asks(tmp_path, monkeypatch):
    """The NxD checkpoint (a second whole copy of the weights) is not alive during `trace`: NxD
    v2.28.0 calls the loader only in `shard_checkpoint`, and the recipe's loader builds it then."""
    from gemma4lib.recipes import neuron_model_builder as mb

    recorder = _Recorder(stop_at_trace=False)
    monkeypatch.setattr(neuron_env, "require", lambda module, purpose="": recorder.module)
    monkeypatch.setattr(torch.jit, "save", lambda traced, path: recorder.calls.append(("save", {"path": path})))
    built = mb.nxd_checkpoint

    def counted(*args, **kwargs):
        recorder.calls.append(("nxd_checkpoint", {}))
        return built(*args, **kwargs)

    monkeypatch.setattr(mb, "nxd_checkpoint", counted)
    model = tiny("e4b")
    mb.compile_model_builder(model, 2, tmp_path, context_length=64, buckets=(16,))
    kinds = [kind for kind, _ in recorder.calls]
    assert kinds == ["init", "add", "add", "trace", "save", "nxd_checkpoint", "shard_checkpoint"]
    trace = dict(recorder.calls)["trace"]
    assert trace == {"initialize_model_weights": False, "loader_calls": 0}
    assert recorder.loader_calls == 1 and dict(recorder.calls)["shard_checkpoint"]["keys"] > 0
    assert (tmp_path / "manifest.json").is_file()


def test_the_nxd_checkpoint_is_every_ranks_shard_concatenated():
    """`nxd_full_checkpoint`, built one key at a time, is still exactly the ranks' shards joined
    along each key's cut (what NxD's contiguous split turns back into `shard_state_dict`)."""
    from gemma4lib.tp.plan import REPLICATE, make_plan
    from gemma4lib.tp.shard import iter_shards, nxd_full_checkpoint

    m = tiny("26b-a4b")
    plan = make_plan(m.config, 2, m.variant)
    full = nxd_full_checkpoint(m.lm, plan, dtype=torch.bfloat16)
    shards = list(iter_shards(m.lm, plan, dtype=torch.bfloat16))
    assert list(full) == list(shards[0])
    for key, value in full.items():
        rule = plan.rule(key)
        expected = shards[0][key] if rule.kind == REPLICATE else torch.cat([s[key] for s in shards], dim=rule.dim)
        assert value.dtype == expected.dtype and torch.equal(value, expected), key


def test_two_commits_with_the_same_graph_code_share_a_neuron_key(monkeypatch):
    """The commit is not part of any compiled program's key: a docs-only commit reuses every Neuron
    artifact and a bundle from another commit still loads."""
    from gemma4lib import environment
    from gemma4lib.backends.compile_cpu import graph_key
    from gemma4lib.backends.neuron import neuron_cache_key
    from gemma4lib.cache.bundle import program_versions

    m = tiny("e2b")
    shapes = {"decode": GraphShape(1, 1, 64), "prefill": GraphShape(1, 32, 64)}
    keys, bundles = [], []
    for sha in ("aaaaaaaaaaaa", "bbbbbbbbbbbb"):
        monkeypatch.setattr(environment, "git_sha", lambda sha=sha: sha)
        assert environment.versions()["git_sha"] == sha  # still recorded with a run
        keys.append(neuron_cache_key(m, "model_builder", 1, shapes, neuron_env.COMPILER_ARGS, torch.bfloat16)[0])
        bundles.append(program_versions())
        assert "git_sha" not in environment.program_versions()
    assert keys[0] == keys[1] and bundles[0] == bundles[1]
    assert "program_versions()" in __import__("inspect").getsource(graph_key)  # the CPU key strips it the same way


def _device_states(n):
    """K/V states as a traced module hands them back when they stay on the device (a non-CPU tensor)."""
    return [torch.empty(1, 2, 8, 4, device="meta") for _ in range(n)]


def test_a_traced_module_returning_its_aliased_states_passes_the_first_call():
    """`torch_neuronx.trace` (no `output_aliased_tensor` option) may return the aliased states after
    the logits: accepted and dropped when they are the declared states on the device."""
    from gemma4lib.errors import DeviceOutputError
    from gemma4lib.recipes.common import DeviceStep, check_first_output

    logits = torch.zeros(1, 1, 10)
    check_first_output((logits, *_device_states(4)), 10, aliases=4)
    step = DeviceStep(lambda *a: (logits, *_device_states(4)), 3, 10, aliases=4)
    assert step(torch.zeros(1), torch.zeros(1), torch.zeros(1)).dtype == torch.float32 and step.checked
    # one tensor more than the declared states: neither the logits nor an alias
    with pytest.raises(DeviceOutputError, match="traced with 4 aliased K/V states"):
        DeviceStep(lambda *a: (logits, *_device_states(5)), 3, 10, aliases=4)(*[torch.zeros(1)] * 3)
    with pytest.raises(DeviceOutputError, match="traced with 4 aliased K/V states"):
        check_first_output((logits, *_device_states(2)), 10, aliases=4)
    # the states as host copies: every token copies all of them back (the silent slowdown)
    with pytest.raises(DeviceOutputError, match="as host tensors"):
        check_first_output((logits, *[torch.zeros(1, 2, 8, 4) for _ in range(4)]), 10, aliases=4)


class _FakeNxDModel:
    """A loaded compiled model as the host sees it: the logits, then `states` device-resident
    tensors (a traced module that hands its aliased K/V states back). A call whose last input is the
    sampling `[B, 3]` float32 is routed, as NxD routes by input shapes, to the key that returns ids."""

    def __init__(self, vocab, states=0):
        self.vocab, self.states, self.calls = vocab, states, []
        # the keyed entry point: a key whose arity differs from the saved executor's is called here
        self.nxd_model = types.SimpleNamespace(forward=self.keyed)
        self.keyed_calls = 0

    def keyed(self, inputs):
        self.keyed_calls += 1
        return self(*inputs)

    def __call__(self, *inputs):
        self.calls.append([(tuple(t.shape), t.dtype) for t in inputs])
        if inputs[-1].dim() == 2 and inputs[-1].dtype == torch.float32:
            out = torch.full((inputs[0].shape[0],), 7, dtype=torch.int32)
        else:
            out = torch.zeros(inputs[0].shape[0], self.vocab)  # each row's last valid token
        return (out, *_device_states(self.states)) if self.states else out


def test_backend_neuron_keeps_no_host_kv(tmp_path, monkeypatch):
    """The device steps keep their K/V as aliased state: the runtime holds no host K/V buffers
    (on an inf2.xlarge's 16 GiB a full-context copy is not free), and generation still runs."""
    from gemma4lib.port import PortSettings, load_model
    from gemma4lib.recipes import neuron_model_builder

    monkeypatch.setenv("GEMMA4LIB_INSTANCE_TYPE", "inf2.8xlarge")
    monkeypatch.setattr(neuron_env, "require_sdk", lambda *a, **k: None)
    monkeypatch.setattr(neuron_env, "require", lambda *a, **k: None)
    settings = PortSettings(variant="e2b", backend="neuron", max_new_tokens=4, cache_dir=str(tmp_path))
    model = load_model(settings)
    fake = _FakeNxDModel(model.config.vocab_size)

    def compile_stub(loaded, tp, folder, **kwargs):
        (folder / "manifest.json").write_text("{}")

    monkeypatch.setattr(neuron_model_builder, "compile_model_builder", compile_stub)
    monkeypatch.setattr(neuron_model_builder, "load_model_builder", lambda path, tp: fake)
    compiled = registry.compile_graphs(model, settings)
    assert compiled.kv is None  # the engine's steps hold no host K/V: the device keeps them
    tokens = compiled.runtime.generate([5, 6, 7], 3).tokens
    assert len(tokens) == 3 and len(fake.calls) == 3  # one prefill call, two decode steps
    # nobody reads the logits: the decode steps went to the key that returns ids (one input more,
    # the sampling [1, 2] in float32; start/length int32) and the device's token is the row's
    assert [len(call) for call in fake.calls] == [4, 5, 5] and fake.calls[1][-1] == ((1, 3), torch.float32)
    assert fake.calls[1][-3:-1] == [((1,), torch.int32)] * 2 and tokens[1:] == [7, 7]
    assert fake.keyed_calls == 2  # its arity is not the saved executor's: through nxd_model.forward
    kept = compiled.runtime.generate([5, 6, 7], 3, keep_logits=True)  # a check keeps them: the logits key
    assert [len(call) for call in fake.calls[3:]] == [4, 4, 4] and kept.step_logits is not None


def _recorded_neuron_port(monkeypatch, **fields) -> tuple[list[dict], list[dict]]:
    """`port(backend="neuron", **fields)` on the E2B up to the compile, NxD's ModelBuilder recorded:
    the `add` calls in order and the shapes each Neuron cache key named."""
    from gemma4lib import port as port_module
    from gemma4lib.backends import neuron

    recorder, keys = _Recorder(), []
    monkeypatch.setenv("GEMMA4LIB_INSTANCE_TYPE", "inf2.8xlarge")
    monkeypatch.setattr(neuron_env, "require_sdk", lambda *a, **k: None)
    monkeypatch.setattr(neuron_env, "require", lambda module, purpose="": recorder.module)
    real_key = neuron.neuron_cache_key
    monkeypatch.setattr(neuron, "neuron_cache_key", lambda *a, **k: keys.append(a[3]) or real_key(*a, **k))
    with pytest.raises(RuntimeError, match="stop: no Neuron compiler here"):
        port_module.port(port_module.PortSettings(variant="e2b", backend="neuron", **fields))
    return [args for kind, args in recorder.calls if kind == "add"], keys


def test_backend_neuron_batch_reaches_every_model_builder_key(tmp_path, monkeypatch):
    """`--backend neuron --batch 3`: the keys are built from `device_graphs` (the settings' batch and
    buckets), so ModelBuilder receives one prefill key per bucket and decode, 3 rows in every key,
    before anything compiles; the cache key names every key's shape."""
    adds, keys = _recorded_neuron_port(monkeypatch, batch_size=3, prefill_buckets=(1, 16, 64), cache_dir=str(tmp_path))
    # the one-token bucket has the decode key's input shapes (NxD routes by shape): decode serves it;
    # the decode that returns ids takes one input more (the sampling), its own route, decode's layout
    assert [a["key"] for a in adds] == ["prefill16", "prefill64", "decode", "decode_ids"]
    assert [a["priority"] for a in adds] == [None, None, 0, None]
    assert [a["inputs"][0][1] for a in adds] == [16, 64, 1, 1]
    assert [("-O2" if "-O2" in a["compiler_args"] else "-O1") for a in adds] == ["-O1", "-O1", "-O2", "-O2"]
    hidden = get_variant("e2b").tiny_config["hidden_size"]
    for a in adds:
        assert a["inputs"][0][0] == 3 and a["inputs"][0][2] == hidden, a  # embeddings [3, T, H]
    assert all(a["inputs"][-2:] == [(3,), (3,)] for a in adds[:3])  # start and length: one per row
    assert adds[3]["inputs"][-3:] == [(3,), (3,), (3, 3)]  # then (temperature, draw, top_p) a row
    shapes = {"prefill16": 16, "prefill64": 64, "decode": 1, "decode_ids": 1}
    assert [{n: s.tokens for n, s in k.items()} for k in keys] == [shapes]


def test_backend_neuron_runs_a_prompt_in_its_own_bucket(tmp_path, monkeypatch):
    """With buckets (16, 64), a short prompt is one call of 16 tokens and a longer one one call of 64
    (never padded to the largest), through the one loaded model, whose keys NxD routes by shape."""
    from gemma4lib.port import PortSettings, load_model
    from gemma4lib.recipes import neuron_model_builder

    monkeypatch.setenv("GEMMA4LIB_INSTANCE_TYPE", "inf2.8xlarge")
    monkeypatch.setattr(neuron_env, "require_sdk", lambda *a, **k: None)
    monkeypatch.setattr(neuron_env, "require", lambda *a, **k: None)
    settings = PortSettings(variant="e2b", backend="neuron", prefill_buckets=(16, 64), cache_dir=str(tmp_path))
    model = load_model(settings)
    fake, compiled_keys = _FakeNxDModel(model.config.vocab_size), []

    def compile_stub(loaded, tp, folder, graphs, **kwargs):
        compiled_keys.append({name: graph.shape.tokens for name, graph in graphs.items()})
        (folder / "manifest.json").write_text("{}")

    monkeypatch.setattr(neuron_model_builder, "compile_model_builder", compile_stub)
    monkeypatch.setattr(neuron_model_builder, "load_model_builder", lambda path, tp: fake)
    runtime = registry.compile_graphs(model, settings).runtime
    assert compiled_keys == [{"prefill16": 16, "prefill64": 64, "decode": 1, "decode_ids": 1}]
    for length, bucket in ((5, 16), (16, 16), (17, 64), (40, 64)):
        fake.calls.clear()
        runtime.generate(list(range(3, 3 + length)), 2)
        assert [call[0][0][1] for call in fake.calls] == [bucket, 1], length  # one prefill, one decode


def int32_graph_inputs(monkeypatch):
    """Stand in for the engine's change (graph.py's `example_inputs` give int32 start/length)."""
    from gemma4lib.device.graph import DeviceGraph

    original = DeviceGraph.example_inputs

    def int32(self):
        inputs = list(original(self))
        n = 4 if self.has_ple else 3
        inputs[n - 2 : n] = [t.to(torch.int32) for t in inputs[n - 2 : n]]
        return tuple(inputs)

    monkeypatch.setattr(DeviceGraph, "example_inputs", int32)


def _recorded_index_dtypes(tmp_path, monkeypatch):
    """The start/length dtypes ModelBuilder's keys and `torch_neuronx.trace` are handed."""
    from gemma4lib.recipes import neuron_model_builder, neuron_trace

    recorder = _Recorder()
    monkeypatch.setattr(neuron_env, "require", lambda module, purpose="": recorder.module)
    model = tiny("e2b")
    with pytest.raises(RuntimeError, match="stop"):
        neuron_model_builder.compile_model_builder(model, 1, tmp_path, context_length=64, buckets=(16,), batch=2)
    seen = {a["key"]: a["dtypes"][-2:] for kind, a in recorder.calls if kind == "add"}
    traced = {}

    def trace(module, example_inputs, *, input_output_aliases, **kwargs):
        traced["dtypes"] = [t.dtype for t in example_inputs[-2:]]
        traced["aliases"] = len(input_output_aliases)
        return module

    monkeypatch.setattr(neuron_env, "require", lambda module, purpose="": types.SimpleNamespace(trace=trace))
    neuron_trace.compile_trace(model, 64)
    seen["trace"] = traced["dtypes"]
    return seen


def test_the_neuron_recipes_take_the_graphs_index_dtype(tmp_path, monkeypatch):
    """With the graphs' example inputs in int32 (the engine's change stood in), every Neuron key
    and the trace receive int32 start/length: the recipes build no index tensors of their own; and
    the host's int64 positions reach the compiled module in its dtype."""
    from gemma4lib.recipes.common import DeviceStep

    int32_graph_inputs(monkeypatch)
    seen = _recorded_index_dtypes(tmp_path, monkeypatch)
    assert seen == {k: [torch.int32, torch.int32] for k in ("prefill16", "decode", "trace")}
    got = []
    step = DeviceStep(lambda *a: got.extend(t.dtype for t in a) or torch.zeros(1, 1, 8), 3, 8, index_dtype=torch.int32)
    step(torch.zeros(1, 1, 4), torch.tensor([3]), torch.tensor([1]))
    assert got == [torch.float32, torch.int32, torch.int32]


def _tiny_assistant(model):
    from gemma4lib.models.assistant import LoadedAssistant, build_tiny_assistant, read_layers

    return LoadedAssistant(build_tiny_assistant(model.config, "e2b"), "random", read_layers(model.layout))


def test_every_backends_example_inputs_have_int32_indices(tmp_path, monkeypatch):
    """NxD Inference converts start/length/position to int32 before the device and the compiler
    truncates INT64 to INT32: int32 end to end, in the device graphs every backend compiles (CPU,
    XLA) and in what the Neuron recipes hand the SDK."""
    from gemma4lib.device.build import device_graphs
    from gemma4lib.port import PortSettings

    model = tiny("e2b")
    graphs = device_graphs(model, PortSettings(variant="e2b", draft="assistant"), assistant=_tiny_assistant(model))
    for name, graph in graphs:
        index = graph.example_inputs()[1:2] if name == "draft" else graph.example_inputs()[2:4]
        assert {t.dtype for t in index} == {torch.int32}, name
    seen = _recorded_index_dtypes(tmp_path, monkeypatch)
    assert seen == {k: [torch.int32, torch.int32] for k in ("prefill16", "decode", "trace")}


def test_the_doctor_names_the_2_28_image_by_name_and_date_not_the_ssm_latest():
    """SSM's `latest` image id now resolves to a 2.29+ image that fails the pins (SSM has no
    per-release parameter): the doctor tells the user how to pick the 2.28 DLAMI instead."""
    from gemma4lab.tools.doctor import DLAMI_DATES, format_doctor, run_doctor

    text = format_doctor(run_doctor())
    (image,) = [line for line in text.splitlines() if line.strip().startswith("image:")]
    assert "describe-images" in image and neuron_env.DLAMI in image
    assert all(date in image for date in DLAMI_DATES)
    assert "gives only the newest image, not a 2.28 one" in image
    assert "(SSM " not in text  # the latest id is never offered as the image to start


@pytest.mark.parametrize("extra,fails", [(0, False), (1, True)])
def test_backend_neuron_accepts_exactly_its_aliased_states_after_the_logits(extra, fails, tmp_path, monkeypatch):
    """The backend declares the K/V states its module aliases (one per K/V buffer of the decode
    graph): a module returning the logits and those states runs; one more tensor fails the first call."""
    from gemma4lib.device.build import device_graphs
    from gemma4lib.errors import DeviceOutputError
    from gemma4lib.port import PortSettings, load_model
    from gemma4lib.recipes import neuron_model_builder

    monkeypatch.setenv("GEMMA4LIB_INSTANCE_TYPE", "inf2.8xlarge")
    monkeypatch.setattr(neuron_env, "require_sdk", lambda *a, **k: None)
    monkeypatch.setattr(neuron_env, "require", lambda *a, **k: None)
    settings = PortSettings(variant="e2b", backend="neuron", max_new_tokens=4, cache_dir=str(tmp_path))
    model = load_model(settings)
    states = len(device_graphs(model, settings, inplace=False).decode.new_kv())
    fake = _FakeNxDModel(model.config.vocab_size, states + extra)
    monkeypatch.setattr(
        neuron_model_builder, "compile_model_builder", lambda m, tp, folder, **k: (folder / "m.json").write_text("{}")
    )
    monkeypatch.setattr(neuron_model_builder, "load_model_builder", lambda path, tp: fake)
    runtime = registry.compile_graphs(model, settings).runtime
    if fails:
        with pytest.raises(DeviceOutputError, match=f"traced with {states} aliased K/V states"):
            runtime.generate([5, 6, 7], 3)
    else:
        assert len(runtime.generate([5, 6, 7], 3).tokens) == 3


# ---- the one-row join (issue 46 item 3): a batch-1 prefill key over the batch's K/V states ----------


def test_backend_neuron_batch_4_compiles_a_join_key_per_bucket(tmp_path, monkeypatch):
    """`--backend neuron --batch 4` with `row_prefill`: ModelBuilder receives every prefill bucket and
    decode at 4 rows, and a `row_prefill<bucket>` key per bucket at one row that takes an int32 row
    index `[1]` first (its input shapes route it); the cache key names the join keys."""
    calls, keys = _recorded_neuron_port(
        monkeypatch, batch_size=4, prefill_buckets=(16, 64), row_prefill=True, cache_dir=str(tmp_path)
    )
    adds = {args["key"]: args for args in calls}
    assert list(adds) == ["prefill16", "prefill64", "decode", "row_prefill16", "row_prefill64", "decode_ids"]
    cfg = get_variant("e2b").tiny_config
    for bucket in (16, 64):
        batched, join = adds[f"prefill{bucket}"], adds[f"row_prefill{bucket}"]
        assert batched["inputs"][0] == (4, bucket, cfg["hidden_size"])
        assert join["inputs"] == [(1,), (1, *batched["inputs"][0][1:]), (1, *batched["inputs"][1][1:]), (1,), (1,)]
        assert join["dtypes"][0] == join["dtypes"][-1] == torch.int32
        assert (join["priority"], join["compiler_args"]) == (None, batched["compiler_args"])
    assert set(keys[0]) == set(adds)


def test_backend_neuron_compiles_a_key_per_context_bucket(tmp_path, monkeypatch):
    """`--context-buckets 32` in a 128-token context: ModelBuilder also receives `decode@32`,
    `decode_ids@32`, `prefill16@32` and the join `row_prefill16@32` (prefill64 has no bucket >= 64),
    each with the read positions int32 `[32]` first and then its whole-context key's inputs, no
    layout priority (the whole-context decode sets it), and no two keys with the same input shapes
    (NxD routes by them)."""
    calls, keys = _recorded_neuron_port(
        monkeypatch,
        batch_size=4,
        prefill_buckets=(16, 64),
        row_prefill=True,
        context_length=128,
        context_buckets=(32,),
        cache_dir=str(tmp_path),
    )
    adds = {args["key"]: args for args in calls}
    bucketed = {"decode@32", "decode_ids@32", "prefill16@32", "row_prefill16@32"}
    assert set(adds) - bucketed == {"prefill16", "prefill64", "decode", "row_prefill16", "row_prefill64", "decode_ids"}
    assert bucketed <= set(adds) and set(keys[0]) == set(adds)
    for name in bucketed:
        whole = adds[name.split("@")[0]]
        assert adds[name]["inputs"] == [(32,), *whole["inputs"]] and adds[name]["dtypes"][0] == torch.int32
        assert adds[name]["priority"] is None and adds[name]["compiler_args"] == whole["compiler_args"]
    assert len({str(a["inputs"]) for a in calls}) == len(calls)


@pytest.mark.parametrize("join", [0, 4], ids=["decode", "join"])
def test_a_context_key_binds_the_whole_context_keys_states(join):
    """A bucket's rank module (`ContextKey`) has its whole-context key's parameters, K/V states
    included, by name and shape: NxD binds one set to every key."""
    from gemma4lib.recipes import neuron_model_builder as mb
    from gemma4lib.tp.plan import make_plan
    from gemma4lib.tp.rank_graph import CpuParallelFactory

    model, rows = tiny("e2b"), 1 if join else 4
    plan = make_plan(model.config, 1, model.variant)
    modules = [
        mb.rank_module(
            model.config, plan, GraphShape(rows, 16, 128, reads=r), torch.float32, CpuParallelFactory(1), join=join
        )
        for r in (None, 32)
    ]
    whole, bucket = ({n: tuple(p.shape) for n, p in m.named_parameters()} for m in modules)
    assert bucket == whole and any(n.startswith("kv.") for n in whole)


def _join_modules(model, batch: int, bucket: int, context: int, tp: int = 1):
    """The recipe's batched prefill and join modules of one bucket at `tp`, CPU layers for NxD's
    (at TP 1 loaded from the recipe's checkpoint)."""
    from gemma4lib.recipes import neuron_model_builder as mb
    from gemma4lib.tp.plan import make_plan
    from gemma4lib.tp.rank_graph import CpuParallelFactory

    plan = make_plan(model.config, tp, model.variant)
    shapes = {"batched": GraphShape(batch, bucket, context), "join": GraphShape(1, bucket, context)}
    joins = {"batched": 0, "join": batch}
    modules = {
        name: mb.rank_module(model.config, plan, shape, torch.float32, CpuParallelFactory(tp), join=joins[name])
        for name, shape in shapes.items()
    }
    if tp == 1:
        checkpoint = mb.nxd_checkpoint(model, plan, torch.float32)
        for module in modules.values():
            module.load_state_dict(checkpoint, strict=False)
    return modules


@pytest.mark.parametrize("name,tp", [("e2b", 1), ("26b-a4b", 2)])
def test_a_neuron_join_key_binds_the_batched_keys_states(name, tp):
    """The join key's rank module has the batched key's parameters, K/V states included, by name and
    shape (NxD binds one set of states to every key and shards the checkpoint with one key's module)."""
    modules = _join_modules(tiny(name), 4, 16, 32, tp)
    states = {n: tuple(p.shape) for n, p in modules["batched"].named_parameters()}
    assert {n: tuple(p.shape) for n, p in modules["join"].named_parameters()} == states
    kv = [shape for n, shape in states.items() if n.startswith("kv.")]
    assert kv and all(shape[0] == 4 for shape in kv)


def test_a_neuron_join_key_writes_exactly_one_row():
    """Run with the device's aliasing, the join key of 9 tokens (bucket 16) into row 2 writes that row's
    slots 0-8 of every K/V state and leaves every other row, and that row's other slots, bit-identical."""
    from gemma4lib.device.graph import index_tensor
    from gemma4lib.recipes.common import AliasEmulator

    join = _join_modules(tiny("e2b"), 4, 16, 32)["join"]
    with torch.no_grad():
        for p in join.kv:
            p.copy_(torch.randn_like(p))
    before = [p.detach().clone() for p in join.kv]
    inputs = list(join.example_inputs())
    inputs[0], inputs[-1] = index_tensor([2]), index_tensor([9])
    inputs[1] = torch.randn_like(inputs[1])
    AliasEmulator(join)(*inputs)
    for old, new in zip(before, join.kv, strict=True):
        assert torch.equal(old[[0, 1, 3]], new[[0, 1, 3]]) and torch.equal(old[2][:, 9:], new[2][:, 9:])
        assert not torch.equal(old[2][:, :9], new[2][:, :9])


class _RoutedNxDModel:
    """A loaded ModelBuilder model on CPU: the recipe's modules of every key (CPU layers, the recipe's
    checkpoint) over one set of K/V parameters, each call routed by its input shapes as NxD routes it,
    through `__call__` or `nxd_model.forward`; `keys` records which key ran."""

    def __init__(self, model, graphs):
        from gemma4lib.recipes import neuron_model_builder as mb
        from gemma4lib.recipes.common import AliasEmulator
        from gemma4lib.tp.plan import make_plan
        from gemma4lib.tp.rank_graph import CpuParallelFactory

        plan = make_plan(model.config, 1, model.variant)
        checkpoint = mb.nxd_checkpoint(model, plan, torch.float32)
        self.routes, self.keys, shared = {}, [], None
        for key, graph in graphs.items():
            join, chooses = mb.key_form(graph)
            factory = CpuParallelFactory(1)
            module = mb.rank_module(model.config, plan, graph.shape, torch.float32, factory, join=join, chooses=chooses)
            module.load_state_dict(checkpoint, strict=False)
            shared = shared or module
            module = shared.sharing(module.graph)
            self.routes[tuple(tuple(t.shape) for t in module.example_inputs())] = (key, AliasEmulator(module))
        self.nxd_model = types.SimpleNamespace(forward=lambda inputs: self(*inputs))

    def __call__(self, *inputs):
        key, run = self.routes[tuple(tuple(t.shape) for t in inputs)]
        self.keys.append(key)
        return run(*inputs)


def test_a_row_joining_a_running_batch_on_neuron_goes_through_the_join_key(tmp_path, monkeypatch):
    """`backend="neuron"`, batch 2, `row_prefill`: the loaded model stood in by the recipe's own
    modules on CPU. Row 0 joins and decodes, row 1 joins the running batch: each admission runs its
    bucket's join key (never the batch-shaped prefill), and both rows' tokens equal the eager engine's."""
    from gemma4lib.port import PortSettings, compile_graphs, eos_ids, load_model
    from gemma4lib.recipes import neuron_model_builder
    from gemma4lib.runtime import Request, encode_prompt

    monkeypatch.setenv("GEMMA4LIB_INSTANCE_TYPE", "inf2.8xlarge")
    monkeypatch.setattr(neuron_env, "require_sdk", lambda *a, **k: None)
    monkeypatch.setattr(neuron_env, "require", lambda *a, **k: None)
    kwargs = dict(variant="e2b", batch_size=2, row_prefill=True, prefill_buckets=(32,), context_length=64)
    model = load_model(PortSettings(backend="eager", **kwargs))
    loaded = {}

    def compile_stub(m, tp, folder, graphs, **kw):
        loaded["model"] = _RoutedNxDModel(m, graphs)
        (folder / "manifest.json").write_text("{}")

    monkeypatch.setattr(neuron_model_builder, "compile_model_builder", compile_stub)
    monkeypatch.setattr(neuron_model_builder, "load_model_builder", lambda path, tp: loaded["model"])
    eos = tuple(eos_ids(model))
    requests = [
        Request(encode_prompt(model.tokenizer, f"What is the capital of {c}?"), 8, eos_token_ids=eos)
        for c in ("France", "Japan")
    ]
    tokens = {}
    for backend in ("eager", "neuron"):
        engine = compile_graphs(model, PortSettings(backend=backend, cache_dir=str(tmp_path), **kwargs)).runtime
        engine.admit({0: requests[0]})
        engine.step()
        engine.admit({1: requests[1]})
        while engine.live_rows():
            engine.step()
        tokens[backend] = [engine.release(r).tokens for r in range(2)]
    keys = loaded["model"].keys
    assert [k for k in keys if not k.startswith("decode")] == ["row_prefill32", "row_prefill32"], keys
    assert tokens["neuron"] == tokens["eager"] and "Paris" in model.tokenizer.decode(tokens["neuron"][0])


@pytest.mark.parametrize("asks", [dict(batch_size=2, row_prefill=True), dict(context_buckets=(32,))])
def test_the_trace_recipe_refuses_row_prefill_and_context_buckets(monkeypatch, asks):
    """The one-graph trace recipe has no prefill key to join through and no key per context bucket:
    refused before anything loads."""
    from gemma4lib.errors import SettingsError

    monkeypatch.setenv("GEMMA4LIB_INSTANCE_TYPE", "inf2.xlarge")
    monkeypatch.setattr(neuron_env, "require_sdk", lambda *a, **k: None)
    settings = PortSettings(variant="e2b", backend="neuron", neuron_recipe="trace", **asks)
    with pytest.raises(SettingsError, match="trace recipe has a single decode graph"):
        preflight(settings)
