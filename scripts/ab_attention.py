"""A/B the device graph's attention forms on decode: grouped (the default) vs transformers' eager.

    .venv/bin/python scripts/ab_attention.py                        # medium-dense, ring, 512 and 4,096
    .venv/bin/python scripts/ab_attention.py --contexts 512 2048 4096 --rounds 9

Every (form, context) decode graph is compiled with the CPU recipe (or loaded from the artifact
cache), then timed at the last `--steps` positions of its context, one thread, in rounds that
visit every graph in turn so load from other processes hits them alike. Prints one JSON line: the
median tok/s per form and context, each form's longest/shortest context ratio (the bench's
`ring_tok_s_4096_over_512`), grouped/eager per context, and each form's roofline fraction at the
shortest context (tok/s over bandwidth / bytes per step, the bandwidth measured as the bench does,
before and after the rounds), with every round's figures.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from gemma4lab.benchmarks.graphs import BenchGraph, time_decode_steps
from gemma4lab.benchmarks.suite import load_bench_model
from gemma4lab.inf2.bandwidth import measure_bandwidth
from gemma4lab.inf2.roofline import decode_bytes
from gemma4lib.backends.compile_cpu import compile_graph
from gemma4lib.device import attention
from gemma4lib.device.graph import DeviceGraph, GraphShape


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="medium-dense")
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--steps", type=int, default=16, help="decode steps per timed round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)

    model = load_bench_model(args.model)
    steps: dict[tuple[str, int], BenchGraph] = {}
    for form in attention.FORMS:
        for ctx in args.contexts:
            graph = DeviceGraph(
                model.text_model, model.lm_head, model.layout, GraphShape(1, 1, ctx, True), attention=form
            )
            steps[(form, ctx)] = BenchGraph(compile_graph(graph), graph.shape, "dense", graph=graph)
    bandwidth = [measure_bandwidth()["bandwidth_bytes_s"]]
    runs: dict[tuple[str, int], list[float]] = {key: [] for key in steps}
    for key, step in steps.items():  # warm-up
        time_decode_steps(model, step, range(key[1] - args.steps - 1, key[1] - 1))
    for _ in range(args.rounds):
        for key, step in steps.items():
            runs[key].append(time_decode_steps(model, step, range(key[1] - args.steps - 1, key[1] - 1)))
    bandwidth.append(measure_bandwidth()["bandwidth_bytes_s"])
    median = {key: statistics.median(r) for key, r in runs.items()}
    first, last = args.contexts[0], args.contexts[-1]
    ceiling = statistics.mean(bandwidth) / decode_bytes(model, context_length=first, ring=True).total
    print(
        json.dumps(
            {
                "model": args.model,
                "decode_tok_s": {f"{form}@{ctx}": median[(form, ctx)] for form, ctx in median},
                f"tok_s_{last}_over_{first}": {
                    form: median[(form, last)] / median[(form, first)] for form in attention.FORMS
                },
                "grouped_over_eager": {
                    ctx: median[(attention.GROUPED, ctx)] / median[(attention.EAGER, ctx)] for ctx in args.contexts
                },
                "bandwidth_gb_s": [b / 1e9 for b in bandwidth],
                f"roofline_fraction_at_{first}": {form: median[(form, first)] / ceiling for form in attention.FORMS},
                "runs": {f"{form}@{ctx}": r for (form, ctx), r in runs.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
