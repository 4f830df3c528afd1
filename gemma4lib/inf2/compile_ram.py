"""Will this host's RAM hold a compile? The estimate the neuron backend warns with before it compiles
(a compile the kernel would kill half an hour in is warned about before it starts), and that the lab's
doctor (`python -m gemma4lab doctor`, `gemma4lab.tools.doctor`) prints. Computed, unverified on inf2."""

from __future__ import annotations

import logging
import warnings
from typing import Any

from ..errors import LowHostMemoryWarning
from ..models.variants import get_variant
from .compile_host import KEYS
from .hardware import GB, host_ram_bytes, smallest_instance
from .memory_plan import COMPILE_CALIBRATION, HOST_HEADROOM, compile_peak_gb, neuron_recipe


def estimate_compile_peak_gb(
    variant: Any, tp: int | None = None, recipe: str | None = None, keys: int = KEYS, **shapes: Any
) -> dict[str, Any]:
    """Estimated peak host RAM (GB) of compiling `variant` with `recipe` (default: `neuron_recipe`'s)
    at `tp` with `keys` ModelBuilder keys (`memory_plan`; `shapes`: the context and buckets compiled)."""
    v = get_variant(variant) if isinstance(variant, str) else variant
    tp = tp or v.tp_degree
    recipe = neuron_recipe(v, tp, recipe)
    peak, basis = compile_peak_gb(v, recipe, 2, tp, keys, **shapes)  # bf16 weights
    host = smallest_instance(tp, peak * HOST_HEADROOM)
    return {
        "variant": v.name,
        "recipe": recipe,
        "tp": tp,
        "peak_gb": round(peak, 1),
        "basis": basis,
        "smallest_instance_with_headroom": host.name if host else None,
        "calibration": COMPILE_CALIBRATION,
    }


def compile_ram_warning(estimate: dict[str, Any], ram: int) -> str | None:
    """The warning for an `estimate_compile_peak_gb` result on a host with `ram` bytes (None if it fits)."""
    peak = estimate["peak_gb"] * GB
    if ram < peak:
        trace = ""
        if estimate["recipe"] == "model_builder" and estimate["tp"] == 1:
            lean = compile_peak_gb(get_variant(estimate["variant"]), "trace")[0]
            if lean * GB <= ram:
                trace = (
                    f", or neuron_recipe='trace' (~{lean:.1f} GB; the prompt then runs through the decode "
                    "graph one token per device step)"
                )
        return (
            f"compile of {estimate['variant']} will likely be killed: estimated peak {estimate['peak_gb']} GB "
            f"host RAM > {ram / GB:.0f} GB here; compile on "
            f"{estimate['smallest_instance_with_headroom'] or 'a larger host'} or add swap{trace}"
        )
    if ram < HOST_HEADROOM * peak:
        return (
            f"tight: estimated compile peak {estimate['peak_gb']} GB is within 20 % of the "
            f"{ram / GB:.0f} GB host RAM; close other processes first"
        )
    return None


def warn_low_host_ram(
    variant: Any, tp: int | None = None, recipe: str | None = None, keys: int = KEYS, **shapes: Any
) -> str | None:
    """Before a compile: warn (`LowHostMemoryWarning`, and the log) when this host's RAM is below or near
    the estimated compile peak of `variant` with `recipe` and `keys` keys (`shapes`: the context and
    buckets compiled, so the compiler's planned RAM counts); returns the warning text (None when it fits)."""
    estimate = estimate_compile_peak_gb(variant, tp, recipe=recipe, keys=keys, **shapes)
    message = compile_ram_warning(estimate, host_ram_bytes())
    if message:
        logging.getLogger(__name__).warning(message)
        warnings.warn(message, LowHostMemoryWarning, stacklevel=2)
    return message
