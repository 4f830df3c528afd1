"""Which layers own K/V buffers, of what shape, and who reads whose.

This is the one place that reads the KV layout out of a transformers config, so the rest of the
library never touches `per_layer_config` or `kv_sharing_modes` directly (their spelling changed
between transformers 5.13 and 5.23).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FULL = "full_attention"
SLIDING = "sliding_attention"


@dataclass(frozen=True)
class LayerKV:
    index: int
    layer_type: str
    kv_heads: int
    head_dim: int
    producer: int  # the layer whose K/V this layer attends over (itself unless KV-shared)
    k_eq_v: bool  # full layers of k_eq_v models: V comes from the K projection

    @property
    def owns_buffer(self) -> bool:
        return self.producer == self.index


@dataclass(frozen=True)
class KVLayout:
    layers: tuple[LayerKV, ...]
    sliding_window: int
    num_attention_heads: int

    @classmethod
    def from_config(cls, config: Any) -> KVLayout:
        n = config.num_hidden_layers
        types = list(config.layer_types)
        modes = list(getattr(config, "kv_sharing_modes", [None] * n))
        first_shared = n - int(getattr(config, "num_kv_shared_layers", 0) or 0)
        k_eq_v = bool(getattr(config, "attention_k_eq_v", False))
        layers = []
        for i in range(n):
            # Gemma-4 configs are per-layer heterogeneous; Gemma 3's are flat (one head_dim, one KV count).
            per_layer = config.per_layer_config[i] if hasattr(config, "per_layer_config") else config
            if modes[i] == "reuse":
                # The last non-shared layer of the same attention type produces this layer's K/V.
                producer = max(j for j in range(first_shared) if types[j] == types[i])
            else:
                producer = i
            layers.append(
                LayerKV(
                    i,
                    types[i],
                    int(per_layer.num_key_value_heads),
                    int(per_layer.head_dim),
                    producer,
                    k_eq_v and types[i] == FULL,
                )
            )
        return cls(tuple(layers), int(config.sliding_window), int(config.num_attention_heads))

    @property
    def producers(self) -> tuple[LayerKV, ...]:
        return tuple(layer for layer in self.layers if layer.owns_buffer)

    @property
    def consumers(self) -> tuple[LayerKV, ...]:
        return tuple(layer for layer in self.layers if not layer.owns_buffer)

    def slots(self, layer_type: str, context_length: int, ring: bool) -> int:
        """Buffer length: sliding layers need only `sliding_window` slots when used as a ring."""
        if layer_type == SLIDING and ring:
            return min(self.sliding_window, context_length)
        return context_length

    def buffer_shapes(self, batch: int, context_length: int, ring: bool) -> list[tuple[int, ...]]:
        """Shapes of the flat K/V list: (K, V) for each producer layer, in layer order."""
        shapes = []
        for layer in self.producers:
            shape = (batch, layer.kv_heads, self.slots(layer.layer_type, context_length, ring), layer.head_dim)
            shapes += [shape, shape]
        return shapes

    def buffer_bytes(
        self, context_length: int, ring: bool, dtype_bytes: int, batch: int = 1, every_layer: bool = False
    ) -> int:
        """Bytes of the K/V buffers (`buffer_shapes`); `every_layer`: as if no layer shared its K/V."""
        layers = self.layers if every_layer else self.producers
        return (
            sum(
                2 * batch * layer.kv_heads * self.slots(layer.layer_type, context_length, ring) * layer.head_dim
                for layer in layers
            )
            * dtype_bytes
        )

    def describe(self) -> dict[str, Any]:
        """A JSON-friendly summary for notebooks and results files."""
        return {
            "producers": [layer.index for layer in self.producers],
            "consumers": {str(layer.index): layer.producer for layer in self.consumers},
            "kv_heads": {
                t: sorted({layer.kv_heads for layer in self.layers if layer.layer_type == t}) for t in (SLIDING, FULL)
            },
            "head_dim": {
                t: sorted({layer.head_dim for layer in self.layers if layer.layer_type == t}) for t in (SLIDING, FULL)
            },
            "sliding_window": self.sliding_window,
        }
