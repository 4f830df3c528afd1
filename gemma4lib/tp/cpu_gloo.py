"""Run every rank of a tensor-parallel plan on CPU, with real collectives, and check the tokens.

One process per rank (`torch.multiprocessing`, fork by default: the children inherit the imported
modules, so a rank starts in well under a second; spawn works too), a gloo process group set up
through a file store in a private temporary folder (no ports), one thread per process. Each rank
does what a NeuronCore does in the ModelBuilder recipe:

1. build the rank graph skeleton from the config (meta device, shard-size layers), the same for
   every rank: the graph is "compiled once";
2. load *its own* shard (weights, buffers, the int32 rank tensor);
3. run prefill then the greedy decode loop over the modules a compiler would get (K/V as
   parameters shared by the prefill and decode graphs, updated through the aliased outputs:
   `recipes.common.KVParamModule` + `AliasEmulator`); row-parallel outputs are all-reduced and the
   lm_head logits all-gathered through gloo. MoE prefill is always all-experts-dense; decode takes
   `decode_experts` (`dense`, or `selective`: each rank gathers its share of the routed top-k).

Every rank also plays host for itself (embedding and PLE lookups, argmax): all ranks see the same
gathered logits, so they pick the same tokens; the result checks that they did. Tokens come back
from rank 0 and are compared with transformers' greedy `generate` on the unsharded model.
"""

from __future__ import annotations

import os
import queue as queue_mod
import tempfile
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..device.embedder import HostEmbedder
from ..device.experts import EXPERT_FORMS
from ..device.graph import DeviceGraph, GraphShape
from ..errors import BadPromptError, PromptTooLongError, TensorParallelError, UnknownNameError
from ..recipes.common import AliasEmulator, KVParamModule, greedy_generate
from .plan import TPPlan, make_plan
from .rank_graph import build_rank_graph, load_shard, with_shape
from .shard import iter_shards, shard_kv, shard_shapes

CPU_EXECUTION = "torch.distributed gloo on CPU, one process per rank"


@dataclass
class RankJob:
    """Everything a rank process needs (picklable for the spawn start method)."""

    config: Any
    plan: TPPlan
    shards: list[dict[str, torch.Tensor]]
    host: HostEmbedder
    prompt: list[int]
    max_new_tokens: int
    context_length: int
    prefill_len: int
    ring: bool = False
    baked_rank: bool = False
    dtype: torch.dtype = torch.float32
    decode_experts: str = "dense"  # the decode graph's expert form; prefill is always dense
    # CPU-seeded prefill (the E4B recipe): per-rank K/V slices and the last prompt token's logits
    seed_kv: list[list[torch.Tensor]] | None = None
    seed_logits: torch.Tensor | None = None
    eos_token_ids: tuple[int, ...] = ()
    keep_logits: bool = False  # rank 0 returns every generated token's logits (LOGITS_MATCH)
    # a batch (batch_runtime.generate_rows): B prompts through batched rank graphs (`prompt` unused)
    prompts: list[list[int]] | None = None
    batch: int = 1


def _run_rank(rank: int, job: RankJob) -> dict[str, Any]:
    from .layers import TorchDistCollectives

    t0 = time.perf_counter()
    coll = TorchDistCollectives()
    prefill = build_rank_graph(
        job.config,
        job.plan,
        GraphShape(job.batch, job.prefill_len, job.context_length, job.ring),
        collectives=coll,
        dtype=job.dtype,
        baked_rank=job.baked_rank,
    )
    missing = load_shard(prefill, job.shards[rank])
    decode = with_shape(prefill, GraphShape(job.batch, 1, job.context_length, job.ring), expert_form=job.decode_experts)
    build_s = time.perf_counter() - t0

    # the modules a compiler would get: K/V as parameters shared by prefill and decode, updated
    # through the aliased outputs (emulated here)
    prefill_module = KVParamModule(prefill)
    decode_module = prefill_module.sharing(decode)
    if job.prompts is not None:
        return _run_rank_rows(rank, job, prefill_module, decode_module, missing, build_s)
    if job.seed_kv is not None:  # prefill happened on the host; this rank gets its K/V slice
        with torch.no_grad():
            for param, value in zip(prefill_module.kv, job.seed_kv[rank], strict=True):
                param.copy_(value)
        run = greedy_generate(
            AliasEmulator(decode_module),
            job.host,
            job.prompt,
            job.max_new_tokens,
            seeded_logits=job.seed_logits,
            eos_token_ids=job.eos_token_ids,
            keep_logits=job.keep_logits,
            dtype=job.dtype,
        )
    else:
        run = greedy_generate(
            AliasEmulator(decode_module),
            job.host,
            job.prompt,
            job.max_new_tokens,
            prefill=AliasEmulator(prefill_module),
            prefill_len=job.prefill_len,
            eos_token_ids=job.eos_token_ids,
            keep_logits=job.keep_logits,
            dtype=job.dtype,
        )
    tokens, kv = run["tokens"], list(prefill_module.kv)
    prefill_s, decode_s, prefill_logits = run["prefill_s"], run["decode_s"], run["prefill_logits"]
    result = {
        "rank": rank,
        "tokens": tokens,
        "missing_keys": missing,
        "kv_shapes": [list(t.shape) for t in kv],
        "prefill_mode": run["prefill_mode"],
        "build_s": build_s,
        "prefill_s": prefill_s,
        "decode_s": decode_s,
    }
    if rank == 0:  # by value: torch's queue pickler would share the storage through a file
        result["prefill_logits"] = prefill_logits.float().numpy().copy()  # descriptor the exiting child closes
        if "step_logits" in run:
            result["step_logits"] = run["step_logits"].float().numpy().copy()
    return result


def _run_rank_rows(
    rank: int, job: RankJob, prefill_module: KVParamModule, decode_module: KVParamModule, missing, build_s: float
) -> dict[str, Any]:
    """A rank's batched generation: every row through the batched rank graphs (`generate_rows`)."""
    from ..serving.batch_runtime import generate_rows

    run = generate_rows(
        AliasEmulator(prefill_module),
        AliasEmulator(decode_module),
        job.host.inputs,
        job.prompts,
        job.max_new_tokens,
        batch=job.batch,
        bucket=job.prefill_len,
        eos_token_ids=job.eos_token_ids,
        keep_logits=job.keep_logits and rank == 0,
    )
    result = {
        "rank": rank,
        "rows_tokens": [row.tokens for row in run.rows],
        "missing_keys": missing,
        "kv_shapes": [list(t.shape) for t in prefill_module.kv],
        "build_s": build_s,
        "prefill_s": run.prefill_s,
        "decode_s": sum(run.step_s),
        "decode_tokens": sum(run.step_tokens),
    }
    if rank == 0 and job.keep_logits:  # by value (see _run_rank)
        result["rows_logits"] = [row.step_logits.float().numpy().copy() for row in run.rows]
    return result


def _worker(rank: int, world: int, init_file: str, job: RankJob, results) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)  # 8 ranks on 2 cores: one thread each, or they thrash
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        run_rank = getattr(job, "run_rank", None)  # another job kind runs its own rank (tp.draft_gloo)
        results.put((rank, "ok", run_rank(rank) if run_rank else _run_rank(rank, job)))
    except BaseException:  # report, never hang the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(job: RankJob, *, start_method: str = "fork", timeout_s: float = 300.0) -> list[dict[str, Any]]:
    """Run all `job.plan.tp` ranks as processes joined by gloo; return their results, rank order."""
    import torch.multiprocessing as mp

    world = job.plan.tp
    ctx = mp.get_context(start_method)
    saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")  # inherited by spawned children
    try:
        with tempfile.TemporaryDirectory(prefix="gemma4lib-gloo-") as folder:
            init_file = os.path.join(folder, "store")
            results = ctx.Queue()
            procs = [
                ctx.Process(target=_worker, args=(r, world, init_file, job, results), daemon=True) for r in range(world)
            ]
            for p in procs:
                p.start()
            collected: dict[int, dict[str, Any]] = {}
            errors: list[str] = []
            deadline = time.monotonic() + timeout_s
            try:
                while len(collected) + len(errors) < world:
                    remaining = deadline - time.monotonic()
                    try:
                        rank, status, payload = results.get(timeout=min(1.0, max(remaining, 0.05)))
                    except queue_mod.Empty:
                        dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                        if dead:
                            errors.append(
                                f"rank processes {dead} exited without a result (exit codes "
                                f"{[p.exitcode for p in procs]}); with start_method='spawn' the "
                                f"calling script needs an `if __name__ == '__main__':` guard"
                            )
                            break
                        if remaining <= 0:
                            errors.append(f"ranks timed out after {timeout_s:.0f}s")
                            break
                        continue
                    if status == "ok":
                        collected[rank] = payload
                    else:
                        errors.append(f"rank {rank}:\n{payload}")
                        break  # the others are blocked in a collective: stop them
            finally:
                for p in procs:
                    p.join(timeout=5 if not errors else 0.5)
                for p in procs:  # only the processes started here
                    if p.is_alive():
                        p.terminate()
                        p.join(timeout=5)
            if errors:
                raise RuntimeError("CPU tensor-parallel run failed: " + "\n".join(errors))
            return [collected[r] for r in range(world)]
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def host_prefill(
    loaded: Any, plan: TPPlan, prompt: Sequence[int], context_length: int, prefill_len: int, ring: bool = False
) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
    """Prefill with the unsharded model on the host (CPU); return the last prompt token's logits
    and each rank's slice of the K/V buffers (the E4B recipe's CPU-seeded prefill)."""
    prompt = [int(t) for t in prompt]
    graph = DeviceGraph(
        loaded.text_model, loaded.lm_head, loaded.layout, GraphShape(1, prefill_len, context_length, ring), inplace=True
    )
    host = HostEmbedder.from_text_model(loaded.text_model)
    kv = graph.new_kv()
    with torch.no_grad():
        logits = graph(
            *host.inputs(torch.tensor([prompt]), prefill_len), torch.tensor([0]), torch.tensor([len(prompt)]), *kv
        )
    return logits[0], [shard_kv(kv, plan, r) for r in range(plan.tp)]


def _as_list(prompt_ids: Any) -> list[int]:
    if isinstance(prompt_ids, torch.Tensor):
        return [int(x) for x in prompt_ids.reshape(-1).tolist()]
    return [int(x) for x in prompt_ids]


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def reference_run(lm: nn.Module, prompt: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens (eos off) and the softcapped logits of the last prompt token."""
    ids = torch.tensor([prompt], dtype=torch.long)
    with torch.no_grad():
        out = lm.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        logits = lm(ids).logits[0, -1].float()
    return out[0, len(prompt) :].tolist(), logits


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    return logits if not cap else cap * torch.tanh(logits / cap)


def run_tp_port(
    loaded_model: Any,
    tp: Any,
    prompt_ids: Any,
    max_new_tokens: Any = None,
    context_length: int | None = None,
    prefill_len: int | None = None,
    *,
    baked_rank: bool = False,
    include_buffers: bool = True,
    check_reference: bool = True,
    reference_tokens: Sequence[int] | None = None,
    eos_token_ids: Sequence[int] = (),
    start_method: str = "fork",
    ring: bool = False,
    prefill: str = "graph",
    decode_experts: str = "dense",
    timeout_s: float = 300.0,
    expert_split: str | None = None,
) -> dict[str, Any]:
    """Shard `loaded_model` for `tp` ranks, run them on CPU with gloo, compare with the reference.

    `loaded_model` is a `loading.LoadedModel`. Returns a JSON-friendly dict: `tokens` (rank 0),
    `seq_match` against transformers' greedy generate, `prefill_logit_max_diff` (softcapped, vs the
    reference's last-prompt-token logits), `ranks_agree`, the plan, per-rank `shard_shapes`, the
    recipe this stands in for, timings. `baked_rank` / `include_buffers=False` run the two faults
    the field report (README) met (rank read at trace time; buffers missing from the shards).
    `prefill="cpu-seeded"` runs the E4B recipe's flow: the unsharded model prefills on the host and
    each rank starts decoding from its slice of those K/V buffers (`prefill="graph"`: the rank
    graphs prefill). `decode_experts="selective"` makes the decode graph gather the routed top-k
    experts from each rank's shard instead of running all its experts (MoE only; prefill stays
    dense). `expert_split` ("intermediate" | "experts"; MoE only): how the ranks share the
    experts; None takes the plan's default (the intermediate split where it divides), except with
    `baked_rank`, whose bug only the expert split can have (the intermediate split reads no rank).

    Also callable as `run_tp_port(loaded_model, port_settings, prompt_ids, eos_ids)` (the port
    pipeline's form): shapes come from the settings and the result is the pipeline's `device_run`
    record (the pipeline runs the reference and the checks itself).
    """
    if not isinstance(tp, int):
        return _run_for_settings(loaded_model, tp, prompt_ids, max_new_tokens or (), baked_rank=baked_rank)
    result, _ = _run_tp(
        loaded_model,
        tp,
        prompt_ids,
        max_new_tokens,
        context_length,
        prefill_len,
        baked_rank=baked_rank,
        include_buffers=include_buffers,
        check_reference=check_reference,
        reference_tokens=reference_tokens,
        eos_token_ids=eos_token_ids,
        start_method=start_method,
        ring=ring,
        prefill=prefill,
        decode_experts=decode_experts,
        timeout_s=timeout_s,
        expert_split=expert_split,
    )
    return result


def _run_tp(
    loaded_model: Any,
    tp: int,
    prompt_ids: Any,
    max_new_tokens: int,
    context_length: int,
    prefill_len: int,
    *,
    baked_rank: bool,
    include_buffers: bool,
    check_reference: bool,
    reference_tokens: Sequence[int] | None,
    eos_token_ids: Sequence[int],
    start_method: str,
    ring: bool,
    prefill: str,
    timeout_s: float,
    decode_experts: str = "dense",
    keep_logits: bool = False,
    expert_split: str | None = None,
) -> tuple[dict[str, Any], torch.Tensor]:
    variant = loaded_model.variant
    lm = loaded_model.lm
    config = lm.config
    prompt = _as_list(prompt_ids)
    if len(prompt) > prefill_len:
        raise BadPromptError(
            f"the prompt has {len(prompt)} tokens but the prefill bucket holds {prefill_len}; "
            f"raise prefill_len (<= context_length) or shorten the prompt"
        )
    if len(prompt) + max_new_tokens - 1 > context_length:  # the last new token is never fed back
        raise PromptTooLongError(len(prompt), max_new_tokens, context_length)
    if tp < 2:
        raise TensorParallelError(
            f"run_tp_port shards over ranks: TP must be >= 2, got {tp} (TP=1 runs one device: no ranks to shard over)"
        )
    if decode_experts not in EXPERT_FORMS:
        raise UnknownNameError("decode_experts form", decode_experts, EXPERT_FORMS)
    if baked_rank and expert_split is None:
        expert_split = "experts"  # the form the field report's bug lives in
    plan = make_plan(config, tp, variant, expert_split=expert_split)
    if baked_rank and plan.expert_split == "intermediate":
        raise TensorParallelError(
            "baked_rank: the intermediate split never reads the rank, so there is no "
            "rank to bake in; the field report's bug needs expert_split='experts'"
        )
    dtype = next(lm.parameters()).dtype

    t0 = time.perf_counter()
    shards = list(iter_shards(lm, plan, include_buffers=include_buffers))
    shapes = shard_shapes(plan, shards)
    shard_s = time.perf_counter() - t0

    host = HostEmbedder.from_text_model(lm.model, copy_tables=True)
    job = RankJob(
        config,
        plan,
        shards,
        host,
        prompt,
        max_new_tokens,
        context_length,
        prefill_len,
        ring,
        baked_rank,
        dtype,
        decode_experts=decode_experts,
        eos_token_ids=tuple(int(t) for t in eos_token_ids),
        keep_logits=keep_logits,
    )
    if prefill == "cpu-seeded":
        job.seed_logits, job.seed_kv = host_prefill(loaded_model, plan, prompt, context_length, prefill_len, ring)
    elif prefill != "graph":
        raise UnknownNameError("prefill", prefill, ("graph", "cpu-seeded"))
    t1 = time.perf_counter()
    ranks = run_ranks(job, start_method=start_method, timeout_s=timeout_s)
    ranks[0]["prefill_logits"] = torch.from_numpy(ranks[0]["prefill_logits"])
    if "step_logits" in ranks[0]:
        ranks[0]["step_logits"] = torch.from_numpy(ranks[0]["step_logits"])
    ranks_s = time.perf_counter() - t1
    tokens = ranks[0]["tokens"]

    result: dict[str, Any] = {
        "variant": variant.name,
        "tp": tp,
        "inf2_recipe": variant.recipe,
        "executed_as": CPU_EXECUTION,
        "prefill": prefill,
        "tokens": tokens,
        "ranks_agree": all(r["tokens"] == tokens for r in ranks),
        "missing_keys": ranks[0]["missing_keys"],
        "baked_rank": baked_rank,
        "decode_experts": decode_experts,
        "expert_split": plan.expert_split,
        "plan": plan.describe(),
        "shard_shapes": shapes,
        "kv_shapes_per_rank": ranks[0]["kv_shapes"],
        "timings": {
            "shard_s": round(shard_s, 3),
            "ranks_wall_s": round(ranks_s, 3),
            "rank0_build_s": round(ranks[0]["build_s"], 3),
            "rank0_prefill_s": round(ranks[0]["prefill_s"], 3),
            "rank0_decode_s": round(ranks[0]["decode_s"], 3),
            "rank0_decode_tok_s": round((len(tokens) - 1) / max(ranks[0]["decode_s"], 1e-9), 2),
        },
        "world": {"backend": "gloo", "processes": tp, "start_method": start_method, "threads_per_process": 1},
    }
    reference_logits = None
    if reference_tokens is None and check_reference:
        t2 = time.perf_counter()
        reference_tokens, reference_logits = reference_run(lm, prompt, max_new_tokens)
        result["timings"]["reference_s"] = round(time.perf_counter() - t2, 3)
    if reference_tokens is not None:
        reference_tokens = [int(t) for t in reference_tokens]
        result["reference_tokens"] = reference_tokens
        result["seq_match"] = tokens == reference_tokens
        result["first_divergence"] = first_divergence(tokens, reference_tokens)
    if reference_logits is not None:
        cap = getattr(config, "final_logit_softcapping", None)
        diff = (softcap(ranks[0]["prefill_logits"].float(), cap) - reference_logits).abs().max()
        result["prefill_logit_max_diff"] = float(diff)
    if keep_logits:
        result["step_logits"] = ranks[0].get("step_logits")
    return result, ranks[0]["prefill_logits"]


RECIPE = "cpu-gloo-tp"


def _run_for_settings(
    loaded_model: Any, settings: Any, prompt_ids: Any, eos_token_ids: Sequence[int], baked_rank: bool = False
) -> dict[str, Any]:
    """`port.port()`'s TP branch: run the plan with the settings' shapes; return a `device_run`
    dict (with `step_logits` for LOGITS_MATCH; `baked_rank`: the fault lab's rank fault)."""
    prompt = _as_list(prompt_ids)
    buckets = sorted(int(b) for b in settings.prefill_buckets)
    bucket = next((b for b in buckets if b >= len(prompt)), None)
    if bucket is None:
        raise PromptTooLongError(len(prompt), 0, buckets[-1], limit="largest compiled prefill bucket")
    out, prefill_logits = _run_tp(
        loaded_model,
        int(settings.tp_degree),
        prompt,
        int(settings.max_new_tokens),
        int(settings.context_length),
        bucket,
        baked_rank=baked_rank,
        include_buffers=True,
        check_reference=False,
        reference_tokens=None,
        eos_token_ids=eos_token_ids,
        start_method="fork",
        ring=bool(settings.ring_kv),
        prefill="graph",
        timeout_s=300.0,
        decode_experts=getattr(settings, "decode_experts", "dense"),
        keep_logits=True,
    )
    from ..reference import reference_last_logits

    cap = getattr(loaded_model.config, "final_logit_softcapping", None)
    reference = reference_last_logits(loaded_model.lm, prompt)
    timings = out["timings"]
    return {
        "tokens": out["tokens"],
        "step_logits": out.get("step_logits"),
        "compiler": RECIPE,
        "executed_as": out["executed_as"],
        "compile_s": 0.0,
        "prefill_ms": timings["rank0_prefill_s"] * 1000.0,
        "decode_tok_s": timings["rank0_decode_tok_s"],
        "prefill_logits_max_abs_diff": float((softcap(prefill_logits.float(), cap) - reference).abs().max()),
        "ranks_agree": out["ranks_agree"],
        "missing_keys": out["missing_keys"],
        "tp_plan": out["plan"],
        "shard_shapes": out["shard_shapes"],
        "kv_shapes_per_rank": out["kv_shapes_per_rank"],
        "tp_timings": timings,
        "world": out["world"],
        "prefill_bucket": bucket,
    }


def run_tp_batch(
    loaded_model: Any, settings: Any, prompts: Sequence[Sequence[int]], eos_token_ids: Sequence[int]
) -> dict[str, Any]:
    """`batch_port`'s TP branch: B prompts through the batched rank graphs on gloo ranks; the
    device run with `rows` (tokens and per-step logits of each row, from rank 0)."""
    from ..serving.batch_runtime import check_rows, pick_bucket

    rows = [_as_list(p) for p in prompts]
    batch, context, max_new = int(settings.batch_size), int(settings.context_length), int(settings.max_new_tokens)
    check_rows(rows, batch)
    for ids in rows:
        if len(ids) + max_new - 1 > context:
            raise PromptTooLongError(len(ids), max_new, context)
    bucket = pick_bucket(settings.prefill_buckets, rows)
    lm = loaded_model.lm
    tp = int(settings.tp_degree)
    plan = make_plan(lm.config, tp, loaded_model.variant)
    shards = list(iter_shards(lm, plan, include_buffers=True))
    job = RankJob(
        lm.config,
        plan,
        shards,
        HostEmbedder.from_text_model(lm.model, copy_tables=True),
        rows[0],
        max_new,
        context,
        bucket,
        bool(settings.ring_kv),
        False,
        next(lm.parameters()).dtype,
        decode_experts=getattr(settings, "decode_experts", "dense"),
        eos_token_ids=tuple(int(t) for t in eos_token_ids),
        keep_logits=True,
        prompts=rows,
        batch=batch,
    )
    t0 = time.perf_counter()
    ranks = run_ranks(job, start_method="fork", timeout_s=300.0)
    wall = time.perf_counter() - t0
    rank0 = ranks[0]
    tok_s = rank0["decode_tokens"] / max(rank0["decode_s"], 1e-9)
    return {
        "rows": [
            {"tokens": tokens, "step_logits": torch.from_numpy(logits)}
            for tokens, logits in zip(rank0["rows_tokens"], rank0["rows_logits"], strict=True)
        ],
        "compiler": RECIPE,
        "executed_as": CPU_EXECUTION,
        "compile_s": 0.0,
        "prefill_ms": rank0["prefill_s"] * 1000.0,
        "decode_tok_s": tok_s,
        "decode_tok_s_per_row": tok_s / len(rows),
        "ranks_agree": all(r["rows_tokens"] == rank0["rows_tokens"] for r in ranks),
        "missing_keys": rank0["missing_keys"],
        "tp_plan": plan.describe(),
        "shard_shapes": shard_shapes(plan, shards),
        "kv_shapes_per_rank": rank0["kv_shapes"],
        "tp_timings": {"ranks_wall_s": round(wall, 3), "rank0_decode_s": round(rank0["decode_s"], 3)},
        "world": {"backend": "gloo", "processes": tp, "start_method": "fork", "threads_per_process": 1},
        "prefill_bucket": bucket,
    }
