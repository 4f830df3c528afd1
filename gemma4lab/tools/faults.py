"""The fault lab: the field report's bugs (README, "The family at a glance") and graph-level faults,
each switchable, each run through the real port and judged by `port`'s own verdict (`checks.failed_checks`).

Every fault is off unless asked for. Each run is the default smoke port of the trained fixture:
SEQ_MATCH, LOGITS_MATCH and coherence on the trained model, plus SEQ_MATCH and LOGITS_MATCH on
the random-weights witness run through the same (faulty) compiled graphs. A fault is caught when
any of them fails; the lab reports which did, and the logit error the fault caused next to the
tolerance it crossed.

| fault | where it lives | trained run: SEQ_MATCH, LOGITS_MATCH, coherent | witness |
|---|---|---|---|
| Gemma 3 turn tokens hand-written into the prompt | host, shared w/ reference | ok, ok, FAIL | ok |
| word-embedding scale wired wrong | host, shared w/ reference | ok, ok, FAIL | ok |
| PLE scale wired wrong | host, shared w/ reference | ok, ok, FAIL | ok |
| every `layer_scalar` left at its init value | device weights | FAIL, FAIL, FAIL | FAIL |
| one layer's `layer_scalar` left at its init value | device weights | ok, FAIL, ok | FAIL |
| a KV-sharing consumer reading the wrong producer | device graph | FAIL, FAIL, FAIL | FAIL |
| the sliding-window mask one key too wide | device masks | ok, FAIL, ok | FAIL |
| RoPE theta swapped between sliding and full layers | device graph | FAIL, FAIL, FAIL | FAIL |
| decode writes each token's K/V one slot ahead | decode graph only | FAIL, FAIL*, FAIL | FAIL |
| decode's sliding-window mask one key short | decode graph only | FAIL, FAIL*, FAIL | FAIL |
| tensor-parallel rank read at trace time | device graph (TP) | FAIL, FAIL, FAIL | FAIL |
| an image's soft tokens written one position late | host runtime (image) | ok, FAIL, ok | FAIL |
| soft tokens scaled by sqrt(hidden) like words | device vision graph | ok, FAIL, ok | FAIL |
| the host's log-mel on the Slaney mel scale | host, shared w/ reference (audio) | ok, ok, FAIL | ok |
| the host's extractor hopping 20 ms, not 10 | host, shared w/ reference (audio) | ok, ok, FAIL | ok |
| one audio placeholder too few in the device's prompt | host runtime (audio) | refused | - |
| a padded clip's padding slots kept as soft tokens | device audio graph | refused | - |
| the conformer attending a padded clip's padding frames | device audio graph | ok, ok, ok | ok |

(* from decode step 1 on: the prefill logits are exact, so a prefill-only logit gate passes.)
The image faults run the trained vision fixture on the red circle (`port --image`). Both leave its
answer "A red circle." (its margins are wide: one soft token more or less, or all of them 16x too
large, still reads as red and round), so SEQ_MATCH and coherence pass; the prefill logits move by
2.0 and 4.6 against a tolerance of 6.6e-5 (eager, measured here) and the witness's tokens change.
The audio faults play the fixture that hears "What is the capital of France?" (`port --audio`): the
reference is handed the host's own features (`reference.MediaBound`), so a wrong mel scale or hop is
shared with it and only coherence sees it (the answers: "What is the capital of Switzerland?", "Brazil").
A miscounted placeholder, or padding slots kept, is refused by the engine's count check (an
`AudioInputError`: `port` fails before any check). The conformer attending padding is caught by nothing,
because it changes nothing: its attention and convolutions are causal and the extractor zeroes padded
frames, so a clip's trailing padding never reaches a kept soft token (logits bit-equal to the clean run's,
with "France" padded from 95 to 215 frames); `uncaught` in the report lists it.
A fault shared by device and reference is invisible to both equality checks: only coherence sees
it. A device fault that moves the logits by ~0.1 leaves a confident model's tokens and answer
unchanged: only LOGITS_MATCH and the witness, whose near-ties turn logit errors into other
tokens, see it. `python -m gemma4lab faults --json` gives, per fault, the checks that caught it
and the logit error against the tolerance it crossed.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from gemma4lib.backends import gloo
from gemma4lib.backends.base import DeviceRun
from gemma4lib.backends.registry import run_device
from gemma4lib.checks import failure_reasons
from gemma4lib.device.audio import AudioGraph
from gemma4lib.device.graph import DeviceGraph, ExplicitKV, _shallow_clone
from gemma4lib.device.kv_layout import FULL, SLIDING, KVLayout
from gemma4lib.device.vision import VisionGraph
from gemma4lib.errors import Gemma4LibError, TensorParallelError
from gemma4lib.models.loading import LoadedModel
from gemma4lib.models.variants import MOE_VARIANT
from gemma4lib.port import (
    PortSettings,
    PromptRow,
    build_graphs,
    eos_ids,
    load_model,
    prompt_rows,
    record_run,
    requests_for,
    witness_record,
    witness_settings,
)
from gemma4lib.runtime import Request

log = logging.getLogger(__name__)

GEMMA3_CHAT = "<bos><start_of_turn>user\n{prompt}<end_of_turn>\n<start_of_turn>model\n"

# Where a fault lives decides whether the witness gets it too. Device (and TP) faults live in the
# graphs, the compiler or the runtime, which the witness shares: it gets them. Prompt and host
# faults live in the trained model's inputs or weights, shared with its reference; `port` builds
# the witness independently (its own seeded weights and prompt), so it runs clean. (Applying a
# weight change to the witness would also void the margins its seed was chosen for: with the
# embedding scale unwired, the compiled witness flips a near-tie at token 24.)
PROMPT, HOST, DEVICE, TP = "prompt", "host", "device", "tp"
# the host's own audio features: the device hears them, the reference does not (it runs transformers' extractor
# on the raw clip, `reference.MediaBound`), and the witness runs clean
FEATURES = "host features"
# the clip the audio faults (and their clean run) play the fixture that hears (its words: the answer);
# the mask fault plays a shorter clip before it, padded to its length (a mask changes only padding)
FAULT_CLIP, SHORT_CLIP = "capital_of_france.wav", "france.wav"
BOTH_SAY = "France"  # what a coherent answer to the two clips names (their words: "France", "... of France?")
# a fault the library's own guards refuse before any check runs (the port fails with that error)
REFUSED = "refused"


GraphEdit = Callable[[DeviceGraph], None]


@dataclass
class FaultRun:
    """What one fault (or the clean baseline) does to one port."""

    model: LoadedModel
    settings: PortSettings
    rows: list[PromptRow]
    # a runtime fault: what the device's requests get that the reference's prompt does not
    request_edit: Callable[[Request], Request] | None = None


@dataclass(frozen=True)
class Fault:
    name: str
    description: str
    variant: str
    # checks that must fail (names as `checks.failed_checks` gives them); for faults shared with
    # the reference, exactly these and no other
    caught_by: tuple[str, ...]
    apply: Callable[[FaultRun], GraphEdit | None]
    scope: str = DEVICE
    tp_degree: int = 1
    images: bool = False  # run on the trained vision fixture with a sample image
    audio: tuple[str, ...] = ()  # shipped clips (`CLIPS_DIR`) the fixture that hears is played

    @property
    def shared_with_reference(self) -> bool:
        return self.scope in (PROMPT, HOST)


# ---- host faults (shared with the reference) ----------------------------------------------------
def gemma3_chat_prompt(run: FaultRun) -> None:
    """Build the chat prompt by hand with Gemma 3's turn markers: ordinary text to Gemma-4."""
    text = GEMMA3_CHAT.format(prompt=run.settings.prompt)
    run.rows = [replace(run.rows[0], ids=run.model.tokenizer(text, add_special_tokens=False)["input_ids"])]


def embedding_scale_unwired(run: FaultRun) -> None:
    """Word embeddings without their sqrt(hidden) scale, on the host and in the reference alike."""
    run.model.text_model.embed_tokens.embed_scale.fill_(1.0)


def ple_scale_unwired(run: FaultRun) -> None:
    """PLE token table without its sqrt(ple_dim) scale, on the host and in the reference alike."""
    run.model.text_model.embed_tokens_per_layer.embed_scale.fill_(1.0)


# ---- device faults ---------------------------------------------------------------------------
def layer_scalar_at_init(run: FaultRun) -> GraphEdit:
    """The device weights carry every `layer_scalar` at its init value 1 (the checkpoint's dropped).

    This is what happens when a loader shards parameters but not buffers (transformers holds the
    scalar as a buffer). The program is the clean one (every weight is loaded at run time), so the
    compiled lab runs the clean run's compile with these weights.
    """

    def edit(graph: DeviceGraph) -> None:
        for layer in graph.model.layers:
            layer.layer_scalar = nn.Parameter(torch.ones_like(layer.layer_scalar), requires_grad=False)

    return edit


ONE_SCALAR_LAYER = 5  # its scalar 0.28 -> 1 moves the trained logits by ~0.1 and no token


def one_layer_scalar_at_init(run: FaultRun, layer_index: int = ONE_SCALAR_LAYER) -> GraphEdit:
    """One layer's `layer_scalar` left at 1 on the device (a loader that missed one buffer)."""

    def edit(graph: DeviceGraph) -> None:
        layer = graph.model.layers[layer_index]
        layer.layer_scalar = nn.Parameter(torch.ones_like(layer.layer_scalar), requires_grad=False)

    return edit


def wrong_kv_producer(run: FaultRun) -> GraphEdit:
    """Sliding-window consumers read the first sliding layer's K/V instead of the last one's."""
    layout = run.model.layout
    consumer = next(lay for lay in layout.consumers if lay.layer_type == SLIDING)
    right = consumer.producer
    wrong = next(lay.index for lay in layout.producers if lay.layer_type == consumer.layer_type and lay.index != right)

    def edit(graph: DeviceGraph) -> None:
        for index, stores in ((right, False), (wrong, True)):
            layer = graph.model.layers[index]
            layer.self_attn = _shallow_clone(layer.self_attn)
            layer.self_attn.store_full_length_kv = stores
        graph.tags["fault"] = f"kv_producer_{wrong}_for_{right}"

    return edit


@dataclass(frozen=True)
class MaskWindowLayout(KVLayout):
    """A layout whose masks use `sliding_window` while its buffers keep `buffer_window` slots:
    what a mask built with an off-by-one window does to graphs whose buffers are right."""

    buffer_window: int = 0

    def slots(self, layer_type: str, context_length: int, ring: bool) -> int:
        if layer_type == SLIDING and ring:
            return min(self.buffer_window, context_length)
        return context_length


def _shift_mask_window(graph: DeviceGraph, delta: int, tag: str) -> None:
    layout = graph.layout
    graph.layout = MaskWindowLayout(
        layout.layers, layout.sliding_window + delta, layout.num_attention_heads, buffer_window=layout.sliding_window
    )
    graph.tags["fault"] = tag


def sliding_window_off_by_one(run: FaultRun) -> GraphEdit:
    """The device's sliding mask keeps keys with q - k <= window (one too many) in every graph."""

    def edit(graph: DeviceGraph) -> None:
        _shift_mask_window(graph, +1, "sliding_window+1")

    return edit


def decode_mask_window_short(run: FaultRun) -> GraphEdit:
    """Only the decode graph's sliding mask drops the oldest key of the window (window - 1)."""

    def edit(graph: DeviceGraph) -> None:
        if graph.shape.phase == "decode":
            _shift_mask_window(graph, -1, "decode_sliding_window-1")

    return edit


def _retheta(inv_freq: torch.Tensor, theta_from: float, theta_to: float) -> torch.Tensor:
    """RoPE frequencies theta^(-2i/d) recomputed for another theta (zeros, the unrotated part of a
    partial RoPE, stay zero)."""
    return inv_freq.clamp(min=0) ** (math.log(theta_to) / math.log(theta_from))


def rope_theta_swapped(run: FaultRun) -> GraphEdit:
    """Sliding layers rotate with the full layers' RoPE theta and full layers with the sliding one's
    (each keeps its own head_dim and partial factor): the per-type RoPE parameters mixed up."""
    params = run.model.config.rope_parameters
    theta = {t: float(params[t]["rope_theta"]) for t in (SLIDING, FULL)}
    swap = {SLIDING: FULL, FULL: SLIDING}

    def edit(graph: DeviceGraph) -> None:
        rotary = _shallow_clone(graph.model.rotary_emb)
        for layer_type, other in swap.items():
            name = f"{layer_type}_inv_freq"
            rotary._buffers[name] = _retheta(getattr(rotary, name), theta[layer_type], theta[other])
        graph.model.rotary_emb = rotary
        graph.tags["fault"] = "rope_theta_swapped"

    return edit


class AheadDecodeWrite(ExplicitKV):
    """Decode writes each new token's K/V at slot position + 1 (prefill writes stay right)."""

    def _write(self, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        if self.tokens != 1:
            return super()._write(old, new)
        start, self.start = self.start, self.start + 1  # every row's write, one slot ahead
        try:
            return super()._write(old, new)
        finally:
            self.start = start


def decode_kv_write_ahead(run: FaultRun) -> GraphEdit:
    """Only the decode graph writes each token's K/V one slot ahead of its position."""

    def edit(graph: DeviceGraph) -> None:
        if graph.shape.phase == "decode":
            graph.kv_class = AheadDecodeWrite
            graph.tags["fault"] = "decode_kv_write_ahead"

    return edit


# ---- image faults: where the soft tokens go, and at what size -----------------------------------
def soft_tokens_one_late(run: FaultRun) -> None:
    """The host writes each image's soft tokens one position late (the last over `<image|>`): an
    off-by-one in the placement; the reference places them where the processor said."""

    def shift(request: Request) -> Request:
        images = request.media
        if images is None:
            return request
        return replace(request, media=replace(images, positions=tuple(p + 1 for p in images.positions)))

    run.request_edit = shift


class _Scaled(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module, factor: float):
        super().__init__()
        self.inner, self.factor = inner, float(factor)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.inner(*args, **kwargs) * self.factor


def soft_tokens_word_scaled(run: FaultRun) -> GraphEdit:
    """The device's vision graph scales its soft tokens by sqrt(hidden), as the word embeddings
    are: the soft tokens joined the embedding stream before the scale, not after it."""
    factor = math.sqrt(int(run.model.lm.config.hidden_size))

    def edit(graph: Any) -> None:
        if not isinstance(graph, VisionGraph):
            return
        # a copy: the graph shares the model's embedder with the reference, which must stay right
        graph.model.embed_vision = _Scaled(copy.deepcopy(graph.model.embed_vision), factor)
        graph.tags["fault"] = "soft_tokens_word_scaled"

    return edit


# ---- audio faults: the host's features, the placeholder count, the encoder's mask ---------------
@contextmanager
def _host_extractor(**constants: Any) -> Iterator[None]:
    """`gemma4lib.models.audio`'s extractor constants swapped while the host builds a prompt."""
    from gemma4lib.models import audio as hearing

    saved = {name: getattr(hearing, name) for name in constants}
    for name, value in constants.items():
        setattr(hearing, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(hearing, name, value)


def mel_scale_slaney(run: FaultRun) -> None:
    """The host's log-mel with librosa's default Slaney mel scale, not the extractor's HTK one: the features
    the device hears (the reference runs transformers' extractor on the raw clip)."""
    from transformers.audio_utils import mel_filter_bank

    from gemma4lib.models import audio as hearing

    slaney = mel_filter_bank(
        num_frequency_bins=hearing.FFT // 2 + 1,
        num_mel_filters=hearing.MELS,
        min_frequency=0.0,
        max_frequency=hearing.RATE / 2,
        sampling_rate=hearing.RATE,
        norm=None,
        mel_scale="slaney",
    )
    with _host_extractor(_FILTERS=slaney):
        run.rows = prompt_rows(run.model, run.settings)


def hop_20ms(run: FaultRun) -> None:
    """The host's extractor steps 20 ms (320 samples) a frame, not 10 ms: half the frames, and the soft-token
    count (read from the same frames) halved with them; the reference's extractor counts twice as many."""
    from gemma4lib.models import audio as hearing

    with _host_extractor(HOP=2 * hearing.HOP):
        run.rows = prompt_rows(run.model, run.settings)


def audio_placeholders_one_short(run: FaultRun) -> None:
    """The device's prompt has one `<|audio|>` placeholder too few for the clip (a count rule off by
    one); the reference's prompt has the processor's count."""

    def drop_last(request: Request) -> Request:
        media = request.media
        if media is None or not media.audio:
            return request
        last = media.audio_positions[-1]
        ids = [t for i, t in enumerate(request.prompt_ids) if i != last]
        counts = (*media.audio_counts[:-1], media.audio_counts[-1] - 1)
        media = replace(media, audio_counts=counts, audio_positions=media.audio_positions[:-1])
        return replace(request, prompt_ids=ids, media=media)

    run.request_edit = drop_last


class _MaskFault(torch.nn.Module):
    """The conformer with its mask wrong: run as if every frame were valid (`padding_attended`, the valid
    soft tokens still picked by the real mask), or run right with every slot reported valid."""

    def __init__(self, tower: torch.nn.Module, padding_attended: bool):
        super().__init__()
        self.tower, self.padding_attended = tower, padding_attended

    def forward(self, features: torch.Tensor, mask: torch.Tensor, **kwargs: Any) -> Any:
        out = self.tower(features, torch.ones_like(mask) if self.padding_attended else mask, **kwargs)
        # the subsampling's own mask of the real frames (two stride-2 steps), or every slot
        out.attention_mask = mask[:, ::2][:, ::2] if self.padding_attended else torch.ones_like(out.attention_mask)
        return out


def _audio_mask_edit(padding_attended: bool, tag: str) -> GraphEdit:
    def edit(graph: Any) -> None:
        if isinstance(graph, AudioGraph) and graph.model.audio_tower is not None:
            graph.model.audio_tower = _MaskFault(graph.model.audio_tower, padding_attended)
            graph.tags["fault"] = tag

    return edit


def audio_padding_attended(run: FaultRun) -> GraphEdit:
    """The audio graph hands the conformer an all-valid mask: padding frames convolved and attended."""
    return _audio_mask_edit(True, "audio_padding_attended")


def audio_valid_mask_ignored(run: FaultRun) -> GraphEdit:
    """The audio graph reports every soft-token slot valid: a padded clip's padding slots kept."""
    return _audio_mask_edit(False, "audio_valid_mask_ignored")


def baked_tp_rank(run: FaultRun) -> None:
    """Marker: handled by the TP runner (every rank computes rank 0's experts)."""


FAULTS: tuple[Fault, ...] = (
    Fault(
        "gemma3_chat_tokens",
        "chat prompt hand-built with Gemma 3's <start_of_turn> text",
        "e2b",
        ("coherence",),
        gemma3_chat_prompt,
        PROMPT,
    ),
    Fault(
        "embedding_scale",
        "word-embedding scale missing on host and reference",
        "e2b",
        ("coherence",),
        embedding_scale_unwired,
        HOST,
    ),
    Fault("ple_scale", "PLE scale missing on host and reference", "e2b", ("coherence",), ple_scale_unwired, HOST),
    Fault(
        "layer_scalar_at_init",
        "layer_scalar buffers left at init in the device weights",
        "e2b",
        ("seq_match", "logits_match"),
        layer_scalar_at_init,
    ),
    Fault(
        "one_layer_scalar_at_init",
        f"layer {ONE_SCALAR_LAYER}'s layer_scalar left at init in the device weights",
        "e2b",
        ("logits_match",),
        one_layer_scalar_at_init,
    ),
    Fault(
        "wrong_kv_producer",
        "a KV-sharing consumer reads the wrong producer",
        "e2b",
        ("seq_match", "logits_match"),
        wrong_kv_producer,
    ),
    Fault(
        "sliding_window_off_by_one",
        "device sliding-window masks keep one key too many",
        "e2b",
        ("logits_match",),
        sliding_window_off_by_one,
    ),
    Fault(
        "rope_theta_swapped",
        "RoPE theta swapped between sliding and full layers on the device",
        "e2b",
        ("logits_match",),
        rope_theta_swapped,
    ),
    Fault(
        "decode_kv_write_ahead",
        "decode graph writes each token's K/V one slot ahead",
        "e2b",
        ("logits_match",),
        decode_kv_write_ahead,
    ),
    Fault(
        "decode_mask_window_short",
        "decode graph's sliding mask drops the window's oldest key",
        "e2b",
        ("logits_match",),
        decode_mask_window_short,
    ),
    Fault(
        "soft_tokens_one_late",
        "an image's soft tokens written one prompt position late",
        "e2b",
        ("logits_match",),
        soft_tokens_one_late,
        images=True,
    ),
    Fault(
        "soft_tokens_word_scaled",
        "the vision graph scales its soft tokens by sqrt(hidden), as words are",
        "e2b",
        ("logits_match",),
        soft_tokens_word_scaled,
        images=True,
    ),
    Fault(
        "mel_scale_slaney",
        "the host's log-mel on the Slaney mel scale, not HTK",
        "e2b",
        ("seq_match", "logits_match", "coherence"),
        mel_scale_slaney,
        FEATURES,
        audio=(FAULT_CLIP,),
    ),
    Fault(
        "hop_20ms",
        "the host's extractor hops 20 ms, not 10 ms",
        "e2b",
        (REFUSED,),  # by the reference: its extractor's soft-token count is not the prompt's
        hop_20ms,
        FEATURES,
        audio=(FAULT_CLIP,),
    ),
    Fault(
        "audio_placeholders_one_short",
        "the device's prompt has one audio placeholder too few",
        "e2b",
        (REFUSED,),
        audio_placeholders_one_short,
        audio=(FAULT_CLIP,),
    ),
    Fault(
        "audio_padding_attended",
        "the audio graph's conformer runs a padded clip's padding frames as valid",
        "e2b",
        (),  # no check: the conformer is causal, so trailing padding never reaches a kept soft token
        audio_padding_attended,
        audio=(SHORT_CLIP, FAULT_CLIP),
    ),
    Fault(
        "audio_valid_mask_ignored",
        "the audio graph reports a padded clip's padding slots as soft tokens",
        "e2b",
        (REFUSED,),
        audio_valid_mask_ignored,
        audio=(SHORT_CLIP, FAULT_CLIP),
    ),
    Fault(
        "baked_tp_rank",
        "tensor-parallel rank read at trace time (MoE experts of rank 0 everywhere)",
        MOE_VARIANT,  # the rank bug lives in the experts' split
        ("seq_match",),
        baked_tp_rank,
        TP,
        tp_degree=2,
    ),
)


def get_fault(name: str) -> Fault:
    for fault in FAULTS:
        if fault.name == name:
            return fault
    from gemma4lib.errors import UnknownNameError

    raise UnknownNameError("fault", name, tuple(f.name for f in FAULTS))


# ---- the lab's backend: the settings' own, with the fault installed -------------------------
@dataclass
class FaultyBackend:
    """The backend `settings` select, with a fault installed where it lives: a graph edit applied
    to the built graphs before they compile (single device), or the TP rank baked in at trace
    time (the gloo ranks). `port` itself has no hook for either."""

    edit: GraphEdit | None = None
    baked_rank: bool = False

    def run(self, run: FaultRun, eos: list[int]) -> DeviceRun:
        settings, requests = run.settings, requests_for(run.rows, run.settings, eos)
        if run.request_edit is not None:
            requests = [run.request_edit(r) for r in requests]
        graphs = None
        if self.baked_rank:  # the gloo ranks' graph form, with the rank read at trace time
            graphs = gloo.rank_graphs(run.model, settings, baked_rank=True)
        elif self.edit is not None and settings.tp_degree > 1:
            raise TensorParallelError("graph edits apply to the single-device graphs; run them at tp_degree 1")
        elif self.edit is not None:
            graphs = build_graphs(run.model, settings)
            for _, graph in graphs:
                self.edit(graph)  # an edit leaves alone the graphs its fault does not live in
        return run_device(run.model, settings, requests, graphs=graphs, bench=False)


def _backend_for_fault(fault: Fault | None, run: FaultRun, shared: bool = True) -> FaultyBackend:
    """The lab's backend for `run`: the fault installed when it lives where this run runs."""
    if fault is None or not shared:
        return FaultyBackend()
    return FaultyBackend(edit=fault.apply(run), baked_rank=fault.scope == TP)


# ---- running them ----------------------------------------------------------------------------
# what the lab reports of each run's (and its witness's) LOGITS_MATCH
LOGITS_KEYS = (
    "logits_max_err",
    "logits_tolerance",
    "logits_worst_position",
    "logits_worst_phase",
    "logits_prefill_max_err",
    "logits_decode_max_err",
    "logits_explain",
)
WITNESS_KEYS = ("seq_match", "first_mismatch", "reference_min_margin", "logits_match", *LOGITS_KEYS)


def _witness(fault: Fault | None, settings: PortSettings) -> dict[str, Any]:
    """The random-weights witness, with the fault when it lives where the witness runs too
    (graphs, compiler, runtime: DEVICE and TP scope)."""
    w = witness_settings(settings)
    model = load_model(w)
    run = FaultRun(model, w, prompt_rows(model, w, vary=False))
    shared = fault is not None and fault.scope in (DEVICE, TP)
    device_run = _backend_for_fault(fault, run, shared).run(run, [])
    return witness_record(model, w, run.rows, device_run)


# the image the image faults (and their clean run) show the trained vision fixture
FAULT_IMAGE = "red_circle.png"


def run_one(
    variant: str,
    fault: Fault | None = None,
    tp_degree: int = 1,
    cache_dir: str | None = None,
    backend: str = "cpu",
    images: bool = False,
    audio: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Port the trained tiny `variant` with `fault` switched on (None: the clean run), witness
    included, and judge it with `port`'s own verdict; `images` (or an image fault): the trained
    vision fixture on a sample image; `audio` (or an audio fault's): the fixture that hears on shipped clips."""
    from gemma4lib.images import SAMPLES_DIR
    from gemma4lib.models.audio import CLIPS_DIR

    started = time.perf_counter()
    images = images or (fault is not None and fault.images)
    audio = fault.audio if fault is not None and fault.audio else audio
    shown = (str(SAMPLES_DIR / FAULT_IMAGE),) if images else ()
    heard = tuple(str(CLIPS_DIR / clip) for clip in audio)
    settings = PortSettings(
        variant=variant,
        model="trained",
        tp_degree=tp_degree,
        cache_dir=cache_dir,
        backend=backend,
        images=shown,
        audio=heard,
        **({"expect": BOTH_SAY} if len(heard) > 1 else {}),
    )
    model = load_model(settings)
    run = FaultRun(model, settings, prompt_rows(model, settings))
    eos = eos_ids(model)
    try:
        device_run = _backend_for_fault(fault, run).run(run, eos)
    except Gemma4LibError as error:
        if fault is None or REFUSED not in fault.caught_by:
            raise
        outcome = _refused(fault, error)  # no witness: it is refused too
    else:
        outcome = _judged(fault, settings, model, run, eos, device_run, started)
    return {
        "fault": fault.name if fault else "clean",
        "description": fault.description if fault else "no fault",
        "variant": variant,
        "tp_degree": tp_degree,
        "images": list(shown),
        "audio": list(heard),
        "backend": backend,
        "scope": fault.scope if fault else None,
        **outcome,
        "seconds": round(time.perf_counter() - started, 1),
    }


def _judged(
    fault: Fault | None, settings: PortSettings, model: Any, run: FaultRun, eos: Any, device_run: Any, started: float
) -> dict[str, Any]:
    """A run's checks by `port`'s own verdict, the witness's, and whether they are the predicted ones."""
    witness = _witness(fault, settings)
    record = record_run(settings, model, run.rows, eos, device_run, started, witness)
    failed = record["failed_checks"]
    as_predicted = True
    if fault is not None:  # shared with the reference, or caught by nothing: exactly the predicted checks
        predicted = set(fault.caught_by)
        exact = fault.shared_with_reference or not predicted
        as_predicted = set(failed) == predicted if exact else predicted <= set(failed)
    return {
        "seq_match": record["seq_match"],
        "logits_match": record["logits_match"],
        "coherent": record["coherent"],
        "caught": bool(failed),
        "caught_by": failed,
        "reasons": failure_reasons(record),
        "predicted_checks": list(fault.caught_by) if fault else [],
        "as_predicted": as_predicted,
        **{k: record.get(k) for k in LOGITS_KEYS},
        "witness": {k: witness.get(k) for k in WITNESS_KEYS},
        "answer": record["answer"],
        "reference_answer": record["reference_answer"],
    }


def _refused(fault: Fault, error: Exception) -> dict[str, Any]:
    """The outcome of a fault the library refused before any check ran: its error, as predicted."""
    return {
        **dict.fromkeys(("seq_match", "logits_match", "coherent")),
        "caught": True,
        "caught_by": [REFUSED],
        "reasons": [f"{type(error).__name__}: {error}"],
        "predicted_checks": list(fault.caught_by),
        "as_predicted": True,
        **dict.fromkeys(LOGITS_KEYS),
        "witness": {},
        "answer": None,
        "reference_answer": None,
    }


def run_fault_lab(
    variant: str | None = None, cache_dir: str | None = None, backend: str = "cpu", faults: list[str] | None = None
) -> dict[str, Any]:
    """Clean runs, then every fault (optionally only those of one variant, or the named ones).
    `ok`: the clean runs pass every check and every fault is caught.

    `backend="eager"` runs the same graphs without compiling them (seconds instead of minutes).
    """
    named = None if faults is None else {get_fault(name).name for name in faults}
    chosen = [f for f in FAULTS if (variant is None or f.variant == variant) and (named is None or f.name in named)]
    pairs = sorted({(f.variant, f.tp_degree, f.images, f.audio) for f in chosen})
    clean = [run_one(v, None, tp, cache_dir, backend, images, audio) for v, tp, images, audio in pairs]
    runs = [run_one(f.variant, f, f.tp_degree, cache_dir, backend) for f in chosen]
    clean_ok = all(not r["caught"] and r["coherent"] for r in clean)
    all_caught = all(r["caught"] for r in runs if r["predicted_checks"])
    return {
        "ok": clean_ok and all_caught,
        "clean_ok": clean_ok,
        "all_caught": all_caught,
        "uncaught": [r["fault"] for r in runs if not r["caught"]],  # findings: faults no check sees
        "all_as_predicted": all(r["as_predicted"] for r in runs),
        "backend": backend,
        "clean": clean,
        "faults": runs,
    }


def _err(value: Any) -> str:
    return "-" if value is None else f"{value:.2g}"


def format_fault_report(report: dict[str, Any]) -> str:
    """A table: each run's checks, the logit error it caused against its tolerance (trained
    run and witness), and which checks caught it."""
    head = (
        f"{'run':<26} {'variant':<8} {'TP':>2}  {'SEQ':<5} {'LOGITS':<6} {'coher':<5} "
        f"{'logit err / tol':<17} {'witness err / tol':<17} {'caught by':<40} answer"
    )
    rows = [head]
    for r in report["clean"] + report["faults"]:
        w = r["witness"]
        rows.append(
            f"{r['fault']:<26} {r['variant']:<8} {r['tp_degree']:>2}  {str(r['seq_match']):<5} "
            f"{str(r['logits_match']):<6} {str(r['coherent']):<5} "
            f"{_err(r['logits_max_err']) + ' / ' + _err(r['logits_tolerance']):<17} "
            f"{_err(w.get('logits_max_err')) + ' / ' + _err(w.get('logits_tolerance')):<17} "
            f"{(', '.join(r['caught_by']) or '-'):<40} {(r['answer'] or '')[:40]!r}"
        )
    rows.append(
        f"ok={report['ok']} (clean runs pass: {report['clean_ok']}, every fault with a predicted catch caught: "
        f"{report['all_caught']}, each by the predicted checks: "
        f"{report['all_as_predicted']}; backend {report['backend']})"
        + (f"; changing nothing a check sees: {', '.join(report['uncaught'])}" if report["uncaught"] else "")
    )
    return "\n".join(rows)
