"""The program key is the same in every process (issue 20, finding 1).

transformers' text model iterated `set(config.layer_types)`, so the exported program's code, its
digest and the cache key followed PYTHONHASHSEED: about half of all fresh processes recompiled.
Here each key is computed in fresh processes under different hash seeds (chosen so that the set's
own order differs between them, which the children report) and compared, prefill and decode. The
export is the costly part (~5 s a graph), so the suite runs two variants with the features that
shape the program most (E2B: PLE + KV sharing; 12B: k_eq_v, the issue's case) and the `slow`
marker all five under four seeds. The port-twice check is tests/test_bundle.py (an export, then
ports from the bundle and from the cache under other seeds, in fresh processes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from conftest import VARIANT_NAMES

CHILD = """
import json, os, sys
import torch
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
from gemma4lib.cache.artifacts import make_key
from gemma4lib.backends.compile_cpu import DEFAULT_COMPILER_OPTIONS, RECIPE, export_graph, graph_key
from gemma4lib.port import PortSettings, build_graphs, load_model

out = {"keys": {}, "set_order": None}
for variant in sys.argv[1].split(","):
    settings = PortSettings(variant=variant)
    model = load_model(settings)
    out["set_order"] = list(set(model.config.layer_types))  # what transformers iterates
    for name, graph in build_graphs(model, settings):
        parts = graph_key(graph, RECIPE, DEFAULT_COMPILER_OPTIONS, export_graph(graph))
        out["keys"][f"{variant}/{graph.shape.phase}/{name}"] = make_key(parts)
print(json.dumps(out))
"""


def keys_under_seeds(variants: list[str], seeds: list[int], tmp_path) -> dict[int, dict]:
    """Run the children side by side (two cores), one per hash seed; each also in its own working
    folder and every other one with two threads (neither may reach the key)."""
    children = {}
    for i, seed in enumerate(seeds):
        env = {**os.environ, "PYTHONHASHSEED": str(seed), "OMP_NUM_THREADS": str(1 + i % 2)}
        cwd = tmp_path / f"seed-{seed}"
        cwd.mkdir()
        children[seed] = subprocess.Popen(
            [sys.executable, "-c", CHILD, ",".join(variants)],
            env=env,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
    out = {}
    for seed, child in children.items():
        stdout, stderr = child.communicate(timeout=900)
        assert child.returncode == 0, stderr.decode()[-2000:]
        out[seed] = json.loads(stdout.decode().strip().splitlines()[-1])
    return out


def assert_same_keys(variants: list[str], seeds: list[int], tmp_path) -> None:
    runs = keys_under_seeds(variants, seeds, tmp_path)
    orders = {tuple(run["set_order"]) for run in runs.values()}
    assert len(orders) > 1, f"the seeds {seeds} gave one set order {orders}: the check would not see the bug"
    first = runs[seeds[0]]["keys"]
    assert {k.split("/")[1] for k in first} == {"prefill", "decode"}
    assert {k.split("/")[0] for k in first} == set(variants)
    for seed in seeds[1:]:
        differ = sorted(k for k in first if runs[seed]["keys"].get(k) != first[k])
        assert not differ, f"PYTHONHASHSEED={seed} gives other keys than {seeds[0]} for {differ}"


def test_program_key_is_the_same_under_every_hash_seed(tmp_path):
    assert_same_keys(["e2b", "12b"], [0, 1], tmp_path)


@pytest.mark.slow
def test_program_key_is_the_same_under_every_hash_seed_every_variant(tmp_path):
    assert_same_keys(VARIANT_NAMES, [0, 1, 2, 3], tmp_path)


DRAFT_CHILD = """
import json
import torch
torch.set_num_threads(1)
from gemma4lib.cache.artifacts import make_key
from gemma4lib.backends.compile_cpu import DEFAULT_COMPILER_OPTIONS, RECIPE, export_graph, graph_key
from gemma4lib.device.build import device_graphs
from gemma4lib.models.assistant import load_assistant
from gemma4lib.port import PortSettings, load_model

settings = PortSettings(variant="e2b", draft="assistant", draft_tokens=4)
model = load_model(settings)
graph = device_graphs(model, settings, assistant=load_assistant(model, settings)).draft
key = make_key(graph_key(graph, RECIPE, DEFAULT_COMPILER_OPTIONS, export_graph(graph)))
print(json.dumps({"key": key, "set_order": list(set(graph.model.config.layer_types))}))
"""


def test_draft_graph_key_is_the_same_under_every_hash_seed(tmp_path):
    """The assistant's text model iterated `set(layer_types)` too: 06_serving's draft graph
    recompiled in every other fresh process until `DraftGraph` gave it the layer types as a list."""
    runs = {}
    for seed in (0, 1):
        env = {**os.environ, "PYTHONHASHSEED": str(seed), "OMP_NUM_THREADS": "1"}
        done = subprocess.run([sys.executable, "-c", DRAFT_CHILD], env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        runs[seed] = json.loads(done.stdout.strip().splitlines()[-1])
    assert runs[0]["set_order"] != runs[1]["set_order"], "the seeds give one set order: the check would not see it"
    assert runs[0]["key"] == runs[1]["key"], "the draft graph's program key follows PYTHONHASHSEED"


def test_a_graph_seen_before_loads_without_exporting_and_an_edit_exports_again(tmp_path):
    """The program index (`compile_cpu.index_key`): the second compile of an equal graph finds its
    entry without an export; a changed module attribute misses the index and exports (here to the
    same program, so the entry is the same and nothing is compiled again)."""
    import torch

    from gemma4lib.backends.compile_cpu import compile_graph, index_key
    from gemma4lib.cache.artifacts import ArtifactCache
    from gemma4lib.port import PortSettings, build_graphs, load_model

    torch.set_num_threads(1)
    settings = PortSettings("e2b", model="random")
    cache = ArtifactCache()
    first = compile_graph(build_graphs(load_model(settings), settings).decode, cache)
    graph = build_graphs(load_model(settings), settings).decode  # a new model object, equal to the first
    again = compile_graph(graph, cache)
    assert again.entry.key == first.entry.key and again.info["export_s"] == 0.0 and again.compile_s == 0.0
    before = index_key(graph, {})
    # a plain attribute: the index cannot know it is harmless; its value new to this run, so that a warm cache
    # (run_tests.sh keeps .cache/gemma4lib-tests) has no index entry for it from an earlier run
    graph.model.layers[0].an_unrelated_setting = time.time_ns()
    assert index_key(graph, {}) != before
    edited = compile_graph(graph, cache)
    assert edited.info["export_s"] > 0 and edited.entry.key == first.entry.key and edited.compile_s == 0.0


def test_a_model_without_experts_has_one_key_whatever_expert_form_is_asked():
    """The port asks for `decode_experts="selective"`, a benchmark builds "dense": on E2B, which has no
    experts, the two programs are the same, so one key (the serving notebook compiled this decode twice);
    on the MoE the form changes the program, and the key."""
    from gemma4lib.backends.compile_cpu import DEFAULT_COMPILER_OPTIONS, RECIPE, export_graph, graph_key
    from gemma4lib.cache.artifacts import make_key
    from gemma4lib.device.build import device_graph
    from gemma4lib.device.graph import GraphShape
    from gemma4lib.port import PortSettings, load_model

    def key(graph):
        return make_key(graph_key(graph, RECIPE, DEFAULT_COMPILER_OPTIONS, export_graph(graph)))

    shape = GraphShape(1, 1, 128, True)
    dense = load_model(PortSettings(variant="e2b"))
    assert key(device_graph(dense, shape, "selective")) == key(device_graph(dense, shape, "dense"))
    moe = load_model(PortSettings(variant="26b-a4b"))
    forms = [device_graph(moe, shape, form).key_parts()["expert_form"] for form in ("selective", "dense")]
    assert forms == ["selective", "dense"]
