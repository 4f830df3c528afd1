"""Weight identity without hashing every weight as float32 (issue 21, finding 3).

The Neuron cache key used to hash every weight as float32 on every `compile()` (~124 GB through
sha256 for the 31B, cache hits included). Now the loader declares what it loaded (checkpoint file
digests, the fixture's hash, the random seed) and the key uses that while the weights stay as
loaded; any edit (in place, through `.data`, or a replaced tensor) falls back to hashing the raw
bytes once, and the key changes.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from gemma4lib.device.graph import GraphShape
from gemma4lib.models import weights_identity
from gemma4lib.models.checkpoint_identity import file_digest, folder_identity
from gemma4lib.models.loading import build_tiny
from gemma4lib.models.variants import get_variant
from gemma4lib.recipes import neuron_env

SHAPES = {"decode": GraphShape(1, 1, 64), "prefill": GraphShape(1, 32, 64)}


def neuron_key(model) -> str:
    from gemma4lib.backends.neuron import neuron_cache_key

    return neuron_cache_key(model, "model_builder", 2, SHAPES, neuron_env.COMPILER_ARGS, torch.bfloat16)[0]


def test_a_declared_model_is_keyed_without_reading_its_weights(monkeypatch):
    model = build_tiny(get_variant("12b"))
    first = neuron_key(model)

    def refuse(*args, **kwargs):
        raise AssertionError("every weight was hashed although the loader declared them")

    monkeypatch.setattr(weights_identity, "weights_fingerprint", refuse)
    assert neuron_key(model) == first
    assert neuron_key(build_tiny(get_variant("12b"))) == first  # a fresh load of the same weights
    assert weights_identity.weights_identity(model.lm).startswith("declared:tiny-random(seed=0)")


@pytest.mark.parametrize("edit", ["in place", "through .data", "replaced", "a buffer"])
def test_any_edit_of_the_weights_changes_the_key(edit):
    model = build_tiny(get_variant("12b"))
    before = neuron_key(model)
    layer = model.lm.model.layers[1]
    weight = layer.mlp.down_proj.weight
    with torch.no_grad():
        if edit == "in place":
            weight.mul_(1.5)
        elif edit == "through .data":  # bypasses the version counter; the sampled values move
            weight.data.add_(1.0)
        elif edit == "replaced":
            layer.mlp.down_proj.weight = torch.nn.Parameter(weight.detach().clone() * 2, requires_grad=False)
        else:
            layer.layer_scalar.fill_(0.25)
    assert weights_identity.declared_identity(model.lm) is None
    after = neuron_key(model)
    assert after != before and weights_identity.weights_identity(model.lm).startswith("bytes:")
    assert neuron_key(model) == after  # remembered: the second call reads no weight again


def test_another_seed_is_another_identity():
    a = weights_identity.weights_identity(build_tiny(get_variant("e2b"), seed=0).lm)
    b = weights_identity.weights_identity(build_tiny(get_variant("e2b"), seed=1).lm)
    assert a != b


def test_a_hub_snapshot_is_named_by_its_blobs_and_a_folder_hashed_once(tmp_path, monkeypatch):
    monkeypatch.setenv("GEMMA4LIB_CACHE", str(tmp_path / "cache"))
    data = b"weights" * 1000
    digest = __import__("hashlib").sha256(data).hexdigest()
    blobs, snapshot = tmp_path / "hub" / "blobs", tmp_path / "hub" / "snapshots" / "rev"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (blobs / digest).write_bytes(data)
    os.symlink(blobs / digest, snapshot / "model.safetensors")
    calls = []

    import gemma4lib.models.checkpoint_identity as ci

    original = ci.sha256_file
    monkeypatch.setattr(ci, "sha256_file", lambda p: calls.append(p) or original(p))
    assert file_digest(snapshot / "model.safetensors") == digest and calls == []  # the blob's name

    plain = tmp_path / "plain"
    plain.mkdir()
    shutil.copy(blobs / digest, plain / "model.safetensors")
    first = folder_identity(plain)
    assert folder_identity(plain) == first and len(calls) == 1  # remembered in file-digests.json
    assert (Path(os.environ["GEMMA4LIB_CACHE"]) / "file-digests.json").is_file()
    (plain / "model.safetensors").write_bytes(data[:-1] + b"X")
    assert folder_identity(plain) != first and len(calls) == 2
