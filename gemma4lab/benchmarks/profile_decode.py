"""Where a batch-1 decode step's time goes: the compiled (AOTInductor) decode graph under torch.profiler.

The package is compiled with Inductor's `cpp.enable_kernel_profile` (each generated C++ kernel
records itself; the extern matmuls record as `aoti_torch_cpu_mm_out` / `_bmm_out`), next to
the same graph compiled with the default options, which gives the step's wall
time without the profiler. Each kernel is put in a kind (`classify`): matmul (the weight GEMVs),
attention (the grouped one-query products over the K/V slots, softmax), norms and elementwise,
K/V writes, copies the wrapper makes (clone / copy_ / empty), and the overhead no kernel accounts
for (the profiled window's wall minus the kernels' self times). Bytes per kind: from the
model (the linear weights and the LM head; the attention the K/V buffers; the rest of the
roofline's total to norms and elementwise).

The gap is the step's wall time above the stream floor (`roofline bytes / stream bandwidth`, both
measured in this process); each kind's share of it is its time minus its own bytes' floor.

    python -m gemma4lab.benchmarks.profile_decode medium-dense
        -> docs/measurements/profile_decode_medium-dense.json

Also (`small_m`): the single-thread FLOP/s of `x @ W.T` with M = 1..16 rows on the model's own MLP
weight shape, next to a large square GEMM (the thread's practical peak): why a batched decode step
stops scaling with B on one CPU thread.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from gemma4lab.inf2.bandwidth import measure_bandwidth
from gemma4lab.inf2.roofline import GB, decode_bytes
from gemma4lib.backends.compile_cpu import compile_graph
from gemma4lib.backends.registry import cpu_balance
from gemma4lib.device import packed_linear
from gemma4lib.device.build import device_graph
from gemma4lib.device.graph import GraphShape, index_tensor

log = logging.getLogger(__name__)

KINDS = ("matmul", "attention", "norms_elementwise", "kv_writes", "copies", "overhead")
PROFILE_OPTIONS = {"cpp.enable_kernel_profile": True}
MEASUREMENTS = Path(__file__).resolve().parents[2] / "docs" / "measurements"

_ATTENTION = re.compile(r"softmax|amax|_exp|bmm")
_NORM = re.compile(r"mean|rsqrt|pow|gelu|tanh|mul|add|div|_to_copy|embedding|view|cat|select")
_KV = re.compile(r"index_copy|scatter|index_put")
_COPY = re.compile(r"^aten::(clone|copy_|empty|empty_like|empty_strided|resolve_conj|contiguous)$")


def classify(name: str) -> str:
    """The kind of one profiler event (module doc); anything else is counted as overhead."""
    if "cpp_fused" not in name and (("mm_out" in name and "bmm" not in name) or "_linear_pointwise" in name):
        return "matmul"  # the extern products, plain or packed (B >= 4); fused kernels are named after their inputs
    if "bmm" in name:
        return "attention"
    if _COPY.match(name):
        return "copies"
    if "cpp_fused" in name:
        if _KV.search(name):
            return "kv_writes"
        if _ATTENTION.search(name):
            return "attention"
        if _NORM.search(name):
            return "norms_elementwise"
    return "overhead"


def _median_step(step, inputs, steps: int) -> float:
    runs = []
    for _ in range(steps):
        started = time.perf_counter()
        step(*inputs)
        runs.append(time.perf_counter() - started)
    return statistics.median(runs)


def profile_decode(
    name: str = "medium-dense",
    context_length: int = 512,
    steps: int = 20,
    warmup: int = 3,
    bandwidth_mb: int = 512,
    batch: int = 1,
) -> dict[str, Any]:
    """Profile one medium model's decode step (ring K/V, dense experts; `batch` rows): module doc."""
    from torch.profiler import ProfilerActivity, profile

    from gemma4lab.models.medium import build_medium

    model = build_medium(name)
    shape = GraphShape(batch, 1, context_length, True)
    # the graph the bench and a port build for this CPU (packed linears from B = 4: `packed_linear`)
    graph = device_graph(model, shape, "dense", compute_balance=cpu_balance("cpu"))
    plain = compile_graph(graph)
    profiled = compile_graph(graph, options=PROFILE_OPTIONS)
    inputs = list(graph.example_inputs())
    inputs[-len(graph.new_kv()) - 2] = index_tensor([context_length // 2] * batch)  # start: halfway in
    element = model.lm_head.weight.element_size()
    bandwidth_before = measure_bandwidth(bandwidth_mb)
    for _ in range(warmup):
        plain(*inputs)
        profiled(*inputs)
    wall = min(_median_step(plain, inputs, steps), _median_step(plain, inputs, steps))
    wall_profiled = _median_step(profiled, inputs, steps)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        window = time.perf_counter()
        for _ in range(steps):
            profiled(*inputs)
        wall_window = (time.perf_counter() - window) / steps
    bandwidth_after = measure_bandwidth(bandwidth_mb)
    per_kind_us: dict[str, float] = defaultdict(float)
    per_kind_calls: dict[str, int] = defaultdict(int)
    per_kind_bytes: dict[str, int] = defaultdict(int)
    kernels: dict[str, dict[str, Any]] = {}
    for event in prof.key_averages(group_by_input_shape=True):
        kind = classify(event.key)
        per_kind_us[kind] += event.self_cpu_time_total / steps
        per_kind_calls[kind] += event.count // steps
        entry = kernels.setdefault(event.key, {"kind": kind, "us_per_step": 0.0, "calls_per_step": 0})
        entry["us_per_step"] += event.self_cpu_time_total / steps
        entry["calls_per_step"] += event.count // steps
    kernel_us = sum(per_kind_us.values())
    # what no kernel accounts for: the profiled window's wall time minus every event's self time
    per_kind_us["overhead"] += max(0.0, wall_window * 1e6 - kernel_us)
    roof = decode_bytes(model, context_length=context_length, ring=True, dtype_bytes=element, batch=batch)
    # bytes by kind, from the model: the matmuls read the linear weights and the LM head, the
    # attention products the K/V buffers, the rest (norms, scalars) is what the roofline has left
    linears = sum(p.numel() for n, p in model.text_model.layers.named_parameters() if n.endswith("proj.weight"))
    linears = (linears + model.lm_head.weight.numel()) * element
    per_kind_bytes["matmul"] = linears
    per_kind_bytes["attention"] = int(roof.kv)
    counted = linears + int(roof.kv)
    stream = max(bandwidth_before["stream_gb_s"], bandwidth_after["stream_gb_s"]) * GB
    gemv = max(bandwidth_before["gemv_gb_s"], bandwidth_after["gemv_gb_s"]) * GB
    floor_s = roof.total / stream
    # rescale the profiled times to the unprofiled wall (the profiler's own cost spread evenly)
    scale = wall / wall_window
    gap_s = wall - floor_s
    rows = []
    for kind in KINDS:
        t = per_kind_us.get(kind, 0.0) * 1e-6 * scale
        moved = per_kind_bytes.get(kind, 0)
        if kind == "norms_elementwise":  # what the matmuls and attention products do not read
            moved = max(0, int(roof.total) - counted)
        own_floor = moved / stream
        rows.append(
            {
                "kind": kind,
                "ms_per_step": t * 1e3,
                "calls_per_step": per_kind_calls.get(kind, 0),
                "bytes_per_step": moved,
                "gb_s": (moved / t / GB) if t and moved else None,
                "floor_ms": own_floor * 1e3,
                "share_of_gap": (t - own_floor) / gap_s if gap_s > 0 else None,
            }
        )
    top = sorted(kernels.items(), key=lambda kv: -kv[1]["us_per_step"])[:25]
    return {
        "model": name,
        "graph": f"decode, batch {batch}, ring K/V, AOTInductor (cpu)",
        "linear_form": graph.linear_form,
        "batch": batch,
        "tok_s_total": batch / wall,
        "context_length": context_length,
        "threads": torch.get_num_threads(),
        "steps": steps,
        "wall_ms_per_step": wall * 1e3,
        "wall_ms_per_step_profiled": wall_profiled * 1e3,
        "wall_ms_per_step_profile_window": wall_window * 1e3,
        "kernel_ms_per_step_profiled": kernel_us / 1e3,
        "tok_s_per_row": 1.0 / wall,
        "roofline_bytes_per_step": roof.total,
        "stream_floor_ms": floor_s * 1e3,
        "gemv_floor_ms": roof.total / gemv * 1e3,
        "gap_ms": gap_s * 1e3,
        "drawn_gb_s": roof.total / wall / GB,
        "fraction_of_stream": floor_s / wall,
        "fraction_of_gemv": roof.total / gemv / wall,
        "bandwidth_before": bandwidth_before,
        "bandwidth_after": bandwidth_after,
        "kinds": rows,
        "top_kernels": [{"name": k, **v} for k, v in top],
        "load_average": list(_load()),
    }


def small_m(hidden: int = 1024, out: int = 3072, ms=(1, 2, 4, 8, 16), repeats: int = 15) -> dict[str, Any]:
    """Single-thread FLOP/s and GB/s of `x [M, hidden] @ W.T` (W `[out, hidden]`, fp32) per M, the
    same with W stored input-major and with W in oneDNN's packed layout (`packed_linear`; None where
    it does not run), and a 1024^3 GEMM (the thread's practical peak): the matmul shapes of a
    batched decode step."""
    linear = torch.nn.Linear(hidden, out, bias=False)
    w = linear.weight.detach()
    w_t = w.t().contiguous()  # the same weight stored [in, out]: no transposed operand
    rows = []
    with torch.no_grad():
        for m in ms:
            x = torch.randn(m, hidden)
            t = _median_step(lambda x=x: torch.nn.functional.linear(x, w), (), repeats)
            t_in = _median_step(lambda x=x: x @ w_t, (), repeats)
            packed = packed_linear.PackedLinear(linear, m) if packed_linear.available() else None
            t_packed = _median_step(lambda x=x, p=packed: p(x), (), repeats) if packed is not None else None
            flops = 2.0 * m * hidden * out
            rows.append(
                {
                    "m": m,
                    "ms": t * 1e3,
                    "gflop_s": flops / t / 1e9,
                    "gb_s": w.numel() * 4 / t / GB,
                    "input_major_ms": t_in * 1e3,
                    "input_major_gflop_s": flops / t_in / 1e9,
                    "packed_ms": None if t_packed is None else t_packed * 1e3,
                    "packed_gflop_s": None if t_packed is None else flops / t_packed / 1e9,
                }
            )
        a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
        t = _median_step(lambda: a @ b, (), 5)
    return {"weight": [out, hidden], "rows": rows, "gemm_1024_gflop_s": 2.0 * 1024**3 / t / 1e9}


def _load() -> tuple[float, ...]:
    try:
        import os

        return os.getloadavg()
    except OSError:
        return ()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gemma4lab.benchmarks.profile_decode", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("model", nargs="?", default="medium-dense")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batches", default="1,8", help="comma-separated batch sizes to profile")
    parser.add_argument("--out", help="JSON path (default: docs/measurements/profile_decode_<model>.json)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    torch.set_num_threads(1)
    profiles = [profile_decode(args.model, args.context, args.steps, batch=int(b)) for b in args.batches.split(",")]
    report = {"model": args.model, "profiles": profiles, "small_m": small_m()}
    out = Path(args.out) if args.out else MEASUREMENTS / f"profile_decode_{args.model}.json"
    out.write_text(json.dumps(report, indent=1) + "\n")
    sys.stdout.write("\n\n".join(format_kinds(p) for p in profiles) + "\n")
    return 0


def format_kinds(report: dict[str, Any]) -> str:
    """Markdown: the per-kind table of a `profile_decode` report."""
    lines = [
        f"{report['model']} {report['graph']}: {report['wall_ms_per_step']:.1f} ms/step "
        f"({report['tok_s_total']:.1f} tok/s total), "
        f"stream floor {report['stream_floor_ms']:.1f} ms, gap {report['gap_ms']:.1f} ms",
        "| kind | ms/step | calls/step | MB/step | GB/s | share of the gap |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["kinds"]:
        gb_s = f"{r['gb_s']:.1f}" if r["gb_s"] else "–"
        share = f"{r['share_of_gap']:.2f}" if r["share_of_gap"] is not None else "–"
        lines.append(
            f"| {r['kind']} | {r['ms_per_step']:.2f} | {r['calls_per_step']} | {r['bytes_per_step'] / 1e6:.1f} "
            f"| {gb_s} | {share} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
