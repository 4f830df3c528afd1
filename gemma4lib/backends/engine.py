"""The one place the generation engine is put over compiled graphs: named callables → `Steps` → `Engine`.

`registry.compile_graphs` puts it over a backend's `Steps`; every caller that compiles graphs on
its own (the benchmark suite's single graphs, the real-width and Gemma 3 checks, the XLA check)
hands its callables here by the names `GraphSet.named()` gives them ("prefill16",
"row_prefill16", "decode", "verify", "draft", "vision", "audio"; a context bucket's "decode@256"), so the
engine's shape (rows, context, dtype, draft slots, image blocks) is read from the graphs in one place
and never restated.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from ..device.build import GraphSet
from ..errors import GraphFormError
from ..runtime import Engine, Step, Steps, bind_kv, bind_kv_rows

if TYPE_CHECKING:
    from ..device.graph import DeviceGraph
    from ..models.loading import LoadedModel
    from ..runtime import Drafter

_BUCKETED = re.compile(r"(row_prefill|prefill)(\d+)")
_SINGLE = ("decode", "decode_ids", "verify", "verify_ids", "draft", "draft_ids", "vision", "audio")


def named_steps(fns: Mapping[str, Step], kv: Sequence[torch.Tensor] | None = None) -> Steps:
    """`Steps` from callables named as `GraphSet.named()`. `kv`: the K/V buffers each takes as
    trailing inputs, bound here (`runtime.bind_kv`; a one-row prefill takes one row of them,
    `bind_kv_rows`; the vision and audio graphs read none). None: the callables hold their K/V themselves
    (device steps whose K/V are aliased state)."""
    prefill: dict[int, Step] = {}
    rows: dict[int, Step] = {}
    single: dict[str, Step] = {}
    contexts: dict[str, dict[int, Step]] = {}
    for full_name, fn in fns.items():
        name, _, reads = full_name.partition("@")  # a context bucket's graph: "decode@256"
        bucketed = _BUCKETED.fullmatch(name)
        if (bucketed is None and name not in _SINGLE) or (reads and not reads.isdigit()):
            raise GraphFormError(
                f"no engine step is named {name!r}: name the graphs as GraphSet.named() does "
                f"('prefill<bucket>', 'row_prefill<bucket>', {', '.join(map(repr, _SINGLE))}; '@<slots>' after "
                f"one reads that many K/V slots)"
            )
        if kv is not None and name not in ("vision", "audio"):
            fn = bind_kv_rows(fn, kv) if name.startswith("row_") else bind_kv(fn, kv)
        if reads:
            contexts.setdefault(name, {})[int(reads)] = fn
        elif bucketed is None:
            single[name] = fn
        else:
            (rows if bucketed.group(1) == "row_prefill" else prefill)[int(bucketed.group(2))] = fn
    return Steps(prefill=prefill, row_prefill=rows, contexts=contexts, **single)


def engine_over(
    model: LoadedModel,
    steps: Steps | Mapping[str, Step],
    graphs: GraphSet | DeviceGraph | None = None,
    *,
    kv: Sequence[torch.Tensor] | None = None,
    drafter: Drafter | None = None,
    batch: int | None = None,
    context_length: int | None = None,
    dtype: torch.dtype | None = None,
) -> Engine:
    """The engine over `steps` (a backend's `Steps`, or callables by name over `kv`: `named_steps`)
    for `model`'s host tables, vocabulary and softcap, shaped by `graphs`: a `GraphSet` (rows,
    context, dtype, draft slots, image blocks; `drafter` used when it has a verify graph) or the one
    `DeviceGraph` its steps share a shape with. Without graphs (modules compiled elsewhere: the
    Neuron recipes' steps), `batch`, `context_length` and `dtype` (float32 if None) say it."""
    if not isinstance(steps, Steps):
        steps = named_steps(steps, kv)
    elif kv is not None:
        raise GraphFormError("kv binds named callables; a Steps already holds its K/V: pass one or the other")
    if graphs is not None:
        if (batch, context_length, dtype) != (None, None, None):
            raise GraphFormError("the graphs fix the engine's rows, context and dtype: pass the graphs or those")
        shape = _shape(graphs)
    elif batch is None or context_length is None:
        raise GraphFormError("the engine needs its rows and context: pass the graphs, or batch and context_length")
    else:
        shape = {"batch": batch, "context_length": context_length, "dtype": dtype or torch.float32}
    verifies = shape.pop("verifies", steps.verify is not None)
    return Engine.for_model(model, steps, drafter=drafter if verifies else None, **shape)


def _shape(graphs: GraphSet | DeviceGraph) -> dict:
    """The engine's keyword arguments a graph set (or one graph) fixes."""
    if isinstance(graphs, GraphSet):
        target = graphs.target
        return {
            "batch": graphs.batch,
            "context_length": target.shape.context_length,
            "dtype": target.dtype,
            "draft_tokens": graphs.draft_tokens,
            "image_blocks": graphs.image_blocks,
            "audio_shape": tuple(graphs.audio.shape.key.values()) if graphs.audio is not None else None,
            "verifies": graphs.verify is not None,
        }
    return {
        "batch": graphs.shape.batch,
        "context_length": graphs.shape.context_length,
        "dtype": graphs.dtype,
        "image_blocks": bool(getattr(graphs, "image_blocks", False)),
    }
