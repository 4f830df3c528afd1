"""`python -m gemma4lib doctor`: is this machine ready to compile and run a Gemma-4 port on inf2?

`run_doctor(variant=None, tp=None)` returns a JSON-friendly report; `format_doctor(report)` renders
it as text. It checks, without importing the Neuron SDK:

- versions found vs the pinned Neuron SDK 2.28 set and transformers (`recipes.neuron_env`);
- Neuron devices and NeuronCores (`neuron-ls --json-output` when present, else `/dev/neuron*`);
- the `transformers.utils.fx` shim `neuronx_distributed` needs under transformers 5 (the recipes
  install it when they import NxD; the doctor only reports whether it will be needed);
- the PATH fix for the `libneuronpjrt-path` import error;
- host RAM against an estimate of the compile's peak for the chosen variant and TP degree, with a
  warning *before* a compile that the kernel would kill half an hour in.

The compile-peak estimate (`estimate_compile_peak_gb`), bf16 weights:

- ModelBuilder (12B, 31B, 26B-A4B): 3 x the text weights. While sharding, the host holds the
  module ModelBuilder builds, the checkpoint the loader returns and the per-rank shards it writes,
  each the size of the model. Calibration: 31B -> 3 x 61.4 GB = 184 GB; the field report measured
  a 182 GB peak. TP does not change it (every rank's shard is cut from the full checkpoint).
- trace / hand-driven TP (E2B, E4B): the host model (text weights including the PLE tables) plus
  2 x the weights that go to the device (traced-in HLO constants and the NEFF). E2B: 9.3 + 2 x 4.6
  = 18.5 GB, more than an inf2.xlarge's 16 GiB: compile on a bigger host.
It is an estimate from the weights alone (compiler working memory comes on top for big graphs);
the warning fires when the host's total RAM is below it, a note when within 20 %.
"""

from __future__ import annotations

import glob
import json
import os
import platform
import shutil
import subprocess
import sys
from typing import Any

from .recipes import neuron_env

GB = 1e9
GIB = 2**30

# bf16 bytes that live on the device per variant (DESIGN §4): PLE on host; all experts for the MoE.
DEVICE_WEIGHTS_GB = {"e2b": 4.6, "e4b": 9.4, "12b": 23.8, "31b": 61.4, "26b-a4b": 50.5}
INSTANCE_RAM_GIB = {"inf2.xlarge": 16, "inf2.8xlarge": 128, "inf2.24xlarge": 384, "inf2.48xlarge": 768}
MODEL_BUILDER_COPIES = 3
SEED_MEASURED = {"variant": "31b", "tp": 8, "peak_gb": 182.0}


def estimate_compile_peak_gb(variant: Any, tp: int | None = None, bytes_per_param: int = 2) -> dict[str, Any]:
    """Estimated peak host RAM (GB) of compiling `variant` with its recipe; see the module docstring."""
    from .variants import get_variant

    v = get_variant(variant) if isinstance(variant, str) else variant
    model_gb = float(v.real_config["params_text_b"]) * bytes_per_param
    device_gb = DEVICE_WEIGHTS_GB[v.name] * bytes_per_param / 2
    if v.recipe == "model_builder":
        peak = MODEL_BUILDER_COPIES * model_gb
        basis = f"{MODEL_BUILDER_COPIES} x text weights (module + checkpoint + per-rank shards)"
    else:
        peak = model_gb + 2 * device_gb
        basis = "host model + 2 x device weights (HLO constants + NEFF)"
    fits = [name for name, gib in INSTANCE_RAM_GIB.items() if gib * GIB >= 1.2 * peak * GB]
    return {"variant": v.name, "recipe": v.recipe, "tp": tp or v.tp_degree, "peak_gb": round(peak, 1),
            "model_gb": round(model_gb, 1), "device_gb": round(device_gb, 1), "basis": basis,
            "smallest_instance_with_headroom": fits[0] if fits else None,
            "calibration": SEED_MEASURED}


def compile_ram_warning(estimate: dict[str, Any], ram: int) -> str | None:
    """The warning for an `estimate_compile_peak_gb` result on a host with `ram` bytes (None if it fits)."""
    peak = estimate["peak_gb"] * GB
    if ram < peak:
        return (f"compile of {estimate['variant']} will likely be killed: estimated peak {estimate['peak_gb']} GB "
                f"host RAM > {ram / GB:.0f} GB here; compile on "
                f"{estimate['smallest_instance_with_headroom'] or 'a larger host'} or add swap")
    if ram < 1.2 * peak:
        return (f"tight: estimated compile peak {estimate['peak_gb']} GB is within 20 % of the "
                f"{ram / GB:.0f} GB host RAM; close other processes first")
    return None


def warn_low_host_ram(variant: Any, tp: int | None = None) -> str | None:
    """Before a compile: warn (`LowHostMemoryWarning`, and the log) when this host's RAM is below or near
    the estimated compile peak of `variant`; returns the warning text (None when it fits)."""
    import logging
    import warnings

    from .errors import LowHostMemoryWarning

    message = compile_ram_warning(estimate_compile_peak_gb(variant, tp), host_ram_bytes())
    if message:
        logging.getLogger(__name__).warning(message)
        warnings.warn(message, LowHostMemoryWarning, stacklevel=2)
    return message


def host_ram_bytes() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except ImportError:  # pragma: no cover - psutil is a dependency
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def instance_type() -> str | None:
    """The EC2 instance type from DMI (no network), None elsewhere."""
    try:
        with open("/sys/devices/virtual/dmi/id/product_name") as handle:
            name = handle.read().strip()
        return name if name.startswith(("inf", "trn")) else None
    except OSError:
        return None


def neuron_devices() -> dict[str, Any]:
    """Neuron devices and cores: `neuron-ls --json-output` if available, else `/dev/neuron*`."""
    nodes = sorted(glob.glob("/dev/neuron*"))
    tool = shutil.which("neuron-ls") or (os.path.join(neuron_env.NEURON_BIN, "neuron-ls")
                                         if os.path.exists(os.path.join(neuron_env.NEURON_BIN, "neuron-ls")) else None)
    info: dict[str, Any] = {"dev_nodes": nodes, "devices": len(nodes), "cores": None, "neuron_ls": tool,
                            "source": "/dev/neuron*"}
    if tool:
        try:
            out = subprocess.run([tool, "--json-output"], capture_output=True, text=True, timeout=20)
            listing = json.loads(out.stdout)
            if isinstance(listing, list):
                info.update(devices=len(listing), source="neuron-ls",
                            cores=sum(int(d.get("nc_count", 2)) for d in listing))
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            info["neuron_ls_error"] = f"{type(exc).__name__}: {exc}"
    if info["cores"] is None and nodes:
        info["cores"] = 2 * len(nodes)  # inf2: two NeuronCore-v2 per device
    if info["cores"] is None:
        info["cores"] = 0
    return info


def _path_report() -> dict[str, Any]:
    parts = os.environ.get("PATH", "").split(os.pathsep)
    rows = [{"folder": f, "exists": os.path.isdir(f), "on_path": f in parts} for f in neuron_env.path_fix_dirs()]
    return {"folders": rows, "ok": all(r["on_path"] or not r["exists"] for r in rows),
            "fix": f"export PATH={os.path.join(sys.prefix, 'bin')}:{neuron_env.NEURON_BIN}:$PATH "
                   f"(the recipes apply it in-process)"}


def run_doctor(variant: str | None = None, tp: int | None = None) -> dict[str, Any]:
    """The report: versions, devices, fixes, RAM vs compile peak, plus warnings and a verdict."""
    warnings: list[str] = []
    versions = neuron_env.check_versions()
    sdk = neuron_env.sdk_present()
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:  # pragma: no cover
        torch_version = None
    devices = neuron_devices()
    shim = neuron_env.fx_shim_status()
    path = _path_report()
    ram = host_ram_bytes()
    report: dict[str, Any] = {
        "python": platform.python_version(), "platform": platform.platform(), "torch": torch_version,
        "instance_type": instance_type(), "neuron_sdk_release": neuron_env.NEURON_SDK_RELEASE,
        "sdk_present": sdk, "versions": versions, "devices": devices,
        "fx_shim": {"status": shim,
                    "meaning": {"real": "transformers provides transformers.utils.fx: no shim",
                                "shim": "gemma4lib's shim is installed",
                                "needed": "transformers 5 lacks it: the recipes install a one-class shim "
                                          "before importing neuronx_distributed",
                                "no-transformers": "transformers is not installed"}[shim]},
        "path": path, "host_ram_gb": round(ram / GB, 1),
    }
    if not sdk:
        warnings.append("Neuron SDK not found (CPU profile only); " + neuron_env.how_to_get("torch-neuronx"))
    else:
        bad = [r for r in versions if not r["ok"]]
        for row in bad:
            warnings.append(f"{row['package']} {row['found']} is not the pinned {'/'.join(row['pinned'])}")
        if devices["cores"] == 0:
            warnings.append("Neuron SDK present but no Neuron devices found (/dev/neuron*): not an inf2 host?")
        if not path["ok"]:
            warnings.append("PATH lacks the venv/Neuron bin folders (libneuronpjrt-path import error): "
                            + path["fix"])
    if not next(r for r in versions if r["package"] == "transformers")["ok"]:
        warnings.append(f"transformers must be {neuron_env.TRANSFORMERS_PIN} (CPU and inf2 alike)")
    if variant is not None:
        from .errors import TensorParallelError
        from .loading import text_config
        from .tp.plan import make_plan
        from .variants import get_variant

        v = get_variant(variant)
        tp = tp or v.tp_degree
        estimate = estimate_compile_peak_gb(v, tp)
        report["compile_estimate"] = estimate
        try:
            make_plan(text_config(v, "real"), tp, v)
            report["tp"] = {"degree": tp, "ok": True}
        except TensorParallelError as exc:
            report["tp"] = {"degree": tp, "ok": False, "error": str(exc)}
            warnings.append(str(exc))
        if devices["cores"] and tp > devices["cores"]:
            warnings.append(f"TP={tp} needs {tp} NeuronCores; this host has {devices['cores']}")
        ram_warning = compile_ram_warning(estimate, ram)
        if ram_warning:
            warnings.append(ram_warning)
    report["warnings"] = warnings
    report["ok"] = sdk and not warnings
    return report


def format_doctor(report: dict[str, Any]) -> str:
    lines = [f"gemma4lib doctor — Neuron SDK {report['neuron_sdk_release']} target",
             f"python {report['python']}, torch {report['torch']}, {report['platform']}"]
    if report.get("instance_type"):
        lines.append(f"instance: {report['instance_type']}")
    lines.append("versions (found / pinned):")
    for row in report["versions"]:
        mark = "ok " if row["ok"] else ("-- " if row["found"] is None else "!! ")
        lines.append(f"  {mark}{row['package']:<22} {row['found'] or 'missing':<22} {' or '.join(row['pinned'])}")
    d = report["devices"]
    lines.append(f"neuron devices: {d['devices']} ({d['cores']} NeuronCores) via {d['source']}")
    lines.append(f"transformers.utils.fx: {report['fx_shim']['status']} — {report['fx_shim']['meaning']}")
    if not report["sdk_present"]:
        lines.append("PATH fix: not needed without the Neuron SDK")
    else:
        lines.append("PATH fix: " + ("ok" if report["path"]["ok"] else "missing — " + report["path"]["fix"]))
    lines.append(f"host RAM: {report['host_ram_gb']} GB")
    if "compile_estimate" in report:
        e = report["compile_estimate"]
        lines.append(f"compile peak estimate for {e['variant']} ({e['recipe']}, TP={e['tp']}): {e['peak_gb']} GB "
                     f"[{e['basis']}]")
    if "tp" in report:
        lines.append(f"TP={report['tp']['degree']}: " + ("ok" if report["tp"]["ok"] else report["tp"]["error"]))
    for w in report["warnings"]:
        lines.append(f"WARNING: {w}")
    lines.append("verdict: " + ("ready for inf2" if report["ok"] else
                                "CPU profile only" if not report["sdk_present"] else "fix the warnings above"))
    return "\n".join(lines)
