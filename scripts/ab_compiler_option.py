"""A/B one Inductor option on a decode graph: compile it both ways, time them interleaved.

    .venv/bin/python scripts/ab_compiler_option.py                       # realize_opcount_threshold 8 vs 30
    .venv/bin/python scripts/ab_compiler_option.py --option max_autotune --a true --b false --model medium-moe

Both graphs come from the artifact cache when they were compiled before (a medium graph takes 1-3
minutes to compile here). One thread; rounds alternate A, B, A, B, ... so load from other processes
hits both alike; the medians and the ratio are printed as one JSON line. This is how the
`realize_opcount_threshold` default in `gemma4lib/backends/compile_cpu.py` was chosen (docs/ROOFLINE.md).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from gemma4lab.benchmarks.graphs import BenchGraph, time_decode_steps
from gemma4lab.benchmarks.suite import load_bench_model
from gemma4lib.backends.compile_cpu import DEFAULT_COMPILER_OPTIONS, compile_graph
from gemma4lib.device.build import device_graph
from gemma4lib.device.graph import GraphShape


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="medium-dense", help="medium-dense, medium-moe or a tiny variant")
    parser.add_argument("--option", default="realize_opcount_threshold")
    parser.add_argument("--a", default="8", help="value A (JSON)")
    parser.add_argument("--b", default="30", help="value B (JSON; 30 is Inductor's default threshold)")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--experts", default="selective", help="MoE decode form")
    parser.add_argument("--steps", type=int, default=16, help="decode steps per timed round")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)

    model = load_bench_model(args.model)
    experts = args.experts if getattr(model.config, "enable_moe_block", False) else "dense"
    graph = device_graph(model, GraphShape(1, 1, args.context, True), experts)
    values = {"a": json.loads(args.a), "b": json.loads(args.b)}
    steps = {}
    for side, value in values.items():
        compiled = compile_graph(graph, options={**DEFAULT_COMPILER_OPTIONS, args.option: value})
        steps[side] = BenchGraph(compiled, graph.shape, experts, graph=graph)
    positions = list(range(args.context - args.steps, args.context))
    runs: dict[str, list[float]] = {"a": [], "b": []}
    for side in ("a", "b"):  # warm-up
        time_decode_steps(model, steps[side], positions)
    for _ in range(args.rounds):
        for side in ("a", "b"):
            runs[side].append(time_decode_steps(model, steps[side], positions))
    medians = {side: statistics.median(r) for side, r in runs.items()}
    print(
        json.dumps(
            {
                "model": args.model,
                "option": args.option,
                "a": values["a"],
                "b": values["b"],
                "context": args.context,
                "decode_tok_s": medians,
                "ms_per_step": {side: 1000 / t for side, t in medians.items()},
                "a_over_b": medians["a"] / medians["b"],
                "runs": runs,
            }
        )
    )


if __name__ == "__main__":
    main()
