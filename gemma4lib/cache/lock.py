"""The build lock of one cache key: who holds it, since when, and a wait that ends.

A plain blocking `flock` made a second run wait silently forever behind a stopped (Ctrl-Z) or hung
compile, so: the holder writes who it is (pid, host, since, command) into the lock file; a waiter
polls and reports that holder while it waits (running, stopped, gone?); a lock whose recorded holder
is dead on this host but which is still held (its descriptor leaked into a surviving child, e.g. a
forked compiler worker) is broken after a grace period; the wait has a limit
(`GEMMA4LIB_LOCK_WAIT_S`), then `CacheLockError` says who holds it and what to do. A holder that
dies releases its `flock` by itself (the kernel closes its descriptors).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import CacheLocationError, CacheLockError

log = logging.getLogger(__name__)

LOCK_WAIT_ENV = "GEMMA4LIB_LOCK_WAIT_S"
DEFAULT_LOCK_WAIT_S = 4 * 3600.0  # a released 31B's Neuron compile takes over an hour; never wait forever
REPORT_AFTER_S = 10.0  # first report while waiting, then every REPORT_EVERY_S
REPORT_EVERY_S = 60.0
DEAD_GRACE_S = 5.0  # a recorded holder gone this long, lock still held: break it
POLL_S = 0.25


def lock_wait_limit() -> float:
    """Seconds a run waits for another process's build of the same key (`GEMMA4LIB_LOCK_WAIT_S`)."""
    raw = os.environ.get(LOCK_WAIT_ENV)
    if not raw:
        return DEFAULT_LOCK_WAIT_S
    try:
        return max(0.0, float(raw))
    except ValueError:
        raise CacheLocationError(
            f"{LOCK_WAIT_ENV}={raw!r} is not a number of seconds; e.g. {LOCK_WAIT_ENV}=3600"
        ) from None


def process_state(pid: int) -> str:
    """'running', 'stopped' (Ctrl-Z, SIGSTOP, a debugger), 'dead' (gone or a zombie) or 'unknown'."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "dead"
    except PermissionError:
        pass  # exists, another user's
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "unknown"
    state = stat.rpartition(")")[2].split()[0]
    return {"T": "stopped", "t": "stopped", "Z": "dead", "X": "dead"}.get(state, "running")


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        raw = os.pread(fd, 4096, 0)
        holder = json.loads(raw.decode()) if raw.strip() else {}
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def describe_holder(holder: dict[str, Any]) -> tuple[str, str]:
    """(text naming the holder and its state, the holder's state)."""
    if not holder.get("pid"):
        return "another process (it recorded no details)", "unknown"
    pid = int(holder["pid"])
    local = holder.get("host") == socket.gethostname()
    state = process_state(pid) if local else "unknown"
    where = "" if local else f" on host {holder.get('host')}"
    since = holder.get("since", "?")
    command = holder.get("command", "")
    text = f"pid {pid}{where} ({state}), holding it since {since}" + (f": {command}" if command else "")
    return text, state


def _advice(state: str, pid: Any) -> str:
    if state == "stopped":
        return f"it is stopped (Ctrl-Z?): resume it (`fg`, or `kill -CONT {pid}`) or end it (`kill {pid}`)"
    if state == "dead":
        return "its process is gone; the lock is broken automatically after a few seconds"
    return (
        f"let it finish, or end it (`kill {pid}`), or raise {LOCK_WAIT_ENV}, or point GEMMA4LIB_CACHE at "
        f"another folder for this run"
    )


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def _break(path: Path, fd: int, text: str) -> None:
    log.warning("breaking the build lock %s: its holder %s is gone but the lock is still held", path.name, text)
    with contextlib.suppress(FileNotFoundError):
        if _same_file(fd, path):
            os.unlink(path)


def _open(path: Path) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except FileNotFoundError:  # the cache folder was removed meanwhile: make it again
        path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o666)


@contextlib.contextmanager
def build_lock(path: Path, wait_s: float | None = None, report_after_s: float = REPORT_AFTER_S) -> Iterator[None]:
    """Hold the lock file `path` exclusively for the block (see the module docstring)."""
    wait_s = lock_wait_limit() if wait_s is None else wait_s
    started = time.monotonic()
    next_report = started + report_after_s
    dead_since: float | None = None
    while True:
        fd = _open(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                os.close(fd)
                raise
            holder = _read_holder(fd)
            text, state = describe_holder(holder)
            now = time.monotonic()
            if state == "dead":
                dead_since = dead_since or now
                if now - dead_since >= DEAD_GRACE_S:
                    _break(path, fd, text)
                    os.close(fd)
                    dead_since = None
                    continue
            else:
                dead_since = None
            if now - started >= wait_s:
                os.close(fd)
                raise CacheLockError(
                    f"waited {now - started:.0f} s for the build lock {path} (another run compiling the same "
                    f"graph); it is held by {text}; {_advice(state, holder.get('pid', '?'))}"
                ) from None
            if now >= next_report:
                log.warning(
                    "waiting for the build lock %s, held by %s; %s", path.name, text, _advice(state, holder.get("pid"))
                )
                next_report = now + REPORT_EVERY_S
            os.close(fd)
            time.sleep(POLL_S)
            continue
        if not _same_file(fd, path):  # broken (unlinked) by another waiter while we locked it: retry
            os.close(fd)
            continue
        break
    try:
        holder = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": " ".join(sys.argv)[:200],
        }
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(holder).encode(), 0)
        yield
    finally:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
