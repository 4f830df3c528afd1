"""The measured decode against its ceiling: this machine's bandwidth and the roofline's bytes per step."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gemma4lab.inf2.bandwidth import measure_bandwidth
from gemma4lab.inf2.roofline import compare
from gemma4lib.inf2.memory_plan import DEFAULT_CONTEXT
from gemma4lib.models.loading import LoadedModel
from gemma4lib.timing import BenchFigures

if TYPE_CHECKING:  # type names only
    from gemma4lib.settings import PortSettings


def measured_vs_ceiling(model: LoadedModel, settings: PortSettings, figures: BenchFigures) -> dict[str, Any]:
    """This run's decode tok/s against the bandwidth ceiling of the machine it ran on.

    Batch-1 decode reads every device weight and K/V buffer once per token, so
    bandwidth / bytes-per-step caps it. On CPU the bandwidth is measured now (streaming read and
    GEMV over a buffer far past the caches, with the benchmark's thread count); on inf2 it is the
    HBM bandwidth of the `tp_degree` NeuronCores the recipe uses. The bytes come from the loaded
    model's shapes and the compiled K/V form (ring or full length) and expert form."""
    v = settings.variant_spec
    experts = settings.decode_experts if v.is_moe else "dense"
    common = dict(context_length=settings.context_length, ring=settings.ring_kv, experts=experts)
    if settings.backend_row.device_bound:  # inf2: the HBM of the cores in use
        row = compare(figures.decode_tok_s, model, device=v.instance_type, cores=settings.tp_degree, **common)
    else:
        bandwidth = measure_bandwidth(size_mb=256, threads=figures.threads)
        row = compare(
            figures.decode_tok_s, model, device="cpu", bandwidth_bytes_s=bandwidth["bandwidth_bytes_s"], **common
        )
        row["bandwidth"] = bandwidth
    row["label"] = f"this run ({settings.profile})"
    released = compare(
        v.field_report.decode_tok_s,
        v.name,
        device=v.instance_type,
        cores=v.tp_degree,
        context_length=DEFAULT_CONTEXT,  # the plan's context (the status box's), not this run's
        ring=True,
        experts="selective" if v.is_moe else "dense",
    )
    source = "field report" if v.field_report.decode_tok_s is not None else "computed ceiling only"
    if v.field_report.decode_tok_s is not None and v.field_report.recipe:  # not the ModelBuilder this port runs
        source = f"field report, its {v.field_report.recipe} recipe"
    released["label"] = f"released {v.name.upper()}, {v.instance_type} TP={v.tp_degree} ({source})"
    if v.field_report.decode_tok_s is None:
        released["note"] = "no decode tok/s measured: no inf2 here, and the field report gives prefill only"
    row["released_inf2"] = released
    return row
