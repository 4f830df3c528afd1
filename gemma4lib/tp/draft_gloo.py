"""Drafted generation over the TP plan's ranks on CPU: one gloo process per rank, as `cpu_gloo` runs
plain decode.

Each rank builds the drafting keys' modules from the configs (`draft_rank_graph`: prefill per
bucket, verify of k + 1 tokens, the assistant's draft step; one set of weights and K/V parameters,
written back through the aliased outputs as on the device), loads its own target and assistant
shards and runs `speculative.DraftedRuntime`'s host loop over them. Every rank plays host for
itself: all see the same gathered logits, so they draft and accept the same tokens (checked:
`ranks_agree`). Rank 0 returns the tokens and the logits that chose each.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..device.embedder import HostEmbedder
from ..errors import PromptTooLongError
from .cpu_gloo import CPU_EXECUTION, RECIPE, run_ranks, run_tp_port
from .draft_rank_graph import KVDraftStep, assistant_shard, build_drafting_modules, draft_key_shapes
from .plan import TPPlan, make_plan
from .shard import iter_shards, shard_shapes


@dataclass
class DraftJob:
    """What a rank process needs for a drafted run (picklable for the spawn start method)."""

    config: Any
    assistant_config: Any
    plan: TPPlan
    shards: list[dict[str, torch.Tensor]]
    assistant_shards: list[dict[str, torch.Tensor]]
    host: HostEmbedder
    prompt: list[int]
    max_new_tokens: int
    context_length: int
    buckets: tuple[int, ...]
    ring: bool
    draft_tokens: int
    read_layers: dict[str, int]
    dtype: torch.dtype = torch.float32
    eos_token_ids: tuple[int, ...] = ()
    bench_tokens: int | None = None  # also time a generation of this many tokens, eos ignored

    def run_rank(self, rank: int) -> dict[str, Any]:
        from ..serving.speculative import CompiledDraft, DraftedRuntime
        from .layers import TorchDistCollectives
        from .rank_graph import CpuParallelFactory

        t0 = time.perf_counter()
        factory = CpuParallelFactory(self.plan.tp, TorchDistCollectives(), self.dtype)
        shapes = draft_key_shapes(self.context_length, self.buckets, self.draft_tokens, self.ring)
        modules = build_drafting_modules(
            self.config,
            self.assistant_config,
            self.plan,
            self.read_layers,
            shapes,
            self.draft_tokens,
            factory=factory,
            dtype=self.dtype,
        )
        checkpoint = {"target." + k: v for k, v in self.shards[rank].items()}
        checkpoint.update({"assistant." + k: v for k, v in self.assistant_shards[rank].items()})
        missing, unexpected = modules["draft"].load_state_dict(checkpoint, strict=False)
        if unexpected:
            raise KeyError(f"shard keys the drafting modules do not have: {sorted(unexpected)[:8]}")
        steps = CompiledDraft(
            {int(n[len("prefill") :]): KVDraftStep(m) for n, m in modules.items() if n.startswith("prefill")},
            KVDraftStep(modules["verify"]),
            KVDraftStep(modules["draft"]),
        )
        runtime = DraftedRuntime.over(self.host, steps, [], self.draft_tokens, self.dtype)
        build_s = time.perf_counter() - t0
        generation = runtime.generate(self.prompt, self.max_new_tokens, eos_token_ids=self.eos_token_ids)
        result: dict[str, Any] = {
            "rank": rank,
            "tokens": generation.tokens,
            "accepted": generation.accepted,
            "emitted": generation.emitted,
            "drafted": generation.drafted,
            "prefill_s": generation.prefill_s,
            "decode_tok_s": generation.decode_tok_s,
            "missing_keys": sorted(k for k in missing if not k.startswith("kv.")),
            "kv_shapes": [list(t.shape) for t in modules["draft"].kv],
            "build_s": build_s,
        }
        if self.bench_tokens:
            timed = runtime.generate(self.prompt, self.bench_tokens)
            result.update(
                bench_tokens=timed.tokens, bench_tok_s=timed.decode_tok_s, bench_accepted=timed.accepted_per_step
            )
        if rank == 0:  # by value (see cpu_gloo._run_rank)
            result["step_logits"] = generation.step_logits.float().numpy().copy()
        return result


def run_tp_drafted(
    loaded_model: Any,
    assistant: Any,
    settings: Any,
    prompt: Sequence[int],
    eos_token_ids: Sequence[int],
    *,
    bench: bool = True,
    start_method: str = "fork",
) -> dict[str, Any]:
    """A drafted run over `settings.tp_degree` gloo ranks: the `device_run` fields (tokens, the
    logits that chose each, acceptance, the plan, rank agreement); with `bench`, decode tok/s with
    drafting (eos ignored, `max_new_tokens`) and of the plain TP ranks in the same call, whose
    tokens must equal the drafted ones (`plain_tp_tokens_match`)."""
    prompt = [int(t) for t in prompt]
    lm, k = loaded_model.lm, int(settings.draft_tokens)
    context, max_new = int(settings.context_length), int(settings.max_new_tokens)
    buckets = tuple(sorted(int(b) for b in settings.prefill_buckets))
    if len(prompt) > buckets[-1]:
        raise PromptTooLongError(len(prompt), 0, buckets[-1], limit="largest compiled prefill bucket")
    if len(prompt) + max_new + k > context:  # a verify writes up to k positions past the last token
        raise PromptTooLongError(len(prompt), max_new + k, context)
    plan = make_plan(lm.config, int(settings.tp_degree), loaded_model.variant)
    dtype = next(lm.parameters()).dtype
    shards = list(iter_shards(lm, plan, include_buffers=True))
    job = DraftJob(
        lm.config,
        assistant.model.config,
        plan,
        shards,
        [assistant_shard(assistant.model, plan, r) for r in range(plan.tp)],
        HostEmbedder.from_text_model(lm.model, copy_tables=True),
        prompt,
        max_new,
        context,
        buckets,
        bool(settings.ring_kv),
        k,
        dict(assistant.read_layers),
        dtype,
        tuple(int(t) for t in eos_token_ids),
        bench_tokens=max_new if bench else None,
    )
    t0 = time.perf_counter()
    ranks = run_ranks(job, start_method=start_method, timeout_s=300.0)
    wall = time.perf_counter() - t0
    rank0 = ranks[0]
    emitted = rank0["emitted"]
    out: dict[str, Any] = {
        "tokens": rank0["tokens"],
        "step_logits": torch.from_numpy(rank0["step_logits"]),
        "compiler": RECIPE,
        "executed_as": CPU_EXECUTION,
        "compile_s": 0.0,
        "prefill_ms": rank0["prefill_s"] * 1000.0,
        "ranks_agree": all(r["tokens"] == rank0["tokens"] and r["accepted"] == rank0["accepted"] for r in ranks),
        "missing_keys": rank0["missing_keys"],
        "tp_plan": plan.describe(),
        "shard_shapes": shard_shapes(plan, shards),
        "kv_shapes_per_rank": rank0["kv_shapes"],
        "verify_steps": len(emitted),
        "accepted_per_step": sum(emitted) / len(emitted) if emitted else None,
        "drafts_accepted": rank0["accepted"],
        "tp_timings": {"ranks_wall_s": round(wall, 3), "rank0_build_s": round(rank0["build_s"], 3)},
        "world": {"backend": "gloo", "processes": plan.tp, "start_method": start_method, "threads_per_process": 1},
    }
    if bench:
        plain = run_tp_port(
            loaded_model,
            plan.tp,
            prompt,
            max_new,
            context,
            buckets[-1],
            check_reference=False,
            ring=bool(settings.ring_kv),
            start_method=start_method,
        )
        with_draft, without = rank0["bench_tok_s"], plain["timings"]["rank0_decode_tok_s"]
        out.update(
            decode_tok_s=with_draft,
            decode_tok_s_with_draft=with_draft,
            decode_tok_s_without_draft=without,
            speedup_with_draft=with_draft / without if with_draft and without else None,
            bench_accepted_per_step=rank0["bench_accepted"],
            bench_tokens=max_new,
            plain_tp_tokens_match=plain["tokens"] == rank0["bench_tokens"],
        )
    return out


__all__ = ["DraftJob", "run_tp_drafted"]
