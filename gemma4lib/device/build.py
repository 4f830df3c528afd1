"""The device graphs a port compiles, by name: prefill graphs (one per bucket), then the decode
graph, or with a drafter the verify graph (k + 1 tokens) and, for Gemma-4's assistant, its draft graph;
for serving, one-row prefill graphs per bucket (`row_prefill{b}`) that a joining request runs alone.
With context buckets C (`PortSettings.context_buckets`), `decode@C`, `decode_ids@C` and `verify@C`
per bucket and `prefill{b}@C` (and `row_prefill{b}@C`) for every C >= b: the same graphs reading
only the first C slots of every full-length K/V buffer (`GraphShape.reads`; the engine runs the
smallest that covers the call's rows, `Engine.reading`), so each chunk of a long prompt reads the K/V
before it and its own, not the whole context.

Built over the model's own modules, so every backend (`cpu`, `eager`, `xla`, `neuron`) and the
benchmark suite take their graphs from here and nothing else decides their shapes: the batch, the
buckets, the context, the ring and the expert forms all come from the settings.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..errors import SettingsError
from ..models.image_attention import bidirectional_images
from .audio import AudioGraph, AudioShape
from .drafting import DraftGraph, RoomyLayout, verify_expert_form
from .graph import DeviceGraph, GraphShape
from .kv_layout import KVLayout
from .row_join import RowJoin
from .vision import VisionGraph, encoder_free, vision_graph

if TYPE_CHECKING:  # type names only
    from ..models.assistant import LoadedAssistant
    from ..models.loading import LoadedModel
    from ..settings import PortSettings

# Prefill computes every expert (the dense form) whatever `decode_experts` says. Short CPU prompts
# measured faster selective, but the gathered slices grow with tokens x k, and the dense form is the
# one that shards over TP ranks (docs/ROOFLINE.md; the benchmark suite reports this as its recommendation).
PREFILL_EXPERTS = "dense"


@dataclass
class GraphSet:
    """The named graphs of one port over one K/V layout (`layout`: rings with room for k + 1 when
    drafting). Exactly one of `decode` and `verify` is set."""

    prefill: dict[int, DeviceGraph]
    decode: DeviceGraph | None
    layout: KVLayout
    verify: DeviceGraph | None = None
    draft: DraftGraph | None = None
    draft_tokens: int = 0
    vision: VisionGraph | None = None  # pixels -> soft tokens, when the port has images (no K/V)
    audio: AudioGraph | None = None  # clips' features -> soft tokens, when the port has audio (no K/V)
    # batch 1 prefill graphs per bucket over one row of the batch's K/V (`runtime.bind_kv_rows`)
    row_prefill: dict[int, DeviceGraph | RowJoin] = field(default_factory=dict)
    # the loaded assistant the draft graph reads (drafting with it): loaded once per port, handed on
    assistant: LoadedAssistant | None = None
    # decode, verify and draft that return token ids, not logits (`DeviceGraph.chooses`: a device across a
    # bus): decode's row by row, verify's greedy verdict, the draft's argmax
    decode_ids: DeviceGraph | None = None
    verify_ids: DeviceGraph | None = None
    draft_ids: DraftGraph | None = None
    # context buckets by name, "decode@256": graphs reading the first 256 slots (module docstring)
    contexts: dict[str, DeviceGraph | RowJoin] = field(default_factory=dict)

    @property
    def image_blocks(self) -> bool:
        """Whether the prefill graphs take each token's image (`DeviceGraph.image_blocks`)."""
        return any(g.image_blocks for g in (*self.prefill.values(), *self.row_prefill.values()))

    def named(self) -> dict[str, nn.Module]:
        """Every graph by the name its compiled artifact and step carry."""
        out: dict[str, nn.Module] = {f"prefill{b}": g for b, g in sorted(self.prefill.items())}
        out.update({f"row_prefill{b}": g for b, g in sorted(self.row_prefill.items())})
        for name in ("decode", "decode_ids", "verify", "verify_ids", "draft", "draft_ids", "vision", "audio"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return {**out, **self.contexts}

    def __iter__(self) -> Iterator[tuple[str, nn.Module]]:
        return iter(self.named().items())

    @property
    def target(self) -> DeviceGraph:
        """The graph every step runs after the prefill: decode, or the verify."""
        return self.decode if self.decode is not None else self.verify

    @property
    def batch(self) -> int:
        return self.target.shape.batch

    def new_kv(self) -> list[torch.Tensor]:
        return self.target.new_kv()


def device_graph(
    model: LoadedModel,
    shape: GraphShape,
    expert_form: str,
    inplace: bool = True,
    weights: str = "bf16",
    compute_balance: float | None = None,
    *,
    layout: KVLayout | None = None,
    every_position: bool = False,
    hidden: bool = False,
    image_blocks: bool = False,
    chooses: bool = False,
) -> DeviceGraph:
    """One device graph over the model's own modules (not copies: a compiled graph takes the model's
    current weights at load time; with `weights="int8"` it holds int8 copies of the linears, made
    now); `device_graphs` and the benchmark suite's graph cache build with it. `compute_balance`:
    the target's FLOPs per byte, for a batched MoE's expert form (`experts.read_form`)."""
    return DeviceGraph(
        model.text_model,
        model.lm_head,
        layout or model.layout,
        shape,
        inplace=inplace,
        expert_form=expert_form,
        weights=weights,
        compute_balance=compute_balance,
        every_position=every_position,
        hidden=hidden,
        image_blocks=image_blocks,
        chooses=chooses,
    )


def device_graphs(
    model: LoadedModel,
    settings: PortSettings,
    inplace: bool = True,
    *,
    compute_balance: float | None = None,
    assistant: LoadedAssistant | None = None,
    chooses: bool | None = None,
) -> GraphSet:
    """The graphs of `settings` over the model's own modules (`graph_set` with the settings' shapes).
    `inplace=False`: the functional form (XLA, Neuron). `compute_balance`: the backend's FLOPs per
    byte (one CPU thread's for cpu/eager; None, bytes decide, elsewhere). `chooses`: also the steps
    that return token ids (`GraphSet.decode_ids`, or `verify_ids` and `draft_ids` when drafting); None:
    where the settings' backend builds them (`PortSettings.builds_decode_ids`)."""
    graphs = graph_set(
        model,
        batch=settings.batch_size,
        context_length=settings.context_length,
        ring=settings.ring_kv,
        weights=settings.weights,
        prefill_buckets=settings.prefill_buckets,
        context_buckets=settings.context_buckets,
        decode_experts=settings.decode_experts,
        draft_tokens=int(settings.draft_tokens or 0) if settings.draft else 0,
        verify_experts=settings.verify_experts,
        hidden=settings.draft == "assistant",
        inplace=inplace,
        compute_balance=compute_balance,
        assistant=assistant,
        vision=image_graph(model, settings),
        row_prefill=settings.builds_row_prefill,
        chooses=settings.builds_decode_ids if chooses is None else chooses,
    )
    graphs.audio = audio_graph(model, settings)
    return graphs


def graph_set(
    model: LoadedModel,
    *,
    batch: int,
    context_length: int,
    ring: bool,
    prefill_buckets: tuple[int, ...],
    context_buckets: tuple[int, ...] = (),
    weights: str = "bf16",
    decode_experts: str = "selective",
    draft_tokens: int = 0,
    verify_experts: str | None = None,
    hidden: bool = False,
    inplace: bool = True,
    compute_balance: float | None = None,
    assistant: LoadedAssistant | None = None,
    vision: VisionGraph | None = None,
    row_prefill: bool = False,
    chooses: bool = False,
) -> GraphSet:
    """The named graphs over the model's own modules from explicit shapes (what `device_graphs` reads
    from the settings; the benchmark suite builds its drafted graphs for models that have no
    `PortSettings` variant, the medium configs and Gemma 3 270M, through here): prefill per bucket
    (MoE experts dense) and decode (`decode_experts`); with `draft_tokens` k > 0 the verify graph
    instead of decode (every position, its MoE form by bytes: `verify_expert_form`) and, with
    `hidden` (the assistant drafts from the target's hidden state), the assistant's draft graph,
    all over one layout whose rings hold window + k + 1 slots (`drafting` module docstring); `vision`, the
    image encoder's graph (`image_graph`), rides beside them; `row_prefill`, the prefill graphs again
    at batch 1 (the same layout: they run over one row of the batch's buffers); `context_buckets`, the
    graphs that read fewer slots (module docstring; the context itself is implied)."""
    k = int(draft_tokens)
    layout = RoomyLayout.around(model.layout, k + 1) if k else model.layout
    sizes = [c for c in context_buckets if c < context_length]
    contexts: dict[str, DeviceGraph | RowJoin] = {}

    def graph(tokens: int, experts: str, rows: int = batch, reads: int | None = None, **kwargs) -> DeviceGraph:
        shape = GraphShape(rows, tokens, context_length, ring, reads)
        return device_graph(model, shape, experts, inplace, weights, layout=layout, **kwargs)

    def keyed(name: str, tokens: int, experts: str, sizes=sizes, **kwargs) -> DeviceGraph:
        """Graph `name` over the whole context; the same at each of `sizes` goes into `contexts`."""
        contexts.update({f"{name}@{c}": graph(tokens, experts, reads=c, **kwargs) for c in sizes})
        return graph(tokens, experts, **kwargs)

    # an image's tokens see each other on a config bidirectional over them: its prefills take the blocks
    blocks = vision is not None and bidirectional_images(model.config)
    firsts = {b: [c for c in sizes if c >= b] for b in prefill_buckets}  # the buckets a chunk of b can read
    prefill = {
        b: keyed(f"prefill{b}", b, PREFILL_EXPERTS, firsts[b], hidden=hidden, image_blocks=blocks) for b in firsts
    }
    rows = {
        b: keyed(f"row_prefill{b}", b, PREFILL_EXPERTS, firsts[b], rows=1, hidden=hidden, image_blocks=blocks)
        for b in prefill_buckets
        if row_prefill
    }
    if not inplace:  # functional: joins (`row_join`)
        rows = {b: RowJoin(g, batch) for b, g in rows.items()}
        contexts.update({n: RowJoin(g, batch) for n, g in contexts.items() if n.startswith("row_")})
    if not k:
        decode = keyed("decode", 1, decode_experts, compute_balance=compute_balance)
        ids = keyed("decode_ids", 1, decode_experts, compute_balance=compute_balance, chooses=True) if chooses else None
        return GraphSet(prefill, decode, layout, vision=vision, row_prefill=rows, decode_ids=ids, contexts=contexts)
    verify_form = verify_expert_form(model.config, k, verify_experts)
    verifying = dict(every_position=True, hidden=hidden, compute_balance=compute_balance)
    verify = keyed("verify", k + 1, verify_form, **verifying)
    verify_ids = keyed("verify_ids", k + 1, verify_form, chooses=True, **verifying) if chooses else None
    draft = draft_ids = None
    if hidden:
        if assistant is None:
            raise SettingsError(
                "draft='assistant' builds the assistant's draft graph: pass assistant=load_assistant(...)"
            )
        one = GraphShape(batch, 1, context_length, ring)
        draft = DraftGraph(assistant.model, layout, one, assistant.read_layers)
        draft_ids = DraftGraph(assistant.model, layout, one, assistant.read_layers, chooses=True) if chooses else None
        for name, graph in (("draft", draft), ("draft_ids", draft_ids)):
            contexts.update({f"{name}@{c}": graph.at(replace(one, reads=c)) for c in sizes if graph is not None})
    assistant = assistant if draft is not None else None
    return GraphSet(
        prefill,
        None,
        layout,
        verify,
        draft,
        k,
        vision=vision,
        row_prefill=rows,
        assistant=assistant,
        contexts=contexts,
        verify_ids=verify_ids,
        draft_ids=draft_ids,
    )


def image_graph(model: LoadedModel, settings: PortSettings) -> VisionGraph | None:
    """The vision graph when the settings carry images: one image per call, at the patch budget of
    the model's image processor (its `max_soft_tokens` x pooling^2 patches); None without images."""
    if not settings.wants_vision:
        return None
    from ..images import require_vision

    require_vision(model.multimodal, model.processor, f"the {model.source} {model.variant.name} model")
    processor = model.processor
    patches = int(processor.max_soft_tokens) * int(processor.pooling_kernel_size) ** 2
    vision_config = model.multimodal.config.vision_config
    if encoder_free(model.multimodal):  # the 12B: merged patches, one soft token each
        patches = int(processor.max_soft_tokens)
        patch_dim = 3 * (int(vision_config.patch_size) * int(vision_config.pooling_kernel_size)) ** 2
    else:
        patch_dim = 3 * int(vision_config.patch_size) ** 2
    return vision_graph(model.multimodal, 1, patches, patch_dim)


def audio_graph(model: LoadedModel, settings: PortSettings) -> AudioGraph | None:
    """The audio graph of the settings' clips, one a call at the longest one's frames (as transformers pads
    them); a server that hears: 30 s."""
    if not settings.wants_audio:
        return None
    from ..models.audio import graph_shape

    return AudioGraph(model.multimodal, AudioShape(*graph_shape(settings.audio, model.variant.unified)))
