"""`python -m gemma4lib serve` as a child process on 127.0.0.1, for the benchmark and the notebook.

A child process, not a thread: the server's scheduler and HTTP threads then share no GIL with the
clients that measure it, and it is exactly the command a user runs. The child's output goes to a
log file (a pipe nobody reads fills up and blocks the server after a few hundred access-log lines).
It stops itself: `stop()` sends SIGTERM (the server drains, then exits) and kills it if it has not
exited in time; on Linux the child also gets SIGTERM when its parent dies (`PR_SET_PDEATHSIG`), so
a notebook kernel that is interrupted or killed never leaves a server listening behind it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from gemma4lib.errors import Gemma4LibError
from gemma4lib.server.launch import LOOPBACK, free_port

log = logging.getLogger("gemma4lib.server")
PR_SET_PDEATHSIG = 1


class ServerProcessError(Gemma4LibError, RuntimeError):
    """The child server exited or did not answer `/health` in time (its log's tail is in the message)."""


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not glibc: the parent's stop() and atexit still end it
        pass


class ServerProcess:
    """`python -m gemma4lib serve ARGS --host 127.0.0.1 --port P` in a child; a context manager."""

    def __init__(self, args: Sequence[str], *, port: int | None = None, log_path: str | Path | None = None):
        self.port = port or free_port()
        self.command = [sys.executable, "-m", "gemma4lib", "serve", *args, "--host", LOOPBACK, "--port", str(self.port)]
        self.log_path = Path(log_path or tempfile.mkstemp(prefix="gemma4lib-serve-", suffix=".log")[1])
        self.proc: subprocess.Popen | None = None
        self.ready_s: float | None = None
        self.returncode: int | None = None
        self.env: dict[str, str] = {}  # set over this process's environment for the child

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def start(self, timeout_s: float = 600.0) -> ServerProcess:
        """Start the child and return once `/health` answers 200 (the engine is loaded)."""
        began = time.perf_counter()
        with open(self.log_path, "w") as out:
            self.proc = subprocess.Popen(
                self.command,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.returncode = self.proc.returncode
                raise ServerProcessError(
                    f"`{' '.join(self.command)}` exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    self.ready_s = time.perf_counter() - began
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.kill()
        raise ServerProcessError(
            f"`{' '.join(self.command)}` did not answer /health within {timeout_s:.0f} s:\n{self.log_tail()}"
        )

    def health(self) -> dict[str, Any]:
        return httpx.get(self.url + "/health", timeout=10).json()

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM (the server finishes its running requests, then exits); kill after `timeout_s`."""
        if self.proc is None or self.proc.poll() is not None:
            self.returncode = None if self.proc is None else self.proc.returncode
            return self.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.returncode = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.error("the server did not exit %.0f s after SIGTERM; killing it", timeout_s)
            self.kill()
        return self.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.returncode = self.proc.wait(10)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
