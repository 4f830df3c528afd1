"""inf2 ceilings the lab computes for its benchmarks and notebooks, and its reports of the library's plans (`plans`).

The library keeps what the preflight and the neuron backend's compile warning need."""
