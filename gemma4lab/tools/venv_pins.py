"""What a Neuron venv must keep as it is, as pip constraints from that venv's own installed
versions, and the checks around the install (`scripts/lab.sh --neuron`).

Installing the project into the DLAMI's Neuron venv must not touch the venv: torch-neuronx is built
against one torch and torch-xla, neuronx-cc against its numpy, NxD against its own helpers, and pip
would happily "upgrade" any of them (or anything they need) to satisfy a looser requirement. So the
constraints are the whole venv, every installed distribution at its version (what `pip freeze`
lists), less the four this project must change (`MUTABLE`: transformers 5.23.0 and the libraries it
is released with); `pip install -c` turns any other change into a resolver error instead of a
broken venv. After the install, nothing constrained may have moved (`--compare`), and `pip check`
may report only NxD Inference's own transformers pin (`KNOWN_CONFLICTS`: NxD Inference 0.7/0.8 pins
transformers 4.56/4.57, this project needs 5.x; it is not used here). Stdlib only: it runs in the
target venv's Python before gemma4lib is installed there (`python -m gemma4lab.tools.venv_pins`).
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
from pathlib import Path

# The torch / SDK packages of the SDK 2.28 venv (`neuron_env.SDK_PINS` + what they are built
# against, `neuron_env.SDK_CONSTRAINTS`): printed by lab.sh, and what `--require` looks for.
PROTECTED = (
    "torch",
    "torch-neuronx",
    "torch-xla",
    "neuronx-cc",
    "neuronx-distributed",
    "neuronx-distributed-inference",
    "libneuronxla",
    "numpy",
)
# What this project's install must be free to change (its pins in pyproject.toml), and itself.
MUTABLE = ("transformers", "tokenizers", "huggingface-hub", "safetensors")
OWN = ("gemma4lib",)
# `pip check` lines that are expected in the Neuron venv (each a regular expression over one line).
KNOWN_CONFLICTS = (r"^neuronx-distributed-inference \S+ has requirement transformers\S*, but you have transformers ",)


def canonical(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_pins(names: tuple[str, ...] | None = PROTECTED) -> dict[str, str]:
    """`{name: version}` of what this interpreter has installed: `names` only, or (None) every
    distribution, the first of a name on `sys.path` (the one that imports), as `pip freeze` does."""
    wanted = None if names is None else {canonical(n) for n in names}
    found: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = canonical(dist.metadata["Name"] or "")
        if not name or name in found or (wanted is not None and name not in wanted):
            continue
        found[name] = dist.version
    return found


def frozen_pins() -> dict[str, str]:
    """The whole venv as constraints: every installed distribution but `MUTABLE` and `OWN`."""
    skip = {canonical(n) for n in (*MUTABLE, *OWN)}
    return {name: version for name, version in installed_pins(None).items() if name not in skip}


def constraints_text(pins: dict[str, str]) -> str:
    """pip constraints, one `name==version` a line."""
    return "".join(f"{name}=={version}\n" for name, version in sorted(pins.items()))


def read_constraints(text: str) -> dict[str, str]:
    return dict(line.split("==", 1) for line in text.split() if "==" in line)


def changed(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """What the install moved or removed among the constrained packages (new ones may appear)."""
    return [f"{n} {v} -> {after.get(n, 'removed')}" for n, v in sorted(before.items()) if after.get(n) != v]


def pip_check_problems(text: str) -> list[str]:
    """`pip check` lines other than the expected ones (`KNOWN_CONFLICTS`)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return [
        line
        for line in lines
        if line != "No broken requirements found." and not any(re.search(p, line) for p in KNOWN_CONFLICTS)
    ]


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def build_backend_problem(pyproject: str | Path) -> str | None:
    """Why `pip install --no-build-isolation` would fail here: the venv's setuptools is older than
    the project's `[build-system] requires` (its `license = "..."` string needs setuptools >= 77,
    PEP 639), with what to do; None when it is new enough."""
    import tomllib

    requires = tomllib.loads(Path(pyproject).read_text())["build-system"]["requires"]
    spec = next((r for r in requires if canonical(re.split(r"[<>=!~ ]", r, maxsplit=1)[0]) == "setuptools"), None)
    minimum = re.search(r">=\s*([\d.]+)", spec or "")
    if minimum is None:
        return None
    found = installed_pins(("setuptools",)).get("setuptools")
    if found is not None and _release(found) >= _release(minimum.group(1)):
        return None
    have = f"setuptools {found}" if found else "no setuptools"
    return (
        f"{sys.prefix} has {have}; the project builds with {spec} (pyproject.toml [build-system]: its "
        f'license = "..." string needs it) and lab.sh installs without build isolation so that pip builds '
        f"against the venv's own packages. Upgrade it in that venv (setuptools is not part of the Neuron "
        f"SDK): `{sys.prefix}/bin/python -m pip install '{spec}'`, then run lab.sh again"
    )


def main(argv: list[str] | None = None) -> int:
    """Print this interpreter's constraints (the whole venv less `MUTABLE`); with `--require NAME`,
    fail when NAME is absent. `--compare FILE`: fail when a package in FILE's constraints moved.
    `--check-pip`: read `pip check`'s output from stdin, fail on anything but `KNOWN_CONFLICTS`.
    `--check-build PYPROJECT`: fail when setuptools is too old for it."""
    args = list(sys.argv[1:] if argv is None else argv)

    def value(flag: str) -> str | None:
        return args[args.index(flag) + 1] if flag in args and args.index(flag) + 1 < len(args) else None

    if "--check-build" in args:
        problem = build_backend_problem(value("--check-build") or "pyproject.toml")
        if problem:
            print(problem, file=sys.stderr)
            return 1
        return 0
    if "--check-pip" in args:
        problems = pip_check_problems(sys.stdin.read())
        if problems:
            print("pip check found broken requirements in " + sys.prefix + ":", file=sys.stderr)
            print("\n".join("  " + p for p in problems), file=sys.stderr)
            return 1
        return 0
    pins = frozen_pins()
    if "--compare" in args:
        moved = changed(read_constraints(Path(value("--compare") or "").read_text()), pins)
        if moved:
            print("the install changed packages of " + sys.prefix + ":\n" + "\n".join(moved), file=sys.stderr)
            return 1
        return 0
    required = [args[i + 1] for i, a in enumerate(args) if a == "--require" and i + 1 < len(args)]
    missing = [name for name in required if canonical(name) not in pins]
    if missing:
        print(f"{sys.prefix} has no {', '.join(missing)}: not a Neuron venv", file=sys.stderr)
        return 1
    sys.stdout.write(constraints_text(pins))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
