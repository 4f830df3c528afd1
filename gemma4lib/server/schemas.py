"""The OpenAI request and response bodies the endpoint speaks (the subset a chat model with images needs).

pydantic validates the requests (a wrong type is a 400 naming the field). An OpenAI field this
server does not implement is refused with a 400 naming it when it asks for anything (a silent 200
would hand back what the client did not ask for); one left at its default, and fields of no effect
(`user`, `metadata`), pass. Sizes are capped before any work: messages, stop strings, prompts.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

MAX_MESSAGES = 1024
MAX_TOOLS = 128
MAX_TOP_LOGPROBS = 20  # OpenAI's bound
MAX_STOP, MAX_STOP_CHARS = 4, 256  # OpenAI's four; each is matched against every new piece of text
# fields a client may send that this server does not implement: refused unless at a value asking for nothing
UNIMPLEMENTED = (
    "tools tool_choice functions function_call response_format logit_bias suffix best_of "
    "frequency_penalty presence_penalty repetition_penalty top_k min_p modalities audio prediction reasoning_effort "
    "web_search_options verbosity"
).split()
QUIET = (None, False, 0, "", [], {}, "none", "auto", {"type": "text"}, ["text"])
QUIET_NUMBERS = {"best_of": 1, "repetition_penalty": 1, "top_k": -1}


# a lone surrogate ("\\ud800", legal in JSON) is no text a tokenizer takes: "surrogates not allowed", a 400
Text = Annotated[str, AfterValidator(lambda text: (text.encode("utf-8"), text)[1])]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]  # the vocabulary's bound: the engine's


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ImageURL(_Body):
    url: str
    detail: str | None = None  # OpenAI's "low" / "high" / "auto": the processor's one budget serves all


class ContentPart(_Body):
    type: str
    text: Text | None = None
    image_url: ImageURL | None = None
    input_audio: dict[str, Any] | None = None


class FunctionCall(_Body):
    name: str
    arguments: str  # OpenAI's JSON object text


class ToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None  # None: an assistant's turn of tool calls only
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls, rendered back
    tool_call_id: str | None = None  # a tool's result: the call it answers
    name: str | None = None


class Function(_Body):
    name: Annotated[str, Field(pattern=r"^\w{1,64}$")]  # the name the model writes after `call:`
    description: Text | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Body):
    type: Literal["function"]
    function: Function


class NamedChoice(_Body):
    type: Literal["function"]
    function: dict[str, str]  # {"name": ...}


class ThinkingSwitch(_Body):
    """vLLM's `chat_template_kwargs`: only the switch the chat template takes from a client."""

    model_config = ConfigDict(extra="forbid")
    enable_thinking: bool = False


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingFields(_Body):
    """What both routes share: the budget, the sampling values and the stop strings."""

    model_config = ConfigDict(extra="allow")  # kept to be refused by name (`unimplemented`)
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)  # a torch generator's range
    stop: (
        Annotated[Text, Field(max_length=MAX_STOP_CHARS)]
        | Annotated[list[Annotated[Text, Field(max_length=MAX_STOP_CHARS)]], Field(max_length=MAX_STOP)]
        | None
    ) = None
    n: int = Field(default=1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extension (clients send it in `extra_body`): generate all `max_tokens`, past any eos
    ignore_eos: bool = False

    def unimplemented(self) -> str | None:
        """The first field sent that asks for something this server does not do, or None."""
        asks = [k for k, v in (self.model_extra or {}).items() if v not in QUIET and v != QUIET_NUMBERS.get(k, 0)]
        return next((k for k in asks if k in UNIMPLEMENTED), None)

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedChoice | None = None
    parallel_tool_calls: bool | None = None  # the model may write several calls either way
    chat_template_kwargs: ThinkingSwitch | None = None
    response_format: dict[str, Any] | None = None  # text, json_object, json_schema (`grammar.schema_of`)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    def logprobs_top(self) -> int | None:
        """How many alternatives each token's log-probability comes with; None: no log-probabilities."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def thinking(self) -> bool:
        return bool(self.chat_template_kwargs and self.chat_template_kwargs.enable_thinking)

    def forced_names(self) -> list[str]:
        """The functions a forced reply may call: the named one, or (`required`) any declared one."""
        forced = self.forced_tool()
        return [forced] if forced else [t.function.name for t in self.tools or ()]

    def forced_tool(self) -> str | None:
        """The function a `required` or named `tool_choice` makes the reply call ("" when any of them)."""
        if isinstance(self.tool_choice, NamedChoice):
            return self.tool_choice.function.get("name", "")
        return "" if self.tool_choice == "required" else None


class CompletionRequest(SamplingFields):
    prompt: Text | list[Text] | TokenIds | list[TokenIds]  # OpenAI's: text or token ids, one or a list
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)  # alternatives a token
    echo: bool = False  # the prompt before the reply (with `logprobs`: the prompt's tokens' too)

    def logprobs_top(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[Any]:
        """Each prompt: a text, or token ids (what lm-eval's `local-completions` sends by default)."""
        one = isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int))
        return [self.prompt] if one else list(self.prompt)


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


def _body(rid: str, model: str, obj: str, choices: list[dict[str, Any]], usage: Usage | None = None) -> dict[str, Any]:
    body = {"id": rid, "object": obj, "created": now(), "model": model, "choices": choices}
    return body if usage is None else {**body, "usage": usage.model_dump()}


Choice = tuple[Any, str, "dict[str, Any] | None"]  # (message or text, finish reason, logprobs)


def chat_response(rid: str, model: str, messages: list[Choice], usage: Usage) -> dict[str, Any]:
    choices = [
        {"index": i, "message": {"role": "assistant", **message}, "finish_reason": reason, "logprobs": logprobs}
        for i, (message, reason, logprobs) in enumerate(messages)
    ]
    return _body(rid, model, "chat.completion", choices, usage)


def chat_chunk(
    rid: str, model: str, delta: dict[str, Any], reason: str | None = None, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": logprobs}
    return _body(rid, model, "chat.completion.chunk", [choice])


def completion_response(rid: str, model: str, texts: list[Choice], usage: Usage) -> dict[str, Any]:
    choices = [{"index": i, "text": t, "finish_reason": r, "logprobs": lp} for i, (t, r, lp) in enumerate(texts)]
    return _body(rid, model, "text_completion", choices, usage)


def completion_chunk(
    rid: str, model: str, text: str, reason: str | None = None, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": logprobs}
    return _body(rid, model, "text_completion", [choice])


def usage_chunk(rid: str, model: str, obj: str, usage: Usage) -> dict[str, Any]:
    return _body(rid, model, obj, [], usage)


def models_list(names: list[str], context_length: int, max_prompt: int) -> dict[str, Any]:
    """Each name with the lengths a request can use: prompt + new tokens within `max_model_len`, the
    prompt alone within `max_prompt_tokens` (the context less a verify's drafts)."""
    lengths = {"max_model_len": context_length, "max_prompt_tokens": max_prompt}
    data = [{"id": name, "object": "model", "created": now(), "owned_by": "gemma4lib", **lengths} for name in names]
    return {"object": "list", "data": data}
