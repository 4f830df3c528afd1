"""What a compiled artifact depends on, as digests: the cache keys of every backend are built here.

A cache that keys an artifact by less than what the compiler received serves an old program after
a change to the graph code, and the first people it misleads are the graph's own developers. So:

- `program_digest(exported)`: the program as torch.export hands it to a compiler (every graph
  module's generated code, the signature, the state's names, shapes and dtypes, lifted constants'
  values): any change to what the graph computes changes it, whether an edit, a monkeypatch or
  another transformers version; parameter *values* do not (they are loaded at run time).
- `source_digest()`: the library's graph-shaping source files, for backends whose compiler input
  cannot be produced on this machine (Neuron: the rank graph holds NxD layers).
- `models.weights_identity`: the weights' part of a key, for artifacts that contain them.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from ..models.weights_identity import tensor_bytes

# Library modules whose code decides what a device graph computes.
GRAPH_SOURCES = (
    "device/graph.py",
    "device/drafting.py",
    "device/attention.py",
    "device/experts.py",
    "device/quant.py",
    "device/kv_layout.py",
    "device/packed_linear.py",
    "device/row_join.py",
    "tp/rank_graph.py",
    "tp/draft_rank_graph.py",
    "tp/layers.py",
    "tp/plan.py",
    "tp/shard.py",
    "recipes/common.py",
    "recipes/neuron_trace.py",
    "recipes/neuron_model_builder.py",
    "recipes/neuron_drafting.py",
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
            digest.update(tensor_bytes(value))
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
