"""Drafting in the ModelBuilder recipe: prefill, verify and draft keys over the one set of K/V states.

Every key's module is a `DraftingRankModule` holding the same parameters (`target.*`, `assistant.*`,
`kv.*`); the draft key aliases every K/V state unchanged; no key is the priority model; the host loop is
the engine with the `AssistantDrafter` over `NxDKeyStep`s. Why, from NxD v2.28.0's model builder, and
the compiler arguments of each key: docs/NEURON.md, "Drafting". Lines that need the SDK are marked
`# inf2-only`.
"""

from __future__ import annotations

import functools
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ..device.build import device_graph
from ..device.graph import GraphShape
from ..errors import SettingsError
from ..tp.draft_rank_graph import assistant_nxd_full, build_drafting_modules, draft_key_shapes
from ..tp.plan import TPPlan, make_plan
from ..tp.shard import nxd_full_checkpoint
from . import neuron_env
from .common import index_dtype, key_inputs
from .neuron_model_builder import instance_class

RECIPE = "model_builder-drafting"
PURPOSE = "drafting in the ModelBuilder recipe (neuronx_distributed.trace.model_builder)"


def drafting_shapes(
    context_length: int,
    buckets: tuple[int, ...],
    k: int,
    ring: bool,
    batch: int = 1,
    joins: bool = False,
    chooses: bool = False,
    contexts: dict[str, GraphShape] | None = None,
) -> dict[str, GraphShape]:
    """The keys' shapes (`chooses`: the ids keys, `draft_key_shapes`; `contexts`: the context
    buckets' keys by name, "verify@64", each taking its read positions first); a prefill bucket of
    k + 1 tokens would route like verify: refused (a join takes its row index first, and the ids
    verify its drafts last, so neither routes like another key)."""
    if k + 1 in buckets:
        raise SettingsError(
            f"a prefill bucket of {k + 1} tokens has the verify key's input shapes (draft_tokens={k} verifies "
            f"{k + 1} tokens) and NxD routes keys by shape: pick other prefill_buckets or another draft_tokens"
        )
    return {
        **draft_key_shapes(context_length, tuple(sorted(buckets)), k, ring, batch, joins, chooses),
        **(contexts or {}),
    }


def key_example_inputs(loaded: Any, name: str, shape: GraphShape, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """A key's example inputs: the target device graph's own for prefill/verify
    (`common.key_inputs`), after a row index `[1]` for a join and, first, a context bucket's read
    positions `[C]`; `(inputs_embeds [B, 1, 2H], position [B])` for the draft key, its position in the
    dtype the target graph gives its indices (int32)."""
    if shape.reads:
        at = torch.arange(shape.reads, dtype=torch.int32)
        inner = key_example_inputs(loaded, name.partition("@")[0], replace(shape, reads=None), dtype)
        return (at.to(index_dtype(inner)), *inner)
    ids = name == "verify_ids"  # its drafts `[B, k]` last
    graph = device_graph(loaded, shape, "dense", inplace=False, every_position=ids, chooses=ids)
    inputs = key_inputs(graph, dtype=dtype)
    if name.startswith("draft"):
        hidden, b = int(loaded.config.hidden_size), shape.batch
        return (torch.zeros(b, 1, 2 * hidden, dtype=dtype), torch.zeros(b, dtype=index_dtype(inputs)))
    return (torch.zeros(1, dtype=index_dtype(inputs)), *inputs) if name.startswith("row_") else inputs


def key_compiler_args(name: str) -> str:
    """Prefill keys the prefill set; verify the `verify` set (k + 1 tokens: tiling 2, -O2, as NxD
    Inference's speculation model); draft the decode set."""
    if "prefill" in name:  # the joins too
        return neuron_env.COMPILER_ARGS["prefill"]
    return neuron_env.COMPILER_ARGS["verify" if name.startswith("verify") else "decode"]  # a bucket: its kind's


def drafting_loader(loaded: Any, assistant: Any, plan: TPPlan, dtype: torch.dtype):
    """The lazy `checkpoint_loader`: target and assistant are arranged only when NxD's
    `shard_checkpoint` calls it (`neuron_model_builder.checkpoint_loader`)."""
    return functools.partial(drafting_checkpoint, loaded, assistant, plan, dtype)


def drafting_checkpoint(loaded: Any, assistant: Any, plan: TPPlan, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The `checkpoint_loader` result: target and assistant, NxD-arranged, keyed like the modules."""
    checkpoint = {"target." + k: v for k, v in nxd_full_checkpoint(loaded.lm, plan, dtype=dtype).items()}
    checkpoint.update({"assistant." + k: v for k, v in assistant_nxd_full(assistant.model, plan, dtype=dtype).items()})
    return checkpoint


def key_module(config, assistant_config, plan, read_layers, shapes, k, name, dtype, factory=None):
    """The module one key compiles (`NxDParallelFactory` by default; tests pass the CPU factory)."""
    if factory is None:
        from .neuron_model_builder import NxDParallelFactory

        factory = NxDParallelFactory(plan.tp, dtype)
    modules = build_drafting_modules(
        config, assistant_config, plan, read_layers, shapes, k, factory=factory, dtype=dtype, keyed=True
    )
    return modules[name].eval()


def compile_drafting(
    loaded: Any,
    assistant: Any,
    tp: int,
    out_dir: str | Path,
    *,
    context_length: int,
    buckets: tuple[int, ...],
    draft_tokens: int,
    ring: bool = False,
    dtype: torch.dtype = torch.bfloat16,
    compiler_workdir: str | Path | None = None,
    batch: int = 1,
    joins: bool = False,
    chooses: bool = False,
    contexts: dict[str, GraphShape] | None = None,
) -> Path:
    """Compile every drafting key for one rank, `batch` rows each (with `joins`, a one-row prefill
    key per bucket beside them; with `chooses`, the ids keys; `contexts`, the context buckets' keys);
    save the model and the per-rank shards to `out_dir`."""
    model_builder, KeyInstance = instance_class()
    k = int(draft_tokens)
    shapes = drafting_shapes(context_length, tuple(buckets), k, ring, batch, joins, chooses, contexts)
    plan = make_plan(loaded.config, tp, loaded.variant)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    workdir = Path(compiler_workdir or out / "compiler_workdir")
    builder = model_builder.ModelBuilder(  # inf2-only
        router=None,
        tp_degree=tp,
        checkpoint_loader=drafting_loader(loaded, assistant, plan, dtype),
        compiler_workdir=str(workdir),
    )
    for name, shape in shapes.items():
        builder.add(  # inf2-only
            key=name,
            model_instance=KeyInstance(
                functools.partial(
                    key_module,
                    loaded.config,
                    assistant.model.config,
                    plan,
                    dict(assistant.read_layers),
                    shapes,
                    k,
                    name,
                    dtype,
                )
            ),
            example_inputs=[key_example_inputs(loaded, name, shape, dtype)],
            compiler_args=key_compiler_args(name),
            priority_model_idx=None,  # no weight layout optimisation (docs/NEURON.md)
        )
    traced = builder.trace(initialize_model_weights=False)  # inf2-only
    torch.jit.save(traced, str(out / "model.pt"))  # inf2-only
    del traced
    builder.shard_checkpoint(serialize_path=str(out / "weights"))  # inf2-only
    manifest = {
        "recipe": RECIPE,
        "variant": loaded.variant.name,
        "tp": tp,
        "keys": {n: [s.tokens, s.context_length, s.ring] for n, s in shapes.items()},
        "context_buckets": sorted({s.reads for s in shapes.values() if s.reads}),
        "draft_tokens": k,
        "dtype": str(dtype),
        "assistant_reads_layers": dict(assistant.read_layers),
        "plan": plan.describe(),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return out


class NxDKeyStep:
    """An engine step over the loaded NxD model: the key is routed by the input shapes;
    the K/V stay on the device as states, so the host passes only the inputs and gets
    `(logits, hidden)`, or `(ids, hidden)` from an ids key (`ids`)."""

    def __init__(self, traced: Any, num_inputs: int, ids: bool = False):
        self.traced, self.num_inputs, self.ids = traced, num_inputs, ids

    def __call__(self, *args: torch.Tensor):
        out = self.traced.nxd_model.forward(list(args[: self.num_inputs]))  # inf2-only
        return (out[0] if self.ids else out[0].float()), out[1]
