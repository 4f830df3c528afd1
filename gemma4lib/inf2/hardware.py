"""Facts about the inf2 machines the recipes target: one leaf module (it imports nothing from
gemma4lib) that the plans, the doctor and the notebooks read, so a figure is written down once.

Sources: AWS's published inf2 specification (chips, NeuronCore-v2 count, host memory, HBM and its
bandwidth); 16 GiB of HBM per NeuronCore is 32 GiB per chip over two cores (NxD Inference's guide says
the same). The tensor-parallel degrees are the ones the Neuron runtime supports on Inferentia2.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

GIB = 2**30
GB = 1e9

CORES_PER_CHIP = 2
HBM_PER_CHIP_GIB = 32
HBM_PER_CORE_GIB = HBM_PER_CHIP_GIB // CORES_PER_CHIP  # 16: what one tensor-parallel rank can hold
# Dense bf16/fp16 matmul peak of one Inferentia2 chip, AWS's published figure (190 TFLOPS), split
# evenly over its two NeuronCores. A datasheet peak, unverified here: prefill estimates use it as a floor.
BF16_TFLOPS_PER_CHIP = 190.0
BF16_FLOPS_PER_CORE = BF16_TFLOPS_PER_CHIP * 1e12 / CORES_PER_CHIP

# Tensor-parallel degrees the Neuron runtime supports on Inferentia2: "Inf2: 1, 2, 4, 8, and 24"
# (NxD Inference feature guide, SDK 2.28). 12 is not among them, though an inf2.24xlarge has 12 cores.
NEURON_TP_DEGREES: tuple[int, ...] = (1, 2, 4, 8, 24)

# Set this to an instance name to plan for it from another machine (or to pretend, in tests).
INSTANCE_ENV = "GEMMA4LIB_INSTANCE_TYPE"
_DMI_PRODUCT = "/sys/devices/virtual/dmi/id/product_name"


@dataclass(frozen=True)
class Inf2Instance:
    """One inf2 size: what a port can use on it."""

    name: str
    chips: int
    host_ram_gib: int
    hbm_gib_s: float  # aggregate HBM bandwidth of the instance

    @property
    def neuron_cores(self) -> int:
        return self.chips * CORES_PER_CHIP

    @property
    def hbm_gib(self) -> int:
        return self.chips * HBM_PER_CHIP_GIB

    @property
    def hbm_bytes_s(self) -> float:
        return self.hbm_gib_s * GIB

    @property
    def per_core_bytes_s(self) -> float:
        """HBM bandwidth per NeuronCore: a chip's 820 GiB/s shared by its 2 cores (an assumption:
        one core is taken to reach at most its half; the chip total is the hard limit)."""
        return self.hbm_bytes_s / self.neuron_cores

    def bandwidth_bytes_s(self, cores: int | None = None) -> float:
        """Bandwidth available to a graph sharded over `cores` NeuronCores (all when None)."""
        if cores is None:
            return self.hbm_bytes_s
        return self.per_core_bytes_s * min(int(cores), self.neuron_cores)


INSTANCES: dict[str, Inf2Instance] = {
    "inf2.xlarge": Inf2Instance("inf2.xlarge", 1, 16, 820.0),
    "inf2.8xlarge": Inf2Instance("inf2.8xlarge", 1, 128, 820.0),
    "inf2.24xlarge": Inf2Instance("inf2.24xlarge", 6, 384, 4920.0),
    "inf2.48xlarge": Inf2Instance("inf2.48xlarge", 12, 768, 9840.0),
}


def smallest_instance(cores: int = 1, host_ram_gb: float = 0.0) -> Inf2Instance | None:
    """The cheapest inf2 size with at least `cores` NeuronCores and `host_ram_gb` of host memory."""
    for inst in INSTANCES.values():  # ordered smallest first
        if inst.neuron_cores >= cores and inst.host_ram_gib * GIB >= host_ram_gb * GB:
            return inst
    return None


def dmi_instance_type() -> str | None:
    """The EC2 instance type from DMI (no network needed), None off inf2/trn."""
    try:
        with open(_DMI_PRODUCT) as handle:
            name = handle.read().strip()
    except OSError:
        return None
    return name if name.startswith(("inf", "trn")) else None


def host_instance_type() -> str | None:
    """This host's instance type: `$GEMMA4LIB_INSTANCE_TYPE`, else the DMI name, else None."""
    return os.environ.get(INSTANCE_ENV) or dmi_instance_type()


def host_ram_bytes() -> int:
    """Total memory of this host."""
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except ImportError:  # pragma: no cover - psutil is a dependency
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
