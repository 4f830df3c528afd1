"""Tensor parallelism, hardware-agnostic: sharding plans (`plan`), per-rank checkpoints (`shard`) and the
rank graph (`rank_graph`; every rank run on CPU with real collectives is the `gloo` backend)."""
