"""Compiled ports that travel (issue 21, finding 2), and the port-twice check of issue 20.

`python -m gemma4lib export --variant e2b --out DIR` in a fresh process (PYTHONHASHSEED=0, the
session's cache: a copy when the suite compiled E2B already), then `port --artifacts DIR` in
another (PYTHONHASHSEED=1) with an empty GEMMA4LIB_CACHE: no compile, every graph a hit, all checks
pass, and nothing is written to that cache. The same round trip with a batch of three drafted by the
assistant: the bundle carries the prefill, verify and draft graphs and the plain decode its benchmark
compares against; at tests/test_engine.py's shapes and k, so its drafted graphs are the programs of
that file's AOTInductor cell and its plain ones those of tests/test_batch.py (compiled once a session).
Then (marker `slow`) a plain `port` (PYTHONHASHSEED=2) on the session cache hits too: the key is the
same in every process. The mismatch rows need no device work: each is refused when the settings are
made or before the compile, a missing graph by its name.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_engine import NEW, SHAPES, K

from gemma4lib.backends.preflight import preflight
from gemma4lib.cache import bundle
from gemma4lib.device.build import device_graphs
from gemma4lib.errors import BundleError
from gemma4lib.port import PortSettings, compile_graphs, load_model

QUICK = ["--iters", "1", "--warmup", "0"]
# the drafted batch of tests/test_engine.py's AOTInductor cell: its shapes, its k
BATCH_SHAPES = dict(batch_size=3, context_length=SHAPES["context_length"], prefill_buckets=SHAPES["prefill_buckets"])
BUCKETS = ",".join(map(str, SHAPES["prefill_buckets"]))
DRAFTED = ["--batch", "3", "--draft", "assistant", "--draft-tokens", str(K), "--max-new-tokens", str(NEW)]
DRAFTED += ["--context-length", str(SHAPES["context_length"]), "--prefill-buckets", BUCKETS]
PREFILL = f"prefill{BUCKETS}"


def gemma4lib_cli(*args: str, seed: int, cache: str | None = None) -> dict:
    env = {**os.environ, "PYTHONHASHSEED": str(seed), "OMP_NUM_THREADS": "1"}
    if cache is not None:
        env["GEMMA4LIB_CACHE"] = cache
    done = subprocess.run(
        [sys.executable, "-m", "gemma4lib", *args, "--json"], env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bundle") / "e2b"
    summary = gemma4lib_cli("export", "--variant", "e2b", "--out", str(out), seed=0)
    assert summary["entries"] and set(summary["models"]) == {"model", "witness"}
    return out


def test_port_from_the_bundle_compiles_nothing_and_passes(exported, tmp_path):
    empty = tmp_path / "empty-cache"
    result = gemma4lib_cli("port", "--variant", "e2b", "--artifacts", str(exported), *QUICK, seed=1, cache=str(empty))
    assert result["seq_match"] and result["logits_match"] and result["coherent"], result.get("failed_checks")
    assert result["compile_s"] == 0 and result["cache_hits"] and all(result["cache_hits"])
    witness = result["witness"]
    assert witness["seq_match"] and witness["logits_match"] and all(witness["cache_hits"])
    assert all(str(exported) in path for path in result["artifacts"].values()), result["artifacts"]
    assert not empty.exists(), "a run from a bundle wrote into the cache"


@pytest.fixture(scope="module")
def exported_drafted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bundle") / "e2b-drafted"
    summary = gemma4lib_cli("export", "--variant", "e2b", *DRAFTED, "--out", str(out), seed=0)
    own, plain = summary["builds"]  # the port's graphs, then the plain decode its benchmark runs
    assert own["graphs"] == [PREFILL, "verify", "draft"] and plain["graphs"] == [PREFILL, "decode"]
    assert own["settings"]["batch_size"] == 3 and own["settings"]["draft_tokens"] == K, own
    return out


def test_a_drafted_batch_runs_from_its_bundle_with_every_graph_a_hit(exported_drafted, tmp_path):
    empty = tmp_path / "empty-cache"
    result = gemma4lib_cli(
        "port", "--variant", "e2b", *DRAFTED, "--artifacts", str(exported_drafted), *QUICK, seed=1, cache=str(empty)
    )
    assert result["checks_passed"], result["failed_checks"]
    assert result["compile_s"] == 0 and len(result["cache_hits"]) == 3 and all(result["cache_hits"])
    assert list(result["artifacts"]) == [PREFILL, "verify", "draft"], result["artifacts"]
    assert all(str(exported_drafted) in path for path in result["artifacts"].values()), result["artifacts"]
    assert len(result["rows"]) == 3
    for row in result["rows"]:
        assert row["tokens"] == row["reference_tokens"] and row["logits_match"] and row["coherent"], row
        assert row["accepted_per_step"] > 1, row
    assert result["hf_assisted_match"] and result["witness"]["seq_match"] and result["witness"]["logits_match"]
    assert not empty.exists(), "a run from a bundle wrote into the cache"


def test_a_bundle_without_the_drafting_graphs_is_refused_naming_them(exported, exported_drafted):
    with pytest.raises(BundleError, match="it has no verify, draft graph") as info:
        preflight(PortSettings(variant="e2b", draft="assistant", artifacts=str(exported)))
    assert "draft: bundle None, this run 'assistant'" in str(info.value)
    with pytest.raises(BundleError, match="it has no verify graph"):
        preflight(PortSettings(variant="e2b", draft="prompt_lookup", artifacts=str(exported)))
    with pytest.raises(BundleError, match="draft: bundle 'assistant', this run 'prompt_lookup'"):
        preflight(PortSettings(variant="e2b", **BATCH_SHAPES, draft="prompt_lookup", artifacts=str(exported_drafted)))
    # the drafted bundle holds the plain batch's graphs too (its benchmark runs them)
    plain = PortSettings(variant="e2b", **BATCH_SHAPES, artifacts=str(exported_drafted))
    assert bundle.graph_names(plain) == [PREFILL, "decode"]


@pytest.mark.slow
def test_a_second_port_in_a_fresh_process_under_another_seed_hits(exported):
    """The export (seed 0) compiled or found E2B's graphs in the session cache; a port under seed 2
    finds every one of them (before the fix about half of all seeds recompiled). Slow: the port
    from the bundle above (seed 1) already shows a fresh process under another seed hitting."""
    result = gemma4lib_cli("port", "--variant", "e2b", *QUICK, "--no-witness", seed=2)
    assert result["cache_hits"] and all(result["cache_hits"]) and result["compile_s"] == 0
    assert result["seq_match"] and result["logits_match"] and result["coherent"]


def _edited_copy(exported: Path, tmp_path: Path, edit) -> str:
    copy = tmp_path / "edited"
    shutil.copytree(exported, copy)
    manifest = json.loads((copy / bundle.MANIFEST).read_text())
    edit(manifest, copy)
    (copy / bundle.MANIFEST).write_text(json.dumps(manifest))
    return str(copy)


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"context_length": 256}, "context_length: bundle 128, this run 256"),
        ({"prefill_buckets": (32,)}, "prefill_buckets: bundle [64], this run [32]"),
        ({"ring_kv": False}, "ring_kv: bundle True, this run False"),
        ({"weights": "int8"}, "weights: bundle 'bf16', this run 'int8'"),
        ({"variant": "e4b"}, "variant: bundle 'e2b', this run 'e4b'"),
        ({"batch_size": 2}, "batch_size: bundle 1, this run 2"),
    ],
)
def test_other_settings_are_refused_before_anything_loads(exported, overrides, fragment):
    settings = {"variant": "e2b", **overrides}
    with pytest.raises(BundleError, match="compiled for other settings") as info:
        preflight(PortSettings(**settings, artifacts=str(exported)))
    assert fragment in str(info.value)


def test_other_versions_or_machine_are_refused(exported, tmp_path):
    def older_torch(manifest, folder):
        manifest["versions"]["torch"] = "0.0.1"

    with pytest.raises(BundleError, match="torch: bundle '0.0.1'"):
        preflight(PortSettings(variant="e2b", artifacts=_edited_copy(exported, tmp_path / "a", older_torch)))

    def arm(manifest, folder):
        manifest["machine"]["processor"] = "aarch64"

    with pytest.raises(BundleError, match="built for aarch64"):
        preflight(PortSettings(variant="e2b", artifacts=_edited_copy(exported, tmp_path / "b", arm)))


def _no_compile(monkeypatch):
    from gemma4lib.backends import compile_cpu

    def refuse(*args, **kwargs):
        raise AssertionError("a run from a bundle compiled")

    monkeypatch.setattr(compile_cpu, "package_program", refuse)


def test_another_checkpoint_is_refused_before_device_work(exported, monkeypatch):
    _no_compile(monkeypatch)
    settings = PortSettings(variant="e2b", model="random", seed=3, witness=False, artifacts=str(exported))
    with pytest.raises(BundleError, match="exported from other weights"):
        compile_graphs(load_model(settings), settings)


def test_a_graph_missing_from_the_bundle_is_an_error_not_a_compile(exported, tmp_path):
    """A key the bundle lacks (its program differs although the manifest matches) is refused, never
    compiled: the cache behind the bundle (empty here) may hold it, nothing else."""
    removed = []

    def drop_decode(manifest, folder):
        for name in list(manifest["entries"]):
            meta = json.loads((folder / "entries" / name / "meta.json").read_text())
            if meta["describe"]["shape"]["tokens"] == 1:
                removed.append(meta["key"])
                shutil.rmtree(folder / "entries" / name)

    empty = str(tmp_path / "empty-cache")
    settings = PortSettings(variant="e2b", cache_dir=empty, artifacts=_edited_copy(exported, tmp_path, drop_decode))
    cache = bundle.cache_for(settings)
    assert len(removed) == 1 and cache.lookup(removed[0]) is None
    with pytest.raises(BundleError, match="has no compiled graph for key"):
        cache.get_or_build(removed[0], lambda folder: pytest.fail("a run from a bundle compiled"))
    assert not Path(empty).exists()


def test_a_folder_that_is_not_a_bundle(tmp_path):
    with pytest.raises(BundleError, match="is not a compiled-port bundle"):
        preflight(PortSettings(variant="e2b", artifacts=str(tmp_path)))
    (tmp_path / bundle.MANIFEST).write_bytes(b"\xff\xfe")
    with pytest.raises(BundleError, match="unreadable"):
        preflight(PortSettings(variant="e2b", artifacts=str(tmp_path)))


def test_a_neuron_bundle_carries_the_model_and_its_shards(tmp_path, monkeypatch):
    """inf2, with the SDK's two calls stood in: `export` on the compile host copies the ModelBuilder
    entry (model.pt, the per-rank shards in weights/); a run from the bundle on the serving host
    loads that entry with no compile, and another instance family is refused."""
    from gemma4lib.backends import neuron
    from gemma4lib.export import export_bundle
    from gemma4lib.recipes import neuron_env, neuron_model_builder

    pins = {
        dist: next(iter(accepted)) if isinstance(accepted, (set, tuple, list)) else accepted
        for dist, accepted in neuron_env.SDK_PINS.items()
    }
    monkeypatch.setattr(neuron_env, "metadata_version", lambda dist: pins.get(dist))
    monkeypatch.setattr(neuron_env, "require_sdk", lambda *a, **k: None)
    monkeypatch.setattr(neuron_env, "require", lambda *a, **k: None)
    monkeypatch.setenv("GEMMA4LIB_INSTANCE_TYPE", "inf2.8xlarge")  # the compile host
    compiled, loaded = [], []

    def fake_compile(model, tp, out, **kwargs):
        compiled.append(tp)
        (out / "model.pt").write_bytes(b"NEFF-holding TorchScript")
        (out / "weights").mkdir()
        for rank in range(tp):
            (out / "weights" / f"tp{rank}_sharded_checkpoint.safetensors").write_bytes(b"shard %d" % rank)

    monkeypatch.setattr(neuron_model_builder, "compile_model_builder", fake_compile)
    monkeypatch.setattr(
        neuron_model_builder, "load_model_builder", lambda path, tp: loaded.append(Path(path)) or (lambda *a: a[0])
    )
    settings = PortSettings(variant="12b", model="random", backend="neuron", tp_degree=2, cache_dir=str(tmp_path / "c"))
    manifest = export_bundle(settings, tmp_path / "bundle")
    assert compiled == [2] and manifest["sdk"] and manifest["machine"]["instance_type"] == "inf2.8xlarge"
    (entry,) = (tmp_path / "bundle" / "entries").iterdir()
    assert sorted(p.name for p in (entry / "weights").iterdir()) == [
        "tp0_sharded_checkpoint.safetensors",
        "tp1_sharded_checkpoint.safetensors",
    ]

    monkeypatch.setenv("GEMMA4LIB_INSTANCE_TYPE", "inf2.xlarge")  # the serving host
    loaded.clear()  # the export loaded its compile once too
    monkeypatch.setattr(neuron_model_builder, "compile_model_builder", lambda *a, **k: pytest.fail("compiled"))
    served = PortSettings(
        variant="12b",
        model="random",
        backend="neuron",
        tp_degree=2,
        cache_dir=str(tmp_path / "empty"),
        artifacts=str(tmp_path / "bundle"),
    )
    model = load_model(served)
    result = neuron.compile(device_graphs(model, served, inplace=False), model, served)
    assert result.cache_hits == [True] and result.compile_s == 0 and loaded == [entry]
    assert not (tmp_path / "empty").exists()

    monkeypatch.setenv("GEMMA4LIB_INSTANCE_TYPE", "trn1.2xlarge")
    with pytest.raises(BundleError, match="instance family"):
        bundle.check_settings(served)
