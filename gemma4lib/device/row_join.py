"""The one-row join where K/V are device state a graph takes whole (xla, neuron; on cpu/eager a row is
a view of host buffers, `runtime.bind_kv_rows`). `RowJoin(graph, batch)` takes an int32 row index
`[1]`, the batch-1 graph's inputs and the batch's K/V at full shape (the batched keys' states: NxD
binds one set to every key), and runs the batch-1 `DeviceGraph` (`inplace=False`) with its cache on
that row (`ExplicitKV.rows`: attention reads the row, the write scatters the new positions into it).
It returns the graph's outputs, then the whole K/V; its children are the graph's, by the same names.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .graph import INDEX_DTYPE, index_tensor


def adopt(wrapper: nn.Module, graph: nn.Module) -> None:
    """`graph`'s children become `wrapper`'s by the same names (no prefix of the wrapper's in the state
    names: NxD binds one set of K/V states and weights to every key); `graph` itself is no child."""
    for name, child in graph.named_children():
        wrapper.add_module(name, child)
    object.__setattr__(wrapper, "graph", graph)


class RowJoin(nn.Module):
    """`forward(row, *inputs, *kv)`: the batch-1 `graph` over row `row` of the batch's `kv`."""

    def __init__(self, graph: nn.Module, batch: int):
        super().__init__()
        adopt(self, graph)
        self.batch, self.shape, self.dtype, self.inplace = int(batch), graph.shape, graph.dtype, False
        self.num_inputs, self.image_blocks = graph.num_inputs + 1, graph.image_blocks

    def new_kv(self) -> list[torch.Tensor]:
        return [torch.zeros((self.batch, *t.shape[1:]), dtype=t.dtype) for t in self.graph.new_kv()]

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        inner = self.graph.example_inputs()[: self.graph.num_inputs]
        return (torch.zeros(1, dtype=INDEX_DTYPE), *inner, *self.new_kv())

    def forward(self, row: torch.Tensor, *args: torch.Tensor):
        kv_class = self.graph.kv_class
        self.graph.kv_class = functools.partial(kv_class, rows=row.long())  # XLA's index ops take one dtype
        try:
            return self.graph(*args)
        finally:
            self.graph.kv_class = kv_class


def row_step(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The engine's row step (`Steps.row_prefill`: `step(row: int, *inputs)`) over a join's callable."""
    return lambda row, *inputs: fn(index_tensor([row]), *inputs)
