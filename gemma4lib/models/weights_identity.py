"""Which weights a model holds, cheaply: the loader's declaration, or raw bytes hashed once.

Artifacts that contain weights (a NEFF with inlined weights, the per-rank shards) are keyed by them.
Hashing every weight as float32 on every compile costs ~124 GB through sha256 for the 31B; instead
the loader declares what it loaded (file digests, the fixture's hashes, the seed) with
`declare_identity`, and the declaration stands while a cheap stamp of every tensor (storage, version
counter, a few sampled values) is unchanged; otherwise the raw bytes are hashed once for that stamp.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

SAMPLES_PER_TENSOR = 16  # values read per tensor for the stamp: an edit of a whole tensor moves them

_IDENTITY_ATTR = "_gemma4lib_weights_identity"  # (identity, stamp) set by declare_identity
_HASHED_ATTR = "_gemma4lib_weights_hashed"  # (digest, stamp) remembered by weights_identity


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
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
            digest.update(tensor_bytes(tensor))
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
            count = min(SAMPLES_PER_TENSOR, flat.numel())  # evenly spaced, in integers: a float32
            # linspace rounds the last index of a 400M-element table past its end
            index = torch.arange(count, dtype=torch.int64) * (flat.numel() - 1) // max(count - 1, 1)
            digest.update(tensor_bytes(flat[index]))
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
