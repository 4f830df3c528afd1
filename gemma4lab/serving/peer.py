"""`transformers serve` on a model folder as a child process on 127.0.0.1: the peer that the serve
bench measures this project's endpoint against.

It runs from the same `.venv` (transformers' own command line, `python -m transformers.cli.transformers
serve FOLDER`, the folder preloaded so no request pays for the load), on CPU, with the same thread
count as this project's server (`OMP_NUM_THREADS`, which torch reads at start), and stops like
`ServerProcess` (SIGTERM, then kill; it dies with its parent). transformers 5.23's
`--continuous-batching` fails on Gemma-4 (`AmbiguousGlobalPerLayerAttributeError`: its paged cache
reads `config.head_dim`, and Gemma-4's head_dim is per layer), so the peer serves without it and
`try_continuous_batching` asks again in every run: one request to a peer started with the flag,
and what came back (served, or the error and the exception names in its log).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from gemma4lab.serving.load import single_replies
from gemma4lab.serving.process import ServerProcess, ServerProcessError
from gemma4lib.server.launch import LOOPBACK

PEER_MODULE = "transformers.cli.transformers"
CONTINUOUS_BATCHING_FLAG = "--continuous-batching"
_ERROR_NAME = re.compile(r"\b([A-Z][A-Za-z]*(?:Error|Exception))\b")


def peer_command(folder: str | Path, port: int, *, continuous_batching: bool = False) -> list[str]:
    """The peer's command line: `transformers serve FOLDER` on CPU, bound to 127.0.0.1:`port`."""
    command = [sys.executable, "-m", PEER_MODULE, "serve", str(folder), "--device", "cpu"]
    command += ["--host", LOOPBACK, "--port", str(port), "--log-level", "warning"]
    if continuous_batching:
        command.append(CONTINUOUS_BATCHING_FLAG)
    return command


class PeerServer(ServerProcess):
    """`transformers serve FOLDER` in a child on 127.0.0.1 (a free port), `threads` torch threads."""

    def __init__(self, folder: str | Path, *, threads: int = 1, continuous_batching: bool = False):
        super().__init__(())
        self.command = peer_command(folder, self.port, continuous_batching=continuous_batching)
        self.env = {"OMP_NUM_THREADS": str(threads)}


def error_names(log_text: str) -> list[str]:
    """The exception class names a log mentions, sorted and each once (what a failed retry records)."""
    return sorted(set(_ERROR_NAME.findall(log_text)))


def try_continuous_batching(
    folder: str | Path,
    model: str,
    prompt: str,
    *,
    threads: int = 1,
    max_tokens: int = 8,
    start_timeout_s: float = 300.0,
    timeout_s: float = 120.0,
) -> dict[str, Any]:
    """Start the peer with `--continuous-batching`, send one streamed greedy request, stop it; the outcome."""
    peer = PeerServer(folder, threads=threads, continuous_batching=True)
    outcome: dict[str, Any] = {"flag": CONTINUOUS_BATCHING_FLAG, "served": False, "reply": None, "error": None}
    try:
        peer.start(start_timeout_s)
        reply = single_replies(peer.url, model, [prompt], max_tokens, timeout_s)[0]
        outcome.update(served=reply.error is None and reply.tokens > 0, reply=reply.text, error=reply.error)
    except ServerProcessError as exc:  # it did not even start: that is the outcome too
        outcome["error"] = str(exc)[-1500:]
    finally:
        peer.stop(30)
    log_text = peer.log_tail(50_000)
    outcome["log_errors"] = error_names(log_text)
    outcome["log_error_line"] = next(
        (ln.strip() for ln in log_text.splitlines() if any(f"{n}: " in ln for n in outcome["log_errors"])), None
    )
    return outcome
