"""The endpoint's app on a uvicorn thread in this process, for tests: what `serve_forever` runs in the
foreground, started and stopped around a block."""

from __future__ import annotations

import threading
import time

import uvicorn

from gemma4lib.errors import Gemma4LibError
from gemma4lib.server.app import Served, create_app
from gemma4lib.server.launch import LOOPBACK, free_port, freeze_startup_objects


class ServerStartError(Gemma4LibError, RuntimeError):
    """A background server that did not come up (its port taken, the app failed to start)."""


class BackgroundServer:
    """The app on a uvicorn thread at 127.0.0.1 (a free port), for tests and notebooks; a context manager."""

    def __init__(self, served: Served, host: str = LOOPBACK, port: int | None = None, start_timeout_s: float = 30.0):
        self.served, self.host, self.port = served, host, port or free_port(host)
        config = uvicorn.Config(create_app(served), host=host, port=self.port, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, name="gemma4lib-uvicorn", daemon=True)
        self.start_timeout_s = start_timeout_s

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> BackgroundServer:
        freeze_startup_objects()
        self._thread.start()
        deadline = time.monotonic() + self.start_timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise ServerStartError(
                    f"uvicorn did not start on {self.url} within {self.start_timeout_s:.0f} s; is the port taken?"
                )
            time.sleep(0.02)
        return self

    def stop(self, close_scheduler: bool = True) -> None:
        self.server.should_exit = True
        self._thread.join(30)
        if close_scheduler:
            self.served.scheduler.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
