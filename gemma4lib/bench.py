from .benchmarks.timing import BenchFigures, benchmark, peak_rss_mb  # noqa: F401  (deprecated: import from there)
