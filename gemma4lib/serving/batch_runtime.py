"""The host loop for a batch of B prompts of different lengths through one set of batched graphs.

Greedy only. Prefill takes every row at once, right-padded to one bucket (`start` all 0, `length`
each row's prompt length); decode feeds one token per row at the row's own position. A row that
emits eos is finished: its tokens stop there, but the compiled shapes are static, so it keeps
running (fed its own last token at its next position, into its own K/V rows only) and its logits
are dropped until every row has finished or `max_new_tokens` is reached. A batch with fewer prompts
than the compiled batch fills the spare rows with copies of the last prompt, whose output is
dropped.

`generate_rows` is the loop over plain step callables (the host runtime's, a TP rank's, a Neuron
module's); `generate_batch` runs it on a `HostRuntime`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..errors import BadPromptError, BatchTooLargeError
from ..runtime import Generation

# step(inputs..., start [B], length [B]) -> logits [B, vocab] (K/V held by the caller)
RowStep = Callable[..., torch.Tensor]
Embed = Callable[..., list[torch.Tensor]]


@dataclass
class BatchGeneration:
    """One batched generation: a `Generation` per prompt, and the batch's own timings."""

    rows: list[Generation]
    batch: int  # the compiled batch (>= len(rows))
    bucket: int
    prefill_s: float
    step_s: list[float] = field(default_factory=list)  # seconds of each decode step (all rows at once)
    step_tokens: list[int] = field(default_factory=list)  # tokens the live rows produced in each step

    @property
    def decode_tok_s(self) -> float | None:
        """The batch's total: tokens all rows produced in decode steps per second of those steps."""
        total = sum(self.step_s)
        return sum(self.step_tokens) / total if total > 0 else None

    @property
    def decode_tok_s_per_row(self) -> float | None:
        total = self.decode_tok_s
        return None if total is None else total / len(self.rows)


def check_rows(prompts: Sequence[Sequence[int]], batch: int) -> None:
    """Refuse, before any device work, more prompts than the compiled batch or an empty one."""
    if len(prompts) == 0:
        raise BadPromptError("the batch has no prompts; pass at least one")
    if len(prompts) > batch:
        raise BatchTooLargeError(
            f"batch of {len(prompts)} prompts, but the graphs were compiled for batch {batch}; "
            f"send at most {batch} at a time or compile with batch_size={len(prompts)}"
        )
    for i, ids in enumerate(prompts):
        if len(ids) == 0:
            raise BadPromptError(f"prompt {i} of the batch has no tokens; every row needs a non-empty prompt")


def _logits(out, batch: int) -> torch.Tensor:
    """`[batch, vocab]` logits from a step's output (a tensor, or a tuple/list led by them)."""
    out = out[0] if isinstance(out, (tuple, list)) else out
    return out.reshape(batch, -1)


def _embed_rows(embed: Embed, rows: Sequence[Sequence[int]], pad_to: int) -> list[torch.Tensor]:
    parts = [embed(torch.tensor([list(ids)], dtype=torch.long), pad_to) for ids in rows]
    return [torch.cat(column, 0) for column in zip(*parts, strict=True)]


@torch.no_grad()
def generate_rows(
    prefill: RowStep,
    decode: RowStep,
    embed: Embed,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    batch: int,
    bucket: int,
    eos_token_ids: Sequence[int] = (),
    keep_logits: bool = False,
) -> BatchGeneration:
    """Greedy tokens for every prompt; each row stops at its own eos (kept) or `max_new_tokens`."""
    check_rows(prompts, batch)
    prompts = [[int(t) for t in ids] for ids in prompts]
    n_real = len(prompts)
    rows = prompts + [prompts[-1]] * (batch - n_real)
    eos = {int(t) for t in eos_token_ids}
    lengths = torch.tensor([len(ids) for ids in rows], dtype=torch.long)

    started = time.perf_counter()
    logits = _logits(prefill(*_embed_rows(embed, rows, bucket), torch.zeros(batch, dtype=torch.long), lengths), batch)
    prefill_s = time.perf_counter() - started
    first = logits.float().clone()
    last = torch.argmax(first, dim=-1)
    tokens = [[int(last[r])] for r in range(batch)]
    kept = [[first[r].clone()] for r in range(n_real)] if keep_logits else None
    done = [tokens[r][0] in eos or max_new_tokens <= 1 for r in range(batch)]
    out = BatchGeneration([], batch, bucket, prefill_s)
    position, one = lengths.clone(), torch.ones(batch, dtype=torch.long)
    while not all(done[:n_real]):
        step_started = time.perf_counter()
        logits = _logits(decode(*embed(last.view(batch, 1)), position, one), batch)
        last = torch.argmax(logits, dim=-1)
        out.step_s.append(time.perf_counter() - step_started)
        live = [r for r in range(n_real) if not done[r]]
        out.step_tokens.append(len(live))
        for r in live:  # a finished row's outputs are dropped
            tokens[r].append(int(last[r]))
            if kept is not None:
                kept[r].append(logits[r].float().clone())
            done[r] = int(last[r]) in eos or len(tokens[r]) >= max_new_tokens
        position = position + 1
        # a finished row is fed its own last token again (its K/V rows only; nothing reads them)
        last = torch.tensor([tokens[r][-1] for r in range(batch)], dtype=torch.long)
    for r in range(n_real):
        out.rows.append(
            Generation(
                prompts[r],
                tokens[r],
                bucket,
                prefill_s,
                [],
                first[r].clone(),
                torch.stack(kept[r]) if kept is not None else None,
            )
        )
    return out


class RowStepwisePrefill:
    """A batched prefill made of one-token decode calls (the trace recipe compiles only decode).

    Step i feeds each row its token i at position i. A row shorter than the longest is fed its own
    last token at its own last position again: the same token over the same context rewrites that
    slot with the same K/V, so nothing past the row's prompt is ever written (a ring would otherwise
    hold padding where it expects real history). Its logits are those of its last real token.
    """

    def __init__(self, decode_step: Callable[..., torch.Tensor], num_inputs: int):
        self.decode_step, self.num_inputs = decode_step, num_inputs

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        inputs = args[: self.num_inputs - 2]
        length = args[self.num_inputs - 1].reshape(-1)
        rows = torch.arange(length.shape[0])
        logits = None
        for i in range(int(length.max())):
            at = torch.clamp(length - 1, max=i)  # each row's position this step
            chunk = [x[rows, at].unsqueeze(1) for x in inputs]
            logits = self.decode_step(*chunk, at, torch.ones_like(length))
        return logits


def pick_bucket(buckets: Sequence[int], prompts: Sequence[Sequence[int]]) -> int:
    """The smallest bucket that holds the longest prompt of the batch."""
    from ..errors import PromptTooLongError

    longest = max(len(ids) for ids in prompts)
    for bucket in sorted(buckets):
        if longest <= bucket:
            return bucket
    raise PromptTooLongError(longest, 0, max(buckets), limit="largest compiled prefill bucket")


def generate_batch(
    runtime,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    eos_token_ids: Sequence[int] = (),
    keep_logits: bool = False,
) -> BatchGeneration:
    """`generate_rows` on a `HostRuntime` compiled for `runtime.batch` rows (K/V in `runtime.kv`)."""
    check_rows(prompts, runtime.batch)
    for ids in prompts:
        runtime.check_fits(list(ids), max_new_tokens)
    bucket = pick_bucket(list(runtime.prefill), prompts)
    kv = runtime.kv
    return generate_rows(
        lambda *inputs: runtime.prefill[bucket](*inputs, *kv),
        lambda *inputs: runtime.decode(*inputs, *kv),
        runtime.embed,
        prompts,
        max_new_tokens,
        batch=runtime.batch,
        bucket=bucket,
        eos_token_ids=eos_token_ids,
        keep_logits=keep_logits,
    )


__all__ = ["BatchGeneration", "RowStepwisePrefill", "check_rows", "generate_batch", "generate_rows", "pick_bucket"]
