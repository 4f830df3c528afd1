"""`python -m gemma4lab doctor`: is this machine ready to compile and run a Gemma-4 port on inf2?

`run_doctor(variant=None, tp=None)` returns a JSON-friendly report (`format_doctor` renders it),
without importing the Neuron SDK: the environment against the pinned SDK 2.28 set, the Neuron
devices, the NxD shim and PATH fixes it will need, and with `variant` the plans (per core, compile
host, serving host; `vision=True` with the vision part), so a compile the kernel would kill half an
hour in is warned about before it starts. A lab tool over the library's plans (the library keeps what
its preflight and the neuron backend's compile warning need); every variant's plans at once:
`python -m gemma4lab plan` (`gemma4lab.tools.inf2_tables.family_report`).
"""

from __future__ import annotations

import glob
import json
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import asdict
from typing import Any

from gemma4lab.inf2.context import context_plan, full_settings, largest_context
from gemma4lab.inf2.plans import compile_summary, core_summary, plan_dict
from gemma4lib.errors import TensorParallelError
from gemma4lib.inf2.compile_host import COMPILER_CALIBRATION, compile_host_plan, compiler_bytes_per_mac
from gemma4lib.inf2.compile_ram import compile_ram_warning, estimate_compile_peak_gb
from gemma4lib.inf2.hardware import GB, INSTANCES, dmi_instance_type, host_instance_type, host_ram_bytes
from gemma4lib.inf2.memory_plan import DEFAULT_CONTEXT, plan_core_memory, require_neuron_tp
from gemma4lib.inf2.serving_host import serving_host_plan
from gemma4lib.models.variants import get_variant
from gemma4lib.recipes import neuron_env

FAMILY_TABLES = "python -m gemma4lab plan"  # the lab command that prints every variant's plans
COMPILER_NOTE = (
    "compile-host bound: neuronx-cc's RAM assumed {per_mac:.3f} B per attention multiply-accumulate of a key, the "
    "keys compiled at once (NxD's ModelBuilder thread pool); the largest coefficient under which "
    f"{COMPILER_CALIBRATION['source']} (at least {{least:.3f}}); unverified on inf2"
)


# The SSM parameter names only the newest image (aws-neuron-sdk v2.28.0 `dlami/index.rst`: "SSM
# parameters support finding the latest DLAMI ID ... Support for finding specific Neuron SDK version
# DLAMIs will be added in future releases"), which is now a 2.29+ image that fails the pins. So the
# image is picked by name and creation date: made between the SDK 2.28.0 and 2.29.0 releases (the
# aws-neuron-sdk tags v2.28.0 2026-02-26 and v2.29.0 2026-04-09; 2.28.1 of 2026-03-13 has the same
# Python packages in its `n2-manifest.json`; the image names and ids themselves are unverified here).
DLAMI_SSM_PARAMETER = "/aws/service/neuron/dlami/multi-framework/ubuntu-24.04/latest/image_id"
DLAMI_DATES = ("2026-02-26", "2026-04-09")  # created on or after the first, before the second
DLAMI_LOOKUP = (
    f"aws ec2 describe-images --owners amazon --filters 'Name=name,Values={neuron_env.DLAMI} *' "
    "--query 'sort_by(Images, &CreationDate)[].[CreationDate,Name,ImageId]' --output text"
)


def dlami_advice() -> str:
    """How to pick the SDK 2.28 image (never the SSM `latest`, which resolves to a newer SDK)."""
    start, end = DLAMI_DATES
    return (
        f"pick the {neuron_env.DLAMI} image of SDK {neuron_env.NEURON_SDK_RELEASE} by name and date: "
        f"`{DLAMI_LOOKUP}` lists them; take the newest created from {start} and before {end} (SDK 2.29 and later "
        f"fail the pins). The SSM parameter {DLAMI_SSM_PARAMETER} gives only the newest image, not a 2.28 one"
    )


def install_lines() -> list[str]:
    """The shell lines that make the inf2 environment, in a clone of this repository on an instance
    started from `neuron_env.DLAMI`. The venv's torch, torch-xla and SDK packages stay as they are:
    gemma4lib does not depend on torch, so pip leaves them alone."""
    return [
        f"source {neuron_env.DLAMI_VENV_PATH}/bin/activate",
        f"export PATH=$VIRTUAL_ENV/bin:{neuron_env.NEURON_BIN}:$PATH",
        'pip install -e ".[notebooks]"',
    ]


def expected_environment() -> dict[str, Any]:
    """The inf2 environment this cookbook is written for, and the lines that make it."""
    return {
        "dlami": neuron_env.DLAMI,
        "image": dlami_advice(),
        "venv": neuron_env.DLAMI_VENV_PATH,
        "python": neuron_env.INF2_PYTHON,
        "neuron_sdk": neuron_env.NEURON_SDK_RELEASE,
        "pins": {d: v[0] for d, v in neuron_env.SDK_PINS.items()} | {"transformers": neuron_env.TRANSFORMERS_PIN},
        "install": install_lines(),
    }


def differences(devices: dict[str, Any], versions: list[dict[str, Any]]) -> list[str]:
    """Why this machine is not the expected inf2 environment (empty when it is)."""
    found = []
    python = ".".join(platform.python_version_tuple()[:2])
    if python != neuron_env.INF2_PYTHON:
        found.append(f"Python {python} here; the inf2 venv is Python {neuron_env.INF2_PYTHON}")
    if os.path.realpath(sys.prefix) != os.path.realpath(neuron_env.DLAMI_VENV_PATH):
        found.append(f"running from {sys.prefix}, not {neuron_env.DLAMI_VENV_PATH}")
    instance = dmi_instance_type()
    if instance is None or not instance.startswith("inf2"):
        found.append(f"not an inf2 instance ({instance or 'no EC2 instance type in DMI'})")
    if devices["cores"] == 0:
        found.append("no Neuron devices (/dev/neuron*)")
    for row in versions:
        if not row["ok"]:
            found.append(f"{row['package']} {row['found'] or 'missing'} (pinned {' or '.join(row['pinned'])})")
    return found


def neuron_devices() -> dict[str, Any]:
    """Neuron devices and cores: `neuron-ls --json-output` if available, else `/dev/neuron*`."""
    nodes = sorted(glob.glob("/dev/neuron*"))
    beside_sdk = os.path.join(neuron_env.NEURON_BIN, "neuron-ls")
    tool = shutil.which("neuron-ls") or (beside_sdk if os.path.exists(beside_sdk) else None)
    info: dict[str, Any] = {
        "dev_nodes": nodes,
        "devices": len(nodes),
        "cores": None,
        "neuron_ls": tool,
        "source": "/dev/neuron*",
    }
    if tool:
        try:
            out = subprocess.run([tool, "--json-output"], capture_output=True, text=True, timeout=20)
            listing = json.loads(out.stdout)
            if isinstance(listing, list):
                info.update(
                    devices=len(listing), source="neuron-ls", cores=sum(int(d.get("nc_count", 2)) for d in listing)
                )
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            info["neuron_ls_error"] = f"{type(exc).__name__}: {exc}"
    if info["cores"] is None:
        info["cores"] = 2 * len(nodes)  # inf2: two NeuronCore-v2 per device (none: 0)
    return info


def _path_report() -> dict[str, Any]:
    parts = os.environ.get("PATH", "").split(os.pathsep)
    rows = [{"folder": f, "exists": os.path.isdir(f), "on_path": f in parts} for f in neuron_env.path_fix_dirs()]
    return {
        "folders": rows,
        "ok": all(r["on_path"] or not r["exists"] for r in rows),
        "fix": f"export PATH={os.path.join(sys.prefix, 'bin')}:{neuron_env.NEURON_BIN}:$PATH "
        f"(the recipes apply it in-process)",
    }


def run_doctor(
    variant: str | None = None,
    tp: int | None = None,
    context_length: int = DEFAULT_CONTEXT,
    vision: bool = False,
    audio: bool = False,
) -> dict[str, Any]:
    """The report: expected environment vs this machine, devices, fixes, RAM vs compile peak and the
    per-core and serving-host plans for `variant` at `context_length` (with `vision` / `audio`: its per-core
    plan counts that part on rank 0's core), plus warnings and a verdict."""
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
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch_version,
        "instance_type": dmi_instance_type(),
        "neuron_sdk_release": neuron_env.NEURON_SDK_RELEASE,
        "expected": expected_environment(),
        "differences": differences(devices, versions),
        "sdk_present": sdk,
        "versions": versions,
        "devices": devices,
        "fx_shim": {
            "status": shim,
            "meaning": {
                "real": "transformers provides transformers.utils.fx: no shim",
                "shim": "gemma4lib's shim is installed",
                "needed": "transformers 5 lacks it: the recipes install a one-class shim "
                "before importing neuronx_distributed",
                "no-transformers": "transformers is not installed",
            }[shim],
        },
        "path": path,
        "host_ram_gb": round(ram / GB, 1),
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
            warnings.append("PATH lacks the venv/Neuron bin folders (libneuronpjrt-path import error): " + path["fix"])
        python = ".".join(platform.python_version_tuple()[:2])
        if python != neuron_env.INF2_PYTHON:
            warnings.append(f"Python {python}: use the {neuron_env.DLAMI_VENV} venv (Python {neuron_env.INF2_PYTHON})")
    if not next(r for r in versions if r["package"] == "transformers")["ok"]:
        warnings.append(f"transformers must be {neuron_env.TRANSFORMERS_PIN} (CPU and inf2 alike)")
    if variant is not None:
        v = get_variant(variant)
        tp = tp or v.tp_degree
        estimate = None
        try:
            require_neuron_tp(v, tp, dmi_instance_type())
            report["tp"] = {"degree": tp, "ok": True}
        except TensorParallelError as exc:
            report["tp"] = {"degree": tp, "ok": False, "error": str(exc)}
            warnings.append(str(exc))
        else:  # the compile host's plan needs a TP degree the weights can be cut for
            estimate = estimate_compile_peak_gb(v, tp)
            report["compile_estimate"] = estimate
            compile_plan = compile_host_plan(v, tp, estimate["recipe"])
            report["compile_host"] = {**plan_dict(compile_plan), "summary": compile_summary(compile_plan)}
            plan = plan_core_memory(
                v, tp, instance=dmi_instance_type(), context_length=context_length, vision=vision, audio=audio
            )
            report["plan"] = {**plan_dict(plan), "summary": core_summary(plan)}
            if not plan.fits:
                warnings.append(core_summary(plan))
            serving = serving_host_plan(
                v, tp, host_instance_type(), context_length=context_length, vision=vision, audio=audio
            )
            report["serving_host"] = {**plan_dict(serving), "summary": serving.summary()}
            longest = {i: largest_context(v, i) for i in INSTANCES}
            report["contexts"] = {
                i: {
                    "context": c,
                    "tp": t,
                    "binding": context_plan(v, i, t).binding if c else None,
                    "hopeful": context_plan(v, i, t, least=True).context if c else 0,
                }
                for i, (c, t) in longest.items()
            }
            planned = context_plan(v, v.instance_type, v.tp_degree)
            report["full_profile"] = {**full_settings(v), "plan": {**asdict(planned), "binding": planned.binding}}
            if not serving.fits:
                warnings.append(serving.summary() + "; " + "; ".join(serving.problems))
        if devices["cores"] and tp > devices["cores"]:
            warnings.append(f"TP={tp} needs {tp} NeuronCores; this host has {devices['cores']}")
        ram_warning = compile_ram_warning(estimate, ram) if estimate else None
        if ram_warning:
            warnings.append(ram_warning)
    report["warnings"] = warnings
    report["ok"] = sdk and not warnings
    return report


def format_doctor(report: dict[str, Any]) -> str:
    e = report["expected"]
    lines = [
        f"gemma4lab doctor — Neuron SDK {report['neuron_sdk_release']} target",
        f"expected: {e['dlami']} of SDK {report['neuron_sdk_release']}, venv {e['venv']}, Python {e['python']}",
        f"  image: {e['image']}",
        "  " + ", ".join(f"{k} {v}" for k, v in e["pins"].items()),
        "  set-up: " + " && ".join(e["install"]),
        f"this machine: python {report['python']}, torch {report['torch']}, {report['platform']}",
    ]
    if report["differences"]:
        lines.append("not the inf2 environment because:")
        lines += [f"  - {d}" for d in report["differences"]]
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
    if "plan" in report:
        lines.append("per NeuronCore: " + report["plan"]["summary"])
    if "serving_host" in report:
        lines.append(report["serving_host"]["summary"])
    if "compile_host" in report:
        e = report["compile_estimate"]
        host = e["smallest_instance_with_headroom"] or "no inf2 size"
        lines.append(f"{report['compile_host']['summary']}; compile on {host} or larger (20 % headroom)")
    if "contexts" in report:  # the least of the HBM bound and the compile host's (its compiler RAM assumed)
        longest = [
            f"{i} {c['context']:,} (TP={c['tp']}, {c['binding']}; {c['hopeful']:,} at the least compiler RAM)"
            for i, c in report["contexts"].items()
            if c["context"]
        ]
        lines.append("longest context per instance (computed, unverified on inf2): " + ", ".join(longest))
        lines.append(COMPILER_NOTE.format(per_mac=compiler_bytes_per_mac(), least=compiler_bytes_per_mac(least=True)))
        f, p = report["full_profile"], report["full_profile"]["plan"]
        planned = min(p["device_context"], p["compile_context"])
        lines.append(
            f"full profile: context {f['context_length']:,}, prefill buckets {f['prefill_buckets']}, context buckets "
            f"{f['context_buckets']} at TP={p['tp']} on {p['instance']} (planned {planned:,}: {p['binding']}; "
            f"compile ~{p['compile_peak_gb']:.0f} GB on {p['compile_host']})"
        )
    if "tp" in report:
        lines.append(f"TP={report['tp']['degree']}: " + ("ok" if report["tp"]["ok"] else report["tp"]["error"]))
    for w in report["warnings"]:
        lines.append(f"WARNING: {w}")
    verdict = "ready for inf2" if report["ok"] else "fix the warnings above" if report["sdk_present"] else None
    lines.append(f"verdict: {verdict or 'CPU profile only'}")
    lines.append(f"every variant's plans, the vision and audio tables and the image prefill floor: {FAMILY_TABLES}")
    return "\n".join(lines)
