"""The one-row join for functional backends (xla, neuron): a request joins a running batch through a
batch-1 prefill over the batch's own K/V, where its K/V are device state a graph takes whole.

`RowJoin(graph, batch)` takes an int32 row index `[1]` first, then the batch-1 graph's inputs and the
batch's K/V buffers at their full `[batch, ...]` shapes (the batched keys' state names and shapes,
so NxD binds the same states to every key); it reads that row (`index_select`), runs the batch-1
`DeviceGraph` (`inplace=False`) over it and writes back only that row (`index_copy`: a one-row scatter),
returning what the graph returns and then the whole updated K/V. Its children and parameters are the
graph's, under the same names, so a checkpoint keyed for the batched keys loads into it unchanged.
On cpu/eager no join is needed: a row is a view of the host buffers (`runtime.bind_kv_rows`).
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
        for name, child in graph.named_children():  # the graph's names: no prefix of ours in the state
            self.add_module(name, child)
        self._inner = (graph,)  # a tuple: not a child, its modules are ours already
        self.batch, self.shape, self.inplace = int(batch), graph.shape, False
        self.dtype, self.returns_hidden = graph.dtype, graph.returns_hidden
        self.num_inputs = graph.num_inputs + 1
        self.image_blocks = graph.image_blocks

    @property
    def graph(self) -> nn.Module:
        return self._inner[0]

    def key_parts(self) -> dict:
        """The batch-1 graph's program parts, and that it is a join over a batch of `batch` rows."""
        return {**self.graph.key_parts(), "row_join": self.batch}

    def new_kv(self) -> list[torch.Tensor]:
        """The batch's K/V buffers (`batch` rows), the states the batched keys hold."""
        one = self.graph.new_kv()
        return [torch.zeros((self.batch, *t.shape[1:]), dtype=t.dtype) for t in one]

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        inner = self.graph.example_inputs()[: self.graph.num_inputs]
        return (torch.zeros(1, dtype=INDEX_DTYPE), *inner, *self.new_kv())

    def forward(self, row: torch.Tensor, *args: torch.Tensor):
        inputs, kv = args[: self.num_inputs - 1], args[self.num_inputs - 1 :]
        index = row.long()  # XLA's index_select / index_copy take one index dtype
        out = self.graph(*inputs, *(t.index_select(0, index) for t in kv))
        out = list(out) if isinstance(out, (tuple, list)) else [out]
        written = out[len(out) - len(kv) :]
        joined = [t.index_copy(0, index, new) for t, new in zip(kv, written, strict=True)]
        return (*out[: len(out) - len(kv)], *joined)


def row_step(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The engine's row step (`Steps.row_prefill`: `step(row, *inputs)`, `row` an int) over a join
    graph's callable, which takes the row as an int32 `[1]` tensor before its inputs."""

    def step(row: int, *inputs: torch.Tensor) -> Any:
        return fn(index_tensor([row]), *inputs)

    return step
