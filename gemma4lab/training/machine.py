"""The CPU type a fixture's training bytes depend on, recorded beside the weights and compared by
the determinism tests."""

from __future__ import annotations

import platform
from typing import Any

import torch

# What decides the floating-point results of CPU training, beyond torch's version and the thread
# count: the vector code path ATen picks (`torch.backends.cpu.get_cpu_capability()`: DEFAULT, AVX2,
# AVX512) and the kernels oneMKL and oneDNN pick for the processor, which follow its vendor, family
# and model. Same values: same bytes; any other CPU type gives different (equally valid) weights.
CPU_TYPE_KEYS = ("vendor", "family", "model", "torch_cpu_capability")


def cpu_type() -> dict[str, Any]:
    """This machine's CPU type: `CPU_TYPE_KEYS`, plus its model name and the vector-instruction
    flags (avx*, amx*, fma) for the record. Read from /proc/cpuinfo on Linux; elsewhere only what
    `platform` and torch report."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if not line.strip():
                    break  # the first processor is enough: they are all the same type
                key, _, value = line.partition(":")
                info[key.strip()] = value.strip()
    except OSError:
        pass
    flags = sorted(f for f in info.get("flags", "").split() if f.startswith(("avx", "amx")) or f == "fma")
    return {
        "vendor": info.get("vendor_id") or platform.processor() or platform.machine(),
        "family": info.get("cpu family"),
        "model": info.get("model"),
        "model_name": info.get("model name"),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "flags": flags,
    }
