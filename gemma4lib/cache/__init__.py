"""Compiled programs kept and carried: the artifact cache, its build lock, and bundles.

`artifacts` (entries by program key, checksummed, rebuilt once when unreadable), `lock` (one
builder per key; a stopped or dead holder reported and broken), `bundle` and `export`
(compiled ports that travel between machines: `python -m gemma4lib export`, `artifacts=DIR`).
"""
