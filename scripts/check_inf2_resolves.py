"""Does the inf2 environment still resolve? Run by CI, so a pin change that would break it fails here.

The inf2 venv (`recipes.neuron_env.DLAMI_VENV`, Python `INF2_PYTHON`, x86-64 Linux) already holds
the Neuron SDK's torch; `pip install -e ".[notebooks]"` adds this project's dependencies on top.
This asks pip's resolver, for that Python and platform and binary wheels only, whether the
project's runtime and notebook dependencies install next to what the SDK packages constrain
(`SDK_CONSTRAINTS`: torch 2.9.0, torch-xla 2.9.0, numpy). Nothing is installed (`--dry-run`); the
resolved set is checked against the pins and printed.

The SDK packages themselves are not on PyPI (placeholders only), so their own metadata cannot be
resolved here; their constraints are carried by `SDK_CONSTRAINTS`, taken from the SDK 2.28 release
manifest and documentation.

    .venv/bin/python scripts/check_inf2_resolves.py [--report out.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

from gemma4lib.recipes import neuron_env

ROOT = Path(__file__).resolve().parent.parent
# Ubuntu 24.04 has glibc 2.39: every manylinux tag up to it installs there (pip matches tags exactly).
PLATFORMS = ["manylinux2014_x86_64"] + [f"manylinux_2_{n}_x86_64" for n in range(17, 40)]


def requirements() -> list[str]:
    """The project's runtime + notebook dependencies (pyproject.toml) and the SDK's constraints."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"]) + list(project["optional-dependencies"]["notebooks"])
    reqs += [f"{name}{spec}" for name, spec in neuron_env.SDK_CONSTRAINTS.items()]
    return reqs


class DoesNotResolve(RuntimeError):
    """pip found no set of wheels that satisfies the requirements on the inf2 Python and platform."""


def resolve(reqs: list[str], python: str = neuron_env.INF2_PYTHON, extra: tuple[str, ...] = ()) -> dict[str, str]:
    """pip's dry-run resolution for `python` on x86-64 Linux, wheels only: {distribution: version}."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--quiet",
            "--ignore-installed",
            "--only-binary=:all:",
            "--python-version",
            python,
            "--implementation",
            "cp",
            *extra,
            "--target",
            str(Path(tmp) / "target"),
            "--report",
            str(report),
        ]
        for platform in PLATFORMS:
            cmd += ["--platform", platform]
        done = subprocess.run(cmd + reqs, capture_output=True, text=True)
        if done.returncode != 0:
            raise DoesNotResolve(f"does not resolve for Python {python} on x86-64 Linux:\n{done.stderr.strip()}")
        installed = json.loads(report.read_text())["install"]
    return {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in installed}


def check(resolved: dict[str, str], reqs: list[str]) -> list[str]:
    """Every requirement satisfied by the resolved set (pip guarantees it; this guards the script)."""
    problems = []
    for text in reqs:
        req = Requirement(text)
        version = resolved.get(req.name.lower().replace("_", "-")) or resolved.get(req.name.lower())
        if version is None:
            problems.append(f"{req.name} is not in the resolved set")
        elif not req.specifier.contains(version, prereleases=True):
            problems.append(f"{req.name} resolved to {version}, outside {req.specifier}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", help="write the resolved set here as JSON")
    args = parser.parse_args(argv)
    reqs = requirements()
    try:
        resolved = resolve(reqs)
    except DoesNotResolve as exc:
        print(f"PROBLEM: the inf2 environment {exc}")
        return 1
    problems = check(resolved, reqs)
    pinned = {name: resolved.get(name) for name in ("torch", "torch-xla", "transformers", "numpy", "tokenizers")}
    print(
        f"inf2 venv {neuron_env.DLAMI_VENV} (Python {neuron_env.INF2_PYTHON}, x86-64): {len(resolved)} "
        f"distributions resolve; " + ", ".join(f"{k} {v}" for k, v in pinned.items())
    )
    if args.report:
        Path(args.report).write_text(
            json.dumps(
                {"python": neuron_env.INF2_PYTHON, "requirements": reqs, "resolved": resolved}, indent=2, sort_keys=True
            )
        )
    for problem in problems:
        print(f"PROBLEM: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
