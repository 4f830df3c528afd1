"""The OpenAI request and response bodies the endpoint speaks (the subset a chat model with images needs).

pydantic validates the requests (a wrong type is a 400 naming the field); fields OpenAI's clients
send that this server does not use are ignored, as vLLM's server does, so any client works.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ImageURL(_Body):
    url: str
    detail: str | None = None  # OpenAI's "low" / "high" / "auto": the processor's one budget serves all


class ContentPart(_Body):
    type: str
    text: str | None = None
    image_url: ImageURL | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingFields(_Body):
    """What both routes share: the budget, the sampling values and the stop strings."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)  # a torch generator's range
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extension (clients send it in `extra_body`): generate all `max_tokens`, past any eos
    ignore_eos: bool = False

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=1)


class CompletionRequest(SamplingFields):
    prompt: str | list[str]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt: int, completion: int) -> Usage:
        return cls(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def chat_response(rid: str, model: str, texts: list[tuple[str, str]], usage: Usage) -> dict[str, Any]:
    choices = [
        {"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": reason, "logprobs": None}
        for i, (text, reason) in enumerate(texts)
    ]
    return {
        "id": rid,
        "object": "chat.completion",
        "created": now(),
        "model": model,
        "choices": choices,
        "usage": usage.model_dump(),
    }


def chat_chunk(rid: str, model: str, delta: dict[str, str], reason: str | None = None) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
    return {"id": rid, "object": "chat.completion.chunk", "created": now(), "model": model, "choices": [choice]}


def completion_response(rid: str, model: str, texts: list[tuple[str, str]], usage: Usage) -> dict[str, Any]:
    choices = [
        {"index": i, "text": text, "finish_reason": reason, "logprobs": None} for i, (text, reason) in enumerate(texts)
    ]
    return {
        "id": rid,
        "object": "text_completion",
        "created": now(),
        "model": model,
        "choices": choices,
        "usage": usage.model_dump(),
    }


def completion_chunk(rid: str, model: str, text: str, reason: str | None = None) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
    return {"id": rid, "object": "text_completion", "created": now(), "model": model, "choices": [choice]}


def usage_chunk(rid: str, model: str, obj: str, usage: Usage) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": now(), "model": model, "choices": [], "usage": usage.model_dump()}


def models_list(names: list[str], context_length: int) -> dict[str, Any]:
    data = [
        {"id": name, "object": "model", "created": now(), "owned_by": "gemma4lib", "max_model_len": context_length}
        for name in names
    ]
    return {"object": "list", "data": data}
