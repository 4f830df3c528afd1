"""The `mtp` section's figures where bytes decide: drafting's ceiling and floor, and prompt lookup.

The tiny models of `benchmarks.mtp` are bound by per-call overhead, so they cannot show what
drafting is for: turning one bandwidth-bound weight read into several tokens. Two measurements do:

- `bench_bounds`, on a bandwidth-bound model (medium-dense): for each k, the verify graph of
  k + 1 tokens against one decode step, and end-to-end drafted decode with an *oracle* drafter
  (proposes exactly the tokens plain greedy decode produces: every draft accepted, the upper
  bound of any drafter at this k) and an *always-wrong* one (proposes tokens that differ from
  them: nothing accepted, the lower bound), timed in turns with plain decode (`timing.time_interleaved`).
- `bench_prompt_lookup`, on a real trained model (Gemma 3 270M, `models.gemma3_real`): n-gram
  prompt lookup (`generation.drafters.PromptLookupDrafter`, what transformers'
  `prompt_lookup_num_tokens` and vLLM's ngram speculation do) on prompts whose answer repeats the
  input (extract, reformat, continue a list), against plain decode on the same compiled graphs.

Everything runs through the one engine (`runtime.Engine`) and its one drafter interface over the
graphs `device.build.graph_set` builds, compiled one by one by the suite's backend (`compile_one`);
prefill graphs run uncompiled (not timed, as in `benchmarks.batch`). Every drafted run's tokens
are checked equal to plain greedy decode (greedy verification keeps them so whatever the drafts).
Per row: tokens emitted per verify, ms per verify against ms per decode step (medians of the
engine's own step clock over the timed runs), and decode tok/s over plain decode in the same
rounds. Timings are CPU measurements on a shared machine: only ratios within one run count.
"""

from __future__ import annotations

import gc
import logging
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gemma4lib.backends.engine import engine_over, named_steps
from gemma4lib.backends.registry import cpu_balance, get_backend
from gemma4lib.device.build import GraphSet, graph_set
from gemma4lib.generation.drafters import CallableDrafter, PromptLookupDrafter
from gemma4lib.models.loading import LoadedModel
from gemma4lib.reference import reference_greedy
from gemma4lib.runtime import BatchResult, Drafter, Engine, Request, Steps
from gemma4lib.timing import time_interleaved

log = logging.getLogger(__name__)

BOUND_DRAFT_TOKENS = tuple(range(1, 9))
PROMPT_LOOKUP_DRAFT_TOKENS = (4,)

# Completion prompts for a base model whose continuation repeats its input (the case prompt lookup
# is for): copy a record out of a text, reformat a list, continue a repeating list.
REPEAT_PROMPTS: dict[str, str] = {
    "extract": (
        "Order confirmation: customer Maria Lopez, 42 Harbour Street, Bristol BS1 4QA, order number "
        "A-77213, two boxes of green tea and one teapot, delivery on Friday 12 May.\n"
        "The same order as a record:\n"
        "customer: Maria Lopez\naddress: 42 Harbour Street, Bristol BS1 4QA\norder number:"
    ),
    "reformat": (
        "Planets, comma separated: Mercury, Venus, Earth, Mars, Jupiter, Saturn, Uranus, Neptune.\n"
        "Planets, one per line:\n- Mercury\n- Venus\n-"
    ),
    "continue_list": (
        "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday.\n"
        "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday.\n"
        "Monday, Tuesday,"
    ),
}


def oracle_drafter(sequence: Sequence[int]) -> CallableDrafter:
    """Proposes the next tokens of `sequence` (prompt + plain greedy tokens): always right."""
    full = [int(t) for t in sequence]
    return CallableDrafter(lambda history, n: full[len(history) : len(history) + n])


def always_wrong_drafter(sequence: Sequence[int], vocab_size: int) -> CallableDrafter:
    """Proposes, at every position, a token other than the one plain greedy decode produces there:
    the first draft is always rejected, so every verify keeps exactly one token."""
    full = [int(t) for t in sequence]
    return CallableDrafter(
        lambda history, n: [(full[i] + 1) % vocab_size for i in range(len(history), min(len(history) + n, len(full)))]
    )


@dataclass
class GraphEngines:
    """The engines over one compiled graph set: plain decode, or one verify graph shared by drafters."""

    graphs: GraphSet
    steps: Steps
    compile_s: float

    def engine(self, model: LoadedModel, drafter: Drafter | None = None) -> Engine:
        return engine_over(model, self.steps, self.graphs, drafter=drafter)


def compile_set(
    model: LoadedModel, *, backend: str, context_length: int, bucket: int, draft_tokens: int, cache=None
) -> GraphEngines:
    """Batch-1 graphs (ring K/V) of `draft_tokens` k (0: plain decode) built by `graph_set` for the
    backend's compute balance; the decode or verify graph compiled by `backend`, the prefill as built."""
    graphs = graph_set(
        model,
        batch=1,
        context_length=context_length,
        ring=True,
        prefill_buckets=(bucket,),
        draft_tokens=draft_tokens,
        compute_balance=cpu_balance(backend),
    )
    compiled = get_backend(backend).compile_one(graphs.target, cache)
    fns = {f"prefill{bucket}": graphs.prefill[bucket], ("verify" if draft_tokens else "decode"): compiled.fn}
    return GraphEngines(graphs, named_steps(fns, graphs.new_kv()), compiled.compile_s)


def _keeping(results: list[BatchResult], run: Callable[[], BatchResult]) -> Callable[[], BatchResult]:
    def go() -> BatchResult:
        result = run()
        results.append(result)
        return result

    return go


def _median(values: Sequence[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def timed_runs(engines: dict[str, Engine], request: Request, warmup: int, iters: int) -> dict[str, dict[str, Any]]:
    """Each engine's generation of `request`, in turns (`time_interleaved`): decode tok/s per timed
    round, the step times of the timed rounds (ms), tokens and acceptance of the last run."""
    kept: dict[str, list[BatchResult]] = {name: [] for name in engines}
    rates = time_interleaved(
        {name: _keeping(kept[name], lambda e=e: e.generate_rows([request])) for name, e in engines.items()},
        warmup,
        iters,
    )
    out = {}
    for name, results in kept.items():
        timed = results[warmup:]
        row = timed[-1].rows[0]
        out[name] = {
            "tok_s": _median(rates[name]),
            "tok_s_runs": rates[name],
            "step_ms": _median([s * 1000 for r in timed for s in r.step_s]),
            "tokens": row.tokens,
            "accepted_per_verify": row.accepted_per_step,
            "drafts_accepted": row.accepted,
            "drafts_proposed": row.drafted,
        }
    return out


def _drafted_figures(run: dict[str, Any], plain: dict[str, Any]) -> dict[str, Any]:
    """One drafted run beside plain decode: acceptance, ms per verify vs per step, speed-up."""
    return {
        "accepted_per_verify": run["accepted_per_verify"],
        "drafts_accepted": run["drafts_accepted"],
        "drafts_proposed": run["drafts_proposed"],
        "ms_per_verify": run["step_ms"],
        "ms_per_step": plain["step_ms"],
        "verify_over_step": _ratio(run["step_ms"], plain["step_ms"]),
        "decode_tok_s": run["tok_s"],
        "plain_decode_tok_s": plain["tok_s"],
        "speedup": _ratio(run["tok_s"], plain["tok_s"]),
        "decode_tok_s_runs": run["tok_s_runs"],
        "tokens_equal_plain": run["tokens"] == plain["tokens"],
    }


def bench_bounds(
    name: str,
    model: LoadedModel,
    prompt: Sequence[int],
    *,
    backend: str = "cpu",
    draft_tokens: Sequence[int] = BOUND_DRAFT_TOKENS,
    context_length: int = 128,
    bucket: int = 16,
    new_tokens: int = 40,
    warmup: int = 1,
    iters: int = 3,
    cache=None,
) -> dict[str, Any]:
    """Drafting's ceiling and floor on `model` (module docstring), one row per k; plain decode is
    timed again beside every k, so each row's ratios come from the same rounds."""
    request = Request(list(prompt), new_tokens)  # greedy, no eos: every run decodes new_tokens
    plain_set = compile_set(
        model, backend=backend, context_length=context_length, bucket=bucket, draft_tokens=0, cache=cache
    )
    plain = plain_set.engine(model)
    plain_tokens = plain.generate_rows([request]).rows[0].tokens
    plain_equal_reference = plain_tokens == reference_greedy(model.lm, list(prompt), new_tokens)
    sequence = [*request.prompt_ids, *plain_tokens]
    vocab = int(model.config.vocab_size)
    rows = []
    for k in draft_tokens:
        log.info("drafting bounds %s: k = %d", name, k)
        drafted = compile_set(
            model, backend=backend, context_length=context_length, bucket=bucket, draft_tokens=k, cache=cache
        )
        runs = timed_runs(
            {
                "plain": plain,
                "oracle": drafted.engine(model, oracle_drafter(sequence)),
                "always_wrong": drafted.engine(model, always_wrong_drafter(sequence, vocab)),
            },
            request,
            warmup,
            iters,
        )
        oracle, wrong = (_drafted_figures(runs[n], runs["plain"]) for n in ("oracle", "always_wrong"))
        # the verify graph's cost: every round of both drafted runs is one verify of k + 1 tokens
        # (a static shape whatever was drafted) plus the drafter's host lookup
        verify_ms = _median([oracle["ms_per_verify"], wrong["ms_per_verify"]])
        rows.append(
            {
                "draft_tokens": k,
                "verify_tokens": k + 1,
                "verify_experts": drafted.graphs.verify.expert_form,
                "ms_per_step": runs["plain"]["step_ms"],
                "ms_per_verify": verify_ms,
                "verify_over_step": _ratio(verify_ms, runs["plain"]["step_ms"]),
                "plain_decode_tok_s": runs["plain"]["tok_s"],
                "plain_tokens_equal_first_run": runs["plain"]["tokens"] == plain_tokens,
                "oracle": oracle,
                "always_wrong": wrong,
                "compile_s": drafted.compile_s,
            }
        )
        del drafted, runs  # before the next k's graphs load: a packed verify graph holds a copy of the weights
        gc.collect()
    return {
        "model": name,
        "model_source": model.source,
        "backend": backend,
        "context_length": context_length,
        "new_tokens": new_tokens,
        "prompt_tokens": len(request.prompt_ids),
        "threads": torch.get_num_threads(),
        "plain_compile_s": plain_set.compile_s,
        "plain_equal_reference": plain_equal_reference,
        "rows": rows,
        "tokens_exact": plain_equal_reference
        and all(r["oracle"]["tokens_equal_plain"] and r["always_wrong"]["tokens_equal_plain"] for r in rows),
    }


def bench_prompt_lookup(
    name: str,
    model: LoadedModel,
    prompts: dict[str, Sequence[int]],
    *,
    backend: str = "cpu",
    draft_tokens: Sequence[int] = PROMPT_LOOKUP_DRAFT_TOKENS,
    context_length: int = 256,
    bucket: int = 128,
    new_tokens: int = 48,
    warmup: int = 1,
    iters: int = 3,
    max_ngram: int = 3,
    cache=None,
) -> dict[str, Any]:
    """Prompt-lookup drafting against plain decode on each of `prompts` (name -> ids), per k; the
    drafted and plain tokens must equal each other and the host reference (HF greedy)."""
    plain_set = compile_set(
        model, backend=backend, context_length=context_length, bucket=bucket, draft_tokens=0, cache=cache
    )
    plain = plain_set.engine(model)
    references = {p: reference_greedy(model.lm, list(ids), new_tokens) for p, ids in prompts.items()}
    rows = []
    for k in draft_tokens:
        drafted = compile_set(
            model, backend=backend, context_length=context_length, bucket=bucket, draft_tokens=k, cache=cache
        )
        lookup = drafted.engine(model, PromptLookupDrafter(max_ngram=max_ngram))
        for prompt_name, ids in prompts.items():
            log.info("prompt lookup %s: k = %d, %s", name, k, prompt_name)
            request = Request(list(ids), new_tokens)
            runs = timed_runs({"plain": plain, "prompt_lookup": lookup}, request, warmup, iters)
            figures = _drafted_figures(runs["prompt_lookup"], runs["plain"])
            rows.append(
                {
                    "draft_tokens": k,
                    "prompt": prompt_name,
                    "prompt_tokens": len(ids),
                    **figures,
                    "tokens_equal_reference": runs["prompt_lookup"]["tokens"] == references[prompt_name],
                    "plain_equal_reference": runs["plain"]["tokens"] == references[prompt_name],
                    "text": model.tokenizer.decode(runs["prompt_lookup"]["tokens"]) if model.tokenizer else None,
                }
            )
        del drafted, lookup  # as in `bench_bounds`
        gc.collect()
    return {
        "model": name,
        "model_source": model.source,
        "backend": backend,
        "context_length": context_length,
        "new_tokens": new_tokens,
        "max_ngram": max_ngram,
        "threads": torch.get_num_threads(),
        "rows": rows,
        "tokens_exact": all(r["tokens_equal_plain"] and r["tokens_equal_reference"] for r in rows),
    }


def geometric_mean(values: Sequence[float | None]) -> float | None:
    values = [v for v in values if v]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def summary_keys(bounds: Sequence[dict[str, Any]], lookups: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The section's headline figures per model and k (JSON keys are strings): `verify_over_step`,
    `oracle_speedup`, `always_wrong_speedup` from the bounds, and `prompt_lookup_speedup` (the
    geometric mean over the repeat-the-input prompts at that k) with its acceptance."""
    out: dict[str, dict[str, dict[str, float | None]]] = {
        "verify_over_step": {},
        "oracle_speedup": {},
        "always_wrong_speedup": {},
        "prompt_lookup_speedup": {},
        "prompt_lookup_accepted_per_verify": {},
    }
    for section in bounds:
        for key, pick in (
            ("verify_over_step", lambda r: r["verify_over_step"]),
            ("oracle_speedup", lambda r: r["oracle"]["speedup"]),
            ("always_wrong_speedup", lambda r: r["always_wrong"]["speedup"]),
        ):
            out[key][section["model"]] = {str(r["draft_tokens"]): pick(r) for r in section["rows"]}
    for section in lookups:
        if not section.get("rows"):  # skipped (the model is not on this machine): no figure at all
            continue
        ks = sorted({r["draft_tokens"] for r in section["rows"]})
        rows_at = {k: [r for r in section["rows"] if r["draft_tokens"] == k] for k in ks}
        out["prompt_lookup_speedup"][section["model"]] = {
            str(k): geometric_mean([r["speedup"] for r in rows]) for k, rows in rows_at.items()
        }
        out["prompt_lookup_accepted_per_verify"][section["model"]] = {
            str(k): _median([r["accepted_per_verify"] for r in rows]) for k, rows in rows_at.items()
        }
    return out


__all__ = [
    "BOUND_DRAFT_TOKENS",
    "PROMPT_LOOKUP_DRAFT_TOKENS",
    "REPEAT_PROMPTS",
    "always_wrong_drafter",
    "bench_bounds",
    "bench_prompt_lookup",
    "compile_set",
    "oracle_drafter",
    "summary_keys",
]
