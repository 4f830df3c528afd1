"""The figures of the README's "Before you start on inf2": disk and time per step of a first full
run, each computed from the plans or marked as a field report or unverified.

One function makes the README's table (`format_first_day(first_day_table())`), so a test holds the
README to it. What each figure rests on:

- disk: the checkpoint's text weights in bf16 (computed from the released config; the released
  files also hold the vision and, for E2B/E4B, audio encoders, not counted: unverified), the
  per-rank shards ModelBuilder writes into the artifact cache (computed, `memory_plan`), and the
  compiler's work directory (`COMPILER_WORKDIR_GB`, an allowance: weights are not inlined into the
  HLO or the NEFF, so it holds HLO, NEFFs and logs; unverified);
- download: checkpoint bytes at `DOWNLOAD_MB_S`, an assumed rate (unverified);
- load and load onto the cores: bytes read from EBS at gp3's baseline throughput
  (`EBS_GP3_MIB_S`, AWS's published gp3 baseline; computed; the page cache makes a second read
  faster, the device copy itself is not counted: unverified);
- compile: the field report's 31B (~39 min); for the others no figure was measured (unverified);
- host reference: the greedy reference reads the host model once per generated token, at
  `HOST_GB_S`, an assumed host memory rate (unverified);
- compile host: the peak of `compile_host.compile_host_plan` at the full profile's context and buckets
  (`gemma4lab.inf2.context.full_settings`; computed, its host side held to a CPU measurement at reduced depth, the
  compiler's own RAM an assumed law: unverified), and the inf2 size it needs;
- serving host: the peak of `serving_host.serving_host_plan` (computed; see there).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from gemma4lab.inf2.context import compile_peak_at, full_settings
from gemma4lib.inf2.hardware import GB
from gemma4lib.inf2.memory_plan import plan_core_memory, rank_weight_bytes
from gemma4lib.inf2.serving_host import NEW_TOKENS, serving_host_plan
from gemma4lib.models.variants import VARIANTS, Variant, get_variant

COMPILER_WORKDIR_GB = 2.0  # allowance: HLO, NEFFs and logs (weights kept out); unverified
DOWNLOAD_MB_S = 100.0  # assumed hub download rate to an EC2 instance; unverified
EBS_GP3_MIB_S = 125.0  # gp3's baseline throughput (AWS); a provisioned volume reads faster
HOST_GB_S = 20.0  # assumed host memory rate of the reference's bf16 GEMVs; unverified
FIELD_REPORT_COMPILE_MIN = {"31b": 39.0}  # the field report's measured ModelBuilder compile


@dataclass(frozen=True)
class FirstDay:
    """Disk and time of a first full run of one variant on its instance."""

    variant: str
    tp: int
    instance: str
    compile_host: str
    checkpoint_gb: float
    shards_gb: float
    workdir_gb: float
    download_min: float
    load_min: float
    compile_min: float | None
    to_cores_min: float
    reference_min: float
    serving_peak_gb: float
    compile_peak_gb: float
    context: int  # the full profile's, at which the compile is planned

    @property
    def disk_gb(self) -> float:
        return self.checkpoint_gb + self.shards_gb + self.workdir_gb

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "disk_gb": self.disk_gb}


def first_day(variant: Variant | str) -> FirstDay:
    """The figures for `variant` at its recipe's TP on its instance (the full profile's shapes)."""
    v = get_variant(variant) if isinstance(variant, str) else variant
    serving = serving_host_plan(v)
    cores = plan_core_memory(v, v.tp_degree, instance=v.instance_type)
    checkpoint = serving.model_gb
    shards = rank_weight_bytes(v, v.tp_degree) * v.tp_degree / GB
    ebs_gb_min = EBS_GP3_MIB_S * 2**20 * 60 / GB
    context = full_settings(v)["context_length"]
    return FirstDay(
        v.name,
        v.tp_degree,
        v.instance_type,
        cores.compile_host or "none",
        checkpoint,
        shards,
        COMPILER_WORKDIR_GB,
        checkpoint * 1e3 / DOWNLOAD_MB_S / 60,
        checkpoint / ebs_gb_min,
        FIELD_REPORT_COMPILE_MIN.get(v.name),
        shards / ebs_gb_min,
        NEW_TOKENS * checkpoint / HOST_GB_S / 60,
        serving.peak_gb,
        compile_peak_at(v, v.tp_degree, context),
        context,
    )


def first_day_table() -> list[FirstDay]:
    return [first_day(v) for v in VARIANTS.values()]


def format_first_day(rows: list[FirstDay]) -> str:
    """The README's table; every column's basis is in its header."""
    lines = [
        "| variant | serve on (compile on) | EBS disk: checkpoint + shards + workdir | download | load | "
        "compile | compile host peak | load onto cores | host reference | serving host peak |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        compile_cell = f"~{r.compile_min:.0f} min (field report)" if r.compile_min else "not measured (unverified)"
        lines.append(
            f"| {r.variant} | {r.instance} ({r.compile_host}) | {r.disk_gb:.0f} GB = {r.checkpoint_gb:.1f} + "
            f"{r.shards_gb:.1f} + {r.workdir_gb:.0f} (computed; workdir an allowance) | "
            f"~{r.download_min:.0f} min (at {DOWNLOAD_MB_S:.0f} MB/s, unverified) | "
            f"~{r.load_min:.1f} min (gp3 baseline, computed) | {compile_cell} | "
            f"~{r.compile_peak_gb:.0f} GB at {r.context:,} tokens (computed; the compiler's RAM assumed, unverified) | "
            f"~{r.to_cores_min:.1f} min (gp3 baseline, computed; device copy unverified) | "
            f"~{r.reference_min:.1f} min ({NEW_TOKENS} tokens at {HOST_GB_S:.0f} GB/s, unverified) | "
            f"{r.serving_peak_gb:.1f} GB (computed) |"
        )
    return "\n".join(lines)


__all__ = [
    "COMPILER_WORKDIR_GB",
    "DOWNLOAD_MB_S",
    "EBS_GP3_MIB_S",
    "FIELD_REPORT_COMPILE_MIN",
    "FirstDay",
    "HOST_GB_S",
    "first_day",
    "first_day_table",
    "format_first_day",
]
