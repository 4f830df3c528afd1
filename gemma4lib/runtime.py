"""The host runtime: the one generation engine around the compiled device graphs (docs/ENGINE.md).

Tokens in, tokens out. The engine holds `batch` rows over one set of K/V (held by the steps: host
buffers on CPU, device states on XLA and inf2). A request is admitted into a free row (its prefill,
other rows untouched), then every `step()` advances every live row at once: one decode step, or
with a drafter k drafts and one verify of k + 1 tokens. Each row has its own position, eos, token
budget and sampling. `generate` runs a batch to the end (what `port` runs), a server admits and
releases rows between steps (continuous batching). Every path runs this loop; there is no other.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from .device.embedder import HostEmbedder
from .device.graph import INDEX_DTYPE, index_tensor, inverse_cdf, nucleus
from .errors import (
    AudioInputError,
    BadPromptError,
    BatchTooLargeError,
    NoVisionError,
    PromptTooLongError,
    SettingsError,
    TooManyImagesError,
)
from .generation.acceptance import greedy_verdict, verify_drafts
from .models.tokenizer import require_chat_template

if TYPE_CHECKING:
    from .models.loading import LoadedModel

Step = Callable[..., Any]


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma's final logit softcap, cap * tanh(logits / cap); monotonic, so greedy never needs it. A
    masked logit (-inf: a grammar forbids the token) stays -inf, not -cap, so sampling never draws it."""
    return logits if not cap else torch.where(torch.isneginf(logits), logits, cap * torch.tanh(logits / cap))


@dataclass(frozen=True)
class Sampling:
    """Greedy when temperature == 0; otherwise softcapped, tempered, nucleus-filtered sampling (a temperature
    under 1e-5 is refused: 1e-40 overflowed the tempered logits to NaN, and a refusal says so, a rounding not)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not (self.temperature == 0.0 or 1e-5 <= float(self.temperature) < float("inf")):
            raise SettingsError(f"temperature must be 0 (greedy) or >= 1e-05, got {self.temperature}")
        if not 0.0 < float(self.top_p) <= 1.0:
            raise SettingsError(
                f"top_p must be in (0, 1], got {self.top_p}; 1.0 keeps the whole distribution, "
                f"a small value such as 0.1 keeps only the most likely tokens"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


GREEDY = Sampling()


def sampling_probs(logits: torch.Tensor, sampling: Sampling, cap: float | None) -> torch.Tensor:
    """The distribution sampling draws from: softcap, temperature, then the top-p nucleus (the device's
    rule, `graph.nucleus`)."""
    probs = torch.softmax(softcap(logits.float(), cap) / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        probs = nucleus(probs, sampling.top_p)
    return probs / probs.sum()


def draw(generator: torch.Generator | None) -> float:
    """A sampled row's one random number per token, u in (0, 1], from its own seeded generator (the
    same draw whether the host or the device then chooses: `choose_token`, `graph.choose_tokens`)."""
    return 1.0 - float(torch.rand((), generator=generator))


def choose_token(
    logits: torch.Tensor, sampling: Sampling, cap: float | None, generator: torch.Generator | None = None
) -> int:
    """Next token from raw device logits `[vocab]`: argmax (no softcap needed), or the token where the
    row's draw falls in the cumulative distribution (inverse CDF: the device's `choose_tokens` rule)."""
    if sampling.greedy:
        return int(torch.argmax(logits))
    probs = sampling_probs(logits, sampling, cap)
    if not torch.isfinite(probs).all():
        raise RuntimeError("the logits give no distribution (NaN or +inf): the row's sampler cannot draw from them")
    return int(inverse_cdf(torch.cumsum(probs, 0), draw(generator)))


def encode_prompt(tokenizer: Any, prompt: str, chat: bool = True) -> list[int]:
    """Prompt text → ids, through the tokenizer's own chat template (never a hand-built one)."""
    if not isinstance(prompt, str):
        raise BadPromptError(f"prompt must be a string, got {type(prompt).__name__}; pass the question as text")
    if not prompt.strip():
        raise BadPromptError("prompt is empty; pass a question, e.g. 'What is the capital of France?'")
    if chat:  # never silently as plain text: the model would see no turn markers
        require_chat_template(tokenizer)
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)
    return list(tokenizer(prompt)["input_ids"])


# ---- what the engine is given ----------------------------------------------------------------
@dataclass
class Steps:
    """The compiled graphs a backend hands the engine, each a callable over its own K/V (how the K/V are
    held is the backend's business). `prefill[bucket](*embeds, start, length)` and `decode(...)` return
    the logits of each row's last valid token `[B, vocab]` (and its hidden state `[B, H]` when the
    assistant drafts); `verify(...)` those of every position `[B, k + 1, ...]`; `draft(inputs_embeds,
    position)` the assistant's logits and projected hidden state. `start`/`length`/`position` are int32
    `[B]`. No prefill graphs (the trace recipe): prompts are fed through `decode` token by token."""

    prefill: dict[int, Step] = field(default_factory=dict)
    decode: Step | None = None
    # `decode_ids(*embeds, start, length, sampling)`: each row's next token `[B]` chosen on the device,
    # `sampling [B, 3]` = (temperature, `draw`, top_p); -1 where its logits were not finite (`graph.choose_tokens`)
    decode_ids: Step | None = None
    verify: Step | None = None
    # `verify_ids(*embeds, start, length, drafts)`: each row's greedy verdict `[B, k + 2]` (drafts kept, the
    # target's k + 1 argmaxes; `graph.greedy_verdicts`) and, drafting with the assistant, the kept hidden `[B, H]`
    verify_ids: Step | None = None
    draft: Step | None = None
    draft_ids: Step | None = None  # the draft's argmax `[B]` and projected hidden: greedy rows' drafts
    vision: Step | None = None  # (pixel_values, position_ids) -> soft tokens [n, slots, hidden]; no K/V
    audio: Step | None = None  # (features, mask) -> (soft tokens [clips, slots, hidden], valid); no K/V
    # one-row prefill per bucket, `row_prefill[bucket](row, *embeds, start, length)` with `[1, ...]`
    # inputs: writes only row `row`'s K/V, so a request that joins a running batch alone costs one
    # row's prefill, not the batch's (continuous batching; `PortSettings.row_prefill`)
    row_prefill: dict[int, Step] = field(default_factory=dict)
    # context buckets: graph name ("decode", "decode_ids", "verify", "prefill16") -> {slots: step}, the same
    # step reading only the first `slots` K/V positions (`device.build`); the engine runs the smallest that covers
    contexts: dict[str, dict[int, Step]] = field(default_factory=dict)

    def __post_init__(self):
        self.prefill = dict(sorted(self.prefill.items()))
        self.row_prefill = dict(sorted(self.row_prefill.items()))


def bind_kv(fn: Step, kv: Sequence[torch.Tensor]) -> Step:
    """A graph that takes its K/V buffers as trailing inputs (and updates them in place) as a step."""

    def step(*inputs: torch.Tensor) -> Any:
        return fn(*inputs, *kv)

    return step


def bind_kv_rows(fn: Step, kv: Sequence[torch.Tensor]) -> Step:
    """A one-row graph over row `row` of batched K/V buffers: `step(row, *inputs)` hands it each
    buffer's `[row : row + 1]` view (batch is dim 0, so the view is contiguous and the graph's in-place
    update lands in the batch's buffers; no copy either way)."""

    def step(row: int, *inputs: torch.Tensor) -> Any:
        return fn(*inputs, *(buffer[row : row + 1] for buffer in kv))

    return step


class Drafter(Protocol):
    """Proposes up to `counts[row]` tokens for each live row; the engine verifies them.

    Returns, per row, the drafted tokens and, when they were sampled from a distribution, its rows
    `q [n, vocab]` (rejection sampling needs them; None: a deterministic proposal, verified against a
    point mass)."""

    def propose(
        self, engine: Engine, counts: Mapping[int, int]
    ) -> dict[int, tuple[list[int], torch.Tensor | None]]: ...


@dataclass(frozen=True)
class MediaPrompt:
    """A prompt's images (the processor's `pixel_values`, `position_ids`; `counts[i]` soft tokens) and clips
    (`audio[i]` = (features [frames, values], valid [frames] bool); `audio_counts[i]`), and the prompt
    positions of every image / audio token. The engine runs their graphs at admission and writes the soft
    tokens over those positions' host embeddings (ids there become `pad_id`, as transformers does)."""

    pixel_values: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    counts: tuple[int, ...] = ()
    positions: tuple[int, ...] = ()
    audio: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
    audio_counts: tuple[int, ...] = ()
    audio_positions: tuple[int, ...] = ()
    clips: tuple[Any, ...] = ()  # the raw 16 kHz samples, for the reference's own feature extractor

    @property
    def soft_tokens(self) -> int:
        return sum(self.counts) + sum(self.audio_counts)


class LogitsWatch(Protocol):
    """A row that needs its logits at every token it chooses (log-probabilities, a grammar's mask):
    `logits` gets the raw logits `[vocab]` and returns those to choose from, `chosen` the token. Its
    presence is the row's "this row needs logits" (a device that returns only token ids still hands
    this row its logits); a drafting engine refuses it (its verify keeps drafts from unwatched logits)."""

    def logits(self, logits: torch.Tensor) -> torch.Tensor: ...
    def chosen(self, token: int) -> None: ...


@dataclass(frozen=True)
class Request:
    """One generation request: prompt ids, token budget, sampling, stop tokens, its images and audio
    (None: text only) and what watches its logits (None: nothing)."""

    prompt_ids: Sequence[int]
    max_new_tokens: int
    sampling: Sampling = GREEDY
    eos_token_ids: Sequence[int] = ()
    media: MediaPrompt | None = None
    watch: LogitsWatch | None = None


@dataclass
class RowResult:
    """What one request produced: its tokens, why it ended, and (when kept) the raw logits that
    chose each token, the prefill's first (LOGITS_MATCH compares them per step)."""

    prompt_ids: list[int]
    tokens: list[int]
    finish_reason: str | None  # "stop" (an eos token, kept), "length" (max_new_tokens), "error", None (released early)
    bucket: int
    prefill_s: float
    first_logits: torch.Tensor
    step_logits: torch.Tensor | None = None
    step_s: list[float] = field(default_factory=list)  # seconds of every step the row took part in
    accepted: list[int] = field(default_factory=list)  # drafts accepted at each verify step
    emitted: list[int] = field(default_factory=list)  # tokens kept at each verify step
    drafted: list[int] = field(default_factory=list)  # drafts proposed at each verify step
    chunks: int = 1  # prefill calls the prompt took (`Engine.chunks`: longer than the largest bucket, more)
    reused: int = 0  # prompt tokens whose K/V the row already held (prefix reuse: `Engine.reusable`)

    @property
    def decode_tok_s(self) -> float | None:
        total = sum(self.step_s)
        return (len(self.tokens) - 1) / total if total > 0 and len(self.tokens) > 1 else None

    @property
    def accepted_per_step(self) -> float | None:
        """Mean tokens emitted per verify step (1 = no draft ever accepted); None without drafting."""
        return sum(self.emitted) / len(self.emitted) if self.emitted else None


@dataclass
class BatchResult:
    """A batch run to the end: a `RowResult` per request, and the batch's own step timings."""

    rows: list[RowResult]
    batch: int
    prefill_s: float
    step_s: list[float] = field(default_factory=list)  # seconds of each step (all rows at once)
    step_tokens: list[int] = field(default_factory=list)  # tokens the live rows produced in each step

    @property
    def decode_tok_s(self) -> float | None:
        """The batch's total: tokens all rows produced in steps per second of those steps."""
        total = sum(self.step_s)
        return sum(self.step_tokens) / total if total > 0 else None

    @property
    def decode_tok_s_per_row(self) -> float | None:
        total = self.decode_tok_s
        return None if total is None else total / len(self.rows)

    @property
    def bucket(self) -> int:
        return self.rows[0].bucket


@dataclass
class _Row:
    request: Request
    eos: frozenset[int]
    generator: torch.Generator | None
    keep_logits: bool
    bucket: int
    prefill_s: float = 0.0
    chunks: int = 1  # prefill calls the prompt took (`Engine.chunks`)
    reused: int = 0  # prompt tokens not prefilled: their K/V were the row's already (`Engine.reusable`)
    tokens: list[int] = field(default_factory=list)
    position: int = 0  # where the row's last token is fed (its next K/V write)
    hidden: torch.Tensor | None = None  # the target's hidden state of the last token (assistant drafting)
    logits: list[torch.Tensor] = field(default_factory=list)
    first_logits: torch.Tensor | None = None
    step_s: list[float] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    emitted: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)
    finish: str | None = None
    fault: BaseException | None = None

    @property
    def history(self) -> list[int]:
        return [*self.request.prompt_ids, *self.tokens]

    @property
    def remaining(self) -> int:
        return self.request.max_new_tokens - len(self.tokens)


RowOut = tuple[torch.Tensor, "torch.Tensor | None"]  # one row's prefill logits and hidden state


def _by_row(out: tuple[torch.Tensor, ...], rows: Mapping[int, Any]) -> dict[int, RowOut]:
    """A batch-shaped prefill's (logits, hidden) split into the admitted rows'."""
    logits, hidden = out[0], (out[1] if len(out) > 1 else None)
    return {row: (logits[row], None if hidden is None else hidden[row]) for row in rows}


def _chunk(parts: Sequence[torch.Tensor], offset: int, n: int, bucket: int) -> list[torch.Tensor]:
    """Positions `offset .. offset + n - 1` of a prompt's inputs `[1, tokens, ...]`, zero-padded to `bucket`."""
    pieces = [part[:, offset : offset + n] for part in parts]
    return [torch.cat([p, p.new_zeros(1, bucket - n, *p.shape[2:])], 1) for p in pieces]


def _outputs(out: Any, n: int) -> tuple[torch.Tensor, ...]:
    """The first `n` outputs of a step (a tensor, or a tuple/list led by them), on the host."""
    parts = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    return tuple(p.to("cpu") if p.device.type != "cpu" else p for p in parts[:n])


def room_for_new_tokens(prompt_tokens: int, context_length: int, draft_tokens: int = 0) -> int:
    """The most new tokens a prompt of `prompt_tokens` can ask for: the K/V hold the prompt and every
    new token but the last, which is never fed back, plus with drafting the k slots a verify writes
    past the last kept token (`len(prompt) + max_new_tokens - 1 + k` positions fit the context). The
    one statement of the fit: `Engine.check` refuses past it, a server's default budget is it."""
    return context_length - prompt_tokens + 1 - draft_tokens


@dataclass(frozen=True)
class _Kept:
    """What a free row's K/V still hold after its request: the K/V of `tokens` at positions 0.., the
    furthest position ever written (`reach`: a verify writes drafts past what it keeps) and when it
    was released (`order`, for the LRU)."""

    tokens: tuple[int, ...]
    reach: int
    order: int


class Engine:
    """Rows over one set of compiled graphs (module docstring). Not thread-safe: one caller."""

    def __init__(
        self,
        embedder: HostEmbedder,
        steps: Steps,
        *,
        batch: int,
        context_length: int,
        vocab_size: int,
        cap: float | None,
        dtype: torch.dtype = torch.float32,
        draft_tokens: int = 0,
        drafter: Drafter | None = None,
        pad_id: int = 0,
        image_blocks: bool = False,
        audio_shape: tuple[int, int, int] | None = None,
    ):
        if (drafter is None) != (steps.verify is None):
            raise SettingsError("a drafter needs the verify graph and the verify graph a drafter: pass both or neither")
        if steps.decode is None and steps.verify is None:
            raise SettingsError("the engine needs a decode graph (or a verify graph and a drafter)")
        self.embedder, self.steps, self.batch = embedder, steps, int(batch)
        self.context_length, self.vocab_size, self.cap, self.dtype = int(context_length), int(vocab_size), cap, dtype
        self.draft_tokens, self.drafter = int(draft_tokens) if drafter is not None else 0, drafter
        self.rows: dict[int, _Row] = {}
        self.kept: dict[int, _Kept] = {}  # free rows' K/V a request may reuse (`reusable`)
        self.released = 0
        self.pad_id = int(pad_id)
        # the prefill graphs take each token's image (`DeviceGraph.image_blocks`): `prefill_inputs`
        self.image_blocks = bool(image_blocks)
        self.audio_shape = audio_shape  # the audio graph's (clips a call: 1, frames, values a frame)

    @classmethod
    def for_model(cls, model: LoadedModel, steps: Steps, **kwargs: Any) -> Engine:
        """An engine over `model`'s host tables, vocabulary and softcap."""
        return cls(
            HostEmbedder.from_text_model(model.text_model),
            steps,
            vocab_size=int(model.config.vocab_size),
            cap=getattr(model.config, "final_logit_softcapping", None),
            pad_id=int(getattr(model.config, "pad_token_id", 0) or 0),
            **kwargs,
        )

    # ---- the one fit check ----------------------------------------------------------------------
    @property
    def buckets(self) -> list[int]:
        return list(self.steps.prefill)

    def bucket_for(self, n_tokens: int) -> int:
        """The smallest compiled prefill length that holds `n_tokens`, else the largest (the prompt
        runs in chunks of it, `chunks`); token by token (no prefill graphs): 1."""
        if not self.steps.prefill:
            return 1
        return next((b for b in self.steps.prefill if n_tokens <= b), max(self.steps.prefill))

    def reading(self, name: str, step: Step, reach: int) -> Step:
        """Graph `name`'s step for a call whose rows end before position `reach`: its context bucket
        that reads the fewest K/V slots >= reach (`Steps.contexts`), else `step` (the whole context)."""
        sizes = self.steps.contexts.get(name, {})
        return next((sizes[c] for c in sorted(sizes) if c >= reach), step)

    def chunks(self, request: Request, start: int = 0) -> list[tuple[int, int]]:
        """(offset, length) of each prefill call of `request`'s prompt from position `start` on: chunks
        of the largest bucket, each written at its offset and attending over the K/V before it (the
        graphs take each row's `start`). Where the prefill graphs take image blocks an image's tokens
        see each other, so a chunk ends before an image it would cut; an image longer than the largest
        bucket is refused."""
        n, size = len(request.prompt_ids), max(self.steps.prefill or [len(request.prompt_ids)])
        spans = []
        if self.image_blocks and request.media is not None:
            at = 0
            for count in request.media.counts:
                spans.append((request.media.positions[at], request.media.positions[at + int(count) - 1]))
                at += int(count)
        out, offset = [], int(start)
        while offset < n:
            end = min(offset + size, n)
            end = min([end, *(first for first, last in spans if first < end <= last and first > offset)])
            for first, last in spans:
                if first <= offset and end <= last:  # an image that no chunk holds whole
                    raise BadPromptError(
                        f"an image of {last - first + 1} soft tokens is longer than the largest prefill bucket "
                        f"{size}; send a smaller image or recompile with a prefill bucket that holds it"
                    )
            out.append((offset, end - offset))
            offset = end
        return out

    def check(self, request: Request) -> int:
        """Raise before any device work when `request` cannot run on these graphs (the fit is
        `room_for_new_tokens`); its bucket."""
        ids, max_new = request.prompt_ids, request.max_new_tokens
        if isinstance(ids, str):
            raise BadPromptError(
                "generate() takes token ids, not text; encode the text first with encode_prompt(tokenizer, prompt)"
            )
        if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1:
            raise SettingsError(f"max_new_tokens must be a whole number >= 1, got {max_new!r}")
        if not isinstance(request.sampling, Sampling):
            raise SettingsError(f"sampling must be a gemma4lib.runtime.Sampling, got {type(request.sampling).__name__}")
        if len(ids) == 0:
            raise BadPromptError("prompt has no tokens; pass a non-empty prompt")
        outside = sorted({int(t) for t in ids if not 0 <= int(t) < self.vocab_size})
        if outside:
            raise BadPromptError(
                f"token ids {outside[:5]} are outside this model's vocabulary (0..{self.vocab_size - 1}); "
                f"encode the text with this model's tokenizer (encode_prompt)"
            )
        if max_new > room_for_new_tokens(len(ids), self.context_length, self.draft_tokens):
            raise PromptTooLongError(
                len(ids),
                max_new,
                self.context_length,
                draft_tokens=self.draft_tokens,
                media_tokens=self._media_tokens(request),
            )
        if request.media is not None:
            self._check_media(request)
        if request.watch is not None and self.drafter is not None:
            raise SettingsError(
                "log-probabilities and constrained output need each token's logits, which drafting's verify "
                "does not hand out; send this request to a server started without drafting"
            )
        if not request.sampling.greedy and self.steps.draft_ids is not None and self.steps.draft is None:
            raise SettingsError(
                "a sampled row drafts from the assistant's distribution, and this engine's draft returns only "
                "its argmax (the ids keys: backend neuron); send temperature 0, or use a server without drafting"
            )
        return self.bucket_for(len(ids))

    @staticmethod
    def _media_tokens(request: Request) -> int:
        return request.media.soft_tokens if request.media is not None else 0

    def _check_media(self, request: Request) -> None:
        """Images need the vision graph, audio the audio graph; one prompt position per soft token."""
        media, n = request.media, len(request.prompt_ids)
        if media.counts and self.steps.vision is None:
            raise NoVisionError(
                "this engine was compiled without a vision graph; compile with images "
                "(PortSettings(images=[...])) on a checkpoint that has a vision part"
            )
        if media.audio and (self.steps.audio is None or self.audio_shape is None):
            raise AudioInputError(
                "this engine was compiled without an audio graph; compile with audio "
                "(PortSettings(audio=[...])) on a checkpoint that hears (e2b, e4b, 12b)"
            )
        images = 0 if media.pixel_values is None else media.pixel_values.shape[0]
        for what, error, parts, counts, positions in (
            ("image", TooManyImagesError, images, media.counts, media.positions),
            ("audio", AudioInputError, len(media.audio), media.audio_counts, media.audio_positions),
        ):
            if len(positions) != sum(counts) or len(counts) != parts:
                raise error(
                    f"{parts} {what} parts with {sum(counts)} soft tokens, but the prompt has {len(positions)} "
                    f"{what} token positions; build the prompt with one {what} part per {what} "
                    f"(gemma4lib.images.media_prompt)"
                )
            if positions and not 0 <= min(positions) <= max(positions) < n:
                raise BadPromptError(
                    f"{what} token positions lie outside the prompt; build it with gemma4lib.images.media_prompt"
                )

    # ---- rows -------------------------------------------------------------------------------------
    def free_rows(self) -> list[int]:
        return [r for r in range(self.batch) if r not in self.rows]

    def live_rows(self) -> list[int]:
        return [r for r, row in sorted(self.rows.items()) if row.finish is None]

    def finished(self, row: int) -> str | None:
        return self.rows[row].finish

    def fault(self, row: int) -> BaseException | None:
        """Why `row` ended with finish "error" (its sampler failed), else None."""
        return self.rows[row].fault

    def embed(self, ids: torch.Tensor, pad_to: int | None = None) -> list[torch.Tensor]:
        """Word embeddings (scaled) and the PLE inputs on the host, right-padded with zeros."""
        return self.embedder.inputs(ids, pad_to, self.dtype)

    def soft_tokens(self, images: MediaPrompt) -> torch.Tensor:
        """The vision graph over each image: its soft tokens in prompt order `[sum(counts), hidden]`."""
        parts = []
        for i, count in enumerate(images.counts):
            pixels, positions = images.pixel_values[i : i + 1], images.position_ids[i : i + 1].to(INDEX_DTYPE)
            out = _outputs(self.steps.vision(pixels.to(self.dtype), positions), 1)[0]
            parts.append(out[0, : int(count)])
        return torch.cat(parts).to(self.dtype)

    def audio_tokens(self, media: MediaPrompt) -> torch.Tensor:
        """The audio graph over each clip (zero-padded at its end to the graph's frames): its valid soft
        tokens, in prompt order `[sum(audio_counts), hidden]`."""
        frames, parts = self.audio_shape[1], []
        for (values, valid), count in zip(media.audio, media.audio_counts, strict=True):
            if len(values) > frames:
                raise AudioInputError(f"a clip of {len(values)} frames, over the audio graph's {frames}: send less")
            features = torch.zeros(1, frames, values.shape[-1], dtype=self.dtype)
            mask = torch.zeros(1, frames, dtype=INDEX_DTYPE)
            features[0, : len(values)], mask[0, : len(values)] = values, valid.to(INDEX_DTYPE)
            tokens, kept = _outputs(self.steps.audio(features, mask), 2)
            parts.append(tokens[0][kept[0].bool()])
            if len(parts[-1]) != count:
                raise AudioInputError(f"the audio graph kept {len(parts[-1])} soft tokens of a clip given {count}")
        return torch.cat(parts).to(self.dtype)

    def prompt_embeds(self, request: Request, pad_to: int | None = None) -> list[torch.Tensor]:
        """A request's prompt inputs `[1, n or pad_to, ...]`: word embeddings (and PLE) on the host,
        an image's and a clip's soft tokens written over their token positions (their ids become `pad_id`
        for the tables, as transformers' `Gemma4Model.forward` does)."""
        ids = torch.as_tensor([list(request.prompt_ids)], dtype=torch.long)
        media = request.media
        if media is None:
            return self.embed(ids, pad_to=pad_to)
        at = torch.as_tensor(media.positions, dtype=torch.long)
        heard = torch.as_tensor(media.audio_positions, dtype=torch.long)
        ids[0, at], ids[0, heard] = self.pad_id, self.pad_id
        parts = self.embed(ids, pad_to=pad_to)
        if media.counts:
            parts[0][0, at] = self.soft_tokens(media)
        if media.audio:
            parts[0][0, heard] = self.audio_tokens(media)
        return parts

    def prefill_inputs(self, request: Request, pad_to: int | None = None) -> list[torch.Tensor]:
        """`prompt_embeds`, and where the prefill graphs take them the image blocks `[1, n or
        pad_to]` int32: image i's soft tokens i + 1, every other token 0 (`device.graph.build_masks`)."""
        parts = self.prompt_embeds(request, pad_to=pad_to)
        if self.image_blocks:
            blocks = torch.zeros(1, parts[0].shape[1], dtype=INDEX_DTYPE)
            images, at = request.media, 0
            for i, count in enumerate(images.counts if images is not None else ()):
                blocks[0, list(images.positions[at : at + int(count)])] = i + 1
                at += int(count)
            parts.append(blocks)
        return parts

    def _zero_inputs(self, tokens: int, prefill: bool = False) -> list[torch.Tensor]:
        """Inputs of `tokens` per row for every row, zero (idle rows stay so); a prefill's take the
        image blocks too where its graphs do."""
        parts = self.embed(torch.zeros(self.batch, tokens, dtype=torch.long))
        if prefill and self.image_blocks:
            parts.append(torch.zeros(self.batch, tokens, dtype=INDEX_DTYPE))
        return parts

    @torch.no_grad()
    def admit(
        self, requests: Mapping[int, Request], *, keep_logits: bool = False, reuse: bool = False
    ) -> dict[int, list[int]]:
        """Prefill `requests` into their (free) rows, each prompt in its chunks (`chunks`); the other
        rows are untouched. `reuse`: a prompt prefills only what its row's kept K/V do not hold
        (`reusable`; a server's next turn). Returns each admitted row's first token."""
        buckets, plans = {}, {}
        for row, request in requests.items():
            if not 0 <= row < self.batch or row in self.rows:
                raise BatchTooLargeError(
                    f"row {row} is not free (rows 0..{self.batch - 1}, free {self.free_rows()}); "
                    f"admit into a free row, or release one first"
                )
            buckets[row] = self.check(request)
            plans[row] = self.chunks(request, self.reusable(row, request) if reuse and self.steps.prefill else 0)
        for row in requests:
            self.kept.pop(row, None)  # overwritten from here on
        if not requests:
            return {}
        lengths = [0] * self.batch
        for row, request in requests.items():
            lengths[row] = len(request.prompt_ids)
        by_row = self.joins_by_row(len(requests))  # only where one-row prefill graphs were compiled
        started = time.perf_counter()
        if by_row:
            out = {row: self._row_prefill(row, request, plans[row]) for row, request in requests.items()}
        elif self.steps.prefill:
            out = self._batch_prefill(requests, plans)
        else:
            out = _by_row(self._stepwise_prefill(requests, lengths), requests)
        elapsed = time.perf_counter() - started
        first: dict[int, list[int]] = {}
        for row, request in requests.items():
            sampling = request.sampling
            generator = None if sampling.greedy else torch.Generator().manual_seed(int(sampling.seed))
            eos = frozenset(int(t) for t in request.eos_token_ids)
            bucket = buckets[row] if by_row else max(buckets.values())
            state = _Row(request, eos, generator, keep_logits, bucket, chunks=len(plans[row]), reused=plans[row][0][0])
            state.prefill_s, state.position = elapsed, len(request.prompt_ids)
            logits, hidden = out[row]
            state.first_logits = logits.float().clone()
            if hidden is not None:
                state.hidden = hidden.clone()
            token = self._choose(state, logits)
            self.rows[row] = state
            first[row] = [] if token is None else self._emit(state, [token], [logits])
        return first

    def reusable(self, row: int, request: Request) -> int:
        """How many of `request`'s first tokens free row `row`'s kept K/V hold for a prefill from there
        (0: none; at least one token is always prefilled, for its logits). A sliding layer's ring holds
        only its last `slots` positions: a prefill at `start` claims each slot for the newest position
        before `start`, so a slot written at or past `start` (the kept tokens after the shared prefix, a
        verify's drafts) holds stale K/V. The rings have `window + k + 1` slots when drafting (k
        drafts), `window` without, so a stale slot stays outside every window the target's prefill
        and the draft read exactly when the row never wrote past `start + k`; otherwise no reuse."""
        kept = self.kept.get(row)
        if kept is None or request.media is not None:
            return 0
        ids, n = request.prompt_ids, 0
        limit = min(len(kept.tokens), len(ids) - 1)
        while n < limit and kept.tokens[n] == int(ids[n]):
            n += 1
        return n if n and kept.reach - n <= self.draft_tokens else 0

    def row_for(self, request: Request, free: Sequence[int]) -> int:
        """The free row to admit `request` into: the one whose kept K/V it reuses most, else a row that
        keeps nothing, else the least recently released (an LRU over the kept rows)."""

        def rank(row: int) -> tuple[int, bool, int]:
            kept = self.kept.get(row)
            return self.reusable(row, request), kept is None, -(kept.order if kept else 0)

        return max(free, key=rank)

    def joins_by_row(self, joining: int) -> bool:
        """Whether `joining` requests are prefilled one row at a time (`Steps.row_prefill`, each in its
        own bucket) rather than in one batch-shaped call: when at most half the rows join. A
        batch-shaped prefill costs about the same for one row as for all (its shape is fixed), one
        row's about 1/B of it on a CPU (the tiny E2B at B=8, quiet machine: 1.2 ms a row, 7.3 ms the batch)."""
        return bool(self.steps.row_prefill) and joining <= max(1, self.batch // 2)

    def _batch_prefill(self, requests: Mapping[int, Request], plans: Mapping[int, list[tuple[int, int]]]):
        """Every admitted row's chunks through the batch-shaped prefill graphs: call i takes each row's
        chunk i at its offset (rows with fewer chunks idle, length 0), in the bucket of the longest;
        each row's (logits, hidden) come from its last chunk."""
        whole = {row: self.prefill_inputs(request) for row, request in requests.items()}
        out: dict[int, RowOut] = {}
        for i in range(max(len(plan) for plan in plans.values())):
            part = {row: plan[i] for row, plan in plans.items() if i < len(plan)}
            bucket = self.bucket_for(max(n for _, n in part.values()))
            inputs, start, length = self._zero_inputs(bucket, prefill=True), [0] * self.batch, [0] * self.batch
            for row, (offset, n) in part.items():
                for slot, piece in zip(inputs, _chunk(whole[row], offset, n, bucket), strict=True):
                    slot[row] = piece[0]
                start[row], length[row] = offset, n
            step = self.reading(f"prefill{bucket}", self.steps.prefill[bucket], max(o + n for o, n in part.values()))
            got = _by_row(self._call(step, inputs, start, length), part)
            out.update({row: got[row] for row in part if i == len(plans[row]) - 1})
        return out

    def _row_prefill(self, row: int, request: Request, plan: list[tuple[int, int]]) -> RowOut:
        """One request's chunks through the one-row graphs of their buckets, into row `row`'s K/V:
        the last chunk's (logits, hidden)."""
        whole = self.prefill_inputs(request)
        for offset, n in plan:
            bucket = self.bucket_for(n)
            step = functools.partial(
                self.reading(f"row_prefill{bucket}", self.steps.row_prefill[bucket], offset + n), row
            )
            out = self._call(step, _chunk(whole, offset, n, bucket), [offset], [n])
        return _by_row(out, [0])[0]

    def _stepwise_prefill(self, requests: Mapping[int, Request], lengths: list[int]) -> tuple[torch.Tensor, ...]:
        """No prefill graph: every admitted row's prompt through `decode`, one position per call
        (the other rows idle, length 0); each row's logits are those of its last prompt token."""
        longest = max(lengths)
        kept: list[torch.Tensor | None] = [None] * self.batch
        whole = {row: self.prompt_embeds(request) for row, request in requests.items()}
        for i in range(longest):
            inputs = self._zero_inputs(1)
            step_lengths = [0] * self.batch
            for row in requests:
                if i < lengths[row]:
                    for slot, part in zip(inputs, whole[row], strict=True):
                        slot[row] = part[0, i : i + 1]
                    step_lengths[row] = 1
            out = self._call(self.steps.decode, inputs, [i] * self.batch, step_lengths)
            for row in requests:
                if i == lengths[row] - 1:
                    kept[row] = out[0][row]
        logits = torch.stack([k if k is not None else torch.zeros(self.vocab_size) for k in kept])
        return (logits,)

    def _call(self, step: Step, inputs: list[torch.Tensor], start: Sequence[int], length: Sequence[int]):
        return _outputs(step(*inputs, index_tensor(start), index_tensor(length)), 2)

    def _emit(self, row: _Row, tokens: list[int], logits: Sequence[torch.Tensor | None]) -> list[int]:
        """Append `tokens` (cut at eos or the budget); mark the row finished when it is."""
        kept = []
        for token, row_logits in zip(tokens, logits, strict=False):
            row.tokens.append(int(token))
            if row.keep_logits:
                row.logits.append(row_logits.float().clone())
            kept.append(int(token))
            if int(token) in row.eos:
                row.finish = "stop"
                break
            if row.remaining <= 0:
                row.finish = "length"
                break
        return kept

    @torch.no_grad()
    def step(self) -> dict[int, list[int]]:
        """Advance every live row: one decode step, or one draft + verify round. The new tokens per row."""
        live = self.live_rows()
        if not live:
            return {}
        started = time.perf_counter()
        out = self._draft_round(live) if self.drafter is not None else self._decode_step(live)
        elapsed = time.perf_counter() - started
        for row in live:
            self.rows[row].step_s.append(elapsed)
        return out

    def _decode_step(self, live: list[int]) -> dict[int, list[int]]:
        tokens = torch.zeros(self.batch, 1, dtype=torch.long)
        start, length = [0] * self.batch, [0] * self.batch
        for r in live:
            row = self.rows[r]
            tokens[r, 0], start[r], length[r] = row.tokens[-1], row.position, 1
        if self.steps.decode_ids is not None and all(self._device_chooses(self.rows[r]) for r in live):
            return self._ids_step(live, tokens, start, length)
        step = self.reading("decode", self.steps.decode, max(start) + 1)
        (logits,) = self._call(step, self.embed(tokens), start, length)[:1]
        new = {}
        for r in live:
            row = self.rows[r]
            token = self._choose(row, logits[r])
            row.position += 1
            new[r] = [] if token is None else self._emit(row, [token], [logits[r]])
        return new

    @staticmethod
    def _device_chooses(row: _Row) -> bool:
        """Whether the device may choose this row's token: no one reads its logits (kept for a check,
        watched)."""
        return not row.keep_logits and row.request.watch is None

    def _ids_step(self, live: list[int], tokens: torch.Tensor, start: list[int], length: list[int]):
        """One decode step whose tokens the device chooses (`Steps.decode_ids`): 4 bytes a row come
        back. Each sampled row draws its number here, one per token, as `choose_token` would."""
        sampling = torch.zeros(self.batch, 3)
        for r in live:
            chosen = self.rows[r].request.sampling
            if not chosen.greedy:
                sampling[r] = torch.tensor([chosen.temperature, draw(self.rows[r].generator), chosen.top_p])
        step = self.reading("decode_ids", self.steps.decode_ids, max(start) + 1)
        (ids,) = _outputs(step(*self.embed(tokens), index_tensor(start), index_tensor(length), sampling), 1)
        new = {}
        for r in live:
            row, token = self.rows[r], int(ids[r])
            row.position += 1
            new[r] = self._device_fault(row) if token < 0 else self._emit(row, [token], [None])
        return new

    def _choose(self, row: _Row, logits: torch.Tensor) -> int | None:
        """The row's next token; a fault in its sampler (non-finite logits) ends this row alone, with
        finish "error" and the cause in `fault`, and the other rows go on."""
        watch = row.request.watch
        try:
            token = choose_token(
                logits if watch is None else watch.logits(logits), row.request.sampling, self.cap, row.generator
            )
        except RuntimeError as exc:
            row.finish, row.fault = "error", exc
            return None
        if watch is not None:
            watch.chosen(token)
        return token

    def _draft_round(self, live: list[int]) -> dict[int, list[int]]:
        """k drafts per row (fewer near its budget), one verify of `[last, drafts]` at each row's
        position, each row's own verdict. Rejected drafts' K/V are never read: the next round starts
        at position + accepted + 1 and overwrites them."""
        k = self.draft_tokens
        counts = {r: min(k, self.rows[r].remaining - 1) for r in live}
        proposals = self.drafter.propose(self, {r: n for r, n in counts.items() if n > 0})
        chunk = torch.zeros(self.batch, k + 1, dtype=torch.long)
        start, length = [0] * self.batch, [0] * self.batch
        drafts: dict[int, list[int]] = {}
        for r in live:
            row = self.rows[r]
            proposed = list(proposals.get(r, ([], None))[0])[: counts[r]]
            drafts[r] = [int(t) for t in proposed]
            chunk[r, 0] = row.tokens[-1]
            chunk[r, 1 : 1 + len(drafts[r])] = torch.tensor(drafts[r], dtype=torch.long)
            start[r], length[r] = row.position, 1 + len(drafts[r])
        reach = max(s + n for s, n in zip(start, length, strict=True))
        if self.steps.verify_ids is not None and all(self._device_judges(self.rows[r]) for r in live):
            return self._verdict_round(live, chunk, start, length, drafts, reach)
        out = self._call(self.reading("verify", self.steps.verify, reach), self.embed(chunk), start, length)
        v_logits, v_hidden = out[0], (out[1] if len(out) > 1 else None)
        new = {}
        for r in live:
            row, d = self.rows[r], drafts[r]
            n_ok, tokens = self._judge(row, v_logits[r], d, proposals.get(r, ([], None))[1])
            logits = [v_logits[r, i] for i in range(len(tokens))]
            new[r] = self._advance(row, n_ok, tokens, logits, len(d), None if v_hidden is None else v_hidden[r, n_ok])
        return new

    def _advance(self, row: _Row, n_ok: int, tokens: list[int], logits: Sequence, drafted: int, hidden) -> list[int]:
        """A verified round's outcome for `row`: its tokens emitted, its counts, its position, the
        hidden state its next draft starts from; the tokens kept."""
        kept = self._emit(row, tokens, logits)
        row.accepted.append(n_ok)
        row.emitted.append(len(kept))
        row.drafted.append(drafted)
        row.position += n_ok + 1
        if hidden is not None:
            row.hidden = hidden.clone()
        return kept

    @staticmethod
    def _device_fault(row: _Row) -> list[int]:
        """End `row` alone: the device marked a token -1, its logits not finite (`graph.choose_tokens`)."""
        row.finish, row.fault = "error", RuntimeError("the device found this row's logits not finite")
        return []

    def _device_judges(self, row: _Row) -> bool:
        """Whether the device may judge this row's drafts (`Steps.verify_ids`): greedy, logits unread."""
        return row.request.sampling.greedy and self._device_chooses(row)

    def _verdict_round(self, live, chunk, start, length, drafts, reach) -> dict[int, list[int]]:
        """The verify whose verdict the device gives (`Steps.verify_ids`): `k + 2` int32 a row come back
        (and the kept position's hidden state), not `k + 1` rows of the vocabulary's logits."""
        padded = torch.full((self.batch, self.draft_tokens), -1, dtype=INDEX_DTYPE)  # past a row's drafts: unread
        for r in live:
            padded[r, : len(drafts[r])] = torch.tensor(drafts[r], dtype=INDEX_DTYPE)
        step = self.reading("verify_ids", self.steps.verify_ids, reach)
        out = _outputs(step(*self.embed(chunk), index_tensor(start), index_tensor(length), padded), 2)
        verdict, hidden = out[0], (out[1] if len(out) > 1 else None)
        new = {}
        for r in live:
            row, n_ok = self.rows[r], int(verdict[r, 0])
            tokens = [int(t) for t in verdict[r, 1 : n_ok + 2]]
            if min(tokens) < 0:
                new[r] = self._device_fault(row)
                continue
            new[r] = self._advance(
                row, n_ok, tokens, [None] * len(tokens), len(drafts[r]), None if hidden is None else hidden[r]
            )
        return new

    def _judge(
        self, row: _Row, v_logits: torch.Tensor, drafts: list[int], q: torch.Tensor | None
    ) -> tuple[int, list[int]]:
        """Greedy rows keep the drafts equal to the target's argmax; sampled rows keep them by
        rejection sampling against the target's p (a deterministic proposal: q a point mass)."""
        sampling = row.request.sampling
        if sampling.greedy:
            return greedy_verdict(v_logits, drafts)
        p = torch.stack([sampling_probs(v_logits[i], sampling, self.cap) for i in range(len(drafts) + 1)])
        if q is None and drafts:
            q = torch.nn.functional.one_hot(torch.tensor(drafts), p.shape[-1]).to(p.dtype)
        elif q is not None:
            q = q[: len(drafts)]
        verdict = verify_drafts(p, q, drafts, row.generator)
        return verdict.accepted, verdict.tokens

    def release(self, row: int) -> RowResult:
        """Free `row` (finished, or ended early: a client gone, a stop string); its result. The row's
        K/V stay, and a later request that starts with its tokens may reuse them (`reusable`)."""
        state = self.rows.pop(row)
        if state.request.media is None and state.finish != "error":  # an image's ids are not its content
            drafts = state.drafted[-1] - state.accepted[-1] if state.drafted else 0  # written past `position`
            self.released += 1
            self.kept[row] = _Kept(tuple(state.history[: state.position]), state.position - 1 + drafts, self.released)
        return RowResult(
            [int(t) for t in state.request.prompt_ids],
            state.tokens,
            state.finish,
            state.bucket,
            state.prefill_s,
            state.first_logits,
            torch.stack(state.logits) if state.logits else None,
            state.step_s,
            state.accepted,
            state.emitted,
            state.drafted,
            state.chunks,
            state.reused,
        )

    # ---- whole generations --------------------------------------------------------------------------
    @torch.no_grad()
    def generate_rows(
        self,
        requests: Sequence[Request],
        *,
        on_token: Callable[[int, int], None] | None = None,
        keep_logits: bool = False,
    ) -> BatchResult:
        """Every request in its own row (request i in row i), all admitted in one prefill, stepped
        until each has ended; `on_token(i, token)` streams them. Refuses more requests than rows."""
        if not requests:
            raise BadPromptError("the batch has no prompts; pass at least one")
        if len(requests) > self.batch:
            raise BatchTooLargeError(
                f"batch of {len(requests)} prompts, but the graphs were compiled for batch {self.batch}; "
                f"send at most {self.batch} at a time or compile with batch_size={len(requests)}"
            )
        if self.rows:
            raise SettingsError(f"rows {sorted(self.rows)} are in use; release them before generate")
        for i, request in enumerate(requests):
            try:
                self.check(request)
            except BadPromptError as error:
                if len(requests) == 1:
                    raise
                raise type(error)(f"prompt {i} of the batch: {error}") from None
        started = time.perf_counter()
        try:
            first = self.admit(dict(enumerate(requests)), keep_logits=keep_logits)
            prefill_s = time.perf_counter() - started
            result = BatchResult([], self.batch, prefill_s)
            if on_token:
                for i, tokens in first.items():
                    for t in tokens:
                        on_token(i, t)
            while self.live_rows():
                step_started = time.perf_counter()
                new = self.step()
                result.step_s.append(time.perf_counter() - step_started)
                result.step_tokens.append(sum(len(t) for t in new.values()))
                if on_token:
                    for i, tokens in new.items():
                        for t in tokens:
                            on_token(i, t)
            result.rows = [self.release(i) for i in range(len(requests))]
        finally:
            self.rows.clear()
        return result

    def generate(
        self,
        prompt_ids: Sequence[int] | torch.Tensor,
        max_new_tokens: int,
        *,
        sampling: Sampling = GREEDY,
        eos_token_ids: Sequence[int] = (),
        on_token: Callable[[int], None] | None = None,
        keep_logits: bool = False,
    ) -> RowResult:
        """One prompt (row 0) to the end: `generate_rows` with one request."""
        if not isinstance(prompt_ids, str):
            ids = torch.as_tensor(prompt_ids if len(prompt_ids) else [], dtype=torch.long)
            if ids.dim() == 2 and ids.shape[0] > 1:
                if ids.shape[0] > self.batch:
                    raise BatchTooLargeError(
                        f"batch of {ids.shape[0]} prompts, but the graphs were compiled for batch {self.batch}; "
                        f"send at most {self.batch} at a time or recompile with batch_size={ids.shape[0]}"
                    )
                raise SettingsError("generate() takes one prompt; pass several to generate_rows([Request(...), ...])")
            prompt_ids = ids.reshape(-1).tolist()
        request = Request(prompt_ids, max_new_tokens, sampling, tuple(eos_token_ids))
        stream = (lambda _row, token: on_token(token)) if on_token else None
        return self.generate_rows([request], on_token=stream, keep_logits=keep_logits).rows[0]

    @torch.no_grad()
    def time_prefill(self, prompt_ids: Sequence[int]) -> float:
        """Seconds for one prefill of `prompt_ids` (host embeddings included, as a user sees it)."""
        started = time.perf_counter()
        self.admit({0: Request(list(prompt_ids), 1)})
        elapsed = time.perf_counter() - started
        self.release(0)
        return elapsed

    @torch.no_grad()
    def time_steps(self, token: int, position: int, n: int) -> float:
        """Seconds of `n` decode steps of row 0 from `position` on, without a prefill (what the K/V
        hold does not change a step's time, so any position of a long context can be timed)."""
        self.kept.pop(0, None)  # its K/V get written
        self.rows[0] = _Row(Request([token], n + 1), frozenset(), None, False, 1, tokens=[token], position=position)
        try:
            started = time.perf_counter()
            for _ in range(n):
                self._decode_step([0])
            return time.perf_counter() - started
        finally:
            self.rows.pop(0, None)
