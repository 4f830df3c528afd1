"""A context bucket as an NxD key. NxD's model routes a call by its inputs' shapes alone, and a
bucket's graph (`GraphShape.reads`: the first C slots of every full-length K/V buffer) takes the
same inputs as the whole-context graph: its K/V are the same full-size states in every key. So
`ContextKey(graph)` takes the read slots' positions `[C]` (int32 0 .. C - 1, made once on the host)
first: their shape routes the call to its bucket, and the masks take the key positions from them
(`graph.slot_positions`), as NxD Inference's token-generation buckets take an attention mask as wide
as the bucket. Its children are the graph's, by the same names (`row_join.adopt`).
"""

from __future__ import annotations

import torch
from torch import nn

from .graph import INDEX_DTYPE
from .row_join import adopt


class ContextKey(nn.Module):
    """`forward(positions, *inputs, *kv)`: `graph` (a `DeviceGraph` at a context bucket, or a
    `RowJoin` over one) with its masks' key positions from `positions`."""

    def __init__(self, graph: nn.Module):
        super().__init__()
        adopt(self, graph)
        self.shape, self.dtype, self.inplace, self.image_blocks = graph.shape, graph.dtype, False, graph.image_blocks
        self.num_inputs, self.chooses = graph.num_inputs + 1, bool(getattr(graph, "chooses", False))
        self.target = getattr(graph, "graph", graph)  # the DeviceGraph whose masks read the positions

    def new_kv(self) -> list[torch.Tensor]:
        return self.graph.new_kv()

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        return (torch.arange(self.shape.reads, dtype=INDEX_DTYPE), *self.graph.example_inputs())

    def forward(self, positions: torch.Tensor, *args: torch.Tensor):
        self.target.key_positions = positions
        try:
            return self.graph(*args)
        finally:
            self.target.key_positions = None
