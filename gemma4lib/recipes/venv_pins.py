"""The packages a Neuron venv must keep as they are, as pip constraints from that venv's own
installed versions (`scripts/lab.sh --neuron`).

Installing the project into the DLAMI's Neuron venv must not touch its torch or SDK packages:
torch-neuronx is built against one torch and torch-xla, neuronx-cc against its numpy, and pip
would happily "upgrade" any of them to satisfy a looser requirement. Written as `NAME==VERSION`
lines of what is installed now and passed with `pip install -c`, they turn any such change into a
resolver error instead of a broken venv. Stdlib only: it runs in the target venv's Python before
gemma4lib is installed there (`python -m gemma4lib.recipes.venv_pins`).
"""

from __future__ import annotations

import importlib.metadata
import sys

# The torch / SDK packages of the SDK 2.28 venv (`neuron_env.SDK_PINS` + what they are built
# against, `neuron_env.SDK_CONSTRAINTS`).
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


def installed_pins(names: tuple[str, ...] = PROTECTED) -> dict[str, str]:
    """`{name: version}` of each of `names` installed in this interpreter (absent ones left out)."""
    found = {}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def constraints_text(pins: dict[str, str]) -> str:
    """pip constraints, one `name==version` a line."""
    return "".join(f"{name}=={version}\n" for name, version in sorted(pins.items()))


def main(argv: list[str] | None = None) -> int:
    """Print this interpreter's constraints; with `--require NAME`, fail when NAME is absent."""
    args = list(sys.argv[1:] if argv is None else argv)
    pins = installed_pins()
    required = [args[i + 1] for i, a in enumerate(args) if a == "--require" and i + 1 < len(args)]
    missing = [name for name in required if name not in pins]
    if missing:
        print(f"{sys.prefix} has no {', '.join(missing)}: not a Neuron venv", file=sys.stderr)
        return 1
    sys.stdout.write(constraints_text(pins))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
