"""What each backend is and runs, as plain flags: the one table the rest of the library reads
instead of comparing a backend's name.

It imports nothing of the library but `errors`, so `settings` checks a backend value against it
without loading any backend. `registry.BACKENDS` is this same table once each row's `compile` is
wired in (`registry`): a new backend is one module and one row (`Backend` is a `BackendFacts`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from ..errors import UnknownNameError


@dataclass(frozen=True)
class BackendFacts:
    """One backend's facts. The defaults describe a plain single-device CPU backend at TP 1 that
    compiles the in-place graphs and runs text: a new backend says only where it differs."""

    name: str
    compiler: str  # what compiles its graphs (the docs' table)
    runs_on: str
    selectable: bool = True  # a `PortSettings.backend` value (`gloo` is what cpu/eager run at TP > 1)
    inplace: bool = True  # the graph form it compiles: K/V updated in place, or returned (functional)
    cpu_balance: bool = False  # graphs built for one CPU thread's FLOPs per byte (else bytes decide)
    min_warmup: int = 0  # untimed runs its first calls need (xla compiles on the first call)
    takes_graphs: bool = False  # compiles prebuilt graphs a caller built (`graphs=`: the fault lab)
    quantizes_itself: bool = False  # reads only the graphs' shapes, int8 in its own layers: graphs stay full precision
    samples_drafts: bool = True  # runs sampled (rejection-sampling) drafted rows
    tp: bool = False  # runs TP > 1 itself (neuron: NeuronCores; gloo: CPU ranks)
    tp_ranks: str | None = None  # the row that runs it at TP > 1 when it does not itself (cpu, eager: gloo)
    rank_graphs: bool = False  # builds rank graphs (TP plan, dense verify), not `device.build`'s single-device ones
    bundles: bool = False  # its artifacts can be exported and run from a bundle
    # runs one-row prefill graphs: over a row's views of host K/V (`runtime.bind_kv_rows`), or, where
    # K/V are device states a graph takes whole (xla, neuron), as joins (`device.row_join`)
    row_prefill: bool = False
    # a greedy or plainly sampled decode step chooses the tokens on the device and returns their ids, not
    # `[B, vocab]` logits (`DeviceGraph.chooses`): the logits would cross a bus every step (xla: the lane's
    # stand-in for one)
    chooses_on_device: bool = False
    images: bool = False  # runs a prompt's images (the vision graph beside the decoder's)
    request_images: bool = False  # serves images per request (`vision=True` without images: the endpoint)
    image_blocks: bool = False  # its prefill graphs take the image blocks (the 12B's bidirectional image mask)
    audio: bool = False  # runs a prompt's clips (the audio graph beside the decoder's)
    int8: bool = False  # builds weight-only int8 linears (single-device graphs; NxD's quantized layers)
    assistant_drafts_only: bool = False  # its drafting graphs are built for Gemma-4's assistant alone
    device_bound: bool = False  # needs the Neuron SDK and an inf2 memory plan (checked before loading)
    checkpoint_dtype: str = "float32"  # what a released checkpoint is loaded as for it


# cpu and eager differ only in their compiler and bundles: eager compiles nothing to bundle
_CPU = BackendFacts(
    "cpu",
    "torch.export + AOTInductor, artifact cache",
    "any CPU",
    cpu_balance=True,
    takes_graphs=True,
    tp_ranks="gloo",
    bundles=True,
    row_prefill=True,
    images=True,
    request_images=True,
    image_blocks=True,
    audio=True,
    int8=True,
)
FACTS: dict[str, BackendFacts] = {
    f.name: f
    for f in (
        _CPU,
        replace(_CPU, name="eager", compiler="none: the same graphs, uncompiled", bundles=False),
        BackendFacts(
            "xla",
            "torch_xla (the front end torch-neuronx uses)",
            "CPU, .venv-xla",
            inplace=False,
            min_warmup=1,
            row_prefill=True,
            chooses_on_device=True,
            images=True,
            request_images=True,
            image_blocks=True,
            audio=True,
            int8=True,
        ),
        BackendFacts(
            "neuron",
            "the inf2 recipes in recipes/",
            "inf2",
            inplace=False,
            quantizes_itself=True,
            chooses_on_device=True,
            samples_drafts=False,
            tp=True,
            rank_graphs=True,
            bundles=True,
            row_prefill=True,
            images=True,
            request_images=True,
            audio=True,
            int8=True,
            assistant_drafts_only=True,
            device_bound=True,
            checkpoint_dtype="bfloat16",
        ),
        BackendFacts(
            "gloo",
            "none: one CPU process per TP rank",
            "any CPU (TP > 1)",
            selectable=False,
            samples_drafts=False,
            tp=True,
            rank_graphs=True,
            images=True,
            audio=True,
        ),
    )
}


def selectable() -> tuple[str, ...]:
    """The `PortSettings.backend` values (read when asked: a test may register a backend)."""
    return tuple(name for name, f in FACTS.items() if f.selectable)


def facts(name: str) -> BackendFacts:
    """The row of backend `name`; `UnknownNameError` naming the selectable ones."""
    if name not in FACTS:
        raise UnknownNameError("backend", name, selectable())
    return FACTS[name]


def row_at(name: str, tp_degree: int) -> BackendFacts:
    """The row that runs backend `name` at `tp_degree`: its own, or at TP > 1 the row it hands its
    ranks to (`cpu` at TP 2 runs on `gloo`)."""
    row = facts(name)
    if int(tp_degree) > 1 and not row.tp and row.tp_ranks is not None:
        return facts(row.tp_ranks)
    return row


def runs_tp(name: str) -> bool:
    """Whether backend `name` runs at TP > 1 (itself, or on the rows it hands its ranks to)."""
    row = facts(name)
    return row.tp or row.tp_ranks is not None


def runs_row_prefill(name: str, tp_degree: int) -> bool:
    """Where one-row prefill graphs run (the one statement of the rule: settings refuse, a server turns
    on): the running row's `row_prefill` (cpu at TP 2 runs gloo's, which has none)."""
    return row_at(name, tp_degree).row_prefill


def names_where(flag: Callable[[BackendFacts], bool]) -> str:
    """The selectable backends whose row has `flag`, quoted for a message: "'cpu', 'eager'"."""
    return ", ".join(repr(name) for name, f in FACTS.items() if f.selectable and flag(f))
