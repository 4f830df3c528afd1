"""What an endpoint client did wrong, as `Gemma4LibError`s, and the OpenAI error body each becomes.

OpenAI's clients read `{"error": {"message", "type", "param", "code"}}` and the HTTP status; the
library's own errors (a prompt over the compiled context, bad sampling values, an empty prompt) map
to a 400 here without the engine knowing about HTTP.
"""

from __future__ import annotations

from typing import Any

from ..errors import (
    AudioInputError,
    BadPromptError,
    Gemma4LibError,
    ImageInputError,
    NoVisionError,
    PromptTooLongError,
    SettingsError,
    TooManyImagesError,
)


class RequestError(Gemma4LibError, ValueError):
    """A request the endpoint refuses with a 4xx; `param` names the field to fix."""

    status = 400
    type = "invalid_request_error"
    code: str | None = None

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class UnknownModelError(RequestError):
    status = 404
    code = "model_not_found"

    def __init__(self, model: str, served: str):
        super().__init__(
            f"model {model!r} is not served here; this endpoint serves {served!r} (GET /v1/models)", "model"
        )


class QueueFullError(RequestError):
    """More requests waiting than the queue holds: the client should come back later."""

    status = 429
    type = "rate_limit_error"
    code = "queue_full"

    def __init__(self, waiting: int, retry_after_s: int):
        super().__init__(
            f"the server's queue is full ({waiting} requests waiting for a row); retry after {retry_after_s} s, "
            f"or start the server with a larger --max-queue or more replicas"
        )
        self.retry_after_s = retry_after_s


class DrainingError(RequestError):
    """The server got SIGTERM: it finishes what it started and takes nothing new."""

    status = 503
    type = "server_shutting_down"
    code = "draining"

    def __init__(self, unfinished: bool = False):
        super().__init__(
            "the server's drain time ran out (SIGTERM) before this request finished; send it again"
            if unfinished
            else "the server is shutting down (SIGTERM) and takes no new requests; send it to another replica"
        )
        self.retry_after_s = 1


class ClientGoneError(RequestError):
    """The client closed the connection before its response was ready (nginx's 499); its row is freed."""

    status = 499
    code = "client_closed_request"

    def __init__(self):
        super().__init__("the client closed the connection before the response was complete")


class EngineFaultError(Gemma4LibError, RuntimeError):
    """The engine failed mid-generation: the request cannot finish; the cause is in the server's log."""

    def __init__(self, cause: BaseException):
        super().__init__(
            f"the engine failed while generating ({type(cause).__name__}: {cause}); the server logged the "
            f"traceback; retry the request"
        )


SAMPLING_FIELDS = ("temperature", "top_p", "seed", "max_tokens")


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def http_error(exc: BaseException) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(status, body, headers) for an exception a route raised; 500 for anything not the client's fault."""
    if isinstance(exc, RequestError):
        headers = {"Retry-After": str(exc.retry_after_s)} if hasattr(exc, "retry_after_s") else {}
        return exc.status, error_body(str(exc), exc.type, exc.param, exc.code), headers
    if isinstance(exc, PromptTooLongError):  # the context's limit: prompt, or prompt plus max_tokens
        param = "max_tokens" if exc.max_new_tokens else "messages"
        return 400, error_body(str(exc), "invalid_request_error", param, "context_length_exceeded"), {}
    if isinstance(exc, SettingsError):
        field = str(exc).split(" ", 1)[0]  # Sampling's messages start with the value's name
        param = field if field in SAMPLING_FIELDS else None
        return 400, error_body(str(exc), "invalid_request_error", param, "invalid_value"), {}
    if isinstance(exc, (ImageInputError, NoVisionError, TooManyImagesError)):
        return 400, error_body(str(exc), "invalid_request_error", "messages", "invalid_image"), {}
    if isinstance(exc, AudioInputError):
        return 400, error_body(str(exc), "invalid_request_error", "messages", "invalid_audio"), {}
    if isinstance(exc, BadPromptError):
        return 400, error_body(str(exc), "invalid_request_error", "messages", "invalid_prompt"), {}
    if isinstance(exc, EngineFaultError):
        return 500, error_body(str(exc), "server_error", None, "engine_fault"), {}
    return 500, error_body(f"internal server error ({type(exc).__name__}); see the server log", "server_error"), {}
