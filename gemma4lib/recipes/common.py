"""What the three Neuron recipes share, all of it runnable on CPU.

- `KVParamModule`: a graph built with `inplace=False` whose K/V buffers are parameters of the module;
  `forward` returns `(logits, *updated_kv)` and `aliases()` maps each K/V parameter to its output
  index, the `input_output_aliases` torch_neuronx / NxD take to write the K/V back in place.
- `AliasEmulator`: runs a `KVParamModule` on CPU as the device runs the compiled one (outputs copied
  back into the K/V parameters), so the host loop below is tested here.
- `DeviceStep`: an engine step over a compiled module that holds its K/V.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..device.embedder import HostEmbedder
from ..errors import DeviceOutputError, GraphFormError, HostTablesMovedError


class KVParamModule(nn.Module):
    """A functional graph with its K/V held as parameters, ready for aliasing."""

    def __init__(self, graph: nn.Module, kv: nn.ParameterList | None = None):
        super().__init__()
        if getattr(graph, "inplace", False):
            raise GraphFormError(
                "KVParamModule needs the functional graph form (K/V returned as outputs): build it with "
                "DeviceGraph(..., inplace=False)"
            )
        self.graph = graph
        if kv is None:
            kv = nn.ParameterList([nn.Parameter(t, requires_grad=False) for t in graph.new_kv()])
        self.kv = kv

    @property
    def num_inputs(self) -> int:
        return self.graph.num_inputs

    def forward(self, *inputs: torch.Tensor):
        return self.graph(*inputs, *self.kv)

    def aliases(self) -> dict[nn.Parameter, int]:
        """`{kv_param: output_index}`: output 0 is the logits, then the K/V in buffer order."""
        return {p: 1 + i for i, p in enumerate(self.kv)}

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        return tuple(self.graph.example_inputs()[: self.num_inputs])

    def sharing(self, graph: nn.Module) -> KVParamModule:
        """Another graph (e.g. decode next to prefill) over the same K/V parameters."""
        return KVParamModule(graph, self.kv)


def key_inputs(
    graph: nn.Module, num_inputs: int | None = None, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, ...]:
    """The example inputs a compiler gets for `graph`: the graph's own `example_inputs()` without
    its K/V (those are aliased state), so their shapes (batch, bucket) and the index tensors'
    dtype are the graph's, never a second copy of them written here. `dtype`: the dtype the module
    is compiled in (the embeddings and PLE, 3-D and more, are cast to it; a chooser's sampling
    `[B, 3]` stays float32: its draw needs the precision). The K/V the call allocates are dropped."""
    n = num_inputs or graph.num_inputs
    inputs = graph.example_inputs()[:n]
    return tuple(t.to(dtype) if dtype is not None and t.is_floating_point() and t.dim() >= 3 else t for t in inputs)


def index_dtype(inputs: tuple[torch.Tensor, ...]) -> torch.dtype:
    """The dtype of the start/length inputs (the last two graph inputs) a module was compiled with."""
    return inputs[-1].dtype


class AliasEmulator:
    """Call a `KVParamModule` on CPU with device aliasing semantics; returns the logits."""

    def __init__(self, module: KVParamModule):
        self.module = module

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out = self.module(*inputs)
            for param, new in zip(self.module.kv, out[1:], strict=True):
                param.copy_(new)
        return out[0]


def first_output(out: Any) -> torch.Tensor:
    """The logits, whether a compiled module returns a tensor or a tuple/list led by them."""
    return out[0] if isinstance(out, (tuple, list)) else out


def check_first_output(out: Any, vocab: int | None = None, aliases: int = 0) -> None:
    """The first call's output, checked: the logits as a tensor (last dim `vocab` when given),
    then either nothing or exactly the `aliases` K/V states the module was traced with
    (`input_output_aliases`), left on the device.

    Why states may follow: NxD drops aliased outputs in its packer (v2.28.0 `trace/model_builder.py`),
    so a ModelBuilder model returns the logits alone, but `torch_neuronx.trace` has no such option
    (the SDK's T5 tutorial indexes the K/V its decoder returns); whether they come back on the device
    is unverified on inf2. Device-resident states are accepted; host copies of the K/V (a silent
    copy every token) and any tensor that is neither the logits nor a declared state are errors."""
    logits = first_output(out)
    if not isinstance(logits, torch.Tensor):
        raise DeviceOutputError(
            f"the compiled module returned {type(out).__name__} led by {type(logits).__name__}, not the logits "
            "tensor: recompile (the artifact is not this recipe's) or check what the traced module returns"
        )
    if vocab is not None and logits.shape[-1] != vocab:
        raise DeviceOutputError(
            f"the compiled module's first output has shape {tuple(logits.shape)}, not [..., {vocab}] logits: "
            "the artifact was compiled for another model or output order; clear its cache entry and recompile"
        )
    rest = list(out[1:]) if isinstance(out, (tuple, list)) else []
    tensors = [t for t in rest if isinstance(t, torch.Tensor)]
    mb = sum(t.numel() * t.element_size() for t in tensors) / 1e6
    if len(tensors) != len(rest) or len(rest) not in (0, aliases):
        raise DeviceOutputError(
            f"the compiled module returns {len(rest)} outputs after the logits ({mb:.1f} MB copied to the host "
            f"every step) but was traced with {aliases} aliased K/V states: what follows the logits is neither "
            "nothing nor those states. Its K/V are outputs, not aliased device state: trace with "
            "input_output_aliases mapping every K/V parameter (KVParamModule.aliases), or clear the cache entry "
            "(the artifact is not this recipe's) and recompile"
        )
    on_host = [t for t in tensors if t.device.type == "cpu"]
    if on_host:
        host_mb = sum(t.numel() * t.element_size() for t in on_host) / 1e6
        raise DeviceOutputError(
            f"the compiled module returns its {len(on_host)} aliased K/V states as host tensors ({host_mb:.1f} MB "
            "copied to the host every step): the states should stay on the device. This is the trace recipe's "
            "unverified case (recipes.common.check_first_output): use the ModelBuilder recipe "
            "(PortSettings(neuron_recipe='model_builder'), whose NxD model drops aliased outputs) and report the "
            "torch-neuronx version"
        )


def check_host_tables(host: HostEmbedder) -> None:
    """After the compile or load: the embedder's tables are still host tensors with their storage
    (a compiler that moved or freed weights shared with the device module, e.g. the tied
    `lm_head`/`embed_tokens`, would make the next lookup fail or cross to the device)."""
    for name in ("embed_tokens", "embed_tokens_per_layer"):
        table = getattr(host, name, None)
        weight = getattr(table, "weight", None)
        if table is None or weight is None:
            continue
        if weight.device.type != "cpu" or weight.numel() == 0 or weight.untyped_storage().nbytes() == 0:
            raise HostTablesMovedError(
                f"the host {name} table is on {weight.device} with {weight.untyped_storage().nbytes()} bytes of "
                "storage after the compile: the compiler moved or freed a weight the host embedder shares; keep "
                "the host model out of the traced module (the recipes build it from the config) and reload it"
            )


class DeviceStep:
    """An engine step over a compiled module that keeps its K/V on the device.

    The engine calls `step(inputs..., start, length)`; the device module takes exactly those (its
    K/V are aliased state). `aliases`: how many K/V states the module was traced with (what may
    follow the logits); `index_dtype`: the start/length dtype it was compiled with. The first call's
    output is checked (`check_first_output`), so a wrong artifact fails there with a named error.
    """

    def __init__(
        self,
        module: Callable[..., Any],
        num_inputs: int,
        vocab: int | None = None,
        *,
        aliases: int = 0,
        index_dtype: torch.dtype | None = None,
        chooses: bool = False,
    ):
        self.module, self.num_inputs, self.vocab = module, num_inputs, vocab
        self.aliases, self.index_dtype = aliases, index_dtype
        # the decode that returns token ids (`DeviceGraph.chooses`): sampling follows start/length
        self.chooses = chooses
        self.checked = False

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        inputs = list(args[: self.num_inputs])
        at = len(inputs) - 2 - int(self.chooses)
        if self.index_dtype is not None:
            inputs[at : at + 2] = [t.to(self.index_dtype) for t in inputs[at : at + 2]]
        out = self.module(*inputs)
        if not self.checked:
            check_first_output(out, None if self.chooses else self.vocab, self.aliases)
            self.checked = True
        return first_output(out) if self.chooses else first_output(out).float()
