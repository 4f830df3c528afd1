"""The XLA lane: run the device graphs through torch_xla (on CPU: ``PJRT_DEVICE=CPU``).

torch-neuronx turns a module into HLO through torch_xla and hands that to neuronx-cc, so running
the same `DeviceGraph`s through torch_xla here checks, without inf2, that they lower through the
XLA front end with no CPU fallback and no per-step recompilation. It runs in the lane's own
environment (``scripts/setup_xla_env.sh`` → ``.venv-xla``: torch 2.9.0 + torch-xla 2.9.0); this
module imports without torch_xla and imports it only when used. `compile` (``port --backend xla``)
puts a whole `GraphSet` in one `XLASession` (`session_steps`) and hands the engine its `Steps`.

- The graphs must be built with ``inplace=False`` (the functional form Neuron traces). The
  session deep-copies them onto the XLA device (weights shared between the graphs, the host model
  left untouched), so the host model stays the CPU reference.
- A step rebinds each K/V tensor passed in to its updated value (``kv[i].copy_(new)``: on XLA an IR
  rebinding, not a data copy), materialises logits and K/V with one ``torch_xla.sync()`` (2.9's
  ``xm.mark_step()``), then waits for it (``xm.wait_device_ops()``: execution is asynchronous and
  the counters must be exact).
- Index inputs are int32 graph data, never constants (`device.graph.INDEX_DTYPE`, as NxD Inference
  hands them to the device): a step refuses any other integer dtype, so every run of the lane
  proves the graphs receive int32 end to end.
- Per graph it counts XLA compilations, executions (one per step, or something in the graph forced
  a materialisation), distinct graph hashes and ``aten::`` CPU fallbacks (a fallback is a graph
  break on inf2), and writes each distinct graph's HLO text to ``hlo_dir`` (`XLASession.report`).
  torch_xla caches compiled graphs per process by graph hash: a second session over identical
  graphs in the same process reports 0 compilations; the distinct-hash count is the same.
- Tensor parallelism: torch_xla 2.9's multi-device CPU client (``CPU_NUM_DEVICES=N``) runs GSPMD
  but not per-rank explicit collectives (``torch_xla.launch`` + ``xm.all_reduce`` aborts in
  XLA:CPU's rendezvous: each device thread compiles its own HloModule and a channel-less all-reduce
  is keyed by the module's unique id, so the ranks never meet).
"""

from __future__ import annotations

import copy
import os
import re
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..device.graph import INDEX_DTYPE
from ..errors import GraphFormError
from .base import CompiledGraphs

if TYPE_CHECKING:
    from ..device.build import GraphSet
    from ..models.loading import LoadedModel
    from ..runtime import Steps
    from ..settings import PortSettings

# The XLA:CPU backend's own optimisation is irrelevant to what the lane checks (the HLO the front
# end emits, fallbacks, compile counts, tokens) and halves its compile time on this machine.
FAST_CPU_COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")


def use_fast_cpu_compile() -> None:
    """Add `FAST_CPU_COMPILE_FLAGS` to ``XLA_FLAGS`` (keeping any set); call before first device use."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    names = {f.split("=")[0] for f in flags}
    flags += [f for f in FAST_CPU_COMPILE_FLAGS if f.split("=")[0] not in names]
    os.environ["XLA_FLAGS"] = " ".join(flags)


def _xla():
    """Import torch_xla (and its metrics) on first use, with a message that says what to do."""
    try:
        import torch_xla
        import torch_xla.debug.metrics as met
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the XLA backend needs torch_xla: create the lane's environment with "
            "scripts/setup_xla_env.sh and run with .venv-xla/bin/python (PJRT_DEVICE=CPU)"
        ) from exc
    return torch_xla, met


def xla_device():
    torch_xla, _ = _xla()
    return torch_xla.device()


def _metric_count(name: str) -> int:
    _, met = _xla()
    data = met.metric_data(name)
    return int(data[0]) if data else 0


def compile_count() -> int:
    """Process-wide number of XLA compilations so far."""
    return _metric_count("CompileTime")


def execute_count() -> int:
    """Process-wide number of XLA graph executions launched so far (SPMD: ``ExecuteReplicated``)."""
    _, met = _xla()
    return sum(int(met.counter_value(name) or 0) for name in ("ExecuteComputation", "ExecuteReplicated"))


def fallback_counters() -> dict[str, int]:
    """Process-wide ``aten::`` CPU-fallback counters (op name → calls)."""
    _, met = _xla()
    return {name: int(met.counter_value(name)) for name in met.counter_names() if name.startswith("aten::")}


# `%name = <type> opcode(operands), attrs`: the opcode is the first lowercase word followed by "("
# after the "=" (a tuple type also opens with "(", but after a space, not a word).
_HLO_OP = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*[^\n]*?(?<![\w\-])([a-z][a-z0-9\-]*)\(", re.M)


def hlo_op_counts(hlo_text: str) -> dict[str, int]:
    """Instructions per opcode over every computation of an HLO module's text, plus "total"."""
    counts = Counter(_HLO_OP.findall(hlo_text))
    result = dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    result["total"] = sum(counts.values())
    return result


def to_device(graphs: Mapping[str, nn.Module], device) -> dict[str, nn.Module]:
    """Deep copies of `graphs` on `device`, sharing each parameter/buffer across the copies.

    `DeviceGraph` shares its weights with the host model (shallow clones), so `.to(device)` would
    move the host reference too. Here every tensor reachable from the modules is copied to the
    device once (the memo keeps tied and shared tensors shared) and the host objects are untouched.
    """
    memo: dict[int, Any] = {}
    for graph in graphs.values():
        for module in graph.modules():
            for tensor in list(module._parameters.values()) + list(module._buffers.values()):
                if tensor is None or id(tensor) in memo:
                    continue
                moved = tensor.detach().to(device)
                memo[id(tensor)] = (
                    nn.Parameter(moved, requires_grad=False) if isinstance(tensor, nn.Parameter) else moved
                )
            # plain tensor attributes (e.g. rotary `original_inv_freq`) that alias no buffer
            for value in vars(module).values():
                if isinstance(value, torch.Tensor) and id(value) not in memo:
                    memo[id(value)] = value.detach().to(device)
    return {name: copy.deepcopy(graph, memo) for name, graph in graphs.items()}


class XLASession:
    """A set of named `DeviceGraph`s (``inplace=False``) on the XLA device, with its bookkeeping."""

    def __init__(self, graphs: Mapping[str, nn.Module], *, hlo_dir: str | Path | None = None, device=None):
        for name, graph in graphs.items():
            if getattr(graph, "inplace", False) and getattr(graph, "writes_kv", True):
                raise GraphFormError(
                    f"graph {name!r} was built with inplace=True; the XLA lane runs the "
                    f"functional form: build it with DeviceGraph(..., inplace=False)"
                )
        self.device = device if device is not None else xla_device()
        self.graphs = to_device(graphs, self.device)
        self.hlo_dir = Path(hlo_dir) if hlo_dir is not None else None
        self._fallbacks_at_start = fallback_counters()
        self.compilations: Counter[str] = Counter()
        self.executions: Counter[str] = Counter()
        self.steps: Counter[str] = Counter()
        self.fallbacks: dict[str, Counter[str]] = {name: Counter() for name in graphs}
        self.hashes: dict[str, list[str]] = {name: [] for name in graphs}
        self.hlo_files: list[str] = []
        self.op_counts: dict[str, dict[str, int]] = {}

    def new_kv(self, name: str) -> list[torch.Tensor]:
        """Zero K/V buffers for graph `name`, on the device (graphs of one context share them)."""
        torch_xla, _ = _xla()
        kv = [t.to(self.device) for t in self.graphs[name].new_kv()]
        torch_xla.sync()
        return kv

    def step(self, name: str):
        """``step(inputs_embeds, [per_layer_inputs,] start, length, *kv) -> logits`` for graph `name`
        (a graph with more outputs before its K/V, e.g. logits and hidden states, returns them as a
        tuple; see `run`)."""

        def run(*args: torch.Tensor) -> torch.Tensor:
            return self.run(name, *args)

        run.__name__ = f"xla_{name}_step"
        return run

    def run(self, name: str, inputs_embeds: torch.Tensor, *args: torch.Tensor) -> Any:
        """One step. A graph's inputs after `inputs_embeds` are `[ple,] [image blocks,] start, length` then the K/V,
        unless it says otherwise (`inputs_before_kv`, counting `inputs_embeds`: the draft graph's
        is 2, its position); its outputs are what it computes, then the updated K/V, unless it
        writes none (`writes_kv = False`: the draft graph only reads them)."""
        torch_xla, _ = _xla()
        graph = self.graphs[name]
        n_head = getattr(graph, "inputs_before_kv", None)
        n_head = (graph.num_inputs if n_head is None else n_head) - 1  # [ple,] [image blocks,] start, length
        head, kv = args[:n_head], args[n_head:]
        for t in head:
            if not t.is_floating_point() and t.dtype != INDEX_DTYPE:
                raise GraphFormError(
                    f"graph {name!r} got a {t.dtype} index input; index inputs are {INDEX_DTYPE} on every "
                    f"backend: build them with gemma4lib.device.graph.index_tensor"
                )
        for t in kv:
            if t.device != self.device:
                raise GraphFormError(
                    f"K/V buffers must live on {self.device} (from XLASession.new_kv), got one on {t.device}"
                )
        inputs = [t.to(self.device) for t in (inputs_embeds, *head)]
        fallbacks0, compiles0, executes0 = fallback_counters(), compile_count(), execute_count()
        with torch.no_grad():
            outputs = graph(*inputs, *kv)
        outputs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
        writes = getattr(graph, "writes_kv", True)
        n_results = len(outputs) - (len(kv) if writes else 0)
        results, new_kv = outputs[:n_results], outputs[n_results:]
        graph_hash = torch_xla._XLAC._get_graph_hash(outputs).hex()
        if graph_hash not in self.hashes[name]:
            self.hashes[name].append(graph_hash)
            self._save_hlo(name, len(self.hashes[name]) - 1, torch_xla._XLAC._get_xla_tensors_hlo(outputs))
        with torch.no_grad():
            for old, new in zip(kv if writes else (), new_kv, strict=True):
                old.copy_(new)
        torch_xla.sync()
        import torch_xla.core.xla_model as xm

        xm.wait_device_ops()  # executions run asynchronously; count them once they have run
        self.steps[name] += 1
        self.compilations[name] += compile_count() - compiles0
        self.executions[name] += execute_count() - executes0
        for op, n in fallback_counters().items():
            if n > fallbacks0.get(op, 0):
                self.fallbacks[name][op] += n - fallbacks0.get(op, 0)
        return results[0] if len(results) == 1 else tuple(results)

    def _save_hlo(self, name: str, index: int, text: str) -> None:
        if index == 0:
            self.op_counts[name] = hlo_op_counts(text)
        if self.hlo_dir is None:
            return
        self.hlo_dir.mkdir(parents=True, exist_ok=True)
        path = self.hlo_dir / f"{name}.{index}.hlo.txt"
        path.write_text(text)
        self.hlo_files.append(str(path))

    def report(self) -> dict[str, Any]:
        ops: Counter[str] = Counter()
        for per_graph in self.fallbacks.values():
            ops.update(per_graph)
        # also anything that fell back outside a step (e.g. while moving the graphs)
        for op, n in fallback_counters().items():
            extra = n - self._fallbacks_at_start.get(op, 0) - ops.get(op, 0)
            if extra > 0:
                ops[op] += extra
        return {
            "xla_fallbacks": sum(ops.values()),
            "xla_fallback_ops": dict(ops),
            "xla_compilations": dict(self.compilations),
            "xla_executions": dict(self.executions),
            "xla_steps": dict(self.steps),
            "xla_graph_hashes": {name: len(h) for name, h in self.hashes.items() if h},  # the graphs that ran
            "hlo_files": list(self.hlo_files),
            "hlo_op_counts": dict(self.op_counts),
        }


COMPILER = "torch-xla"


def session_steps(graphs: GraphSet, hlo_dir: str | Path | None = None) -> tuple[Steps, XLASession]:
    """The named graphs of `graphs` (functional form) in one session, as the engine's `Steps` over
    one set of device K/V that the prefill, decode and verify steps rebind and the draft step reads."""
    from ..device.row_join import row_step
    from ..runtime import bind_kv
    from .engine import named_steps

    named = graphs.named()
    session = XLASession(named, hlo_dir=hlo_dir)
    kv = session.new_kv("decode" if graphs.decode is not None else "verify")
    steps = named_steps({name: session.step(name) for name in named if not name.startswith("row_")}, kv)
    rows = named_steps({name: row_step(bind_kv(session.step(name), kv)) for name in named if name.startswith("row_")})
    steps.row_prefill, steps.contexts = rows.row_prefill, {**steps.contexts, **rows.contexts}
    return steps, session  # a row joins through its join graph (`device.row_join`) over the whole K/V


def compile(graphs: GraphSet, model: LoadedModel, settings: PortSettings, progress: bool = False) -> CompiledGraphs:
    """Backend `xla` (`port --backend xla`): `session_steps`, its HLO under the artifact cache.
    XLA compiles lazily, on each graph's first call: its time shows there, not in `compile_s`.
    The `report()` adds the lane's figures (fallbacks, compilations per graph, HLO files) to the
    result record once generation and benchmark ran."""
    from ..cache.artifacts import ArtifactCache

    use_fast_cpu_compile()
    tag = f"b{graphs.batch}" + (f"-draft{graphs.draft_tokens}" if graphs.draft_tokens else "")
    hlo_dir = ArtifactCache(settings.cache_dir).root / "xla-hlo" / model.variant.name / tag
    steps, session = session_steps(graphs, hlo_dir)
    return CompiledGraphs(steps, 0.0, [], COMPILER, report=session.report)
