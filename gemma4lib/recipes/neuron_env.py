"""The inf2 environment: pinned Neuron SDK 2.28 versions, lazy SDK imports, and the two fixes the
field report (README, "The family at a glance") needed before anything imports.

Nothing here imports the Neuron SDK at module import time. `SDK_PINS` (+ `TRANSFORMERS_PIN`) is the
single source of the pins; the doctor and every recipe read it, through `metadata_version` (one
function, so tests simulate any installation by monkeypatching it).

- `require(module)`: import an SDK module or raise `NeuronSDKMissingError` naming the package, the
  pinned version and how to get it (the DLAMI venv or the Neuron pip repository; PyPI has only
  placeholders).
- `install_fx_shim()`: `neuronx_distributed` imports `transformers.utils.fx.HFTracer`, which
  transformers 5 removed; a one-class module, installed only when the real one is missing.
- `apply_path_fix()`: `libneuronxla` finds the PJRT plugin by running the `libneuronpjrt-path`
  console script, which a kernel started without activating the venv does not have on PATH: put
  `$VENV/bin` and `/opt/aws/neuron/bin` there.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import math
import os
import shlex
import sys
import types
from collections.abc import MutableMapping
from typing import Any

from ..environment import TRANSFORMERS_PIN as TRANSFORMERS_VERSION
from ..errors import EnvironmentMismatchError, NeuronSDKMissingError

NEURON_SDK_RELEASE = "2.28"
# The one inf2 environment this cookbook names (SDK 2.28 DLAMI documentation and its release
# manifest): transformers 5.23.0 needs Python >= 3.11, and of the 2.28 DLAMIs only the Ubuntu 24.04
# one has it (Python 3.12, torch 2.9 venvs). The Ubuntu 22.04 DLAMI's venvs are Python 3.10 and the
# AL2023 DLAMIs ship no PyTorch 2.9 environment.
DLAMI = "Deep Learning AMI Neuron (Ubuntu 24.04)"
DLAMI_VENV = "aws_neuronx_venv_pytorch_2_9_nxd_inference"
DLAMI_VENV_PATH = f"/opt/{DLAMI_VENV}"
INF2_PYTHON = "3.12"
NEURON_PIP_INDEX = "https://pip.repos.neuron.amazonaws.com"
NEURON_BIN = "/opt/aws/neuron/bin"

# distribution name -> accepted versions (SDK 2.28 release manifest). torch-neuronx for torch 2.9,
# the torch of the Ubuntu 24.04 venv and of the CPU torch_xla lane.
SDK_PINS: dict[str, tuple[str, ...]] = {
    "torch-neuronx": ("2.9.0.2.12.22436",),
    "neuronx-cc": ("2.23.6484.0",),
    "neuronx-distributed": ("0.17.26814",),
    "libneuronxla": ("2.2.15515.0",),
}
TRANSFORMERS_PIN = TRANSFORMERS_VERSION
# What the SDK packages constrain in the venv the project installs into (checked by
# scripts/check_inf2_resolves.sh): torch-neuronx 2.9.0.x is built against torch 2.9.0 and
# torch-xla 2.9.0; the 2.28 docs support numpy 2.x and >= 1.21.6.
SDK_CONSTRAINTS: dict[str, str] = {"torch": "==2.9.0", "torch-xla": "==2.9.0", "numpy": ">=1.21.6"}


# import name -> distribution name
MODULE_TO_DIST = {
    "torch_neuronx": "torch-neuronx",
    "neuronx_distributed": "neuronx-distributed",
    "libneuronxla": "libneuronxla",
    "neuronxcc": "neuronx-cc",
}

# Compiler arguments for the decoder graphs (prefill favours compile time, decode run time), each
# flag decided against NxD's and NxD Inference's defaults at SDK 2.28:
# - `--model-type=transformer --auto-cast=none`: as both (no automatic down-cast: the graph's own
#   bf16 is what the CPU reference checks);
# - `--enable-mixed-precision-accumulation`: the compiler's default, explicit so the arithmetic the
#   checks were tuned on does not follow a later default; it is part of every cache key;
# - `--enable-saturate-infinity` (NxD's default without args): left out. Our masks are finite
#   (finfo.min, never -inf), so no infinity arises by design, and saturating one would hide from the
#   checks exactly the overflow they should show;
# - `--tensorizer-options=...` from NxD Inference's 2.28 `models/model_wrapper.py` (tiling 2 for
#   context encoding, 1 for token generation): scheduling only (collectives overlapped with compute,
#   strided DMA vectorised), no change of arithmetic. Unverified on inf2 with these graphs;
# - `--lnc=1` left out: logical NeuronCores group cores on trn2; inf2 has only LNC=1.
_COMMON_ARGS = "--model-type=transformer --auto-cast=none --enable-mixed-precision-accumulation"
_TENSORIZER = (
    "--tensorizer-options='--enable-ccop-compute-overlap --cc-pipeline-tiling-factor={} --vectorize-strided-dma'"
)
# "verify": drafting's k + 1 token target key. NxD Inference 0.7/0.8 (`models/model_wrapper.py`)
# sets tiling 1 only for its token-generation and fused-speculation tags; its k-token speculation
# model keeps the default 2, and every tag but context encoding gets -O2. Verify is that model.
COMPILER_ARGS = {
    "prefill": f"{_COMMON_ARGS} {_TENSORIZER.format(2)} -O1",
    "decode": f"{_COMMON_ARGS} {_TENSORIZER.format(1)} -O2",
    "verify": f"{_COMMON_ARGS} {_TENSORIZER.format(2)} -O2",
}


def compiler_args(phase: str) -> list[str]:
    """neuronx-cc arguments for 'prefill' or 'decode', as a list (torch_neuronx accepts both)."""
    return shlex.split(COMPILER_ARGS[phase])


# ---- versions -------------------------------------------------------------------------------


def metadata_version(dist: str) -> str | None:
    """Installed version of a distribution, None when absent. Tests monkeypatch this."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _matches(found: str, accepted: tuple[str, ...]) -> bool:
    base = found.split("+")[0]
    return base in accepted


def check_versions() -> list[dict[str, Any]]:
    """Found vs pinned, one row per package (the SDK set, then transformers)."""
    rows = []
    for dist, accepted in {**SDK_PINS, "transformers": (TRANSFORMERS_PIN,)}.items():
        found = metadata_version(dist)
        ok = found is not None and _matches(found, accepted)
        rows.append({"package": dist, "pinned": list(accepted), "found": found, "ok": ok})
    return rows


def sdk_present() -> bool:
    return all(metadata_version(d) is not None for d in ("torch-neuronx", "neuronx-distributed"))


def how_to_get(dist: str) -> str:
    pins = " ".join(f"{d}=={v[0]}" for d, v in SDK_PINS.items())
    return (
        f"on an inf2 instance started from the {DLAMI} (SDK {NEURON_SDK_RELEASE}) run "
        f"`source {DLAMI_VENV_PATH}/bin/activate` (Python {INF2_PYTHON}), or install from the Neuron pip "
        f"repository: `pip install --extra-index-url {NEURON_PIP_INDEX} {pins}` (the PyPI packages of "
        f"these names are placeholders). The CPU profile needs none of it"
    )


def missing_error(module: str, purpose: str = "") -> NeuronSDKMissingError:
    dist = MODULE_TO_DIST.get(module.split(".")[0], module)
    pin = SDK_PINS.get(dist, ("",))[0]
    what = f"{purpose} needs" if purpose else "this needs"
    return NeuronSDKMissingError(
        f"{what} the Neuron SDK package {dist}{'==' + pin if pin else ''} (import {module}), which is not "
        f"installed here; {how_to_get(dist)}"
    )


def _check_installed(dist: str, module: str, purpose: str) -> None:
    """Raise when `dist` is absent or outside `SDK_PINS`; reads metadata only, imports nothing."""
    found = metadata_version(dist)
    if found is None:
        raise missing_error(module, purpose)
    if not _matches(found, SDK_PINS[dist]):  # another SDK release: fail now, not mid-compile
        raise EnvironmentMismatchError(
            f"{dist} {found} is installed, but this cookbook pins {' or '.join(SDK_PINS[dist])} (Neuron SDK "
            f"{NEURON_SDK_RELEASE}; the last release with NxD Inference for inf2); {how_to_get(dist)}"
        )


def require_sdk(purpose: str = "") -> None:
    """Check, without importing anything, that the pinned SDK packages the recipes call are
    installed: the early check `backends.preflight` makes for backend "neuron" before any load."""
    for module in ("torch_neuronx", "neuronx_distributed"):
        _check_installed(MODULE_TO_DIST[module], module, purpose)


def require(module: str, purpose: str = "") -> types.ModuleType:
    """Import an SDK module, applying the environment fixes first; a clear error if it is absent.

    Absent means: its distribution is not installed (checked before touching PATH or sys.modules).
    Installed at a version outside `SDK_PINS` raises `EnvironmentMismatchError`, also before any import.
    """
    top = module.split(".")[0]
    dist = MODULE_TO_DIST.get(top)
    if dist is not None:
        _check_installed(dist, module, purpose)
    apply_path_fix()
    if top == "neuronx_distributed":
        install_fx_shim()
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise EnvironmentMismatchError(
            f"{module} is installed but failed to import ({exc}); check the versions with "
            f"`python -m gemma4lab doctor` (pinned: Neuron SDK {NEURON_SDK_RELEASE})"
        ) from exc


# ---- the transformers.utils.fx shim -----------------------------------------------------------

FX_MODULE = "transformers.utils.fx"
FX_PARENT = "transformers.utils"


def _make_fx_shim() -> types.ModuleType:
    import torch.fx

    module = types.ModuleType(FX_MODULE)
    module.__doc__ = (
        "gemma4lib shim: transformers 5 removed transformers.utils.fx; neuronx_distributed "
        "only subclasses HFTracer when it imports. Gemma-4 never goes through it."
    )

    class HFTracer(torch.fx.Tracer):
        """Stand-in for transformers' removed fx tracer: a plain torch.fx.Tracer."""

        def __init__(self, autowrap_modules=(math,), autowrap_functions=(), **kwargs):
            super().__init__(autowrap_modules=autowrap_modules, autowrap_functions=autowrap_functions, **kwargs)

    HFTracer.__module__ = FX_MODULE
    module.HFTracer = HFTracer
    module.GEMMA4LIB_SHIM = True
    return module


def fx_shim_status(namespace: MutableMapping[str, Any] | None = None) -> str:
    """'real' (transformers has it), 'shim' (ours is installed), 'needed', or 'no-transformers'."""
    modules = sys.modules if namespace is None else namespace
    existing = modules.get(FX_MODULE)
    if existing is not None and getattr(existing, "GEMMA4LIB_SHIM", False):
        return "shim"
    if existing is not None:
        return "real" if hasattr(existing, "HFTracer") else "needed"
    if namespace is None:
        try:
            importlib.import_module(FX_PARENT)
        except ImportError:
            return "no-transformers"
        try:
            module = importlib.import_module(FX_MODULE)
        except ImportError:
            return "needed"
        return "real" if hasattr(module, "HFTracer") else "needed"
    return "needed" if FX_PARENT in modules else "no-transformers"


def install_fx_shim(namespace: MutableMapping[str, Any] | None = None) -> str:
    """Install the shim into `namespace` (default `sys.modules`) only when needed.

    Returns the status afterwards: 'real' (left alone), 'shim' (installed now or before) or
    'no-transformers'.
    """
    modules = sys.modules if namespace is None else namespace
    state = fx_shim_status(namespace)
    if state != "needed":
        return state
    shim = _make_fx_shim()
    modules[FX_MODULE] = shim
    parent = modules.get(FX_PARENT)
    if parent is not None:
        parent.fx = shim
    return "shim"


# ---- PATH ----------------------------------------------------------------------------------


def path_fix_dirs(prefix: str | None = None) -> list[str]:
    return [os.path.join(prefix or sys.prefix, "bin"), NEURON_BIN]


def apply_path_fix(env: MutableMapping[str, str] | None = None, prefix: str | None = None) -> dict[str, Any]:
    """Prepend the venv's bin and /opt/aws/neuron/bin to PATH when missing (only existing folders)."""
    env = os.environ if env is None else env
    parts = [p for p in env.get("PATH", "").split(os.pathsep) if p]
    added = []
    for folder in reversed(path_fix_dirs(prefix)):
        if folder not in parts and os.path.isdir(folder):
            parts.insert(0, folder)
            added.append(folder)
    if added:
        env["PATH"] = os.pathsep.join(parts)
    return {
        "added": list(reversed(added)),
        "needed": path_fix_dirs(prefix),
        "ok": all(f in parts or not os.path.isdir(f) for f in path_fix_dirs(prefix)),
    }
