"""This machine's memory bandwidth, measured: the CPU ceiling the benchmarks and notebooks hand the roofline
(`gemma4lab.inf2.roofline.compare(..., device="cpu", bandwidth_bytes_s=...)`)."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from gemma4lib.inf2.hardware import GB


def measure_bandwidth(size_mb: int = 512, repeats: int = 7, threads: int | None = 1) -> dict[str, Any]:
    """Single-thread read bandwidth of this machine, two ways, on a buffer far past the caches.

    - `gemv`: fp32 matrix-vector product (`torch.mv`), the kernel shape of a batch-1 decode;
    - `stream`: a plain sum over the same buffer.
    Medians after one warm-up. `bandwidth_bytes_s` is the larger of the two (the stricter ceiling).
    """
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        cols = 4096
        rows = max(1, size_mb * 2**20 // (4 * cols))
        matrix = torch.randn(rows, cols)
        vector = torch.randn(cols)
        nbytes = matrix.numel() * 4

        def timed(fn) -> float:
            fn()
            runs = []
            for _ in range(repeats):
                started = time.perf_counter()
                fn()
                runs.append(time.perf_counter() - started)
            return statistics.median(runs)

        with torch.no_grad():
            gemv_s = timed(lambda: torch.mv(matrix, vector))
            stream_s = timed(lambda: matrix.sum())
    finally:
        torch.set_num_threads(previous)
    gemv, stream = nbytes / gemv_s, nbytes / stream_s
    return {
        "gemv_gb_s": gemv / GB,
        "stream_gb_s": stream / GB,
        "bandwidth_bytes_s": max(gemv, stream),
        "basis": "gemv" if gemv >= stream else "stream",
        "buffer_mb": nbytes / 2**20,
        "threads": threads or previous,
        "repeats": repeats,
    }
