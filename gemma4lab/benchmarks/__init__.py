"""Benchmarks: the side-by-side suite against Hugging Face `generate`, above `port`.

- `suite`: `run_suite`, `SuiteOptions`, the per-model / ring KV / experts / prefill-bucket benches,
  `check_targets` (it compares against `port`'s logits check);
- `hf`: Hugging Face `generate` timed per step, and its static cache + torch.compile route;
- `report`: `format_report`, the suite's report as markdown.

Timing one runtime (`benchmark`, `time_decode_steps`, `peak_rss_mb`) is `gemma4lib.timing`, below
`port`, which times its own runs with it. This package imports nothing on import, so loading one
of its modules loads only that module.
"""
