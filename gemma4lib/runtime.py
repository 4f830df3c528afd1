"""The host runtime: everything around the device graph.

Tokens in, tokens out: the chat template, word embeddings and PLE on the host, the prefill graph
(smallest bucket that fits), the decode loop over one compiled graph, greedy argmax on raw
logits, and the softcap only when sampling needs real probabilities.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .device.embedder import HostEmbedder
from .errors import BadPromptError, BatchTooLargeError, PromptTooLongError, SettingsError
from .models.loading import LoadedModel
from .models.tokenizer import require_chat_template

Step = Callable[..., torch.Tensor]


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma's final logit softcap, cap * tanh(logits / cap); monotonic, so greedy never needs it."""
    return logits if not cap else cap * torch.tanh(logits / cap)


@dataclass(frozen=True)
class Sampling:
    """Greedy when temperature == 0; otherwise softcapped, tempered, nucleus-filtered sampling."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not 0.0 <= float(self.temperature) < float("inf"):
            raise SettingsError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < float(self.top_p) <= 1.0:
            raise SettingsError(
                f"top_p must be in (0, 1], got {self.top_p}; 1.0 keeps the whole distribution, "
                f"a small value such as 0.1 keeps only the most likely tokens"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def sampling_probs(logits: torch.Tensor, sampling: Sampling, cap: float | None) -> torch.Tensor:
    """The distribution sampling draws from: softcap, temperature, then the top-p nucleus."""
    probs = torch.softmax(softcap(logits.float(), cap) / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, 0) - sorted_probs < sampling.top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    return probs / probs.sum()


def choose_token(
    logits: torch.Tensor, sampling: Sampling, cap: float | None, generator: torch.Generator | None = None
) -> int:
    """Next token from raw device logits `[vocab]`: argmax (no softcap needed) or a sample."""
    if sampling.greedy:
        return int(torch.argmax(logits))
    return int(torch.multinomial(sampling_probs(logits, sampling, cap), 1, generator=generator))


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


@dataclass
class Generation:
    prompt_ids: list[int]
    tokens: list[int]
    bucket: int
    prefill_s: float
    decode_s: list[float] = field(default_factory=list)  # one entry per decode step
    first_logits: torch.Tensor | None = None
    # raw device logits of every generated token (prefill's, then each decode step's), `[n, vocab]`;
    # kept only when asked (`generate(keep_logits=True)`): LOGITS_MATCH compares them per step
    step_logits: torch.Tensor | None = None

    @property
    def decode_tok_s(self) -> float | None:
        total = sum(self.decode_s)
        return len(self.decode_s) / total if total > 0 else None


@dataclass
class DecodeRun:
    """What `decode_loop` produced: the tokens, each decode step's seconds, and (when kept) the raw
    logits of every generated token, the prefill's first."""

    tokens: list[int]
    step_s: list[float]
    step_logits: torch.Tensor | None = None


@torch.no_grad()
def decode_loop(
    step: Callable[[list[torch.Tensor], torch.Tensor], torch.Tensor],
    embed: Callable[[torch.Tensor], list[torch.Tensor]],
    first_logits: torch.Tensor,
    position: int,
    max_new_tokens: int,
    *,
    sampling: Sampling | None = None,
    cap: float | None = None,
    eos_token_ids: Sequence[int] = (),
    on_token: Callable[[int], None] | None = None,
    keep_logits: bool = False,
    generator: torch.Generator | None = None,
) -> DecodeRun:
    """The one host decode loop: pick a token from the logits, embed it on the host, run one
    decode step at the next position, until `max_new_tokens` or an eos token (kept).

    `step(inputs, position)` runs the compiled decode graph and returns the `[vocab]` logits row;
    how its K/V are held (host buffers appended, or device state) is the caller's business. The
    host runtime, the TP ranks, the Neuron recipes' host loops and the benchmarks all come here.
    """
    sampling = sampling or Sampling()
    eos = {int(t) for t in eos_token_ids}
    token = choose_token(first_logits, sampling, cap, generator)
    run = DecodeRun([token], [], None)
    kept = [first_logits.float().clone()] if keep_logits else None
    if on_token:
        on_token(token)
    while len(run.tokens) < max_new_tokens and token not in eos:
        started = time.perf_counter()
        logits = step(embed(torch.tensor([[token]])), torch.tensor([position]))
        token = choose_token(logits, sampling, cap, generator)
        run.step_s.append(time.perf_counter() - started)
        if kept is not None:  # after the timing: keeping them is the check's cost, not decode's
            kept.append(logits.float().clone())
        run.tokens.append(token)
        position += 1
        if on_token:
            on_token(token)
    if kept is not None:
        run.step_logits = torch.stack(kept)
    return run


class HostRuntime:
    """Drives compiled (or eager) prefill/decode steps that share one set of K/V buffers.

    `prefill` maps a bucket length to a step; each step has the DeviceGraph calling convention
    `step(inputs_embeds, [per_layer_inputs,] start, length, *kv) -> logits` and updates `kv` in place.
    """

    def __init__(
        self,
        model: LoadedModel,
        prefill: dict[int, Step],
        decode: Step,
        kv: list[torch.Tensor],
        context_length: int,
        batch: int = 1,
        dtype: torch.dtype = torch.float32,
    ):
        self.model, self.prefill, self.decode, self.kv = model, dict(sorted(prefill.items())), decode, kv
        self.context_length, self.batch, self.dtype = context_length, batch, dtype
        self.embedder = HostEmbedder.from_text_model(model.text_model)
        self.has_ple = self.embedder.has_ple
        self.cap = getattr(model.config, "final_logit_softcapping", None)

    def embed(self, ids: torch.Tensor, pad_to: int | None = None) -> list[torch.Tensor]:
        """Word embeddings (scaled) and the PLE inputs on the host, right-padded with zeros."""
        return self.embedder.inputs(ids, pad_to, self.dtype)

    def bucket_for(self, n_tokens: int) -> int:
        """The smallest compiled prefill length that holds the prompt."""
        for bucket in self.prefill:
            if n_tokens <= bucket:
                return bucket
        raise PromptTooLongError(n_tokens, 0, max(self.prefill), limit="largest compiled prefill bucket")

    def check_fits(self, prompt_ids: Sequence[int], max_new_tokens: int) -> int:
        """Raise before any device work when the request cannot fit the compiled shapes.

        The K/V buffers hold the prompt and every new token but the last, which is never fed back:
        `len(prompt) + max_new_tokens - 1` positions must fit the compiled context.
        """
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise SettingsError(f"max_new_tokens must be a whole number >= 1, got {max_new_tokens!r}")
        if len(prompt_ids) == 0:
            raise BadPromptError("prompt has no tokens; pass a non-empty prompt")
        vocab = int(self.model.config.vocab_size)
        outside = sorted({int(t) for t in prompt_ids if not 0 <= int(t) < vocab})
        if outside:
            raise BadPromptError(
                f"token ids {outside[:5]} are outside this model's vocabulary (0..{vocab - 1}); "
                f"encode the text with this model's tokenizer (encode_prompt)"
            )
        if len(prompt_ids) + max_new_tokens - 1 > self.context_length:
            raise PromptTooLongError(len(prompt_ids), max_new_tokens, self.context_length)
        return self.bucket_for(len(prompt_ids))

    # ---- generation -------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self,
        prompt_ids: Sequence[int] | torch.Tensor,
        max_new_tokens: int,
        *,
        sampling: Sampling = Sampling(),
        eos_token_ids: Sequence[int] = (),
        on_token: Callable[[int], None] | None = None,
        keep_logits: bool = False,
    ) -> Generation:
        if isinstance(prompt_ids, str):
            raise BadPromptError(
                "generate() takes token ids, not text; encode the text first with encode_prompt(tokenizer, prompt)"
            )
        if self.batch > 1:  # the graphs take `batch` rows: batch_runtime.generate_batch feeds them
            raise SettingsError(
                f"this runtime's graphs were compiled for batch {self.batch}; generate with "
                f"gemma4lib.serving.batch_runtime.generate_batch(runtime, [prompt_ids, ...], max_new_tokens)"
            )
        ids = torch.as_tensor(prompt_ids, dtype=torch.long)
        if ids.dim() == 2:
            if ids.shape[0] > self.batch:
                raise BatchTooLargeError(
                    f"batch of {ids.shape[0]} prompts, but the graphs were compiled for "
                    f"batch {self.batch}; send at most {self.batch} at a time or recompile"
                )
            ids = ids[0]
        ids_list = ids.tolist()
        bucket = self.check_fits(ids_list, max_new_tokens)
        generator = torch.Generator().manual_seed(sampling.seed)
        n = len(ids_list)

        started = time.perf_counter()
        inputs = self.embed(ids[None], pad_to=bucket)
        first = self.prefill[bucket](*inputs, torch.tensor([0]), torch.tensor([n]), *self.kv)[0]
        prefill_s = time.perf_counter() - started
        one = torch.tensor([1])
        run = decode_loop(
            lambda inputs, position: self.decode(*inputs, position, one, *self.kv)[0],
            self.embed,
            first,
            n,
            max_new_tokens,
            sampling=sampling,
            cap=self.cap,
            eos_token_ids=eos_token_ids,
            on_token=on_token,
            keep_logits=keep_logits,
            generator=generator,
        )
        return Generation(ids_list, run.tokens, bucket, prefill_s, run.step_s, first.clone(), run.step_logits)

    def time_prefill(self, prompt_ids: Sequence[int]) -> float:
        """Seconds for one prefill of `prompt_ids` (host embeddings included, as a user sees it)."""
        ids = torch.as_tensor(prompt_ids, dtype=torch.long)[None]
        bucket = self.bucket_for(ids.shape[1])
        started = time.perf_counter()
        with torch.no_grad():
            inputs = self.embed(ids, pad_to=bucket)
            self.prefill[bucket](*inputs, torch.tensor([0]), torch.tensor([ids.shape[1]]), *self.kv)
        return time.perf_counter() - started
