"""What Ray Serve's HTTP proxy answers when the replica holding a request dies: a 503 in OpenAI's shape.

When a replica's actor dies mid-request, Serve's proxy logs the `RayActorError` and writes no
response of its own, so uvicorn under it answers a bare `500 Internal Server Error`. The proxy's one
hook is `RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`, a function returning Starlette middlewares that
wrap its ASGI app (`proxy_middlewares`): a request the proxy ended without a response gets OpenAI's
error JSON, 503 and `Retry-After`; a stream cut after its first chunk ends with one error event (the
`openai` client raises it as `APIError`), not a truncated body.

The variable must be in the proxy actor's environment: `ray_app.start_ray` sets it before it starts a
local cluster; for a cluster of your own, export it before `ray start`. This module imports only
Starlette (the proxy process has no reason to load torch).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from starlette.middleware import Middleware

log = logging.getLogger("gemma4lib.server")
CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
CALLBACK = "gemma4lib.server.ray_proxy:proxy_middlewares"
RETRY_AFTER_S = 1
REPLICA_LOST = (
    "the replica serving this request stopped before it answered (its Ray actor died or failed); Ray Serve "
    "starts a new replica from the bundle and the others keep serving: retry the request"
)


def replica_lost_body() -> dict[str, Any]:
    return {"error": {"message": REPLICA_LOST, "type": "server_error", "param": None, "code": "replica_unavailable"}}


class ReplicaLost:
    """Plain ASGI middleware (Serve's proxy streams; BaseHTTPMiddleware would buffer and hide disconnects)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = {"started": False, "finished": False, "stream": False}

        async def watched(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                state["started"] = True
                headers = {bytes(k).lower(): bytes(v) for k, v in message.get("headers", [])}
                state["stream"] = headers.get(b"content-type", b"").startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                state["finished"] = True
            await send(message)

        await self.app(scope, receive, watched)
        if state["finished"]:
            return
        try:
            if not state["started"]:
                log.warning("%s %s: no response from the replica; answering 503", scope["method"], scope["path"])
                body = json.dumps(replica_lost_body()).encode()
                headers = [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"retry-after", str(RETRY_AFTER_S).encode()),
                ]
                await send({"type": "http.response.start", "status": 503, "headers": headers})
                await send({"type": "http.response.body", "body": body})
            elif state["stream"]:
                log.warning("%s %s: the replica stopped mid-stream", scope["method"], scope["path"])
                event = f"data: {json.dumps(replica_lost_body())}\n\n".encode()
                await send({"type": "http.response.body", "body": event})
        except OSError:  # the client is gone as well: nobody to tell
            log.debug("client gone before the replica-lost answer", exc_info=True)


def proxy_middlewares() -> list[Middleware]:
    """Serve's proxy callback (`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`): the middlewares it applies."""
    return [Middleware(ReplicaLost)]
