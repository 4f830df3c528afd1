"""Benchmark section `serve`: the endpoint under 1, 4, 8 and 16 concurrent streaming clients.

The server runs as `python -m gemma4lib serve` in its own process (the command a user runs, and no
GIL shared with the clients), bound to 127.0.0.1 on a free port; the clients are the official
`openai` async client (`gemma4lab.serving.load.run_load`; at least `min_requests` requests per level, so the
one-client level the others are divided by lasts long enough to measure). Per level: every response
complete, none mixed (each greedy reply equal to the same prompt's reply sent alone), p50/p99 time
to first token and the total tokens/s. Where aiperf's venv exists (`scripts/setup_aiperf_env.sh`), a load
generator nobody here wrote then drives the same server at 1 and 8 concurrent streams and its own figures are
recorded beside ours (`aiperf`; otherwise the reason it did not run). The server gets SIGTERM at the end and
drains. Every step is bounded in requests and time.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from gemma4lab.serving.aiperf import AIPERF_VERSION, aiperf_command, find_aiperf, run_aiperf
from gemma4lab.serving.load import DEFAULT_LEVELS, run_load
from gemma4lab.serving.process import ServerProcess
from gemma4lib.models.corpus import COUNTRIES

log = logging.getLogger(__name__)


def bench_serve(
    variant: str = "e2b",
    *,
    batch: int = 8,
    backend: str = "cpu",
    levels: Sequence[int] = DEFAULT_LEVELS,
    requests_per_client: int = 2,
    min_requests: int = 16,
    max_tokens: int = 64,
    ignore_eos: bool = True,
    row_prefill: bool | None = None,
    admit_wait_ms: float = 0.0,
    prefill_buckets: Sequence[int] | None = None,
    start_timeout_s: float = 900.0,
    level_timeout_s: float = 300.0,
) -> dict[str, Any]:
    """The section's report: the server's settings, then one row per level.

    By default every reply is `max_tokens` long (`ignore_eos`, as vLLM's serving benchmark fixes
    output lengths): the tiny model answers a capital question in 8 tokens, so with eos honoured
    a level measures admission and HTTP per request more than the batched decode that continuous
    batching is for. `row_prefill` None: the server's default (on for cpu/eager)."""
    args = [
        "--variant",
        variant,
        "--batch",
        str(batch),
        "--backend",
        backend,
        "--max-queue",
        str(4 * max(levels)),
        "--admit-wait-ms",
        str(admit_wait_ms),
    ]
    if row_prefill is not None:
        args.append("--row-prefill" if row_prefill else "--no-row-prefill")
    if prefill_buckets:  # else the variant's smoke default
        args += ["--prefill-buckets", ",".join(str(b) for b in prefill_buckets)]
    server = ServerProcess(args)
    server.start(start_timeout_s)
    try:
        health = server.health()
        prompts = [f"What is the capital of {country}?" for country, _ in COUNTRIES[:16]]
        rows = run_load(
            server.url,
            variant,
            prompts,
            levels,
            requests_per_client=requests_per_client,
            max_tokens=max_tokens,
            timeout_s=level_timeout_s,
            min_requests=min_requests,
            ignore_eos=ignore_eos,
        )
        third_party = aiperf_levels(server.url, variant, max_tokens, level_timeout_s)
    finally:
        server.stop(60)
    by_clients = {row.clients: row for row in rows}
    one, eight = by_clients.get(1), by_clients.get(8)
    return {
        "variant": variant,
        "batch": batch,
        "backend": backend,
        "threads": int(os.environ.get("GEMMA4LIB_THREADS", "1")),
        "server_ready_s": server.ready_s,
        "compile_s": health.get("compile_s"),
        "max_tokens": max_tokens,
        "ignore_eos": ignore_eos,
        "row_prefill": health.get("row_prefill", row_prefill),
        "admit_wait_ms": admit_wait_ms,
        "prefill_buckets": list(prefill_buckets) if prefill_buckets else None,
        "requests_per_client": requests_per_client,
        "min_requests": min_requests,
        "levels": [row.as_dict() for row in rows],
        "all_complete": all(row.complete for row in rows),
        "mixed": sum(row.mixed for row in rows),
        "speedup_8_over_1": eight.tokens_per_s / one.tokens_per_s if one and eight and one.tokens_per_s else None,
        "aiperf": third_party,
    }


def aiperf_levels(url: str, model: str, max_tokens: int, timeout_s: float, levels=(1, 8)) -> dict[str, Any]:
    """aiperf's own figures at each of `levels` concurrent streams (16 requests of 16 prompt tokens and
    `max_tokens` out, each level bounded by `timeout_s`), or why it did not run."""
    import tempfile
    from pathlib import Path

    from gemma4lib.models.trained import TOKENIZER_DIR

    binary = find_aiperf()
    if binary is None:
        return {"ran": False, "why": "no aiperf venv: scripts/setup_aiperf_env.sh (or GEMMA4LIB_AIPERF)"}
    rows = []
    for clients in levels:
        with tempfile.TemporaryDirectory(prefix="gemma4lab-aiperf-") as tmp:
            bounds = dict(concurrency=clients, requests=16, input_tokens=16, output_tokens=max_tokens)
            command = aiperf_command(binary, url, model, TOKENIZER_DIR, Path(tmp), duration_s=timeout_s, **bounds)
            rows.append({"clients": clients, **run_aiperf(command, Path(tmp), timeout_s + 60).as_dict()})
    return {"ran": True, "version": AIPERF_VERSION, "levels": rows}
