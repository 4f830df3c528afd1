"""The serve bench's side by side: this project's endpoint and `transformers serve` on the same model folder.

Both servers load one folder (`models.served_folder`: the tiny E2B's trained fixture, or medium-dense
saved with a tokenizer as large as its vocabulary), run on CPU with the same thread count, listen on
127.0.0.1 as child processes and are stopped at the end. The same client (`serving.load`, the
official `openai` async client, streamed greedy chat requests) drives both with the same prompts, at
each level of concurrent clients, the two servers one after the other within the level, so both meet
the shared machine's load at the same time (the load average is recorded before and after each level).

Fixed output length without an ignore-eos switch (transformers serve has none; a `generation_config`
with `min_new_tokens` would suppress eos and change the text, not ignore it): `max_tokens` no longer
than the shortest natural reply, so every reply stops at exactly `max_tokens`; every reply's token
count (each server's own `usage`) is checked and the off-length ones counted. Greedy equality: each
prompt's reply sent alone must be the same text on both servers, and every reply under load equal to
its own server's reply alone (`mixed`). Per level: tokens/s and TTFT p50/p99 of both, and the ratios
against the issue's goal (`GOAL_TOKENS_PER_S`, a lower p50 TTFT at every level). The peer's
continuous batching is tried again in the same run (`peer.try_continuous_batching`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gemma4lab.models.served_folder import base_variant, save_served_folder
from gemma4lab.serving.load import DEFAULT_LEVELS, Level, Reply, measure_level, single_replies
from gemma4lab.serving.peer import PeerServer, try_continuous_batching
from gemma4lab.serving.process import ServerProcess
from gemma4lib.environment import versions
from gemma4lib.models.corpus import COUNTRIES

log = logging.getLogger(__name__)

SIDES = ("gemma4lib", "transformers_serve")
# The goal: this endpoint's tokens/s over transformers serve's, per level of clients.
GOAL_TOKENS_PER_S = {1: 2.0, 8: 4.0, 16: 4.0}
# Reply length per model: the tiny E2B answers a capital question in 8 tokens (eos counted), so 8 is
# a fixed length there; the random medium model rarely picks an eos among 32,768 ids.
REPLY_TOKENS = {"e2b": 8}
# the capital questions take 16 tokens or fewer with the template: ours prefills a 16-token graph for them,
# as the peer prefills the prompt as it is (with the default 64 alone, the 2026-12-05 run prefilled 4x the
# prompt: 0.47x the peer's TTFT at one client on medium-dense); a longer prompt takes the 64 one
PREFILL_BUCKETS = (16, 64)
DEFAULT_REPLY_TOKENS = 16


def capital_prompts(n: int = 16) -> list[str]:
    return [f"What is the capital of {country}?" for country, _ in COUNTRIES[:n]]


def off_length(replies: Sequence[Reply], max_tokens: int) -> int:
    """Replies that failed or whose token count is not `max_tokens` (the fixed length asked for)."""
    return sum(1 for r in replies if r.error or r.tokens != max_tokens)


def compare_references(ours: Sequence[Reply], peer: Sequence[Reply]) -> dict[str, Any]:
    """Each prompt's reply alone on both servers: how many are the same text, and the ones that are not."""
    mismatches = [
        {"prompt": a.prompt, "gemma4lib": a.text, "transformers_serve": b.text, "errors": [a.error, b.error]}
        for a, b in zip(ours, peer, strict=True)
        if a.error or b.error or a.text != b.text
    ]
    return {"prompts": len(ours), "equal": len(ours) - len(mismatches), "mismatches": mismatches}


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def level_ratios(clients: int, ours: dict[str, Any], peer: dict[str, Any]) -> dict[str, Any]:
    """One level's ratios: tokens/s ours over the peer's (and the goal, where the issue sets one);
    TTFT the peer's over ours (above 1: ours answers first)."""
    tok = _ratio(ours["tokens_per_s"], peer["tokens_per_s"])
    goal = GOAL_TOKENS_PER_S.get(clients)
    p50 = _ratio(peer["ttft_p50_s"], ours["ttft_p50_s"])
    return {
        "tokens_per_s_ratio": tok,
        "ttft_p50_ratio": p50,
        "ttft_p99_ratio": _ratio(peer["ttft_p99_s"], ours["ttft_p99_s"]),
        "goal_tokens_per_s_ratio": goal,
        "meets_tokens_per_s_goal": None if goal is None or tok is None else tok >= goal,
        "lower_ttft_p50": None if p50 is None else p50 > 1.0,
    }


def goal_summary(levels: Sequence[dict[str, Any]], references: dict[str, Any]) -> dict[str, Any]:
    """Whether the run meets the issue's goal: every tokens/s goal, a lower p50 TTFT at every level,
    greedy replies equal (alone and under load), every reply of the fixed length."""
    ratios = [row["ratios"] for row in levels]
    tokens_ok = all(r["meets_tokens_per_s_goal"] for r in ratios if r["goal_tokens_per_s_ratio"] is not None)
    ttft_ok = all(r["lower_ttft_p50"] for r in ratios)
    equal = references["equal"] == references["prompts"] and all(
        row[side]["mixed"] == 0 and row[side]["errors"] == 0 for row in levels for side in SIDES
    )
    fixed = all(row[side]["off_length"] == 0 for row in levels for side in SIDES)
    return {
        "tokens_per_s_goal_met": tokens_ok,
        "lower_ttft_p50_every_level": ttft_ok,
        "greedy_equal": equal,
        "fixed_length": fixed,
        "goal_met": tokens_ok and ttft_ok and equal and fixed,
        "tokens_per_s_ratios": {str(row["clients"]): row["ratios"]["tokens_per_s_ratio"] for row in levels},
        "ttft_p50_ratios": {str(row["clients"]): row["ratios"]["ttft_p50_ratio"] for row in levels},
    }


def _load_average() -> list[float] | None:
    with contextlib.suppress(OSError, AttributeError):
        return [round(x, 2) for x in os.getloadavg()]
    return None


def _level_dict(level: Level, max_tokens: int) -> dict[str, Any]:
    return {**level.as_dict(), "off_length": off_length(level.replies, max_tokens)}


def bench_side_by_side(
    name: str,
    *,
    batch: int = 8,
    backend: str = "cpu",
    levels: Sequence[int] = DEFAULT_LEVELS,
    max_tokens: int | None = None,
    min_requests: int = 16,
    threads: int | None = None,
    prompts: Sequence[str] | None = None,
    start_timeout_s: float = 1200.0,
    level_timeout_s: float = 300.0,
    prefill_buckets: Sequence[int] = PREFILL_BUCKETS,
) -> dict[str, Any]:
    """Model `name` (a tiny variant or a medium config) saved once, served by both, measured level by level."""
    threads = threads or int(os.environ.get("GEMMA4LIB_THREADS", "1"))
    max_tokens = max_tokens or REPLY_TOKENS.get(name, DEFAULT_REPLY_TOKENS)
    prompts = list(prompts or capital_prompts())
    report: dict[str, Any] = {
        "model": name,
        "batch": batch,
        "backend": backend,
        "threads": threads,
        "max_tokens": max_tokens,
        "prompts": len(prompts),
        "min_requests": min_requests,
        "prefill_buckets": list(prefill_buckets),
        "peer": {"versions": {"transformers": versions().get("transformers")}, "device": "cpu"},
        "load_average_start": _load_average(),
    }
    with tempfile.TemporaryDirectory(prefix="gemma4lab-side-by-side-") as tmp:
        folder = save_served_folder(name, Path(tmp) / name)
        model = str(folder)  # both servers answer to the folder's path as the model id
        ours = ServerProcess(
            ["--variant", base_variant(name), "--model", "checkpoint", "--checkpoint", model, "--batch", str(batch)]
            + ["--backend", backend, "--threads", str(threads), "--max-queue", str(4 * max(levels))]
            + ["--model-name", model, "--prefill-buckets", ",".join(map(str, prefill_buckets))]
        )
        peer = PeerServer(folder, threads=threads)
        servers = dict(zip(SIDES, (ours, peer), strict=True))
        try:
            for side, server in servers.items():
                log.info("side by side %s: starting %s", name, side)
                server.start(start_timeout_s)
                report[f"{side}_ready_s"] = server.ready_s
            report["peer"]["command"] = peer.command[1:]
            alone = {
                side: single_replies(s.url, model, prompts, max_tokens, level_timeout_s) for side, s in servers.items()
            }
            report["references"] = compare_references(alone[SIDES[0]], alone[SIDES[1]])
            report["references_off_length"] = {side: off_length(r, max_tokens) for side, r in alone.items()}
            refs = {side: {r.prompt: r.text for r in replies} for side, replies in alone.items()}
            rows = []
            for clients in levels:
                row: dict[str, Any] = {"clients": clients, "load_average_before": _load_average()}
                for side, server in servers.items():
                    level = measure_level(
                        server.url, model, prompts, clients, refs[side],
                        max_tokens=max_tokens, timeout_s=level_timeout_s, min_requests=min_requests,
                    )  # fmt: skip
                    row[side] = _level_dict(level, max_tokens)
                row["load_average_after"] = _load_average()
                row["ratios"] = level_ratios(clients, row[SIDES[0]], row[SIDES[1]])
                rows.append(row)
        finally:
            for server in servers.values():
                server.stop(60)
        report["levels"] = rows
        log.info("side by side %s: retrying the peer's continuous batching", name)
        report["peer"]["continuous_batching_retry"] = try_continuous_batching(
            folder, model, prompts[0], threads=threads, max_tokens=max_tokens, start_timeout_s=start_timeout_s
        )
    report["summary"] = goal_summary(rows, report["references"])
    report["load_average_end"] = _load_average()
    return report
