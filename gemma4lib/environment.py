"""What this run ran on: package versions, git sha, machine. Recorded with every result."""

from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from .errors import EnvironmentMismatchError


def _transformers_pin() -> str:
    """The exact transformers version this project pins. pyproject.toml is the one place it is
    written: read it from the installed distribution's metadata, or, for a source tree that was
    never installed, from the pyproject.toml beside the package."""
    from packaging.requirements import Requirement

    try:
        requires = importlib.metadata.requires("gemma4lib") or []
    except importlib.metadata.PackageNotFoundError:
        import tomllib

        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        requires = tomllib.loads(pyproject.read_text())["project"]["dependencies"] if pyproject.is_file() else []
    for text in requires:
        req = Requirement(text)
        pinned = [s.version for s in req.specifier if s.operator == "=="]
        if req.name == "transformers" and req.marker is None and len(pinned) == 1:
            return pinned[0]
    raise RuntimeError(
        "gemma4lib's metadata has no exact transformers pin (`transformers==X` in pyproject.toml); "
        "reinstall it: pip install -e ."
    )


TRANSFORMERS_PIN = _transformers_pin()


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_transformers() -> str:
    """Raise `EnvironmentMismatchError` when transformers is missing or older than `TRANSFORMERS_PIN`
    (older releases lack Gemma-4's per-layer config and fail with an ImportError or silently wrong
    shapes). Called by `loading` before it touches a Gemma-4 class. Returns the version found."""
    from packaging.version import InvalidVersion, Version

    found = package_version("transformers")
    fix = f"`pip install transformers=={TRANSFORMERS_PIN}` (the one version this cookbook pins, CPU and inf2 alike)"
    if found is None:
        raise EnvironmentMismatchError(f"transformers is not installed; {fix}")
    try:
        too_old = Version(found) < Version(TRANSFORMERS_PIN)
    except InvalidVersion:
        too_old = False
    if too_old:
        raise EnvironmentMismatchError(f"transformers {found} is older than the pinned {TRANSFORMERS_PIN}; {fix}")
    return found


@functools.lru_cache(maxsize=1)
def git_sha() -> str | None:
    root = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def versions() -> dict[str, Any]:
    names = ["transformers", "gemma4lib", "torch-neuronx", "neuronx-cc", "neuronx-distributed", "torch-xla"]
    found = {name: package_version(name) for name in names}
    found["torch"] = torch.__version__
    found["python"] = platform.python_version()
    found["git_sha"] = git_sha()
    return {k: v for k, v in found.items() if v is not None}


# What `versions()` records that never changes a compiled program: the commit. Every cache key
# (CPU, Neuron, drafting) and bundle takes `program_versions()`, so a docs-only commit reuses the
# artifacts; the library's graph code is in the keys by its own digest (`program_key.source_digest`).
NOT_PROGRAM = ("git_sha",)


def program_versions() -> dict[str, Any]:
    """`versions()` without what does not change a compiled program (`NOT_PROGRAM`)."""
    return {k: v for k, v in versions().items() if k not in NOT_PROGRAM}


def machine() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "processor": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "instance_type": os.environ.get("GEMMA4LIB_INSTANCE_TYPE") or "cpu",
    }


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, in MiB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 1024 / (1024 if sys.platform == "darwin" else 1)
