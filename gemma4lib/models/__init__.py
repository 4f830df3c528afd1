"""The models a port runs: the variants table, loading, and the makers of the test fixtures.

`variants` (one `Variant` per family member), `loading` and `checkpoint` (tiny builds, released
checkpoints), `trained`/`vision`/`assistant` (the trained tiny fixtures; their training is the lab's).
"""
