"""`python -m gemma4lab.benchmarks.host_rss`: the serving host's peak RSS, measured on this machine
against the plan (`serving_host`), recorded as JSON.

The released checkpoints do not fit (or download to) the CPU machine, so the full profile's host
side runs on real-width models (`real_width`, bf16) of reduced depth, saved as a checkpoint folder
and loaded back the way the full profile loads one (`loading.load_checkpoint`), each in a process
of its own:

1. `load_checkpoint` (bf16: the weights stay memory-mapped until read), 2. every weight page read
once (the Neuron backend's cache key reads every weight before the compile), 3. the per-rank
weight shards read back as `load_model_builder` reads them (TP=1: the device weights) and every
page of them read (what `nxd_model.initialize` does copying them to the cores), then dropped,
4. the host reference's greedy `generate` over the full profile's prompt and new tokens, 5.
LOGITS_MATCH's teacher-forced logits and their spread (`reference.logits_spread`). No host K/V:
the neuron backend keeps none.

`compile` measures the ModelBuilder compile's host side the same way (`inf2.compile_host`): the
load, every weight page read, the two keys' modules at shard size, then the lazy NxD checkpoint
and one rank's file written at a time.

Its peak is compared with `serving_host_plan(..., layer_overrides=...)` at the same depth, and a
line through the two depths' (model bytes, peak) points is extended to the released model's bytes
(the per-layer fit) and compared with the released plan. `spread` measures `logits_spread` alone.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

S, F = "sliding_attention", "full_attention"
# Two depths per variant; each keeps the variant's features (E2B: KV sharing, PLE over the vocabulary).
DEPTHS: dict[str, list[dict[str, Any]]] = {
    "e2b": [
        dict(num_hidden_layers=3, layer_types=[S, F, F], num_kv_shared_layers=1),
        dict(num_hidden_layers=7, layer_types=[S, S, S, S, F, S, F], num_kv_shared_layers=2),
    ],
}
SHARD_FILE = "tp0_sharded_checkpoint.safetensors"


def _build(variant: str, overrides: dict[str, Any], folder: Path) -> None:
    """Child 1: a real-width bf16 model saved as a checkpoint folder, plus its TP=1 shard."""
    import torch
    from safetensors.torch import save_file

    from gemma4lab.models.real_width import build_real_width
    from gemma4lib.tp.plan import make_plan
    from gemma4lib.tp.shard import shard_state_dict

    model = build_real_width(variant, dtype=torch.bfloat16, **overrides)
    model.lm.save_pretrained(folder)
    plan = make_plan(model.lm.config, 1, model.variant)
    (folder / "shards").mkdir()
    save_file(shard_state_dict(model.lm, plan, 0), str(folder / "shards" / SHARD_FILE))


def _read_every_page(tensors) -> float:
    """Touch one element per 4 KiB page of every tensor (what a copy of it to the device reads)."""
    total = 0.0
    for t in tensors:
        flat = t.reshape(-1)
        total += float(flat[:: max(1, 4096 // t.element_size())].double().sum())
    return total


def _serve(variant: str, folder: Path, context_length: int, prompt_tokens: int, new_tokens: int) -> dict[str, Any]:
    """Child 2: the full profile's host side on the saved model; the RSS of each step."""
    import torch
    from safetensors.torch import load_file

    from gemma4lab.benchmarks.host_memory import measure_peak, rss_bytes
    from gemma4lib.models.checkpoint import load_checkpoint
    from gemma4lib.models.variants import get_variant
    from gemma4lib.reference import logits_spread, random_prompt, reference_greedy, teacher_forced_logits

    torch.set_num_threads(1)
    base = rss_bytes()
    steps: dict[str, Any] = {}
    model, steps["load"] = measure_peak(
        lambda: load_checkpoint(get_variant(variant), str(folder), torch.bfloat16, with_tokenizer=False)
    )
    lm = model.lm
    model_bytes = sum(p.numel() * p.element_size() for p in lm.parameters())
    model_bytes += sum(b.numel() * b.element_size() for b in lm.buffers())
    _, steps["read_weights"] = measure_peak(lambda: _read_every_page(lm.state_dict().values()))
    _, steps["shards"] = measure_peak(lambda: _read_every_page(load_file(str(folder / "shards" / SHARD_FILE)).values()))
    ids = random_prompt(lm.config.vocab_size, prompt_tokens, 1)
    tokens, steps["reference"] = measure_peak(lambda: reference_greedy(lm, ids, new_tokens))

    def check() -> float:
        reference = teacher_forced_logits(lm, ids, tokens)
        return logits_spread(lm, ids, tokens, reference)[0]

    spread, steps["spread"] = measure_peak(check)
    return {
        "base_gb": base / 1e9,
        "model_gb": model_bytes / 1e9,
        "host_kv_gb": 0.0,  # the neuron backend keeps no host K/V
        "steps": {k: v.to_dict() for k, v in steps.items()},
        # the steps' peaks (ru_maxrss cannot say: resetting VmHWM for each step resets it too)
        "peak_gb": max(step.peak_bytes for step in steps.values()) / 1e9,
        "peak_step": max(steps, key=lambda k: steps[k].peak_bytes),
        "spread": spread,
        "new_tokens": len(tokens),
    }


def _compile_host(variant: str, folder: Path, tp: int, context_length: int) -> dict[str, Any]:
    """Child 3: the ModelBuilder compile's host side on the saved model (`inf2.compile_host`): the
    load, every weight page read, each key's module at shard size (CPU parallel layers standing in
    for NxD's, their weights written as NxD's initialisers write them), then NxD's
    `shard_checkpoint` emulated: the recipe's lazy loader, the first key's module dropped (NxD
    rebuilds it on the meta device), each rank's contiguous cut written with safetensors in turn."""
    import tempfile

    import torch
    from safetensors.torch import save_file

    from gemma4lab.benchmarks.host_memory import measure_peak, rss_bytes
    from gemma4lib.models.checkpoint import load_checkpoint
    from gemma4lib.models.variants import get_variant
    from gemma4lib.recipes import neuron_model_builder as mb
    from gemma4lib.tp.plan import REPLICATE, make_plan
    from gemma4lib.tp.rank_graph import CpuParallelFactory

    torch.set_num_threads(1)
    base = rss_bytes()
    steps: dict[str, Any] = {}
    model, steps["load"] = measure_peak(
        lambda: load_checkpoint(get_variant(variant), str(folder), torch.bfloat16, with_tokenizer=False)
    )
    lm = model.lm
    model_bytes = sum(p.numel() * p.element_size() for p in lm.parameters())
    model_bytes += sum(b.numel() * b.element_size() for b in lm.buffers())
    _, steps["read_weights"] = measure_peak(lambda: _read_every_page(lm.state_dict().values()))
    plan = make_plan(lm.config, tp, model.variant)
    shapes = mb.bucket_shapes(context_length, (128,), ring=True)

    def modules() -> list[Any]:
        built = []
        for shape in shapes.values():
            factory = CpuParallelFactory(tp, dtype=torch.bfloat16)  # NxD's layers are built in bf16 too
            module = mb.rank_module(lm.config, plan, shape, torch.bfloat16, factory=factory)
            for p in module.parameters():
                if p.is_floating_point():
                    p.data.fill_(0.5)  # resident, as NxD's initialised weights are
            built.append(module)
        return built

    keys, steps["trace_modules"] = measure_peak(modules)
    del keys[0]  # shard_checkpoint rebuilds the first key's module on the meta device

    def shard_checkpoint() -> int:
        checkpoint = mb.checkpoint_loader(model, plan, torch.bfloat16)()
        with tempfile.TemporaryDirectory(prefix="gemma4lib-shards-") as out:
            for rank in range(tp):
                cut = {
                    k: v if plan.rule(k).kind == REPLICATE else v.chunk(tp, plan.rule(k).dim)[rank]
                    for k, v in checkpoint.items()
                }
                save_file({k: v.contiguous() for k, v in cut.items()}, f"{out}/tp{rank}_sharded_checkpoint.safetensors")
        return len(checkpoint)

    _, steps["shard_checkpoint"] = measure_peak(shard_checkpoint)
    return {
        "base_gb": base / 1e9,
        "model_gb": model_bytes / 1e9,
        "steps": {k: v.to_dict() for k, v in steps.items()},
        "peak_gb": max(step.peak_bytes for step in steps.values()) / 1e9,
        "peak_step": max(steps, key=lambda k: steps[k].peak_bytes),
    }


def measure_compile(variant: str = "e2b", tp: int = 1, context_length: int = 2048) -> dict[str, Any]:
    """The compile host's side at both depths, measured and planned, and the per-layer fit held to
    the released plan (`inf2.compile_host`)."""
    from gemma4lab.inf2.plans import plan_dict
    from gemma4lib.inf2.compile_host import compile_host_plan

    rows = []
    for overrides in DEPTHS[variant]:
        with tempfile.TemporaryDirectory(prefix="gemma4lib-host-rss-") as tmp:
            folder = Path(tmp) / "model"
            _child(["build", variant, json.dumps(overrides), str(folder)])
            started = time.perf_counter()
            measured = _child(["compile-host", variant, str(folder), str(tp), str(context_length)])
            measured["wall_s"] = time.perf_counter() - started
        plan = compile_host_plan(variant, tp, "model_builder", context_length=context_length, layer_overrides=overrides)
        rows.append({"layers": overrides["num_hidden_layers"], "measured": measured, "plan": plan_dict(plan)})
    (a, b) = rows
    slope = (b["measured"]["peak_gb"] - a["measured"]["peak_gb"]) / (b["plan"]["model_gb"] - a["plan"]["model_gb"])
    released = compile_host_plan(variant, tp, "model_builder", context_length=context_length)
    fitted = a["measured"]["peak_gb"] + slope * (released.model_gb - a["plan"]["model_gb"])
    return {
        "variant": variant,
        "tp": tp,
        "context_length": context_length,
        "depths": rows,
        "fit": {"peak_gb_per_model_gb": slope, "released_peak_gb": fitted},
        "released_plan": plan_dict(released),
        "plan_over_fit": released.peak_gb / fitted,
        "plan_over_measured": [r["plan"]["peak_gb"] / r["measured"]["peak_gb"] for r in rows],
    }


def _spread(variant: str, overrides: dict[str, Any], prompt_tokens: int, new_tokens: int) -> dict[str, Any]:
    """`logits_spread`'s extra peak RSS on a real-width bf16 model, and whether its blocked LM head
    gives the very logits of one whole float32 LM head on the real vocabulary."""
    import torch

    from gemma4lab.benchmarks.host_memory import measure_peak
    from gemma4lab.models.real_width import build_real_width
    from gemma4lib.models import upcast
    from gemma4lib.reference import logits_spread, random_prompt, teacher_forced_logits

    torch.set_num_threads(1)
    model = build_real_width(variant, dtype=torch.bfloat16, **overrides)
    lm = model.lm
    model_bytes = sum(p.numel() * p.element_size() for p in lm.parameters())
    model_bytes += sum(b.numel() * b.element_size() for b in lm.buffers())
    ids = random_prompt(lm.config.vocab_size, prompt_tokens, 1)
    tokens = random_prompt(lm.config.vocab_size, new_tokens, 2)
    reference = teacher_forced_logits(lm, ids, tokens)
    (spread, precise), peak = measure_peak(lambda: logits_spread(lm, ids, tokens, reference))
    with upcast.upcast_forward(lm, torch.float32):
        blocked = teacher_forced_logits(lm, ids, tokens)
    whole_rows, upcast.LINEAR_BLOCK_ROWS = upcast.LINEAR_BLOCK_ROWS, lm.config.vocab_size
    try:  # the LM head widened whole: what the deep copy computed
        with upcast.upcast_forward(lm, torch.float32):
            whole = teacher_forced_logits(lm, ids, tokens)
    finally:
        upcast.LINEAR_BLOCK_ROWS = whole_rows
    return {
        "variant": variant,
        "layers": lm.config.num_hidden_layers,
        "model_gb": model_bytes / 1e9,
        "spread": spread,
        "precise_dtype": precise,
        **peak.to_dict(),
        "extra_over_model": peak.extra_bytes / model_bytes,
        "blocked_head_equal": bool(torch.equal(blocked, whole)),
    }


def _child(args: list[str]) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "gemma4lab.benchmarks.host_rss", *args], capture_output=True, text=True, env=env
    )
    if out.returncode:
        raise RuntimeError(f"host_rss {' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1]) if out.stdout.strip() else {}


def measure_serving(
    variant: str = "e2b", context_length: int = 1024, prompt_tokens: int = 128, new_tokens: int = 64
) -> dict[str, Any]:
    """Both depths measured and planned, the per-layer fit, and the released plan it is held to."""
    from gemma4lab.inf2.plans import plan_dict
    from gemma4lib.inf2.serving_host import serving_host_plan

    shapes = dict(context_length=context_length, prompt_tokens=prompt_tokens, new_tokens=new_tokens)
    rows = []
    for overrides in DEPTHS[variant]:
        with tempfile.TemporaryDirectory(prefix="gemma4lib-host-rss-") as tmp:
            folder = Path(tmp) / "model"
            _child(["build", variant, json.dumps(overrides), str(folder)])
            started = time.perf_counter()
            measured = _child(["serve", variant, str(folder), json.dumps(shapes)])
            measured["wall_s"] = time.perf_counter() - started
        plan = serving_host_plan(variant, 1, "inf2.xlarge", layer_overrides=overrides, **shapes)
        rows.append({"layers": overrides["num_hidden_layers"], "measured": measured, "plan": plan_dict(plan)})
    (a, b) = rows
    slope = (b["measured"]["peak_gb"] - a["measured"]["peak_gb"]) / (b["plan"]["model_gb"] - a["plan"]["model_gb"])
    released = serving_host_plan(variant, 1, "inf2.xlarge", **shapes)
    fitted = a["measured"]["peak_gb"] + slope * (released.model_gb - a["plan"]["model_gb"])
    return {
        "variant": variant,
        "shapes": shapes,
        "depths": rows,
        "fit": {"peak_gb_per_model_gb": slope, "released_peak_gb": fitted},
        "released_plan": plan_dict(released),
        "plan_over_fit": released.peak_gb / fitted,
        "plan_over_measured": [r["plan"]["peak_gb"] / r["measured"]["peak_gb"] for r in rows],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gemma4lab.benchmarks.host_rss", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build")
    build.add_argument("variant")
    build.add_argument("overrides")
    build.add_argument("folder")
    serve = sub.add_parser("serve")
    serve.add_argument("variant")
    serve.add_argument("folder")
    serve.add_argument("shapes")
    spread = sub.add_parser("spread")
    spread.add_argument("variant", nargs="?", default="e2b")
    spread.add_argument("--overrides", default=json.dumps(DEPTHS["e2b"][0]))
    spread.add_argument("--prompt-tokens", type=int, default=24)
    spread.add_argument("--new-tokens", type=int, default=16)
    compile_host = sub.add_parser("compile-host")
    compile_host.add_argument("variant")
    compile_host.add_argument("folder")
    compile_host.add_argument("tp", type=int)
    compile_host.add_argument("context_length", type=int)
    compile_ = sub.add_parser("compile")
    compile_.add_argument("variant", nargs="?", default="e2b", choices=sorted(DEPTHS))
    compile_.add_argument("--out", help="write the JSON record here too")
    serving = sub.add_parser("serving")
    serving.add_argument("variant", nargs="?", default="e2b", choices=sorted(DEPTHS))
    serving.add_argument("--out", help="write the JSON record here too")
    args = parser.parse_args(argv)
    if args.command == "build":
        _build(args.variant, json.loads(args.overrides), Path(args.folder))
        out: dict[str, Any] = {"folder": args.folder}
    elif args.command == "serve":
        shapes = json.loads(args.shapes)
        out = _serve(
            args.variant, Path(args.folder), shapes["context_length"], shapes["prompt_tokens"], shapes["new_tokens"]
        )
    elif args.command == "compile-host":
        out = _compile_host(args.variant, Path(args.folder), args.tp, args.context_length)
    elif args.command == "compile":
        from gemma4lib.environment import machine, versions

        out = {**measure_compile(args.variant), "machine": machine(), "versions": versions(), "threads": 1}
        if args.out:
            Path(args.out).write_text(json.dumps(out, indent=2))
    elif args.command == "spread":
        out = _spread(args.variant, json.loads(args.overrides), args.prompt_tokens, args.new_tokens)
    else:
        from gemma4lib.environment import machine, versions

        out = {**measure_serving(args.variant), "machine": machine(), "versions": versions(), "threads": 1}
        if args.out:
            Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
