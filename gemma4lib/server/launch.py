"""Start the endpoint: the engine from `PortSettings` (a bundle never compiles), uvicorn, SIGTERM drain.

The engine comes from the caller (`gemma4lib.cli.load_engine`: the server sits above `port` but does
not import it). `serve_forever` is what `python -m gemma4lib serve` runs. On SIGTERM (or Ctrl-C) the
server stops taking requests (503 + Retry-After), lets every queued and running one finish, then
exits; a second signal stops it at once.
"""

from __future__ import annotations

import gc
import logging
import signal
import socket
import sys
import threading
from dataclasses import dataclass
from types import FrameType
from typing import Any

import uvicorn

from .app import MAX_BODY_BYTES, Served, create_app
from .metrics import ServerMetrics
from .scheduler import EngineLike, Scheduler
from .text import Codec

log = logging.getLogger("gemma4lib.server")
LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class Loaded:
    """An engine ready to serve, with what the routes need and how long it took to get it (a bundle: 0 s
    compiling)."""

    engine: Any
    tokenizer: Any
    model_name: str
    aliases: tuple[str, ...]
    eos_ids: tuple[int, ...]
    load_s: float
    compile_s: float
    processor: Any = None  # the image processor and image token id, when served with its vision part
    image_token_id: int | None = None


def build_served(
    engine: EngineLike,
    tokenizer: Any,
    *,
    model_name: str,
    eos_ids: tuple[int, ...] = (),
    aliases: tuple[str, ...] = (),
    max_queue: int = 64,
    replica: str = "",
    info: dict[str, Any] | None = None,
    admit_wait_s: float = 0.0,
    processor: Any = None,
    image_token_id: int | None = None,
    allow_control_tokens: bool = False,
    max_body: int = MAX_BODY_BYTES,
) -> Served:
    """The scheduler (started) and what the routes need, around an engine and its tokenizer; `info`
    (load and compile seconds, the replica) is shown by `GET /health`; `processor` and `image_token_id`
    (a model served with its vision part) let chat requests carry `image_url` parts; `allow_control_tokens`
    parses special tokens in content (trusted clients only); bodies over `max_body` bytes get 413."""
    metrics = ServerMetrics(engine.batch, replica=replica)
    codec = Codec(tokenizer, processor, image_token_id, allow_control_tokens)
    codec.hearing = getattr(engine, "audio_shape", None)  # a server that hears (`serve --hear`)
    scheduler = Scheduler(
        engine,
        codec,
        max_queue=max_queue,
        metrics=metrics,
        admit_wait_s=admit_wait_s,
    ).start()
    return Served(scheduler, model_name, eos_ids, aliases, info=info, max_body=max_body)


class DrainingServer(uvicorn.Server):
    """uvicorn that drains the scheduler on SIGTERM/SIGINT before it stops (a second signal: at once)."""

    def __init__(self, config: uvicorn.Config, scheduler: Scheduler, drain_timeout_s: float):
        super().__init__(config)
        self.scheduler, self.drain_timeout_s = scheduler, drain_timeout_s
        self.drain_started = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain_started:
            self.should_exit = self.force_exit = True
            return
        self.drain_started = True
        log.info(
            "%s: draining (%d running, %d queued); new requests get 503",
            signal.Signals(sig).name,
            self.scheduler.rows_in_use,
            self.scheduler.waiting,
        )
        threading.Thread(target=self._drain, name="gemma4lib-drain", daemon=True).start()

    def _drain(self) -> None:
        if self.scheduler.drain(self.drain_timeout_s):
            log.info("drained: every started request finished; exiting")
        else:
            log.error("drain timed out after %.0f s; ending unfinished requests with an error", self.drain_timeout_s)
            self.scheduler.close(timeout_s=0.5)  # each open stream gets its final error chunk
        self.should_exit = True


ENGINE_SWITCH_INTERVAL_S = 0.00025


def favour_the_engine_thread(interval_s: float = ENGINE_SWITCH_INTERVAL_S) -> None:
    """Shorten Python's GIL switch interval (default 5 ms) in a process that serves: the scheduler
    thread gives the GIL up around every torch op, and each time the HTTP thread runs Python it waits a
    whole interval to get it back. Measured on the tiny E2B at B=8 beside a busy Python thread: a decode
    step took twice as long at 5 ms as alone, about as long as alone at 0.25 ms."""
    sys.setswitchinterval(interval_s)


def freeze_startup_objects() -> None:
    """Move everything loaded so far (torch, transformers, the model) out of the garbage collector's
    view: they live as long as the server, and a full collection over them mid-load paused every
    request for tens to hundreds of ms here."""
    gc.collect()
    gc.freeze()


def serve_forever(served: Served, host: str = LOOPBACK, port: int = 8000, drain_timeout_s: float = 600.0) -> None:
    """Serve in the foreground until SIGTERM/SIGINT (then drain, then return)."""
    freeze_startup_objects()
    favour_the_engine_thread()
    config = uvicorn.Config(
        create_app(served), host=host, port=port, log_level="info", timeout_graceful_shutdown=1, lifespan="off"
    )
    server = DrainingServer(config, served.scheduler, drain_timeout_s)
    log.warning("serving %s on http://%s:%d/v1 (%d rows)", served.model_name, host, port, served.scheduler.engine.batch)
    try:
        server.run()
    finally:
        served.scheduler.close()


def serve_loaded(loaded: Loaded, args: Any) -> int:
    """`python -m gemma4lib serve` without `--ray`: one server in the foreground until SIGTERM."""
    served = build_served(
        loaded.engine,
        loaded.tokenizer,
        model_name=args.model_name or loaded.model_name,
        eos_ids=loaded.eos_ids,
        aliases=loaded.aliases,
        max_queue=args.max_queue,
        info={
            "load_s": round(loaded.load_s, 3),
            "compile_s": round(loaded.compile_s, 3),
            "row_prefill": bool(loaded.engine.steps.row_prefill),
        },
        admit_wait_s=args.admit_wait_ms / 1000.0,
        processor=loaded.processor,
        image_token_id=loaded.image_token_id,
        allow_control_tokens=args.allow_control_tokens,
        max_body=int(args.max_body_mb * 2**20),
    )
    log.warning("engine ready: load %.1f s, compile %.1f s", loaded.load_s, loaded.compile_s)
    serve_forever(served, args.host, args.port, args.drain_timeout)
    return 0
