"""The fault lab: the field report's bugs, each switchable, each run through the real port.

Every fault is off unless asked for. Each run reports the pair (SEQ_MATCH, coherent) and whether
the fault was caught (at least one check failed). The point is which check catches which bug:

| fault | where it lives | SEQ_MATCH | coherent |
|---|---|---|---|
| Gemma 3 turn tokens hand-written into the prompt | host, shared with the reference | true | false |
| word-embedding scale wired wrong | host, shared with the reference | true | false |
| PLE scale wired wrong | host, shared with the reference | true | false |
| `layer_scalar` left at its init value on the device | device weights only | false | - |
| a KV-sharing consumer reading the wrong producer | device graph only | false | - |
| tensor-parallel rank read at trace time | device graph only (TP) | false | - |

A fault shared by device and reference is invisible to SEQ_MATCH: only coherence sees it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from . import checks
from .graph import DeviceGraph, _shallow_clone
from .loading import LoadedModel
from .port import PortSettings, build_graphs, compile_graphs, decode_text, eos_ids, prompt_ids
from .reference import reference_greedy

log = logging.getLogger(__name__)

GEMMA3_CHAT = "<bos><start_of_turn>user\n{prompt}<end_of_turn>\n<start_of_turn>model\n"


@dataclass
class FaultRun:
    """What one fault (or the clean baseline) does to one port."""

    model: LoadedModel
    settings: PortSettings
    ids: list[int]


@dataclass(frozen=True)
class Fault:
    name: str
    description: str
    variant: str
    caught_by: str  # "coherence" | "seq_match": the check the field report predicts
    apply: Callable[[FaultRun], Callable[[DeviceGraph], None] | None]
    tp_degree: int = 1


# ---- the faults ------------------------------------------------------------------------------
def gemma3_chat_prompt(run: FaultRun) -> None:
    """Build the chat prompt by hand with Gemma 3's turn markers: ordinary text to Gemma-4."""
    text = GEMMA3_CHAT.format(prompt=run.settings.prompt)
    run.ids = run.model.tokenizer(text, add_special_tokens=False)["input_ids"]


def embedding_scale_unwired(run: FaultRun) -> None:
    """Word embeddings without their sqrt(hidden) scale, on the host and in the reference alike."""
    run.model.text_model.embed_tokens.embed_scale.fill_(1.0)


def ple_scale_unwired(run: FaultRun) -> None:
    """PLE token table without its sqrt(ple_dim) scale, on the host and in the reference alike."""
    run.model.text_model.embed_tokens_per_layer.embed_scale.fill_(1.0)


def layer_scalar_at_init(run: FaultRun) -> Callable[[DeviceGraph], None]:
    """The device weights carry every `layer_scalar` at its init value 1 (the checkpoint's dropped).

    This is what happens when a loader shards parameters but not buffers.
    """
    def edit(graph: DeviceGraph) -> None:
        for layer in graph.model.layers:
            layer._buffers["layer_scalar"] = torch.ones_like(layer.layer_scalar)
        graph.tags["fault"] = "layer_scalar_at_init"
    return edit


def wrong_kv_producer(run: FaultRun) -> Callable[[DeviceGraph], None]:
    """Sliding-window consumers read the first sliding layer's K/V instead of the last one's."""
    layout = run.model.layout
    consumer = next(l for l in layout.consumers if l.layer_type == "sliding_attention")
    right = consumer.producer
    wrong = next(l.index for l in layout.producers if l.layer_type == consumer.layer_type and l.index != right)

    def edit(graph: DeviceGraph) -> None:
        for index, stores in ((right, False), (wrong, True)):
            layer = graph.model.layers[index]
            layer.self_attn = _shallow_clone(layer.self_attn)
            layer.self_attn.store_full_length_kv = stores
        graph.tags["fault"] = f"kv_producer_{wrong}_for_{right}"
    return edit


def baked_tp_rank(run: FaultRun) -> None:
    """Marker: handled by the TP runner (every rank computes rank 0's experts)."""


FAULTS: tuple[Fault, ...] = (
    Fault("gemma3_chat_tokens", "chat prompt hand-built with Gemma 3's <start_of_turn> text", "e2b",
          "coherence", gemma3_chat_prompt),
    Fault("embedding_scale", "word-embedding scale missing on host and reference", "e2b", "coherence",
          embedding_scale_unwired),
    Fault("ple_scale", "PLE scale missing on host and reference", "e2b", "coherence", ple_scale_unwired),
    Fault("layer_scalar_at_init", "layer_scalar buffers left at init in the device weights", "e2b",
          "seq_match", layer_scalar_at_init),
    Fault("wrong_kv_producer", "a KV-sharing consumer reads the wrong producer", "e2b", "seq_match",
          wrong_kv_producer),
    Fault("baked_tp_rank", "tensor-parallel rank read at trace time (MoE experts of rank 0 everywhere)",
          "26b-a4b", "seq_match", baked_tp_rank, tp_degree=2),
)


# ---- running them ----------------------------------------------------------------------------
def _device_tokens(run: FaultRun, edit: Callable[[DeviceGraph], None] | None, fault: Fault | None) -> list[int]:
    model, settings = run.model, run.settings
    if settings.tp_degree > 1:
        from .tp import run_tp_port
        out = run_tp_port(model, settings.tp_degree, run.ids, settings.max_new_tokens, settings.context_length,
                          settings.prefill_buckets[-1], baked_rank=fault is not None and fault.apply is baked_tp_rank,
                          eos_token_ids=eos_ids(model))
        return out["tokens"]
    prefill, decode = build_graphs(model, settings)
    if edit is not None:
        for graph in (*prefill.values(), decode):
            edit(graph)
    runtime = compile_graphs(model, settings, graphs=(prefill, decode)).runtime
    return runtime.generate(run.ids, settings.max_new_tokens, eos_token_ids=eos_ids(model)).tokens


def run_one(variant: str, fault: Fault | None = None, tp_degree: int = 1, cache_dir: str | None = None,
            backend: str = "cpu") -> dict:
    """Port the trained tiny `variant` with `fault` switched on (None: the clean run)."""
    from .trained import load_trained

    started = time.perf_counter()
    settings = PortSettings(variant=variant, model="trained", tp_degree=tp_degree, cache_dir=cache_dir,
                            backend=backend)
    model = load_trained(variant)
    run = FaultRun(model, settings, [])
    run.ids = prompt_ids(model, settings)
    edit = fault.apply(run) if fault else None
    tokens = _device_tokens(run, edit, fault)
    reference = reference_greedy(model.lm, run.ids, settings.max_new_tokens, eos_ids(model))
    answer = decode_text(model, tokens)
    report = checks.run_checks(tokens, reference, answer, decode_text(model, reference),
                               checks.expect_substring(settings.expect))
    caught = not report.seq_match or report.coherent is False
    expected = None
    if fault is not None:
        expected = ({"seq_match": True, "coherent": False} if fault.caught_by == "coherence"
                    else {"seq_match": False})
    as_predicted = fault is None or all(getattr(report, k) == v for k, v in expected.items())
    return {
        "fault": fault.name if fault else "clean", "description": fault.description if fault else "no fault",
        "variant": variant, "tp_degree": tp_degree, "seq_match": report.seq_match, "coherent": report.coherent,
        "caught": caught, "expected": expected, "as_predicted": as_predicted,
        "predicted_check": fault.caught_by if fault else None, "answer": answer,
        "reference_answer": report.reference_answer, "seconds": round(time.perf_counter() - started, 1),
    }


def run_fault_lab(variant: str | None = None, cache_dir: str | None = None, backend: str = "cpu") -> dict[str, Any]:
    """Clean runs, then every fault (optionally only those of one variant). `ok`: all caught, clean clean.

    `backend="eager"` runs the same graphs without compiling them (seconds instead of minutes).
    """
    faults = [f for f in FAULTS if variant is None or f.variant == variant]
    pairs = sorted({(f.variant, f.tp_degree) for f in faults})
    clean = [run_one(v, None, tp, cache_dir, backend) for v, tp in pairs]
    runs = [run_one(f.variant, f, f.tp_degree, cache_dir, backend) for f in faults]
    clean_ok = all(r["seq_match"] and r["coherent"] for r in clean)
    all_caught = all(r["caught"] for r in runs)
    return {"ok": clean_ok and all_caught, "clean_ok": clean_ok, "all_caught": all_caught,
            "all_as_predicted": all(r["as_predicted"] for r in runs), "clean": clean, "faults": runs}


def format_fault_report(report: dict[str, Any]) -> str:
    rows = [f"{'run':<22} {'variant':<8} {'TP':>2}  {'SEQ_MATCH':<9} {'coherent':<8} {'caught':<6} answer"]
    for r in report["clean"] + report["faults"]:
        rows.append(f"{r['fault']:<22} {r['variant']:<8} {r['tp_degree']:>2}  {str(r['seq_match']):<9} "
                    f"{str(r['coherent']):<8} {'' if r['fault'] == 'clean' else str(r['caught']):<6} "
                    f"{(r['answer'] or '')[:48]!r}")
    rows.append(f"ok={report['ok']} (clean runs pass: {report['clean_ok']}, every fault caught: "
                f"{report['all_caught']}, each by the predicted check: {report['all_as_predicted']})")
    return "\n".join(rows)
