"""The models a port runs: the variants table, loading, and the makers of the test fixtures.

`variants` (one `Variant` per family member: configs, recipe, TP, notebook, aliases),
`loading` (tiny builds and checkpoints), `trained`/`training`/`corpus`/`tokenizer` (the
trained tiny fixtures), `medium`, `real_width`, `released`, `gemma3_real`.
"""
