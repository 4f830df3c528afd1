"""One model, three paths: this project's compiled graphs, HF eager `generate`, and HF's static cache +
torch.compile route, measured interleaved and compared within the run."""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from gemma4lab.benchmarks.graphs import GraphFactory
from gemma4lab.benchmarks.hf import hf_generate, hf_static_compile_kwargs
from gemma4lab.benchmarks.measure import _Deadline, _median, _ratio, recommendation
from gemma4lab.inf2.bandwidth import measure_bandwidth
from gemma4lab.inf2.roofline import GB, decode_bytes
from gemma4lib.backends.registry import prefill_logits_error
from gemma4lib.models.loading import LoadedModel
from gemma4lib.reference import reference_greedy

log = logging.getLogger(__name__)

PATHS = ("gemma4lib", "hf_eager", "hf_static_compile")


def bench_model(
    name: str,
    model: LoadedModel,
    factory: GraphFactory,
    *,
    context_length: int,
    bucket: int,
    prompt: Sequence[int],
    new_tokens: int,
    warmup: int,
    iters: int,
    hf_compile: bool,
    hf_compile_timeout_s: float,
    bandwidth_mb: int,
    decode_form: str,
) -> dict[str, Any]:
    """Interleaved medians of the three paths on one model, with bytes/step and roofline."""
    lm = model.lm
    is_moe = bool(getattr(model.config, "enable_moe_block", False))
    decode_form = decode_form if is_moe else "dense"
    ring = recommendation()["ring_kv"]

    bandwidth = [measure_bandwidth(bandwidth_mb)]
    reference = reference_greedy(lm, prompt, new_tokens)
    result: dict[str, Any] = {
        "name": name,
        "params": model.param_count(),
        "source": model.source,
        "reference_distinct_tokens": len(set(reference)),
        "context_length": context_length,
        "prefill_bucket": bucket,
        "prompt_tokens": len(prompt),
        "new_tokens": new_tokens,
        "ring_kv": ring,
        "decode_experts": decode_form if is_moe else None,
        "threads": torch.get_num_threads(),
    }
    paths: dict[str, dict[str, Any]] = {}

    # gemma4lib: compile (or load) once; warm-up run excluded
    started = time.perf_counter()
    try:
        runtime = factory.runtime(context_length, (bucket,), ring, decode_form)
    except Exception as exc:  # noqa: BLE001 — recorded, the suite goes on
        log.exception("compiling %s failed", name)
        paths["gemma4lib"] = {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:500]}
        runtime = None
    if runtime is not None:
        paths["gemma4lib"] = {
            "status": "ok",
            "compiler": factory.compiler,
            "setup_s": time.perf_counter() - started,
            "graphs": factory.compile_report(),
            "decode_tok_s_runs": [],
            "prefill_ms_runs": [],
        }

    paths["hf_eager"] = {"status": "ok", "cache": "dynamic", "decode_tok_s_runs": []}
    compile_kwargs: dict[str, Any] | None = None
    if hf_compile:
        paths["hf_static_compile"] = {"status": "ok", "cache": "static", "decode_tok_s_runs": []}
        try:
            compile_kwargs = hf_static_compile_kwargs()
            paths["hf_static_compile"]["compile_config"] = {
                k: v for k, v in compile_kwargs["compile_config"].to_dict().items()
            }
            torch._dynamo.reset()
            with _Deadline(hf_compile_timeout_s):
                tokens, _, wall = hf_generate(lm, prompt, new_tokens, **compile_kwargs)
            paths["hf_static_compile"]["first_call_s"] = wall  # includes torch.compile of prefill + decode
            paths["hf_static_compile"]["tokens_match_reference"] = tokens == reference
        except Exception as exc:  # noqa: BLE001 — a broken/slow torch.compile is a result, not a crash
            log.warning("HF static cache + torch.compile failed on %s: %s", name, exc)
            paths["hf_static_compile"] = {
                "status": "error",
                "cache": "static",
                "error": f"{type(exc).__name__}: {exc}"[:500],
            }
            compile_kwargs = None
    else:
        paths["hf_static_compile"] = {"status": "skipped", "reason": "quick mode (torch.compile takes minutes)"}

    runners: list[tuple[str, Callable[[], None]]] = []
    last: dict[str, Any] = {}  # our latest generation: its prefill logits are checked after the runs
    if runtime is not None:

        def run_ours():
            prefill_s = runtime.time_prefill(prompt)
            generation = last["gemma4lib"] = runtime.generate(prompt, new_tokens)
            paths["gemma4lib"]["decode_tok_s_runs"].append(generation.decode_tok_s)
            paths["gemma4lib"]["prefill_ms_runs"].append(prefill_s * 1000)
            paths["gemma4lib"]["tokens_match_reference"] = generation.tokens == reference

        runners.append(("gemma4lib", run_ours))

    def run_eager():
        tokens, tok_s, _ = hf_generate(lm, prompt, new_tokens)
        paths["hf_eager"]["decode_tok_s_runs"].append(tok_s)
        paths["hf_eager"]["tokens_match_reference"] = tokens == reference

    runners.append(("hf_eager", run_eager))

    if compile_kwargs is not None:

        def run_compiled():
            tokens, tok_s, _ = hf_generate(lm, prompt, new_tokens, **compile_kwargs)
            paths["hf_static_compile"]["decode_tok_s_runs"].append(tok_s)
            paths["hf_static_compile"]["tokens_match_reference"] = tokens == reference

        runners.append(("hf_static_compile", run_compiled))

    for i in range(warmup + iters):
        for path, run in runners:
            try:
                run()
            except Exception as exc:  # noqa: BLE001
                log.exception("%s on %s failed", path, name)
                paths[path].update(status="error", error=f"{type(exc).__name__}: {exc}"[:500])
                runners = [(p, r) for p, r in runners if p != path]
        if i < warmup:  # drop warm-up figures
            for path in paths.values():
                for key in ("decode_tok_s_runs", "prefill_ms_runs"):
                    if key in path:
                        path[key].clear()
    bandwidth.append(measure_bandwidth(bandwidth_mb))

    if "gemma4lib" in last and paths["gemma4lib"]["status"] == "ok":
        # the strong check where a random model's greedy tokens vary little: prefill logits themselves
        paths["gemma4lib"]["prefill_logits_max_abs_diff"] = prefill_logits_error(model, last["gemma4lib"])
    for path in paths.values():
        if "decode_tok_s_runs" in path:
            path["decode_tok_s"] = _median(path["decode_tok_s_runs"])
        if "prefill_ms_runs" in path:
            path["prefill_ms"] = _median(path["prefill_ms_runs"])
    eager = paths["hf_eager"].get("decode_tok_s")
    result["paths"] = paths
    result["speedup_vs_hf_eager"] = {p: _ratio(paths[p].get("decode_tok_s"), eager) for p in PATHS}

    steps = decode_bytes(model, context_length=context_length, ring=ring, experts=decode_form if is_moe else "dense")
    bw = statistics.mean(b["bandwidth_bytes_s"] for b in bandwidth)
    ceiling = bw / steps.total
    result["bytes_per_step"] = {
        "weights": steps.weights,
        "kv": steps.kv,
        "total": steps.total,
        "experts_form": steps.experts_form,
        "ring": steps.ring,
        "basis": "the gemma4lib decode graph: device weights (tied LM head once, routed "
        "experts only when selective) + every K/V buffer as allocated",
    }
    result["bandwidth"] = {"gb_s": bw / GB, "samples": bandwidth}
    result["ceiling_tok_s"] = ceiling
    result["roofline_fraction"] = {p: _ratio(paths[p].get("decode_tok_s"), ceiling) for p in PATHS}
    return result
