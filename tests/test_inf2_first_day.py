"""A user's first day on inf2 (issue 21, findings 4-12), rehearsed on CPU: int8 counted at its
bytes, no re-quantizing the host model for shapes, no compiler litter, no second model on the
cores, int8 rows reduced in float32, embeddings in the compiled dtype, threads from the machine,
the compiler flags decided, and named errors at the first call.

The SDK is stood in by recording fakes where a call is inf2-only; what is checked is this
library's side of each call.
"""

from __future__ import annotations

import gc
import os
import types
from pathlib import Path

import pytest
import torch
from conftest import held_cores, release_core_claims
from torch import nn

from gemma4lib.backends.engine import engine_over
from gemma4lib.backends.preflight import preflight
from gemma4lib.device.embedder import HostEmbedder
from gemma4lib.errors import DeviceMemoryError, DeviceOutputError, HostTablesMovedError, NeuronCoresBusyError
from gemma4lib.inf2.memory_plan import plan_core_memory, rank_weight_bytes
from gemma4lib.models.loading import build_tiny
from gemma4lib.models.variants import get_variant
from gemma4lib.recipes import cores, neuron_env
from gemma4lib.recipes.common import DeviceStep, check_first_output, check_host_tables


# ---- finding 4: int8 at its bytes; no host re-quantization for shapes -----------------------------
def test_int8_is_counted_at_one_byte_plus_a_scale_per_row():
    """31B at TP=4: bf16 does not fit a core (14.3 GiB + K/V + working memory), int8 does."""
    from gemma4lab.inf2.plans import core_summary
    from gemma4lib.inf2.params import count_params, meta_model

    bf16 = plan_core_memory("31b", 4, instance="inf2.24xlarge")
    int8 = plan_core_memory("31b", 4, instance="inf2.24xlarge", weights="int8")
    assert not bf16.fits and int8.fits, (core_summary(bf16), core_summary(int8))
    assert "int8 weights" in core_summary(int8)
    counts = count_params(meta_model("e2b"))  # at TP=1 the rank holds every linear whole
    full = rank_weight_bytes("e2b", 1)
    assert rank_weight_bytes("e2b", 1, "int8") == full - counts.linear + 4 * counts.linear_rows
    from gemma4lib.inf2.serving_host import serving_host_plan

    for weights in ("bf16", "int8"):  # the serving host reads the same shards the cores get
        shards = serving_host_plan("31b", 4, "inf2.24xlarge", weights=weights).shards_gb
        assert shards == pytest.approx(rank_weight_bytes("31b", 4, weights) * 4 / 1e9)


def test_int8_port_settings_pass_where_bf16_is_refused(monkeypatch):
    from gemma4lib.errors import NeuronSDKMissingError
    from gemma4lib.settings import PortSettings

    monkeypatch.setenv("GEMMA4LIB_INSTANCE_TYPE", "inf2.24xlarge")
    with pytest.raises(DeviceMemoryError):
        preflight(PortSettings("31b", profile="full", backend="neuron", tp_degree=4, context_length=1024))
    with pytest.raises(NeuronSDKMissingError):  # every memory check passed: only the SDK is missing here
        preflight(
            PortSettings("31b", profile="full", backend="neuron", tp_degree=4, context_length=1024, weights="int8")
        )


def test_neuron_backend_builds_no_int8_graph_on_the_host(monkeypatch):
    """weights="int8": NxD quantizes its own layers; the backend's graphs (`device_graphs`: one per
    prefill bucket and the decode graph, for shapes and example inputs) stay full precision."""
    from gemma4lib import port as port_module
    from gemma4lib.device import graph as graph_module
    from gemma4lib.recipes import neuron_model_builder

    built = []
    original = graph_module.DeviceGraph.__init__

    def recording(self, *args, **kwargs):
        built.append(kwargs.get("weights", "bf16"))
        original(self, *args, **kwargs)

    monkeypatch.setattr(graph_module.DeviceGraph, "__init__", recording)
    monkeypatch.setenv("GEMMA4LIB_INSTANCE_TYPE", "inf2.xlarge")
    monkeypatch.setattr(neuron_env, "require_sdk", lambda *a, **k: None)
    monkeypatch.setattr(neuron_env, "require", lambda *a, **k: None)

    def stop(*args, **kwargs):
        assert kwargs["weights"] == "int8"  # the recipe still quantizes, with NxD's layers
        raise RuntimeError("stop: compile reached")

    monkeypatch.setattr(neuron_model_builder, "compile_model_builder", stop)
    settings = port_module.PortSettings(
        variant="e2b", model="random", backend="neuron", weights="int8", prefill_buckets=(16, 32), cache_dir=None
    )
    with pytest.raises(RuntimeError, match="stop: compile reached"):
        port_module.port(settings)
    assert built == ["bf16"] * 4, built  # buckets 16 and 32, decode and its ids form, in full precision


# ---- finding 5: compiler litter ---------------------------------------------------------------------
def test_compiler_workdir_is_removed_after_success_and_kept_after_failure():
    from gemma4lib.backends.neuron import compiler_workdir

    with compiler_workdir() as ok:
        Path(ok, "log-neuron-cc.txt").write_text("fine")
    assert not Path(ok).exists()
    with pytest.raises(RuntimeError), compiler_workdir() as failed:
        raise RuntimeError("NCC_EXXX")
    assert Path(failed).is_dir()  # the compiler's logs stay for inspection
    Path(failed).rmdir()


def _neuron_compile(tmp_path, monkeypatch, seen):
    """The neuron backend's compile (through the registry) of a tiny E2B with the inf2-only calls
    stood in: the compile records its current directory and writes a relative `.hlo` as NxD's trace
    does; the load returns a fresh module."""
    from gemma4lib.backends.registry import compile_graphs
    from gemma4lib.port import PortSettings, load_model
    from gemma4lib.recipes import neuron_model_builder

    monkeypatch.setenv("GEMMA4LIB_INSTANCE_TYPE", "inf2.xlarge")
    monkeypatch.setattr(neuron_env, "require_sdk", lambda *a, **k: None)
    monkeypatch.setattr(neuron_env, "require", lambda *a, **k: None)

    def fake_compile(model, tp, folder, **kwargs):
        seen.setdefault("cwd", []).append(os.getcwd())
        Path("decode_0.hlo").write_text("hlo")  # NxD v2.28.0 writes this by relative path
        Path(folder, "model.pt").write_text("neff")

    monkeypatch.setattr(neuron_model_builder, "compile_model_builder", fake_compile)
    monkeypatch.setattr(neuron_model_builder, "load_model_builder", lambda path, tp: _Loaded())
    settings = PortSettings("e2b", model="random", backend="neuron", cache_dir=str(tmp_path / "cache"))
    model = load_model(settings)
    return lambda: compile_graphs(model, settings)


def test_the_compile_runs_in_a_directory_of_its_own(tmp_path, monkeypatch):
    """NxD v2.28.0 writes `{key}_{rank}.hlo` by relative path in `trace()`: it must not land in
    (or fail on) the caller's current directory."""
    seen = {}
    monkeypatch.chdir(tmp_path)
    compiled = _neuron_compile(tmp_path, monkeypatch, seen)()
    assert os.getcwd() == str(tmp_path) and not list(tmp_path.glob("*.hlo"))
    (cwd,) = seen["cwd"]
    assert cwd != str(tmp_path) and not Path(cwd).exists()  # its own, removed
    assert compiled.compiler == "neuron-model_builder"
    release_core_claims()


# ---- finding 6: a second model on the same cores ------------------------------------------------------
class _Loaded(nn.Module):
    pass


def test_a_second_load_on_busy_cores_is_refused_until_the_first_is_released():
    release_core_claims()
    first = cores.claim(_Loaded(), 0, 2, "the first model")
    with pytest.raises(NeuronCoresBusyError, match=r"the first model on cores 0-1.*del compiled"):
        cores.check_free(1, 1, "the second model")
    cores.check_free(2, 2, "a model on other cores")  # other cores: allowed
    del first
    gc.collect()
    cores.check_free(0, 2, "the second model")  # released: allowed
    assert held_cores() == []


def test_compiling_again_while_the_first_model_lives_is_refused(tmp_path, monkeypatch):
    """A notebook's compile cell run twice: the second load would put a second copy on the cores."""
    release_core_claims()
    compile_again = _neuron_compile(tmp_path, monkeypatch, {})
    first = compile_again()
    with pytest.raises(NeuronCoresBusyError, match="e2b \\(model_builder, TP=1\\).*del compiled"):
        compile_again()
    del first
    gc.collect()
    assert compile_again().cache_hits == [True]  # released: loads (from the cache) again
    release_core_claims()


# ---- finding 7: int8 rows reduced in float32 -----------------------------------------------------------
def test_quantized_rows_reduce_in_float32_and_keep_their_names():
    from gemma4lib.recipes.neuron_model_builder import reduce_rows_in_float32

    reduced = []

    class QuantizedRowParallel(nn.Module):  # stands in for NxD's, with its reduce_output switch
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(3, 4, dtype=torch.bfloat16), requires_grad=False)
            self.reduce_output, self.tensor_parallel_group = True, "tp-group"

        def forward(self, x):
            out = x @ self.weight.T
            return mappings.reduce_from_tensor_model_parallel_region(out, "own") if self.reduce_output else out

    def reduce(x, process_group):
        reduced.append((x.dtype, process_group))
        return x * 2  # two ranks holding the same partial

    mappings = types.SimpleNamespace(reduce_from_tensor_model_parallel_region=reduce)
    block = nn.Sequential(nn.Linear(4, 4), QuantizedRowParallel())
    names = [k for k, _ in block.named_parameters()]
    assert reduce_rows_in_float32(block, QuantizedRowParallel, mappings) == 1
    out = block[1](torch.ones(1, 4, dtype=torch.bfloat16))
    assert reduced == [(torch.float32, "tp-group")] and out.dtype == torch.bfloat16
    assert torch.equal(out, torch.full((1, 3), 8.0, dtype=torch.bfloat16))
    assert [k for k, _ in block.named_parameters()] == names  # checkpoint keys unchanged


# ---- finding 8: host embeddings in the compiled dtype ------------------------------------------------
def test_host_loop_passes_embeddings_in_the_compiled_dtype():
    model = build_tiny(get_variant("e2b"))  # float32 tables
    seen = set()
    vocab = model.config.vocab_size

    def step(*inputs):
        seen.update(t.dtype for t in inputs[:-2])
        return torch.zeros(1, vocab)

    engine = engine_over(model, {"decode": step}, batch=1, context_length=6, dtype=torch.bfloat16)
    assert engine.generate([5, 6, 7], 3).tokens == [0, 0, 0]
    assert seen == {torch.bfloat16}


# ---- finding 10: threads from the machine ---------------------------------------------------------------
def test_full_profile_threads_come_from_the_machine(tmp_path):
    from papermill_runs.run import host_threads, load_profiles, notebook_parameters

    profiles = load_profiles()
    full = notebook_parameters(profiles, "full", "31b", tmp_path, {})
    smoke = notebook_parameters(profiles, "smoke", "31b", tmp_path, {})
    assert full["threads"] == host_threads() >= 1 and smoke["threads"] == 1
    assert notebook_parameters(profiles, "full", "31b", tmp_path, {"threads": 3})["threads"] == 3


# ---- finding 11: the compiler flags ----------------------------------------------------------------------
def test_compiler_flags_follow_the_decisions_in_neuron_env():
    decode, prefill = neuron_env.compiler_args("decode"), neuron_env.compiler_args("prefill")
    for args, tiling in ((decode, 1), (prefill, 2)):
        assert "--enable-saturate-infinity" not in args and not any(a.startswith("--lnc") for a in args)
        assert (
            f"--tensorizer-options=--enable-ccop-compute-overlap --cc-pipeline-tiling-factor={tiling} "
            "--vectorize-strided-dma" in args
        )
    assert "--enable-mixed-precision-accumulation" in decode and decode[-1] == "-O2" and prefill[-1] == "-O1"


# ---- finding 12: named errors at the first call --------------------------------------------------------
def test_first_output_checks_name_what_is_wrong():
    logits = torch.zeros(1, 1, 10)
    check_first_output(logits, 10)
    check_first_output((logits,), 10)
    with pytest.raises(DeviceOutputError, match="MB copied to the host every step"):
        check_first_output((logits, torch.zeros(1, 1, 64, 8), torch.zeros(1, 1, 64, 8)), 10)
    with pytest.raises(DeviceOutputError, match="not the logits"):
        check_first_output({"logits": logits}, 10)
    with pytest.raises(DeviceOutputError, match=r"not \[\.\.\., 12\] logits"):
        check_first_output(logits, 12)
    step = DeviceStep(lambda *a: (logits, torch.zeros(4)), 3, 10)
    with pytest.raises(DeviceOutputError):
        step(torch.zeros(1), torch.zeros(1), torch.zeros(1))


def test_host_tables_moved_or_freed_by_a_compile_are_named():
    model = build_tiny(get_variant("e2b"))
    host = HostEmbedder.from_text_model(model.text_model)
    check_host_tables(host)
    host.embed_tokens_per_layer.weight.data = torch.empty(0)  # what a compiler freeing a shared weight leaves
    with pytest.raises(HostTablesMovedError, match="embed_tokens_per_layer"):
        check_host_tables(host)
    table = host.embed_tokens
    table.weight = nn.Parameter(torch.empty(table.weight.shape, device="meta"), requires_grad=False)  # moved off
    with pytest.raises(HostTablesMovedError, match="embed_tokens table is on meta"):
        check_host_tables(host)
