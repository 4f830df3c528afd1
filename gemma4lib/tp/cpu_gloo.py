"""Run every rank of a tensor-parallel plan on CPU, with real collectives: the backend `gloo`.

One process per rank (`torch.multiprocessing`, fork by default: the children inherit the imported
modules, so a rank starts in well under a second; spawn works too), a gloo process group set up
through a file store in a private temporary folder (no ports), one thread per process. Each rank
does what a NeuronCore does in the ModelBuilder recipe:

1. build its rank graphs from the config (meta device, shard-size layers), the same for every rank:
   prefill per bucket and decode (`rank_graph`), or with a drafter the verify of k + 1 tokens (and
   the assistant's draft step: `draft_rank_graph`); the graphs are "compiled once";
2. load *its own* shard (weights, buffers, the int32 rank tensor);
3. run the one generation engine (`runtime.Engine`) over those graphs, wrapped as steps over K/V
   held as parameters and written back through the aliased outputs, as on the device
   (`recipes.common.KVParamModule` + `AliasEmulator`, `draft_rank_graph.KVDraftStep`).
   Row-parallel outputs are all-reduced and the lm_head logits all-gathered through gloo.

Every rank plays host for itself (embeddings, token choice, drafts): all ranks see the same gathered
logits, so they pick the same tokens; `ranks_agree` checks that they did. Rank 0 sends its rows back.

Images: the vision graph (`device.vision.VisionGraph`, built by `device.build.image_graph`) is not
sharded. Every rank holds it whole and runs it at admission, as the engine does at TP 1, so every
rank writes the same soft tokens into its host embeddings; the sharded text graphs never see the
image (docs/IMAGES.md, "Images under tensor parallelism").
"""

from __future__ import annotations

import os
import queue as queue_mod
import tempfile
import time
import traceback
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from ..device.build import image_graph
from ..device.drafting import RoomyLayout
from ..device.embedder import HostEmbedder
from ..device.graph import DeviceGraph, GraphShape, index_tensor
from ..errors import BatchTooLargeError, SettingsError, TensorParallelError, UnknownNameError
from ..generation.drafters import make_drafter
from ..recipes.common import AliasEmulator, KVParamModule
from ..reference import reference_for, reference_last_logits
from ..runtime import Engine, Request, RowResult, Steps, softcap
from ..timing import bench_drafted, benchmark
from .plan import TPPlan, make_plan
from .rank_graph import build_rank_graph, load_shard, with_shape
from .shard import iter_shards, shard_kv, shard_shapes

if TYPE_CHECKING:
    from ..models.loading import LoadedModel
    from ..settings import PortSettings

CPU_EXECUTION = "torch.distributed gloo on CPU, one process per rank"
COMPILER = "cpu-gloo-tp"
PREFILLS = ("graph", "cpu-seeded")


@dataclass
class RankJob:
    """Everything a rank process needs (picklable for the spawn start method)."""

    config: Any
    plan: TPPlan
    shards: list[dict[str, torch.Tensor]]
    host: HostEmbedder
    requests: list[Request]
    batch: int
    context_length: int
    buckets: tuple[int, ...]
    ring: bool
    dtype: torch.dtype
    decode_experts: str = "dense"  # the decode graph's expert form; prefill (and a verify) stay dense
    baked_rank: bool = False  # the field report's fault: the rank read at trace time
    draft: str | None = None  # a `generation.drafters.DRAFTERS` name
    draft_tokens: int = 0
    assistant_config: Any = None
    assistant_shards: list[dict[str, torch.Tensor]] | None = None
    read_layers: dict[str, int] | None = None
    # CPU-seeded prefill (the E4B recipe): the host's logits [B, vocab] and each rank's K/V slices
    seed: tuple[torch.Tensor, list[list[torch.Tensor]]] | None = None
    bench: tuple[int, int] | None = None  # (warmup, iters): also time generations, eos ignored
    pad_id: int = 0  # the id an image's positions take for the host tables (`Engine.prompt_embeds`)
    vision: Any = None  # the unsharded vision graph every rank runs (requests with images), or None


def job_engine(job: RankJob, steps: Steps, drafting: bool = True) -> Engine:
    """The engine every rank runs (and the parent checks requests with before any rank starts)."""
    drafter = make_drafter(job.draft) if drafting else None
    return Engine(
        job.host,
        steps,
        batch=job.batch,
        context_length=job.context_length,
        vocab_size=int(job.config.vocab_size),
        cap=getattr(job.config, "final_logit_softcapping", None),
        dtype=job.dtype,
        draft_tokens=job.draft_tokens if drafter else 0,
        drafter=drafter,
        pad_id=job.pad_id,
    )


class SeededPrefill:
    """The E4B recipe's prefill as a step: the unsharded model prefilled on the host (`host_prefill`);
    the step writes this rank's slice of those K/V into its K/V parameters and returns the host's
    logits, so the engine's loop is the same as with a prefill graph."""

    def __init__(self, kv: list[torch.Tensor], seeded_kv: list[torch.Tensor], logits: torch.Tensor, lengths: list[int]):
        self.kv, self.seeded_kv, self.logits, self.lengths = kv, seeded_kv, logits, lengths

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        asked = inputs[-1].tolist()
        if any(n and n != seeded for n, seeded in zip(asked, self.lengths, strict=True)):
            raise SettingsError(
                f"prefill='cpu-seeded' holds the host's K/V of prompts of {self.lengths} tokens, not {asked}: "
                f"seed the prompts this run generates, or use prefill='graph'"
            )
        with torch.no_grad():
            for param, value in zip(self.kv, self.seeded_kv, strict=True):
                param.copy_(value)
        return self.logits


def rank_steps(rank: int, job: RankJob) -> tuple[Steps, Any, list[str], list[list[int]]]:
    """This rank's steps over one set of K/V parameters; a plain decode step over the same weights
    and K/V (the drafted benchmark's baseline); the keys its shard lacked; its K/V shapes."""
    from .draft_rank_graph import KVDraftStep, build_drafting_modules, draft_key_shapes
    from .layers import TorchDistCollectives
    from .rank_graph import CpuParallelFactory

    factory = CpuParallelFactory(job.plan.tp, TorchDistCollectives(), job.dtype)
    b, ctx, ring, k = job.batch, job.context_length, job.ring, job.draft_tokens

    def shape(tokens: int) -> GraphShape:
        return GraphShape(b, tokens, ctx, ring)

    if job.draft == "assistant":  # the target returns hidden states; the assistant reads its K/V
        modules = build_drafting_modules(
            job.config,
            job.assistant_config,
            job.plan,
            job.read_layers,
            draft_key_shapes(ctx, job.buckets, k, ring, batch=b),
            k,
            factory=factory,
            dtype=job.dtype,
            baked_rank=job.baked_rank,
        )
        checkpoint = {"target." + key: v for key, v in job.shards[rank].items()}
        checkpoint.update({"assistant." + key: v for key, v in job.assistant_shards[rank].items()})
        missing, unexpected = modules["draft"].load_state_dict(checkpoint, strict=False)
        if unexpected:
            raise KeyError(f"shard keys the drafting modules do not have: {sorted(unexpected)[:8]}")
        draft = modules["draft"]
        decode = draft.sharing(with_shape(draft.target, shape(1), job.decode_experts), "prefill")
        steps = Steps(
            {int(n[len("prefill") :]): KVDraftStep(m) for n, m in modules.items() if n.startswith("prefill")},
            verify=KVDraftStep(modules["verify"]),
            draft=KVDraftStep(draft),
        )
        missing = sorted(key for key in missing if not key.startswith("kv."))
        return steps, KVDraftStep(decode), missing, [list(t.shape) for t in draft.kv]
    base = build_rank_graph(
        job.config, job.plan, shape(max(job.buckets)), factory=factory, dtype=job.dtype, baked_rank=job.baked_rank
    )
    if job.draft:  # rings with room for the k + 1 positions a verify writes (`device.drafting`)
        base.layout = RoomyLayout.around(base.layout, k + 1)
    missing = load_shard(base, job.shards[rank])
    kv = KVParamModule(base)

    def step(graph: DeviceGraph) -> AliasEmulator:
        return AliasEmulator(kv.sharing(graph))

    if job.seed is None:
        prefill = {bucket: step(with_shape(base, shape(bucket))) for bucket in job.buckets}
    else:
        logits, per_rank = job.seed
        lengths = [len(r.prompt_ids) for r in job.requests] + [0] * (b - len(job.requests))
        prefill = {max(job.buckets): SeededPrefill(list(kv.kv), per_rank[rank], logits, lengths)}
    decode = step(with_shape(base, shape(1), job.decode_experts))
    shapes = [list(t.shape) for t in kv.kv]
    if not job.draft:
        return Steps(prefill, decode=decode), None, missing, shapes
    verify = with_shape(base, shape(k + 1))
    verify.every_position = True
    return Steps(prefill, verify=step(verify)), decode, missing, shapes


def _by_value(row: RowResult) -> RowResult:
    """Tensors as numpy copies: torch's queue pickler would share their storage through a file
    descriptor the exiting child closes."""
    step_logits = None if row.step_logits is None else row.step_logits.numpy().copy()
    return replace(row, first_logits=row.first_logits.numpy().copy(), step_logits=step_logits)


def _run_rank(rank: int, job: RankJob) -> dict[str, Any]:
    t0 = time.perf_counter()
    steps, plain_decode, missing, kv_shapes = rank_steps(rank, job)
    steps.vision = job.vision  # replicated: every rank runs the whole vision graph (module docstring)
    engine = job_engine(job, steps)
    build_s = time.perf_counter() - t0
    generation = engine.generate_rows(job.requests, keep_logits=rank == 0)
    result: dict[str, Any] = {
        "agree": [(row.tokens, row.accepted) for row in generation.rows],
        "missing_keys": missing,
        "kv_shapes": kv_shapes,
        "build_s": build_s,
        "prefill_s": generation.prefill_s,
        "decode_tok_s": generation.decode_tok_s,
        "decode_tok_s_per_row": generation.decode_tok_s_per_row,
    }
    if job.bench:
        warmup, iters = job.bench
        timed = [replace(r, eos_token_ids=()) for r in job.requests]  # eos ignored: every run decodes alike
        if engine.drafter is None:
            result["bench"] = benchmark(engine, timed, warmup, iters)
        else:
            plain = job_engine(job, Steps(steps.prefill, decode=plain_decode), drafting=False)
            result["drafted_bench"] = bench_drafted(engine, plain, timed, warmup, iters)
    if rank == 0:
        result["rows"] = [_by_value(row) for row in generation.rows]
    return result


def _worker(rank: int, world: int, init_file: str, job: RankJob, results) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)  # 8 ranks on 2 cores: one thread each, or they thrash
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        results.put((rank, "ok", _run_rank(rank, job)))
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


@torch.no_grad()
def host_prefill(
    model: LoadedModel, plan: TPPlan, requests: list[Request], shape: GraphShape, dtype: torch.dtype
) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
    """Prefill every request (row i) with the unsharded model on the host; return each row's last
    prompt token's logits `[B, vocab]` and each rank's slice of the K/V (the E4B recipe's flow)."""
    graph = DeviceGraph(model.text_model, model.lm_head, model.layout, shape, inplace=True)
    ids = torch.zeros(shape.batch, shape.tokens, dtype=torch.long)
    lengths = [0] * shape.batch
    for row, request in enumerate(requests):
        lengths[row] = len(request.prompt_ids)
        ids[row, : lengths[row]] = torch.as_tensor(list(request.prompt_ids))
    kv = graph.new_kv()
    inputs = HostEmbedder.from_text_model(model.text_model).inputs(ids, dtype=dtype)
    logits = graph(*inputs, index_tensor([0] * shape.batch), index_tensor(lengths), *kv)
    return logits, [shard_kv(kv, plan, r) for r in range(plan.tp)]


def _in_ranks(*_: Any) -> None:
    raise AssertionError("the rank processes run the graphs; the parent's engine only checks requests")


def run_tp(
    model: LoadedModel,
    settings: PortSettings,
    requests: list[Request],
    *,
    bench: bool = True,
    baked_rank: bool = False,
    include_buffers: bool = True,
    prefill: str = "graph",
    expert_split: str | None = None,
    start_method: str = "fork",
    timeout_s: float = 300.0,
) -> dict[str, Any]:
    """Every request (row i) over `settings.tp_degree` gloo ranks; the `backends.base.DeviceRun`
    fields (`backends.gloo.run` builds it: this package sits below the backends).

    Rows from rank 0 (tokens, first and per-step logits, acceptance); `details`: rank agreement,
    the plan, per-rank shard and K/V shapes, timings. `bench`: the settings' warmup and iters of
    generations with eos ignored (with a drafter: with and without drafting, taking turns).
    The field report's faults: `baked_rank` (the MoE reads the rank at trace time; it needs
    `expert_split="experts"`, the default then) and `include_buffers=False` (buffers missing from
    the shards). `prefill="cpu-seeded"`: the E4B recipe's flow, the unsharded model prefills on
    the host and each rank starts from its slice of those K/V. `expert_split` ("intermediate" |
    "experts", MoE only): how the ranks share the experts (None: the plan's default).
    """
    tp, k = int(settings.tp_degree), int(settings.draft_tokens or 0) if settings.draft else 0
    if tp < 2:
        raise TensorParallelError(f"the gloo ranks shard over TP >= 2, got {tp}; TP=1 runs on one device (cpu, eager)")
    if prefill not in PREFILLS:
        raise UnknownNameError("prefill", prefill, PREFILLS)
    if settings.draft and any(not r.sampling.greedy for r in requests):
        raise SettingsError(
            "the gloo TP ranks draft greedy rows only; sampled drafting (rejection sampling) runs at tp_degree 1 on "
            "backend 'cpu' or 'eager': set tp_degree=1, temperature 0, or draft=None"
        )
    if settings.draft and prefill != "graph":
        raise SettingsError("prefill='cpu-seeded' seeds plain decode; draft with prefill='graph' (or draft=None)")
    images = [r.images for r in requests if r.images is not None]
    if images and prefill != "graph":
        raise SettingsError(
            "prefill='cpu-seeded' prefills token ids on the host, without an image's soft tokens; "
            "run image requests with prefill='graph'"
        )
    lm = model.lm
    if baked_rank and expert_split is None:
        expert_split = "experts"  # the form the field report's bug lives in
    plan = make_plan(lm.config, tp, model.variant, expert_split=expert_split)
    if baked_rank and plan.expert_split == "intermediate":
        raise TensorParallelError(
            "baked_rank: the intermediate split never reads the rank, so there is no rank to bake in; the field "
            "report's bug needs expert_split='experts'"
        )
    t0 = time.perf_counter()
    shards = list(iter_shards(lm, plan, include_buffers=include_buffers))
    shard_s = time.perf_counter() - t0
    job = RankJob(
        lm.config,
        plan,
        shards,
        HostEmbedder.from_text_model(lm.model, copy_tables=True),
        list(requests),
        int(settings.batch_size),
        int(settings.context_length),
        tuple(settings.prefill_buckets),
        bool(settings.ring_kv),
        next(lm.parameters()).dtype,
        settings.decode_experts,
        baked_rank,
        settings.draft,
        k,
        bench=(int(settings.warmup), int(settings.iters)) if bench else None,
        pad_id=int(getattr(lm.config, "pad_token_id", 0) or 0),
        vision=image_graph(model, settings) if images else None,
    )
    unrun = dict.fromkeys(job.buckets, _in_ranks)
    checker = job_engine(
        job,
        Steps(
            unrun,
            decode=None if k else _in_ranks,
            verify=_in_ranks if k else None,
            vision=_in_ranks if job.vision is not None else None,
        ),
    )
    if len(requests) > job.batch:
        raise BatchTooLargeError(
            f"{len(requests)} requests for batch_size {job.batch}: send at most {job.batch} or raise batch_size"
        )
    bucket = max(checker.check(r) for r in requests)
    assistant = None
    if settings.draft == "assistant":
        from ..models.assistant import load_assistant
        from .draft_rank_graph import assistant_shard

        assistant = load_assistant(model, settings)
        job.assistant_config, job.read_layers = assistant.model.config, dict(assistant.read_layers)
        job.assistant_shards = [assistant_shard(assistant.model, plan, r) for r in range(tp)]
    host_s = None
    if prefill == "cpu-seeded":
        t1 = time.perf_counter()
        job.buckets = (bucket,)
        shape = GraphShape(job.batch, bucket, job.context_length, job.ring)
        job.seed = host_prefill(model, plan, job.requests, shape, job.dtype)
        host_s = time.perf_counter() - t1
    t2 = time.perf_counter()
    ranks = run_ranks(job, start_method=start_method, timeout_s=timeout_s)
    wall = time.perf_counter() - t2
    rank0 = ranks[0]
    rows = [
        replace(
            r,
            first_logits=torch.from_numpy(r.first_logits),
            step_logits=None if r.step_logits is None else torch.from_numpy(r.step_logits),
        )
        for r in rank0["rows"]
    ]
    cap = getattr(lm.config, "final_logit_softcapping", None)
    first = softcap(rows[0].first_logits.float(), cap)
    details: dict[str, Any] = {
        "executed_as": CPU_EXECUTION,
        "prefill": prefill,
        "prefill_bucket": bucket,
        "ranks_agree": all(r["agree"] == rank0["agree"] for r in ranks),
        "missing_keys": rank0["missing_keys"],
        "baked_rank": baked_rank,
        "expert_split": plan.expert_split,
        "decode_experts": settings.decode_experts,
        "tp_plan": plan.describe(),
        "shard_shapes": shard_shapes(plan, shards),
        "kv_shapes_per_rank": rank0["kv_shapes"],
        "tp_timings": {
            "shard_s": round(shard_s, 3),
            **({"host_prefill_s": round(host_s, 3)} if host_s is not None else {}),
            "ranks_wall_s": round(wall, 3),
            "rank0_build_s": round(rank0["build_s"], 3),
            "rank0_prefill_s": round(rank0["prefill_s"], 3),
        },
        "world": {"backend": "gloo", "processes": tp, "start_method": start_method, "threads_per_process": 1},
    }
    if job.vision is not None:
        details["vision_graph"] = "replicated: unsharded on every rank"
    if len(requests) > 1:
        details["decode_tok_s_per_row"] = rank0["decode_tok_s_per_row"]
    if settings.draft:
        layout = RoomyLayout.around(model.layout, k + 1)
        details.update(
            draft=settings.draft,
            draft_tokens=k,
            verify_steps=len(rows[0].emitted),
            accepted_per_step=rows[0].accepted_per_step,
            drafts_accepted=rows[0].accepted,
            sliding_ring_slots=layout.slots("sliding_attention", job.context_length, job.ring),
        )
        if assistant is not None:
            details["assistant_reads_layers"] = job.read_layers
    figures = rank0.get("bench")
    prefill_ms, decode_tok_s = rank0["prefill_s"] * 1000, rank0["decode_tok_s"]
    if figures is not None:
        prefill_ms, decode_tok_s = figures.prefill_ms, figures.decode_tok_s
    if "drafted_bench" in rank0:
        details.update(rank0["drafted_bench"])
        decode_tok_s = details["decode_tok_s_with_draft"]
    if host_s is not None:  # what the prompt waits for: the host's prefill (a rank only copies its K/V)
        prefill_ms = host_s * 1000
    return {
        "rows": rows,
        "compiler": COMPILER,
        "compile_s": 0.0,
        "prefill_logits_max_abs_diff": float(
            (first - reference_last_logits(reference_for(model, requests[0].images), rows[0].prompt_ids)).abs().max()
        ),
        "bench": figures,
        "prefill_ms": prefill_ms,
        "decode_tok_s": decode_tok_s,
        "details": details,
        "assistant": assistant,
    }
