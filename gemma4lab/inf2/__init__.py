"""inf2 ceilings the lab computes for its benchmarks and notebooks.

The library keeps what the doctor and the preflight need."""
