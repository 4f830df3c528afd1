"""The device graph: transformers' Gemma-4 forward over explicit K/V buffers, and its parts.

`graph` (DeviceGraph, GraphShape), `attention` (the attention forms), `experts` (dense and
selective MoE experts), `quant` (int8 weights), `kv_layout` (which layers own K/V buffers),
`embedder` (word embeddings and PLE, looked up on the host), `build` (the prefill and decode
graphs every single-device backend compiles). Nothing here imports a backend or `port`.
"""
