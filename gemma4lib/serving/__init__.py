"""Serving beyond one stream of one token per step, over the same device graphs and checks.

`batch_port`, `batch_runtime`, `batch_prompts` (B prompts of different lengths, every row judged
against its own reference), `speculative` (Gemma-4's MTP assistant drafts, the target verifies
k + 1 tokens per step, greedy-exact).
"""
