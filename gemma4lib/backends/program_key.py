"""What a compiled artifact depends on, as digests: the cache keys of every backend are built here.

A cache that keys an artifact by less than what the compiler received serves an old program after
a change to the graph code (an edit to the masks, the experts, the K/V writes), and the first
people it misleads are the graph's own developers. So:

- `program_digest(exported)`: the program itself as torch.export hands it to a compiler: the
  generated code of every graph module, the signature (which inputs are parameters, buffers,
  mutated K/V), the names, shapes and dtypes of the state and the values of lifted constants. Any
  change to what the graph computes changes it, whether it came from an edit, a monkeypatch or
  another transformers version; parameter *values* do not (they are loaded at run time).
- `source_digest()`: the source files of the library modules that shape the graph, for backends
  whose compiler input cannot be produced on this machine (Neuron: the rank graph holds NxD layers).
- `weights_fingerprint(module)`: names, shapes and dtypes of every tensor, plus the raw bytes of
  the ones a compiler folds into the program (the buffers: small).
- `weights_identity(lm)`: which weights a model holds, for keys of artifacts that contain them (a
  Neuron NEFF with inlined weights, the per-rank shards). Not every weight hashed as float32 on
  every compile (~124 GB through sha256 for the 31B, an 11 GB temporary for its embedding): the
  loader declares what it loaded (the checkpoint's file digests, the fixture's recorded hashes,
  the random seed) with `declare_identity`, and that stands as long as no tensor was replaced or
  edited since (a stamp of each tensor's storage, version counter and a few sampled values). A
  model without a valid declaration is hashed once, as raw bytes, and the digest remembered for
  that stamp.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

# Library modules whose code decides what a device graph computes.
GRAPH_SOURCES = (
    "device/graph.py",
    "device/batch_graph.py",
    "device/attention.py",
    "device/experts.py",
    "device/quant.py",
    "device/kv_layout.py",
    "tp/rank_graph.py",
    "tp/layers.py",
    "tp/plan.py",
    "tp/shard.py",
    "recipes/common.py",
    "recipes/neuron_trace.py",
    "recipes/neuron_model_builder.py",
)

# Config fields that never change the compiled program: bookkeeping, init, token ids used on the host.
_PROGRAM_NEUTRAL = {
    "_name_or_path",
    "architectures",
    "transformers_version",
    "dtype",
    "torch_dtype",
    "initializer_range",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "use_cache",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "id2label",
    "label2id",
    "_attn_implementation_autoset",
    "_experts_implementation",
}


SAMPLES_PER_TENSOR = 16  # values read per tensor for the stamp: an edit of a whole tensor moves them

_IDENTITY_ATTR = "_gemma4lib_weights_identity"  # (identity, stamp) set by declare_identity
_HASHED_ATTR = "_gemma4lib_weights_hashed"  # (digest, stamp) remembered by weights_identity


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's own bytes (no float32 copy; bf16 and int8 included), zero-copy when contiguous."""
    flat = tensor.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def weights_fingerprint(module: nn.Module, values_of: str = "buffers") -> str:
    """sha256 over names, shapes and dtypes of every tensor, plus the raw bytes of `values_of`
    ("buffers": what the compiler folds into the program; "all": parameters too)."""
    digest = hashlib.sha256()
    params = dict(module.named_parameters())
    state = _state(module)
    for name in sorted(state):
        tensor = state[name].detach()
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        if values_of == "all" or name not in params:
            digest.update(_tensor_bytes(tensor))
    return digest.hexdigest()


def weights_stamp(module: nn.Module) -> str:
    """Cheap evidence that no tensor changed: per tensor its name, shape, dtype, storage address,
    version counter (bumped by in-place ops) and a few evenly spaced values (an edit through
    `.data`, which bypasses the counter, still moves them). Reads ~16 values per tensor."""
    digest = hashlib.sha256()
    for name, tensor in sorted(_state(module).items()):
        tensor = tensor.detach()
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}:{tensor.data_ptr()}:{tensor._version}".encode())
        flat = tensor.reshape(-1)
        if flat.numel():
            index = torch.linspace(0, flat.numel() - 1, min(SAMPLES_PER_TENSOR, flat.numel())).long()
            digest.update(_tensor_bytes(flat[index]))
    return digest.hexdigest()


def declare_identity(module: nn.Module, identity: str) -> None:
    """Record what the loader loaded (e.g. the checkpoint's file digests); `weights_identity`
    returns it while the weights stay as loaded."""
    object.__setattr__(module, _IDENTITY_ATTR, (identity, weights_stamp(module)))


def declared_identity(module: nn.Module) -> str | None:
    """The declared identity if the weights are still as loaded, else None."""
    declared = getattr(module, _IDENTITY_ATTR, None)
    if declared is None or declared[1] != weights_stamp(module):
        return None
    return declared[0]


def weights_identity(module: nn.Module) -> str:
    """Which weights `module` holds: the loader's declaration while it stands, else the raw bytes of
    every tensor hashed once and remembered until a tensor changes (see the module docstring)."""
    declared = declared_identity(module)
    if declared is not None:
        return f"declared:{declared}"
    stamp = weights_stamp(module)
    hashed = getattr(module, _HASHED_ATTR, None)
    if hashed is None or hashed[1] != stamp:
        hashed = (f"bytes:{weights_fingerprint(module, 'all')}", stamp)
        object.__setattr__(module, _HASHED_ATTR, hashed)
    return hashed[0]


def program_config(config: Any) -> dict[str, Any]:
    """The config as the compiled program sees it (so a fixture loaded from disk and the same
    architecture built in memory share one artifact)."""
    return {k: v for k, v in sorted(config.to_dict().items()) if k not in _PROGRAM_NEUTRAL}


def program_digest(program: torch.export.ExportedProgram) -> str:
    """sha256 of an exported program: code, signature, state layout and constant values."""
    digest = hashlib.sha256()
    for name, module in program.graph_module.named_modules():
        if isinstance(module, torch.fx.GraphModule):
            digest.update(f"module {name}\n".encode())
            digest.update(module.code.encode())
    digest.update(str(program.graph_signature).encode())
    for name, tensor in sorted(program.state_dict.items()):
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
    for name, value in sorted(program.constants.items()):
        digest.update(f"constant {name}".encode())
        if isinstance(value, torch.Tensor):
            digest.update(f"{tuple(value.shape)}:{value.dtype}".encode())
            digest.update(_tensor_bytes(value))
        else:
            digest.update(repr(value).encode())
    return digest.hexdigest()


def source_digest(files: tuple[str, ...] = GRAPH_SOURCES) -> str:
    """sha256 of the library source files that shape the device graphs."""
    root = Path(__file__).resolve().parent.parent  # gemma4lib/
    digest = hashlib.sha256()
    for name in files:
        digest.update(name.encode())
        digest.update((root / name).read_bytes())
    return digest.hexdigest()


__all__ = [
    "GRAPH_SOURCES",
    "declare_identity",
    "declared_identity",
    "program_config",
    "program_digest",
    "source_digest",
    "weights_fingerprint",
    "weights_identity",
    "weights_stamp",
]
