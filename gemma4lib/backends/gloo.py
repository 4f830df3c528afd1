"""Backend `gloo`: the TP plan's ranks as CPU processes joined by gloo; the parent runs the engine.

What `cpu` and `eager` select at TP > 1. `compile` starts one worker process per rank (fork by
default: a rank starts in well under a second; spawn works too), joined through a file store in a
private temporary folder (no ports), one thread each. Each rank does what a NeuronCore does in the
ModelBuilder recipe: it builds the rank graphs from the config (`tp.rank_graph`, with a drafter
`tp.draft_rank_graph`), loads *its own* shard, and holds its K/V as parameters written back through
the aliased outputs (`recipes.common`).

The parent holds the one engine and no K/V: a step sends its name and inputs to every rank and
returns rank 0's outputs, after checking every rank computed the same (`ranks_agree`). The media
towers (vision, audio) read no K/V, so they run in the parent, unsharded. The workers end with the compiled steps
(or `RankWorld.close()`), at interpreter exit, and within a second of the parent process's end.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import tempfile
import time
import traceback
import weakref
from dataclasses import dataclass, field, fields
from multiprocessing.connection import wait
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..device.build import GraphSet, device_graphs
from ..device.graph import GraphShape
from ..errors import RankProcessError, SettingsError, TensorParallelError, UnknownNameError
from ..runtime import Steps
from ..tp.plan import TPPlan, make_plan
from ..tp.shard import iter_shards, shard_kv
from .base import CompiledGraphs
from .engine import named_steps

if TYPE_CHECKING:
    from ..models.loading import LoadedModel
    from ..settings import PortSettings

COMPILER = "cpu-gloo-tp"
EXECUTED_AS = "torch.distributed gloo on CPU, one process per rank"
PREFILLS = ("graph", "cpu-seeded")


@dataclass
class RankGraphs(GraphSet):
    """The gloo backend's graph form: the settings' graph set (its shapes, K/V layout, vision graph
    and assistant; the ranks build their own graphs from the config) and how the ranks shard and run
    it. The field report's faults live here: `baked_rank` (the MoE reads the rank at trace time; it
    needs `expert_split="experts"`, the default then) and `include_buffers=False` (buffers missing
    from the shards). `prefill_from="cpu-seeded"`: the E4B recipe's flow, the unsharded model
    prefills on the host and each rank copies its slice of those K/V. `expert_split` ("intermediate"
    | "experts", MoE only): how the ranks share the experts (None: the plan's default)."""

    backend: ClassVar[str] = "gloo"  # `base.refuse_graphs`: the one prebuilt graph form gloo takes
    baked_rank: bool = False
    include_buffers: bool = True
    prefill_from: str = "graph"
    expert_split: str | None = None
    start_method: str = "fork"
    timeout_s: float = 300.0  # for starting the ranks, and for each step

    def __post_init__(self):
        if self.prefill_from not in PREFILLS:
            raise UnknownNameError("prefill", self.prefill_from, PREFILLS)


def rank_graphs(
    model: LoadedModel, settings: PortSettings, graphs: GraphSet | None = None, *, prefill: str = "graph", **options
) -> RankGraphs:
    """The gloo graph form of `settings` (or of the graph set `graphs` the registry built), with the
    `RankGraphs` options; pass it as `graphs=` to `registry.run_device` or `compile_graphs`."""
    refuse_tp1(settings)
    if graphs is None:
        assistant = None
        if settings.draft == "assistant":
            from ..models.assistant import load_assistant

            assistant = load_assistant(model, settings)
        graphs = device_graphs(model, settings, assistant=assistant)
    if graphs.verify is not None:
        graphs.verify.expert_form = "dense"  # what the rank graphs verify with (the record says so)
    return RankGraphs(**{f.name: getattr(graphs, f.name) for f in fields(GraphSet)}, prefill_from=prefill, **options)


def refuse_tp1(settings: PortSettings) -> int:
    """The settings' TP degree; below 2 there is nothing to shard (it runs on one device)."""
    tp = int(settings.tp_degree)
    if tp < 2:
        raise TensorParallelError(f"the gloo ranks shard over TP >= 2, got {tp}; TP=1 runs on one device (cpu, eager)")
    return tp


@dataclass
class RankJob:
    """Everything a rank process needs to build its steps (picklable for the spawn start method)."""

    config: Any
    plan: TPPlan
    shards: list[dict[str, torch.Tensor]]
    batch: int
    context_length: int
    buckets: tuple[int, ...]
    ring: bool
    dtype: torch.dtype
    decode_experts: str  # the decode graph's expert form; prefill and verify stay dense
    baked_rank: bool
    draft_tokens: int  # k > 0: a verify graph of k + 1 tokens instead of decode
    assistant_config: Any = None  # drafting with the assistant: its config, shards and the layers it reads
    assistant_shards: list[dict[str, torch.Tensor]] | None = None
    read_layers: dict[str, int] | None = None
    contexts: dict[str, GraphShape] = field(default_factory=dict)  # context buckets' graphs by name ("decode@64")


def rank_steps(rank: int, job: RankJob) -> tuple[dict[str, Any], list[torch.Tensor], list[str]]:
    """This rank's steps by name over one set of K/V parameters, those K/V, and the keys its shard lacked."""
    from ..device.drafting import RoomyLayout
    from ..recipes.common import AliasEmulator, KVParamModule
    from ..tp.draft_rank_graph import KVDraftStep, build_drafting_modules, draft_key_shapes, verify_of
    from ..tp.layers import TorchDistCollectives
    from ..tp.rank_graph import CpuParallelFactory, build_rank_graph, load_shard, with_shape

    factory = CpuParallelFactory(job.plan.tp, TorchDistCollectives(), job.dtype)
    b, ctx, ring, k = job.batch, job.context_length, job.ring, job.draft_tokens

    def shape(tokens: int) -> GraphShape:
        return GraphShape(b, tokens, ctx, ring)

    if job.assistant_config is not None:  # the target returns hidden states; the assistant reads its K/V
        modules = build_drafting_modules(
            job.config,
            job.assistant_config,
            job.plan,
            job.read_layers,
            {**draft_key_shapes(ctx, job.buckets, k, ring, batch=b), **job.contexts},
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
        steps = {name: KVDraftStep(module) for name, module in modules.items()}
        return steps, list(modules["draft"].kv), sorted(key for key in missing if not key.startswith("kv."))
    base = build_rank_graph(
        job.config, job.plan, shape(max(job.buckets)), factory=factory, dtype=job.dtype, baked_rank=job.baked_rank
    )
    if k:  # rings with room for the k + 1 positions a verify writes (`device.drafting`)
        base.layout = RoomyLayout.around(base.layout, k + 1)
    missing = load_shard(base, job.shards[rank])
    kv = KVParamModule(base)
    steps = {f"prefill{bucket}": AliasEmulator(kv.sharing(with_shape(base, shape(bucket)))) for bucket in job.buckets}
    if k:
        steps["verify"] = AliasEmulator(kv.sharing(verify_of(base, shape(k + 1))))
    else:
        steps["decode"] = AliasEmulator(kv.sharing(with_shape(base, shape(1), job.decode_experts)))
    for name, at in job.contexts.items():  # the same rank graph reading the first `at.reads` slots
        graph = (
            verify_of(base, at)
            if name.startswith("verify")
            else with_shape(base, at, job.decode_experts if at.tokens == 1 else None)
        )
        steps[name] = AliasEmulator(kv.sharing(graph))
    return steps, list(kv.kv), missing


def _digest(outputs: tuple[torch.Tensor, ...]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for t in outputs:
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _seed(kv: list[torch.Tensor], length: torch.Tensor, *values: torch.Tensor) -> tuple:
    """Copy the host-prefilled K/V of the rows that were admitted (length > 0) into this rank's K/V."""
    rows = length > 0
    with torch.no_grad():
        for param, value in zip(kv, values, strict=True):
            param[rows] = value[rows]
    return ()


def _worker(rank: int, world: int, init_file: str, job: RankJob, conn: Any, parent: int) -> None:
    """One rank: build its steps, report ready, then run each step it is sent until told to stop,
    the pipe closes or the parent is gone. Errors go back to the parent, never hang it."""
    import torch.distributed as dist

    torch.set_num_threads(1)  # 8 ranks on 2 cores: one thread each, or they thrash
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        started = time.perf_counter()
        steps, kv, missing = rank_steps(rank, job)
        del job
        ready = (missing, [list(t.shape) for t in kv], time.perf_counter() - started)
        conn.send_bytes(pickle.dumps(("ok", ready)))
        while True:
            if not conn.poll(1.0):
                if os.getppid() != parent:
                    return
                continue
            name, inputs = pickle.loads(conn.recv_bytes())
            if name is None:
                return
            with torch.no_grad():
                out = _seed(kv, *inputs) if name == "seed" else steps[name](*inputs)
            outputs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
            conn.send_bytes(pickle.dumps(("ok", (outputs if rank == 0 else None, _digest(outputs)))))
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the parent closed the pipe: nothing to report to
    except BaseException:
        try:
            conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
        except OSError:
            pass
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _shutdown(procs: list[Any], conns: list[Any], folder: str) -> None:
    """Ask every rank to stop, then end those that did not (only the processes this world started)."""
    for conn in conns:
        try:
            conn.send_bytes(pickle.dumps((None, ())))
        except OSError:
            pass
    for p in procs:
        p.join(timeout=2)
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)
    for conn in conns:
        conn.close()
    try:
        for name in os.listdir(folder):
            os.remove(os.path.join(folder, name))
        os.rmdir(folder)
    except OSError:
        pass


class RankWorld:
    """The rank processes of one compile: started here, called step by step, closed on `close()`,
    on garbage collection and at interpreter exit."""

    def __init__(self, job: RankJob, start_method: str = "fork", timeout_s: float = 300.0):
        import multiprocessing

        self.size, self.timeout_s, self.start_method = job.plan.tp, float(timeout_s), start_method
        ctx = multiprocessing.get_context(start_method)
        folder = tempfile.mkdtemp(prefix="gemma4lib-gloo-")
        pipes = [ctx.Pipe() for _ in range(self.size)]
        self.conns = [mine for mine, _ in pipes]
        self.procs = [
            ctx.Process(
                target=_worker,
                args=(r, self.size, os.path.join(folder, "store"), job, theirs, os.getpid()),
                daemon=True,
                name=f"gemma4lib-gloo-rank{r}",
            )
            for r, (_, theirs) in enumerate(pipes)
        ]
        self._finalizer = weakref.finalize(self, _shutdown, self.procs, self.conns, folder)
        saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
        os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")  # inherited by spawned children
        try:
            for p in self.procs:
                p.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        for _, theirs in pipes:
            theirs.close()
        self.ready = self._gather("start")  # each rank's (missing keys, K/V shapes, build seconds)
        self.agree, self.calls, self.call_s = True, 0, 0.0

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        self._finalizer()

    def call(self, name: str, inputs: tuple, per_rank: list[tuple] | None = None) -> tuple[torch.Tensor, ...]:
        """Step `name` on every rank (each its own inputs when `per_rank`); rank 0's outputs."""
        if self.closed:
            raise RankProcessError("the gloo rank processes are closed (an earlier failure, or close()); compile again")
        started = time.perf_counter()
        for r, conn in enumerate(self.conns):
            conn.send_bytes(pickle.dumps((name, per_rank[r] if per_rank else inputs)))
        replies = self._gather(name)
        self.agree = self.agree and all(digest == replies[0][1] for _, digest in replies)
        self.calls, self.call_s = self.calls + 1, self.call_s + time.perf_counter() - started
        return replies[0][0]

    def _gather(self, what: str) -> list[Any]:
        """Every rank's reply, rank order; a rank's error, exit or the timeout closes the world and raises."""
        replies: dict[int, Any] = {}
        deadline = time.monotonic() + self.timeout_s
        while len(replies) < self.size:
            waiting = {self.conns[r]: r for r in range(self.size) if r not in replies}
            for conn in wait(list(waiting), timeout=min(1.0, max(deadline - time.monotonic(), 0.05))):
                rank = waiting[conn]
                try:
                    status, payload = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    status, payload = "error", f"exited (exit code {self.procs[rank].exitcode})"
                if status != "ok":
                    self._fail(f"rank {rank} failed at {what}:\n{payload}")
                replies[rank] = payload
            dead = [r for r, p in enumerate(self.procs) if r not in replies and p.exitcode is not None]
            if dead:
                self._fail(
                    f"rank processes {dead} exited at {what} without a reply (exit codes "
                    f"{[p.exitcode for p in self.procs]}); with start_method='spawn' the calling script needs an "
                    f"`if __name__ == '__main__':` guard"
                )
            if len(replies) < self.size and time.monotonic() > deadline:
                late = sorted(set(range(self.size)) - set(replies))
                self._fail(f"ranks {late} timed out after {self.timeout_s:.0f}s at {what}")
        return [replies[r] for r in range(self.size)]

    def _fail(self, message: str) -> None:
        self.close()  # the others may be blocked in a collective: stop them all
        raise RankProcessError("CPU tensor-parallel run failed: " + message)


class RemoteStep:
    """A step the engine calls in the parent: run by every rank over its own K/V."""

    def __init__(self, world: RankWorld, name: str):
        self.world, self.name = world, name

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.world.call(self.name, inputs)


class SeededPrefill:
    """The E4B recipe's prefill as a step: the unsharded in-place graph prefills on the host, each rank
    copies its slice of those K/V for the admitted rows; the host's logits are the step's."""

    def __init__(self, world: RankWorld, graph: Any, plan: TPPlan, timings: dict[str, float]):
        self.world, self.graph, self.plan, self.timings = world, graph, plan, timings

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        kv = self.graph.new_kv()
        with torch.no_grad():
            logits = self.graph(*inputs, *kv)
        self.timings["host_prefill_s"] = self.timings.get("host_prefill_s", 0.0) + time.perf_counter() - started
        length = inputs[-1]
        self.world.call("seed", (), [(length, *shard_kv(kv, self.plan, r)) for r in range(self.plan.tp)])
        return logits


class AssistantWeights:
    """The assistant as `assistant_shard` reads it, from its draft graph: the same state-dict keys (all
    but the word embedding, which no shard holds) and its config."""

    def __init__(self, draft: Any):
        self.config, self.state_dict = draft.assistant_config, draft.state_dict


def compile(graphs: GraphSet, model: LoadedModel, settings: PortSettings, progress: bool = False) -> CompiledGraphs:
    """The rank processes started over the settings' graph set (`RankGraphs`: with the fault options),
    each with its steps built and its shard loaded; the parent's steps call them."""
    spec = graphs if isinstance(graphs, RankGraphs) else rank_graphs(model, settings, graphs)
    tp = refuse_tp1(settings)
    seeded = spec.prefill_from == "cpu-seeded"
    if seeded and spec.verify is not None:
        raise SettingsError("prefill='cpu-seeded' seeds plain decode; draft with prefill='graph' (or draft=None)")
    towers = [n for n in ("vision", "audio") if getattr(spec, n) is not None]
    if seeded and towers:
        raise SettingsError(
            "prefill='cpu-seeded' prefills token ids on the host, without images' or clips' soft tokens; "
            "run media requests with prefill='graph'"
        )
    if spec.row_prefill:
        raise SettingsError("the gloo ranks prefill batch-shaped only: set row_prefill=False at tp_degree > 1")
    lm = model.lm
    split = spec.expert_split if spec.expert_split is not None or not spec.baked_rank else "experts"
    plan = make_plan(lm.config, tp, model.variant, expert_split=split)  # baked_rank: the bug lives in "experts"
    if spec.baked_rank and plan.expert_split == "intermediate":
        raise TensorParallelError(
            "baked_rank: the intermediate split never reads the rank, so there is no rank to bake in; the field "
            "report's bug needs expert_split='experts'"
        )
    started = time.perf_counter()
    shards = list(iter_shards(lm, plan, include_buffers=spec.include_buffers))
    shard_s = time.perf_counter() - started
    target = spec.target.shape
    job = RankJob(
        lm.config,
        plan,
        shards,
        target.batch,
        target.context_length,
        tuple(spec.prefill),
        target.ring,
        next(lm.parameters()).dtype,
        settings.decode_experts,
        spec.baked_rank,
        spec.draft_tokens,
    )
    if spec.draft is not None:
        from ..tp.draft_rank_graph import assistant_shard

        source = AssistantWeights(spec.draft)
        job.assistant_config, job.read_layers = source.config, dict(spec.draft.read_layers)
        job.assistant_shards = [assistant_shard(source, plan, r) for r in range(tp)]
    # context buckets (prefill ones only where the ranks prefill: not `cpu-seeded`)
    job.contexts = contexts = {n: g.shape for n, g in spec.contexts.items() if not (seeded and n.startswith("prefill"))}
    world = RankWorld(job, spec.start_method, spec.timeout_s)
    del job, shards  # the ranks hold them now
    timings: dict[str, float] = {"shard_s": round(shard_s, 3), "rank0_build_s": round(world.ready[0][2], 3)}
    prefill: dict[int, Any] = {b: RemoteStep(world, f"prefill{b}") for b in spec.prefill}
    if seeded:
        prefill = {b: SeededPrefill(world, g, plan, timings) for b, g in spec.prefill.items()}
    steps = Steps(
        prefill,
        decode=RemoteStep(world, "decode") if spec.decode is not None else None,
        verify=RemoteStep(world, "verify") if spec.verify is not None else None,
        draft=RemoteStep(world, "draft") if spec.draft is not None else None,
        vision=spec.vision,  # the media towers read no K/V: unsharded, in the parent
        audio=spec.audio,
        contexts=named_steps({n: RemoteStep(world, n) for n in contexts}).contexts,
    )
    info: dict[str, Any] = {
        "executed_as": EXECUTED_AS,
        "prefill": spec.prefill_from,
        "missing_keys": world.ready[0][0],
        "baked_rank": spec.baked_rank,
        "expert_split": plan.expert_split,
        "decode_experts": settings.decode_experts,
        "tp_plan": plan.describe(),
        "kv_shapes_per_rank": world.ready[0][1],
        "world": {"backend": "gloo", "processes": tp, "start_method": spec.start_method, "threads_per_process": 1},
    }
    info.update({f"{n}_graph": "unsharded, in the parent process (it reads no K/V)" for n in towers})

    def report() -> dict[str, Any]:
        figures = {k: round(v, 3) for k, v in timings.items()}
        figures.update(steps=world.calls, steps_s=round(world.call_s, 3))
        return {"ranks_agree": world.agree, "tp_timings": figures}

    return CompiledGraphs(steps, 0.0, [], COMPILER, info, report=report, kv=None)
