"""Concurrent streaming clients against an endpoint: per level of concurrency, TTFT, tokens/s, and
whether every response is complete and equal to its request's answer alone.

What `bench --sections serve` and a notebook call. Each level runs `clients` tasks of the official
`openai` async client, each sending `requests_per_client` streamed greedy requests one after
another (or more, so that the level sends at least `min_requests`: a one-client level of two short
replies lasts a fraction of a second, and one pause of a shared machine then moves every ratio
against it): bounded in count, and the whole level in time (`timeout_s`), so a load run always stops.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from gemma4lib.errors import Gemma4LibError

DEFAULT_LEVELS = (1, 4, 8, 16)


class LoadRunError(Gemma4LibError, RuntimeError):
    """A load run could not take its single-request references: the server is not answering."""


@dataclass
class Reply:
    prompt: str
    text: str = ""
    finish_reason: str | None = None
    tokens: int = 0
    ttft_s: float | None = None
    total_s: float = 0.0
    error: str | None = None


@dataclass
class Level:
    """One concurrency level's figures (JSON-ready through `as_dict`)."""

    clients: int
    requests: int
    errors: int
    complete: bool  # every request ended by eos or max_tokens, none failed
    mixed: int  # greedy replies that differ from the same prompt's reply alone
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tokens: int
    wall_s: float
    tokens_per_s: float
    replies: list[Reply] = field(default_factory=list, repr=False)

    def as_dict(self, replies: bool = False) -> dict[str, Any]:
        out = asdict(self)
        if not replies:
            out.pop("replies")
        return out


async def stream_one(client: Any, model: str, prompt: str, max_tokens: int, ignore_eos: bool = False) -> Reply:
    """One streamed greedy chat request; its text, tokens (the server's usage count) and TTFT.
    `ignore_eos`: generate all `max_tokens` (vLLM's extra field, sent in `extra_body`), a fixed
    output length as serving benchmarks use, so that tokens/s measures decode, not answer lengths."""
    reply = Reply(prompt)
    t0 = time.perf_counter()
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True} if ignore_eos else None,
        )
        async for chunk in stream:
            if chunk.usage is not None:
                reply.tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                if choice.delta.content and reply.ttft_s is None:
                    reply.ttft_s = time.perf_counter() - t0
                reply.text += choice.delta.content or ""
                reply.finish_reason = choice.finish_reason or reply.finish_reason
    except Exception as exc:  # counted and reported per level; the load goes on
        reply.error = f"{type(exc).__name__}: {exc}"
    reply.total_s = time.perf_counter() - t0
    return reply


def _client(base_url: str, timeout_s: float) -> Any:
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=base_url.rstrip("/") + "/v1", api_key="none", max_retries=0, timeout=timeout_s)


async def _level(
    base_url: str,
    model: str,
    prompts: Sequence[str],
    clients: int,
    per_client: int,
    max_tokens: int,
    timeout_s: float,
    references: dict[str, str],
    min_requests: int = 0,
    ignore_eos: bool = False,
) -> Level:
    client = _client(base_url, timeout_s)
    per_client = max(per_client, -(-min_requests // clients))

    async def one_client(index: int) -> list[Reply]:
        out = []
        for k in range(per_client):
            prompt = prompts[(index * per_client + k) % len(prompts)]
            out.append(await stream_one(client, model, prompt, max_tokens, ignore_eos))
        return out

    t0 = time.perf_counter()
    try:
        batches = await asyncio.wait_for(asyncio.gather(*(one_client(i) for i in range(clients))), timeout_s)
    finally:
        await client.close()
    wall = time.perf_counter() - t0
    replies = [r for batch in batches for r in batch]
    ttfts = [r.ttft_s for r in replies if r.ttft_s is not None]
    tokens = sum(r.tokens for r in replies)
    errors = sum(1 for r in replies if r.error)
    mixed = sum(1 for r in replies if r.prompt in references and not r.error and r.text != references[r.prompt])
    return Level(
        clients=clients,
        requests=len(replies),
        errors=errors,
        complete=errors == 0 and all(r.finish_reason in ("stop", "length") for r in replies),
        mixed=mixed,
        ttft_p50_s=float(np.percentile(ttfts, 50)) if ttfts else None,
        ttft_p99_s=float(np.percentile(ttfts, 99)) if ttfts else None,
        tokens=tokens,
        wall_s=wall,
        tokens_per_s=tokens / wall if wall > 0 else 0.0,
        replies=replies,
    )


async def references_for(
    base_url: str,
    model: str,
    prompts: Sequence[str],
    max_tokens: int,
    timeout_s: float = 120.0,
    ignore_eos: bool = False,
) -> dict[str, str]:
    """Each prompt's greedy reply sent alone (nothing else on the server): what a batched reply must equal."""
    client = _client(base_url, timeout_s)
    try:
        out = {}
        for prompt in dict.fromkeys(prompts):
            reply = await stream_one(client, model, prompt, max_tokens, ignore_eos)
            if reply.error:
                raise LoadRunError(
                    f"the reference request for {prompt!r} failed ({reply.error}); check that the server at "
                    f"{base_url} is up and serves {model!r} (GET /v1/models)"
                )
            out[prompt] = reply.text
        return out
    finally:
        await client.close()


def run_load(
    base_url: str,
    model: str,
    prompts: Sequence[str],
    levels: Sequence[int] = DEFAULT_LEVELS,
    *,
    requests_per_client: int = 2,
    max_tokens: int = 24,
    timeout_s: float = 300.0,
    min_requests: int = 0,
    ignore_eos: bool = False,
) -> list[Level]:
    """Every level in turn (the references first); a level that passes `timeout_s` raises TimeoutError.
    Each client sends `requests_per_client` requests, or more when the level would send fewer than
    `min_requests` in all; `ignore_eos`: every reply is `max_tokens` long (`stream_one`)."""

    async def main() -> list[Level]:
        refs = await references_for(base_url, model, prompts, max_tokens, timeout_s, ignore_eos)
        per = requests_per_client
        return [
            await _level(base_url, model, prompts, n, per, max_tokens, timeout_s, refs, min_requests, ignore_eos)
            for n in levels
        ]

    return run_async(main)


def run_async(main: Callable[[], Awaitable[Any]]) -> Any:
    """`asyncio.run(main())`, also from code that already runs in an event loop (a Jupyter cell:
    ipykernel's loop is running there, and `asyncio.run` refuses): then on a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(main())
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gemma4lib-load") as pool:
        return pool.submit(lambda: asyncio.run(main())).result()


def measure_level(
    base_url: str,
    model: str,
    prompts: Sequence[str],
    clients: int,
    references: dict[str, str],
    *,
    requests_per_client: int = 1,
    max_tokens: int = 24,
    timeout_s: float = 300.0,
    min_requests: int = 0,
) -> Level:
    """One level on its own, against references taken before (`references_for`): what a comparison of
    two servers calls, level by level, so that both meet the machine's load at the same time."""
    return run_async(
        lambda: _level(
            base_url, model, prompts, clients, requests_per_client, max_tokens, timeout_s, references, min_requests
        )
    )


def single_replies(
    base_url: str, model: str, prompts: Sequence[str], max_tokens: int, timeout_s: float = 120.0
) -> list[Reply]:
    """Each prompt sent alone, one after another; failures are kept in `Reply.error`, not raised."""

    async def main() -> list[Reply]:
        client = _client(base_url, timeout_s)
        try:
            return [await stream_one(client, model, prompt, max_tokens) for prompt in prompts]
        finally:
            await client.close()

    return run_async(main)
