"""The one-row join where K/V are device state a graph takes whole (xla, neuron; on cpu/eager a row is
a view of host buffers, `runtime.bind_kv_rows`). `RowJoin(graph, batch)` takes an int32 row index
`[1]`, the batch-1 graph's inputs and the batch's K/V at their full shapes (the batched keys' states:
NxD binds one set to every key); it reads that row (`index_select`), runs the batch-1 `DeviceGraph`
(`inplace=False`) and writes back that row only (`index_copy`, a one-row scatter): the graph's
outputs, then the whole K/V. Its children are the graph's by name: the batched keys' checkpoint loads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .graph import INDEX_DTYPE, index_tensor


class RowJoin(nn.Module):
    """`forward(row, *inputs, *kv)`: the batch-1 `graph` over row `row` of the batch's `kv`."""

    def __init__(self, graph: nn.Module, batch: int):
        super().__init__()
        for name, child in graph.named_children():  # no prefix of ours in the state names
            self.add_module(name, child)
        object.__setattr__(self, "graph", graph)  # not a child: its children are ours already
        self.batch, self.shape, self.dtype, self.inplace = int(batch), graph.shape, graph.dtype, False
        self.num_inputs, self.image_blocks = graph.num_inputs + 1, graph.image_blocks

    def key_parts(self) -> dict:
        return {**self.graph.key_parts(), "row_join": self.batch}  # a join over `batch` rows' K/V

    def new_kv(self) -> list[torch.Tensor]:
        return [torch.zeros((self.batch, *t.shape[1:]), dtype=t.dtype) for t in self.graph.new_kv()]

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        inner = self.graph.example_inputs()[: self.graph.num_inputs]
        return (torch.zeros(1, dtype=INDEX_DTYPE), *inner, *self.new_kv())

    def forward(self, row: torch.Tensor, *args: torch.Tensor):
        inputs, kv = args[: self.num_inputs - 1], args[self.num_inputs - 1 :]
        index = row.long()  # XLA's index_select / index_copy take one index dtype
        out = self.graph(*inputs, *(t.index_select(0, index) for t in kv))
        out = list(out) if isinstance(out, (tuple, list)) else [out]
        n = len(out) - len(kv)
        return (*out[:n], *(t.index_copy(0, index, new) for t, new in zip(kv, out[n:], strict=True)))


def row_step(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The engine's row step (`Steps.row_prefill`: `step(row, *inputs)`, `row` an int) over a join's
    callable, which takes the row as an int32 `[1]` tensor first."""
    return lambda row, *inputs: fn(index_tensor([row]), *inputs)
