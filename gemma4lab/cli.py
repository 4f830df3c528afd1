"""The lab's command line: `python -m gemma4lab bench` (the benchmark suite), `python -m gemma4lab
faults` (the fault lab), `python -m gemma4lab plan` (the inf2 plans of every variant) and `python -m
gemma4lab doctor` (this machine against the pinned SDK, one variant's plans). Beside the
library: it imports `gemma4lib`, never the other way round."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from gemma4lib import cli
from gemma4lib.cli import _threads
from gemma4lib.errors import UnknownNameError
from gemma4lib.inf2.memory_plan import DEFAULT_CONTEXT


def cmd_faults(args: argparse.Namespace) -> int:
    from .tools.faults import run_fault_lab

    _threads(args.threads)
    report = run_fault_lab(
        variant=args.variant, backend=args.backend, faults=args.fault.split(",") if args.fault else None
    )
    if args.json:
        print(json.dumps(report, default=str))
    else:
        from .tools.faults import format_fault_report

        print(format_fault_report(report))
    return 0 if report["ok"] else 1


def cmd_bench(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from .benchmarks.suite import SECTIONS, SuiteOptions, run_suite

    _threads(args.threads)
    options = None
    if args.sections:
        sections = tuple(name.strip() for name in args.sections.split(",") if name.strip())
        unknown = [name for name in sections if name not in SECTIONS]
        if unknown:
            raise UnknownNameError("bench section", unknown[0], SECTIONS)
        options = replace(SuiteOptions.quick() if args.quick else SuiteOptions(), sections=sections)
    report = run_suite(args.suite, quick=args.quick, options=options)
    print(json.dumps(report, default=str) if args.json else json.dumps(report, indent=2, default=str))
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from .tools.doctor import format_doctor, run_doctor

    report = run_doctor(variant=args.variant, tp=args.tp, vision=args.vision, audio=args.audio)
    print(json.dumps(report, default=str) if args.json else format_doctor(report))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from .tools.inf2_tables import family_report, format_family

    report = family_report(args.context_length)
    print(json.dumps(report, default=str) if args.json else format_family(report))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gemma4lab", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("faults", help="run the fault lab: each field-report bug, and which check catches it")
    p.add_argument("--variant", default=None)
    p.add_argument("--backend", default="cpu", help="cpu (compiled, default) | eager (same graphs, no compile)")
    p.add_argument("--fault", help="comma-separated fault names (default: all)")
    p.add_argument("--threads", type=int)
    p.add_argument(
        "--json",
        action="store_true",
        help="one JSON object: per fault the checks that caught it, its logit error and the tolerance it crossed",
    )
    p.set_defaults(func=cmd_faults)

    p = sub.add_parser("doctor", help="check this machine against the pinned Neuron SDK 2.28 set; one variant's plans")
    p.add_argument("--variant")
    p.add_argument("--tp", type=int)
    p.add_argument(
        "--vision",
        action="store_true",
        help="plan --variant with its vision part (weights + activations on one core; computed, unverified)",
    )
    p.add_argument(
        "--audio",
        action="store_true",
        help="plan --variant (e2b, e4b, 12b) with its audio part, 30 s graph, on rank 0's core (computed, unverified)",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("bench", help="side-by-side decode benchmarks")
    p.add_argument("--suite", default="cpu")
    p.add_argument("--quick", action="store_true", help="tiny models only (schema check)")
    p.add_argument("--sections", help="comma-separated parts to run (default: all), e.g. int8 or models,experts")
    p.add_argument("--threads", type=int)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser(
        "plan",
        help="every variant's per-core memory plan, serving host and vision part on inf2 (computed, unverified); "
        "one variant: python -m gemma4lab doctor --variant V",
    )
    p.add_argument("--context-length", type=int, default=DEFAULT_CONTEXT)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return cli.main(argv, build_parser())


if __name__ == "__main__":
    sys.exit(main())
