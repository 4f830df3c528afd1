"""Continuous batching: one thread owns the engine and admits waiting requests into free rows.

Between two decode steps the scheduler frees the rows whose requests ended (eos, `max_tokens`, a
stop string, a client gone), prefills waiting requests into the free rows (`engine.admit`: the
other rows keep their state), then runs one `engine.step()` over every live row and hands each row's
new text to its request. A request goes to the free row whose kept K/V hold the longest start of its
prompt (its conversation's previous turn, `Engine.row_for`) and prefills only the rest. Only this
thread calls the engine (it is not thread-safe; torch releases the GIL while a graph runs); requests
reach it through a bounded queue, and all of one step's events go back to the asyncio loop in one
wake-up (`Outbox`), so the HTTP thread spends less of the GIL on being woken.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from .errors import DrainingError, EngineFaultError, QueueFullError
from .metrics import ServerMetrics
from .text import Codec, TextStream

log = logging.getLogger("gemma4lib.server")


class EngineLike(Protocol):
    """The engine calls the scheduler makes (`gemma4lib.runtime.Engine`)."""

    batch: int
    context_length: int

    def check(self, request: Any) -> Any: ...
    def free_rows(self) -> list[int]: ...
    def row_for(self, request: Any, free: list[int]) -> int: ...
    def admit(self, requests: dict[int, Any], *, reuse: bool = False) -> dict[int, list[int]]: ...
    def step(self) -> dict[int, list[int]]: ...
    def finished(self, row: int) -> str | None: ...
    def fault(self, row: int) -> BaseException | None: ...
    def release(self, row: int) -> Any: ...


@dataclass
class Event:
    """New text of one request; the last one has a `finish_reason` ("stop", "length", "cancelled", "error")."""

    text: str
    tokens: int
    finish_reason: str | None = None
    error: BaseException | None = None


class Outbox:
    """Events gathered during one pass of the scheduler, sent with one `call_soon_threadsafe` per
    asyncio loop (each call writes to the loop's wake-up pipe and makes its thread take the GIL)."""

    def __init__(self) -> None:
        self._by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Event], Event]]] = {}

    def add(self, job: Job, event: Event) -> None:
        self._by_loop.setdefault(job.loop, []).append((job.queue, event))

    def send(self) -> None:
        by_loop, self._by_loop = self._by_loop, {}
        for loop, events in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, events)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                pass


def _put_all(events: list[tuple[asyncio.Queue[Event], Event]]) -> None:
    for queue, event in events:
        queue.put_nowait(event)


@dataclass
class Job:
    request: Any
    text: TextStream
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Event]
    submitted: float = field(default_factory=time.monotonic)
    id: int = 0
    cancelled: bool = False
    done: bool = False
    row: int | None = None
    first_at: float | None = None
    last_at: float | None = None
    tokens: int = 0


class Ticket:
    """The HTTP side's handle on a submitted request: its events, in order, on its own asyncio loop."""

    def __init__(self, scheduler: Scheduler, job: Job, queue: asyncio.Queue[Event]):
        self.scheduler, self.job, self._queue = scheduler, job, queue
        self.prompt_tokens = len(job.request.prompt_ids)
        self.completion_tokens = 0
        self.finish_reason: str | None = None

    async def events(self) -> AsyncIterator[Event]:
        while self.finish_reason is None:
            event = await self._queue.get()
            self.completion_tokens += event.tokens
            if event.finish_reason is not None:
                self.finish_reason = event.finish_reason
                if event.error is not None:
                    raise event.error
            yield event

    async def text(self) -> str:
        return "".join([event.text async for event in self.events()])

    def cancel(self) -> None:
        """The client is gone (or the response is complete): free the row now, if it still holds one."""
        if self.finish_reason is None:
            self.scheduler.cancel(self.job)


class Scheduler:
    """Owns `engine` on one thread; `submit` from any asyncio loop; `drain` for SIGTERM."""

    def __init__(
        self,
        engine: EngineLike,
        codec: Codec,
        *,
        max_queue: int = 64,
        metrics: ServerMetrics | None = None,
        admit_wait_s: float = 0.0,
    ):
        self.engine, self.codec, self.max_queue = engine, codec, int(max_queue)
        self.admit_wait_s = float(admit_wait_s)
        self.metrics = metrics or ServerMetrics(engine.batch)
        self._waiting: collections.deque[Job] = collections.deque()
        self._live: dict[int, Job] = {}
        self._cond = threading.Condition()
        self._ids = itertools.count(1)
        self._accepting = True
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="gemma4lib-scheduler", daemon=True)
        self._engine_lock = threading.Lock()  # held by the thread while it calls the engine; `paused` takes it
        self._outbox = Outbox()  # only the scheduler thread touches it
        self.steps = 0
        self.metrics.queue_depth.set_function(lambda: len(self._waiting))
        self.metrics.rows_in_use.set_function(lambda: len(self._live))

    # ---- the HTTP side ----------------------------------------------------------------------------
    def start(self) -> Scheduler:
        self._thread.start()
        return self

    def submit(self, request: Any, stop: Sequence[str] = (), raw: bool = False) -> Ticket:
        """Queue `request` (already an engine `Request`); raises the 4xx errors before it queues. `raw`:
        its text keeps the special tokens (a reply parsed for its thought and tool calls)."""
        self.engine.check(request)  # reads the compiled shapes only: the one fit check, before queueing
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Event] = asyncio.Queue()
        job = Job(request, TextStream(self.codec, stop, raw), loop, queue)
        with self._cond:
            if not self._accepting:
                raise DrainingError()
            if len(self._waiting) >= self.max_queue:
                raise QueueFullError(len(self._waiting), self.retry_after_s())
            job.id = next(self._ids)
            self._waiting.append(job)
            self._cond.notify_all()
        return Ticket(self, job, queue)

    def retry_after_s(self) -> int:
        """A hint for 429: about one request's time per row's worth of queue, at least a second."""
        return max(1, round(len(self._waiting) / max(1, self.engine.batch)))

    def cancel(self, job: Job) -> None:
        with self._cond:
            job.cancelled = True
            self._cond.notify_all()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def rows_in_use(self) -> int:
        return len(self._live)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def accepting(self) -> bool:
        return self._accepting

    @contextlib.contextmanager
    def paused(self) -> Iterator[EngineLike]:
        """Borrow the engine (an in-process evaluation beside the server): the scheduler thread waits
        meanwhile; requests still queue. Rows that are live keep their state but make no progress."""
        with self._engine_lock:
            yield self.engine

    def idle(self) -> bool:
        with self._cond:
            return not self._waiting and not self._live

    def drain(self, timeout_s: float = 600.0) -> bool:
        """Take no new requests, let every queued and running one finish; True when all did in time."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._accepting = False
            self._cond.notify_all()
            while self._waiting or self._live:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._cond.wait(min(left, 0.1))
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the thread; requests still queued or running end with an error (the drain's time ran out)."""
        with self._cond:
            self._accepting = False
            self._closing = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    # ---- the scheduler thread -----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except Exception as exc:  # a bug here, not in the engine: fail every request, leave health red
            log.exception("the scheduler thread failed")
            with self._cond:
                self._accepting = False
                jobs = [*self._live.values(), *self._waiting]
                self._live.clear()
                self._waiting.clear()
            for job in jobs:
                self._finish(job, "error", error=EngineFaultError(exc))
            self._outbox.send()
            self._publish()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._live and not self._closing:
                    self._cond.wait()
                if self._closing:
                    break
                waiting = [job for job in self._waiting if job.cancelled]
                for job in waiting:
                    self._waiting.remove(job)
            for job in waiting:
                self._finish(job, "cancelled")
            with self._engine_lock:
                self._reap()
                self._admit()
                self._outbox.send()  # first tokens out before the step: their TTFT does not wait for it
                if self._live:
                    self._step()
                stuck = not self._live and not self.engine.free_rows()
            self._outbox.send()
            if stuck:  # rows the engine kept after a fault: wait instead of spinning (the log has the fault)
                with self._cond:
                    self._cond.wait(0.05)
            self._publish()
        for row in list(self._live):
            self._fail(row, DrainingError(unfinished=True))
        for job in list(self._waiting):
            self._finish(job, "error", error=DrainingError(unfinished=True))
        self._waiting.clear()
        self._outbox.send()
        self._publish()

    def _publish(self) -> None:
        with self._cond:
            self._cond.notify_all()  # drain() waits on the same condition

    def _reap(self) -> None:
        """Free the rows of requests whose client went away."""
        for row, job in list(self._live.items()):
            if job.cancelled:
                self._end(row, "cancelled")

    def _admit(self) -> None:
        free = self.engine.free_rows()
        if not free:
            return
        batch: dict[int, Job] = {}
        with self._cond:
            if self._defer(len(free)):
                return
            while free and self._waiting:
                job = self._waiting.popleft()
                if job.cancelled:
                    self._waiting.appendleft(job)  # reaped on the next pass
                    break
                row = self.engine.row_for(job.request, free)  # the row whose kept K/V it reuses most, else LRU
                free.remove(row)
                batch[row] = job
        if not batch:
            return
        for row, job in batch.items():
            job.row = row
            self._live[row] = job
        try:
            first = self.engine.admit({row: job.request for row, job in batch.items()}, reuse=True)
        except Exception as exc:  # a real fault: the log has the cause, the clients a 500-shaped error
            log.exception("engine.admit failed for rows %s", sorted(batch))
            for row in batch:
                self._fail(row, EngineFaultError(exc))
            return
        self._deliver(first)

    def _defer(self, free: int) -> bool:
        """Whether to let waiting requests gather for one prefill: a prefill graph has a fixed shape, so
        it costs the same for one row as for all (measured on the tiny E2B at B=8: ~55 ms either way,
        against ~2.5 ms a decode step). Never while no row decodes (nothing to gain), nor once the
        waiting fill every free row or the oldest has waited `admit_wait_s`."""
        if not self._waiting or not self._live or self.admit_wait_s <= 0 or len(self._waiting) >= free:
            return False
        return time.monotonic() - self._waiting[0].submitted < self.admit_wait_s

    def _step(self) -> None:
        try:
            new = self.engine.step()
        except Exception as exc:
            log.exception("engine.step failed with rows %s live", sorted(self._live))
            for row in list(self._live):
                self._fail(row, EngineFaultError(exc))
            return
        self.steps += 1
        self._deliver(new)

    def _deliver(self, tokens_by_row: dict[int, list[int]]) -> None:
        now = time.monotonic()
        for row, tokens in tokens_by_row.items():
            job = self._live.get(row)
            if job is not None and self.engine.finished(row) == "error":  # this row's fault alone
                log.error("row %d failed: %s", row, self.engine.fault(row))
                self._fail(row, EngineFaultError(self.engine.fault(row)))
            if job is None or not tokens or job.done:
                continue
            if job.first_at is None:
                job.first_at = now
                self.metrics.ttft.observe(now - job.submitted)
            elif job.last_at is not None:
                gap = (now - job.last_at) / len(tokens)  # a verify round's tokens arrive together
                for _ in tokens:
                    self.metrics.itl.observe(gap)
            job.last_at = now
            job.tokens += len(tokens)
            self.metrics.generated(len(tokens))
            text = job.text.push(tokens)
            reason = "stop" if job.text.stopped else self.engine.finished(row)
            if reason is None:
                self._outbox.add(job, Event(text, len(tokens)))
            else:
                self._end(row, reason, text, len(tokens))

    def _end(self, row: int, reason: str, text: str = "", tokens: int = 0) -> None:
        job = self._live.pop(row)
        try:
            self.metrics.reused_tokens.inc(self.engine.release(row).reused)
        except Exception:
            log.exception("engine.release(%d) failed", row)
        self._finish(job, reason, text + job.text.finish(), tokens)

    def _fail(self, row: int, error: BaseException) -> None:
        job = self._live.pop(row, None)
        try:
            self.engine.release(row)
        except Exception:  # the row may never have been admitted
            log.debug("release of failed row %d", row, exc_info=True)
        if job is not None:
            self._finish(job, "error", error=error)

    def _finish(self, job: Job, reason: str, text: str = "", tokens: int = 0, error: BaseException | None = None):
        if job.done:
            return
        job.done = True
        self.metrics.requests.labels(finish_reason=reason).inc()
        self._outbox.add(job, Event(text, tokens, reason, error))
