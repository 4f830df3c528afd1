"""The vision graph on inf2: `torch_neuronx.trace` of `device.vision.VisionGraph` on ONE NeuronCore,
saved as its own artifact, loaded onto rank 0's core (`vision_core`) beside the decoder's. The audio graph
(`device.audio.AudioGraph`, features and int32 mask in) is the other media tower and is traced alike.
Why a plain trace, inlined weights, that core: docs/NEURON.md, "The media graphs". Only the lines marked
`# inf2-only` need the Neuron SDK; the tests stand the SDK in with fakes.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import torch

from ..device.audio import AudioGraph
from ..device.vision import VisionGraph
from . import neuron_env
from .neuron_trace import save  # noqa: F401  (the same TorchScript save: `neuron_vision.save`)

PURPOSE = "a media tower on one NeuronCore (torch_neuronx.trace)"


def names(tower: str) -> tuple[str, str]:
    """The recipe name and artifact file of media tower `tower` ("vision"; "audio", traced alike)."""
    return f"{tower}_trace", f"{tower}.pt"


RECIPE, FILE = names("vision")

# neuronx-cc arguments for the vision graph (neuronx-cc CLI reference), as the decoders'
# (`neuron_env.COMPILER_ARGS`: the arithmetic is part of the cache key, no saturated infinities) but:
# - `--auto-cast=none` matters here: the compiler's default `matmult` casts FP32 matmuls to BF16, and
#   the fp32 fixtures' soft tokens go straight into the prompt's embeddings, where an error shows as a
#   logits mismatch (docs/IMAGES.md's fault lab: a scaled soft token fails LOGITS_MATCH at 6.6e-5);
# - `-O1`: the graph runs once per image, not per token; compile time matters more than its last
#   few percent of latency (the prefill keys' choice);
# - no `--tensorizer-options`: NxD Inference's decoder scheduling, tuned for collectives at TP > 1.
# Unverified on inf2: no instance here.
COMPILER_ARGS = "--model-type=transformer --auto-cast=none --enable-mixed-precision-accumulation -O1"


def compiler_args() -> list[str]:
    """The vision graph's neuronx-cc arguments as a list (torch_neuronx.trace takes str or list)."""
    return shlex.split(COMPILER_ARGS)


def vision_core(tp: int) -> int:
    """The NeuronCore the vision graph loads onto: rank 0's, whatever the degree (docs/NEURON.md;
    relative to the cores visible to this process, as the SDK's placement indices are)."""
    return 0


def compile_vision(graph: VisionGraph | AudioGraph, *, compiler_workdir: str | None = None) -> Any:
    """Trace and compile a media tower for one NeuronCore over its own example inputs (one image at the
    processor's patch budget: `pixel_values [1, patches, patch_dim]`, `position_ids [1, patches, 2]` int32;
    one clip: features, int32 mask); returns the TorchScript module. No state: no aliased inputs."""
    torch_neuronx = neuron_env.require("torch_neuronx", PURPOSE)
    graph = graph.eval()
    with torch.no_grad():
        return torch_neuronx.trace(  # inf2-only
            graph,
            graph.example_inputs(),
            compiler_workdir=compiler_workdir,
            compiler_args=compiler_args(),
            inline_weights_to_neff=True,  # (docs/NEURON.md)
        )


def load(path: str | Path, core: int) -> Any:
    """Load a saved vision trace straight onto NeuronCore `core` (importing torch_neuronx first
    registers the Neuron ops the artifact holds; the placement context must wrap the load itself)."""
    torch_neuronx = neuron_env.require("torch_neuronx", PURPOSE)
    with torch_neuronx.neuron_cores_context(start_nc=int(core), nc_count=1):  # inf2-only
        return torch.jit.load(str(path))  # inf2-only (the artifact holds a NEFF)
