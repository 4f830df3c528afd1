"""The FastAPI app: OpenAI's routes over a `Scheduler`, errors in OpenAI's shape.

FastAPI because its pydantic bodies give OpenAI's field checks and 400s for free and Ray Serve deploys
it (`serve.ingress`), so one app serves both ways. Untrusted clients: a body over `max_body` is a 413
before it is read, every size and field is checked before any work, and long text and images are
encoded on a small worker pool, so one large request never holds up the event loop. Streams are
Starlette's `StreamingResponse` of server-sent events: sse-starlette would add a dependency for two
lines of framing, and it ends open streams when uvicorn begins its shutdown (SIGTERM must not).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import logging
import random
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Form, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..errors import Gemma4LibError
from ..runtime import Request as EngineRequest
from ..runtime import Sampling, room_for_new_tokens
from . import reply, schemas
from .errors import ClientGoneError, RequestError, UnknownModelError, error_body, http_error
from .grammar import Grammars, schema_of
from .logprobs import Forced, TokenLogprobs, chat_logprobs, completion_logprobs
from .scheduler import Scheduler, Ticket

log = logging.getLogger("gemma4lib.server")
DISCONNECT_POLL_S = 0.25
SSE = "text/event-stream"
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")
MAX_BODY_BYTES = 4 * 2**20  # `serve --max-body-mb`: a long context's text; images need it raised
MAX_IMAGES = 16  # image parts per request, counted before any is decoded


class Served:
    """What the routes need besides the scheduler: the model's names, its eos ids, its context."""

    def __init__(
        self,
        scheduler: Scheduler,
        model_name: str,
        eos_ids: Sequence[int],
        aliases: Sequence[str] = (),
        info: dict[str, Any] | None = None,
        max_body: int = MAX_BODY_BYTES,
    ):
        self.scheduler, self.max_body = scheduler, int(max_body)
        self.info = dict(info or {})
        self.model_name = model_name
        self.names = [model_name, *[a for a in aliases if a and a != model_name]]
        self.eos_ids = tuple(int(i) for i in eos_ids)
        self.context_length = int(scheduler.engine.context_length)
        self.draft_tokens = int(getattr(scheduler.engine, "draft_tokens", 0) or 0)
        # a prompt longer than the largest prefill bucket runs in chunks: the context is its limit
        self.max_prompt = self.context_length - self.draft_tokens
        self.pool = ThreadPoolExecutor(2, thread_name_prefix="gemma4lib-encode")  # the bound on encoding work
        self.grammars: Grammars | None = None  # structured output's engine, built at its first request

    def check_body(self, body: schemas.SamplingFields, texts: Sequence[str], param: str) -> int:
        """Refuse what can never run, before any work: a field not implemented, text too long to fit.
        Returns the text's characters (what decides where it is encoded, `off_loop`)."""
        self.check_model(body.model)
        field = body.unimplemented()
        if field is not None:
            raise RequestError(f"{field} is not implemented by this server; leave it out (or at its default)", field)
        chars, longest = sum(len(t) for t in texts), self.scheduler.codec.longest_token
        if chars > self.max_prompt * longest:  # a token is at most `longest` characters: it can never fit
            message = f"{chars:,} characters, more than the {self.max_prompt} tokens of the context can hold"
            raise RequestError(f"{param} has {message} ({longest} characters a token at most); shorten it", param)
        return chars

    def check_model(self, name: str) -> None:
        if name not in self.names:
            raise UnknownModelError(name, self.model_name)

    def watch(
        self,
        body: schemas.ChatCompletionRequest | schemas.CompletionRequest,
        schema: dict[str, Any] | None = None,
        forced_call: Sequence[str] = (),
        forced: list[int] | None = None,
    ) -> Any:
        """What watches a request's logits (`runtime.LogitsWatch`): its log-probabilities' record, the
        grammar mask of its schema or forced call, both, or None."""
        if isinstance(body, schemas.ChatCompletionRequest) and body.top_logprobs and not body.logprobs:
            raise RequestError("top_logprobs needs logprobs: true; send both", "top_logprobs")
        top = body.logprobs_top()
        asks = [
            f
            for f, on in (("logprobs", top is not None), ("response_format", schema), ("tool_choice", forced_call))
            if on
        ]
        if asks and self.draft_tokens:
            raise RequestError(f"{asks[0]} needs each token's logits, which a drafting server does not keep", asks[0])
        mask = None
        if schema is not None or forced_call:
            self.grammars = self.grammars or Grammars(self.scheduler.codec.tokenizer, self.eos_ids)
            grammar = self.grammars.json(schema) if schema is not None else self.grammars.call(forced_call)
            mask = self.grammars.constrain(grammar, "response_format" if schema is not None else "tool_choice")
        mask = Forced(forced) if forced is not None else mask
        return mask if top is None else TokenLogprobs(top, getattr(self.scheduler.engine, "cap", None), mask)

    def engine_request(
        self, ids: list[int], body: schemas.SamplingFields, max_tokens: int | None, images: Any = None, watch=None
    ) -> EngineRequest:
        """The engine's request: the budget (default: the rest of the compiled context), the sampling,
        the prompt's images (`runtime.MediaPrompt`, or None) and what watches its logits."""
        if max_tokens is None:
            max_tokens = max(1, room_for_new_tokens(len(ids), self.context_length, self.draft_tokens))
        temperature = 0.0 if body.temperature is None else body.temperature
        seed = body.seed if body.seed is not None else (random.randrange(2**31) if temperature > 0 else 0)
        sampling = Sampling(temperature=temperature, top_p=1.0 if body.top_p is None else body.top_p, seed=seed)
        eos = () if body.ignore_eos else self.eos_ids
        return EngineRequest(ids, max_tokens, sampling, eos, media=images, watch=watch)


def chat_messages(body: schemas.ChatCompletionRequest, codec: Any) -> tuple[list[dict[str, Any]], list[Any], list[Any]]:
    """Messages as the chat template takes them, the images (PIL) and clips (samples) of their parts, in
    order. A message with only text keeps its text as one string (rendered exactly as before); one with
    media keeps its parts (`{"type": "image"}`, `{"type": "audio"}`), where the template expands them."""
    from .image_urls import audio_from_input_audio, image_from_data_url

    wanted = sum(1 for m in body.messages if isinstance(m.content, list) for p in m.content if p.type == "image_url")
    if wanted > MAX_IMAGES:
        raise RequestError(f"{wanted} image parts, over this server's {MAX_IMAGES}; send fewer", "messages")
    if wanted and codec.processor is None:
        codec.chat_with_images([], [])  # the server's own refusal (no vision part), before any decoding
    out: list[dict[str, Any]] = []
    images: list[Any] = []
    clips: list[Any] = []
    for i, message in enumerate(body.messages):
        content: Any = message.content
        if isinstance(content, list):
            parts: list[dict[str, Any]] = []
            for j, part in enumerate(content):
                where = f"messages[{i}].content[{j}]"
                if part.type == "text":
                    parts.append({"type": "text", "text": part.text or ""})
                elif part.type == "image_url":
                    if part.image_url is None:
                        raise RequestError("an image_url part needs {'image_url': {'url': 'data:...'}}", where)
                    images.append(image_from_data_url(part.image_url.url, f"{where}.image_url.url"))
                    parts.append({"type": "image"})
                elif part.type == "input_audio":
                    clips.append(audio_from_input_audio(part.input_audio, f"{where}.input_audio"))
                    if codec.hearing is None:
                        raise RequestError("this server does not hear: start it with --hear (e2b, e4b, 12b)", where)
                    parts.append({"type": "audio"})
                else:
                    raise RequestError(f"content parts are text, image_url or input_audio, not {part.type!r}", where)
            if any(p["type"] != "text" for p in parts):
                content = parts
            else:
                content = "".join(p["text"] for p in parts)
        out.append({"role": message.role, "content": content or "", **tool_fields(message, i)})
    return out, images, clips


def tool_fields(message: schemas.ChatMessage, i: int) -> dict[str, Any]:
    """A message's tool parts as the chat template takes them: an assistant's calls (arguments as the
    object they name), a tool result's call id and name."""
    fields: dict[str, Any] = {k: v for k in ("tool_call_id", "name") if (v := getattr(message, k)) is not None}
    calls = []
    for j, call in enumerate(message.tool_calls or ()):
        try:
            arguments = json.loads(call.function.arguments)
        except json.JSONDecodeError:
            arguments = None
        if not isinstance(arguments, dict):
            where = f"messages[{i}].tool_calls[{j}].function.arguments"
            raise RequestError(
                "a tool call's arguments are a JSON object's text, such as '{\"city\": \"Paris\"}'", where
            )
        calls.append(
            {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}
        )
    return {**fields, "tool_calls": calls} if calls else fields


def reply_plan(body: schemas.ChatCompletionRequest, codec: Any) -> tuple[list[dict[str, Any]] | None, str | None]:
    """The tools to declare (None: none, or `tool_choice: "none"`) and the server's opening of the reply:
    a forced call's marker (its name and arguments held by a grammar: `forced_names`), or None."""
    forced = body.forced_tool()
    if forced is not None and not body.tools:
        raise RequestError("tool_choice asks for a tool call but no tools are declared; send tools", "tool_choice")
    names = [t.function.name for t in body.tools or ()]
    if forced and forced not in names:
        raise RequestError(f"tool_choice names {forced!r}, not among the declared tools {names}", "tool_choice")
    if not body.tools or body.tool_choice == "none":
        return None, None
    if "tools" not in codec.tokenizer.chat_template:  # a template that would drop them: the model never sees them
        raise RequestError("this model's chat template declares no tools; serve a model whose template does", "tools")
    tools = [t.model_dump(exclude_none=True) for t in body.tools]
    return tools, None if forced is None else f"{reply.CALL}call:"


INLINE_CHARS = 4096  # text this short encodes in a fraction of a millisecond: on the loop, no thread hop


async def off_loop(served: Served, heavy: bool, work: Any) -> Any:
    """`work()` on the bounded encoding pool when it is `heavy` (long text, images), else right here."""
    return await asyncio.get_running_loop().run_in_executor(served.pool, work) if heavy else work()


def encode_chat(
    body: schemas.ChatCompletionRequest, codec: Any, tools: list[dict[str, Any]] | None, opening: str
) -> tuple[list[int], Any]:
    """The prompt ids and images of a chat request (on the encoding pool: decoding, templating)."""
    messages, pictures, clips = chat_messages(body, codec)
    if pictures or clips:
        if tools or opening or body.thinking:
            raise RequestError("media with tools or thinking are not implemented; send them apart", "messages")
        return codec.chat_with_images(messages, pictures, clips)
    return codec.chat(messages, tools, body.thinking, opening), None


def sse(payload: dict[str, Any] | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def until_disconnect(request: Request, work: asyncio.Future) -> Any:
    """Await `work`, cancelling it if the client goes away first (then the row is freed at once)."""
    while True:
        done, _ = await asyncio.wait({work}, timeout=DISCONNECT_POLL_S)
        if done:
            return work.result()
        if await request.is_disconnected():
            work.cancel()
            raise ClientGoneError()


class CountResponses:
    """Counts responses by route and status and names the replica in a header (plain ASGI: Starlette's
    BaseHTTPMiddleware would sit between a route and the client's disconnect)."""

    def __init__(self, app: Any, metrics: Any, max_body: int = MAX_BODY_BYTES):
        self.app, self.metrics, self.max_body = app, metrics, max_body

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body, size, message = [], 0, {"more_body": scope["method"] == "POST"}
        while message.get("more_body"):  # read here, to the end: a client still sending would not read a 413
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left
            size += len(message.get("body", b""))
            body += [message.get("body", b"")] if size <= self.max_body else []

        async def replay() -> dict[str, Any]:  # the body once, then the connection's own messages (disconnect)
            nonlocal body
            if body is None:
                return await receive()
            message, body = {"type": "http.request", "body": b"".join(body), "more_body": False}, None
            return message

        async def send_counted(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                route = scope["path"] if scope["path"] in ROUTES else "other"  # bounded label values
                self.metrics.http.labels(route=route, status=str(message["status"])).inc()
                if self.metrics.replica:
                    message["headers"] = [
                        *message.get("headers", []),
                        (b"x-gemma4lib-replica", self.metrics.replica.encode()),
                    ]
            await send(message)

        if size > self.max_body:
            message = f"the body is over {self.max_body:,} bytes; send less, or serve with a larger --max-body-mb"
            refusal = error_body(message, "invalid_request_error", None, "body_too_large")
            return await JSONResponse(refusal, 413)(scope, receive, send_counted)
        await self.app(scope, replay, send_counted)


def create_app(served: Served) -> FastAPI:
    """The OpenAI-compatible app over `served.scheduler` (already started by its owner)."""
    app = FastAPI(title="gemma4lib", docs_url=None, redoc_url=None)
    app.state.served = served
    app.add_middleware(CountResponses, metrics=served.scheduler.metrics, max_body=served.max_body)
    scheduler, metrics, codec = served.scheduler, served.scheduler.metrics, served.scheduler.codec

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            message = "the request body is not valid JSON: " + str(first.get("msg"))
            return JSONResponse(error_body(message, "invalid_request_error", None, "invalid_json"), 400)
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        more = f" ({len(errors) - 1} more problems)" if len(errors) > 1 else ""
        message = f"{param or 'body'}: {first.get('msg', 'invalid')}{more}"
        return JSONResponse(error_body(message, "invalid_request_error", param, "invalid_value"), 400)

    @app.exception_handler(Gemma4LibError)
    async def library_error(request: Request, exc: Gemma4LibError) -> JSONResponse:
        status, body, headers = http_error(exc)
        if status >= 500:
            log.error("%s %s failed: %s", request.method, request.url.path, exc, exc_info=exc)
        return JSONResponse(body, status, headers=headers)

    @app.exception_handler(Exception)
    async def server_fault(request: Request, exc: Exception) -> JSONResponse:
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        status, body, headers = http_error(exc)
        return JSONResponse(body, status, headers=headers)

    @app.get("/health")
    async def health() -> JSONResponse:
        body = {
            "status": "ok" if scheduler.accepting else "draining",
            "rows": scheduler.engine.batch,
            "rows_in_use": scheduler.rows_in_use,
            "waiting": scheduler.waiting,
            "replica": metrics.replica,
            **served.info,
        }
        return JSONResponse(body, 200 if scheduler.accepting else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return schemas.models_list(served.names, served.context_length, served.max_prompt)

    @app.post("/v1/chat/completions")
    async def chat(body: schemas.ChatCompletionRequest, request: Request) -> Any:
        parts = [p for m in body.messages for p in (m.content if isinstance(m.content, list) else [m])]
        texts = [p.content or "" if isinstance(p, schemas.ChatMessage) else p.text or "" for p in parts]
        texts += [c.function.arguments for m in body.messages for c in m.tool_calls or ()]
        texts += [t.function.model_dump_json() for t in body.tools or ()]  # declarations are prompt text too
        chars = served.check_body(body, texts, "messages")
        heavy = chars > INLINE_CHARS or any(getattr(p, "type", "text") != "text" for p in parts)
        tools, opening = reply_plan(body, codec)
        ids, images = await off_loop(served, heavy, lambda: encode_chat(body, scheduler.codec, tools, opening or ""))
        schema = schema_of(body.response_format)
        if schema is not None and (tools is not None or body.thinking):
            raise RequestError("response_format with tools or thinking is not implemented; send one", "response_format")
        grammar = schema is not None or opening is not None
        names = body.forced_names() if opening is not None else []
        watch = await off_loop(served, grammar, lambda: served.watch(body, schema, names))
        job = served.engine_request(ids, body, body.max_completion_tokens or body.max_tokens, images, watch)
        parsed = tools is not None or body.thinking  # the reply's thought and calls to parse out
        ticket = scheduler.submit(job, body.stop_strings(), raw=parsed)
        rid = schemas.new_id("chatcmpl")
        if body.stream:
            fields = reply.ReplyStream(codec.specials, opening or "") if parsed else None
            logged = watch if isinstance(watch, TokenLogprobs) else None
            events = _stream(served, ticket, rid, body.include_usage, True, fields, logged)
            return StreamingResponse(events, media_type=SSE)
        text = (await _collect(request, [ticket]))[0]
        usage = schemas.Usage.of(ticket.prompt_tokens, ticket.completion_tokens)
        message, reason = ({"content": text}, ticket.finish_reason)
        if parsed:
            message, reason = reply.message((opening or "") + text, codec.specials, body.thinking, reason)
        logprobs = chat_logprobs(watch.entries, codec) if isinstance(watch, TokenLogprobs) else None
        return schemas.chat_response(rid, served.model_name, [(message, reason, logprobs)], usage)

    @app.post("/v1/audio/transcriptions")
    async def transcriptions(request: Request, file: UploadFile, model: str = Form()) -> dict[str, str]:
        """OpenAI's transcription route (multipart: `file`, a 16 kHz WAV or MP3 of at most 30 s; `model`): the
        clip's words, by the prompt the fixtures learnt (`models.audio.TRANSCRIBE` after the clip), greedy."""
        from ..models.audio import TRANSCRIBE
        from .image_urls import MAX_AUDIO_BYTES, audio_from_input_audio

        served.check_model(model)
        data = base64.b64encode(await file.read(MAX_AUDIO_BYTES + 1)).decode()
        clip = audio_from_input_audio({"data": data, "format": "wav"}, "file")  # a deaf server: the codec's 400
        messages = [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": TRANSCRIBE}]}]
        ids, media = await off_loop(served, True, lambda: codec.chat_with_images(messages, [], [clip]))
        ticket = scheduler.submit(served.engine_request(ids, schemas.SamplingFields(model=model), None, media), [])
        return {"text": (await _collect(request, [ticket]))[0]}

    @app.post("/v1/completions")
    async def completions(body: schemas.CompletionRequest, request: Request) -> Any:
        prompts = body.prompts()
        chars = served.check_body(body, [p for p in prompts if isinstance(p, str)], "prompt")
        if len(prompts) > scheduler.max_queue:
            raise RequestError(f"{len(prompts)} prompts, more than the queue holds ({scheduler.max_queue})", "prompt")
        if not prompts:
            raise RequestError("prompt is an empty list; send a string, token ids or a list of either", "prompt")
        if body.stream and len(prompts) > 1:
            raise RequestError("stream=true takes one prompt; send the others as their own requests", "prompt")
        if any(isinstance(p, str) and not p.strip() for p in prompts):
            raise RequestError("prompt is empty; send the text the model should continue", "prompt")
        if body.echo and (body.stream or body.stop):
            raise RequestError("echo is served without stream and stop; send it without them", "echo")
        encoded = await off_loop(
            served, chars > INLINE_CHARS, lambda: [codec.text(p) if isinstance(p, str) else p for p in prompts]
        )
        forced = body.echo and body.logprobs is not None  # the prompt's own log-probabilities: teacher-forced
        watches = [served.watch(body, forced=ids[1:] if forced else None) for ids in encoded]
        jobs = [
            served.engine_request(ids, body, body.max_tokens, None, w) for ids, w in zip(encoded, watches, strict=True)
        ]
        if forced:  # from the first token on, the rest of the prompt chosen one decode step each
            for job in jobs:  # the whole prompt's fit and vocabulary (token ids from a client), before it is cut
                scheduler.engine.check(job)
            jobs = [echo_request(job, ids, body.max_tokens is None) for job, ids in zip(jobs, encoded, strict=True)]
        tickets: list[Ticket] = []
        try:
            for job in jobs:
                tickets.append(scheduler.submit(job, body.stop_strings()))
        except Exception:
            for ticket in tickets:
                ticket.cancel()
            raise
        rid = schemas.new_id("cmpl")
        if body.stream:
            events = _stream(served, tickets[0], rid, body.include_usage, False, None, watches[0])
            return StreamingResponse(events, media_type=SSE)
        texts = await _collect(request, tickets)
        usage = schemas.Usage.of(sum(t.prompt_tokens for t in tickets), sum(t.completion_tokens for t in tickets))
        lps = [None if w is None else completion_logprobs(w.entries, codec) for w in watches]
        if forced:  # the reply is what follows the prompt's tokens; the first prompt token has no logprob
            new = [[t for t, _, _ in w.entries[len(ids) - 1 :]] for w, ids in zip(watches, encoded, strict=True)]
            texts = [codec.decode(n) for n in new]
            firsts = [(ids[0], None, None) for ids in encoded]
            lps = [completion_logprobs([f, *w.entries], codec) for f, w in zip(firsts, watches, strict=True)]
            usage = schemas.Usage.of(sum(map(len, encoded)), sum(map(len, new)))
        if body.echo:  # a token-id prompt echoed as its text
            shown = [p if isinstance(p, str) else codec.decode(p, raw=True) for p in prompts]
            texts = [p + t for p, t in zip(shown, texts, strict=True)]
        choices = [(text, t.finish_reason, lp) for text, t, lp in zip(texts, tickets, lps, strict=True)]
        return schemas.completion_response(rid, served.model_name, choices, usage)

    return app


def echo_request(job: EngineRequest, ids: list[int], default_budget: bool) -> EngineRequest:
    """`job` from the prompt's first token, its other tokens forced (`logprobs.Forced`) before the reply's
    budget; no eos while an eos id is among the forced (it would end the row inside the prompt)."""
    budget = job.max_new_tokens if default_budget else job.max_new_tokens + len(ids) - 1
    eos = () if set(ids[1:]) & set(job.eos_token_ids) else job.eos_token_ids
    return dataclasses.replace(job, prompt_ids=ids[:1], max_new_tokens=budget, eos_token_ids=eos)


async def _collect(request: Request, tickets: list[Ticket]) -> list[str]:
    """Every ticket's whole text; a client that leaves first frees its rows."""

    async def texts() -> list[str]:  # one task, not a gather: a cancelled gather logs its exception unread
        return [await ticket.text() for ticket in tickets]  # the rows run at once; their events wait queued

    work = asyncio.ensure_future(texts())
    try:
        return await until_disconnect(request, work)
    finally:
        for ticket in tickets:
            ticket.cancel()


async def _stream(
    served: Served,
    ticket: Ticket,
    rid: str,
    include_usage: bool,
    chat: bool,
    fields: reply.ReplyStream | None = None,
    watch: TokenLogprobs | None = None,
) -> AsyncIterator[str]:
    """A response's events: its text's chunks (`fields`: parsed into thought, text and tool calls; each
    event's tokens' log-probabilities with its first chunk, when `watch`ed), the finish reason, the
    usage when asked, `[DONE]`; an engine fault or the drain's end mid-stream is one OpenAI error
    payload (the headers are sent)."""
    name, codec, taken, sent = served.model_name, served.scheduler.codec, 0, 0
    try:
        if chat:
            yield sse(schemas.chat_chunk(rid, name, {"role": "assistant", "content": ""}))
        async for event in ticket.events():
            final = event.finish_reason is not None
            new, taken = ([], taken) if watch is None else (watch.entries[taken:], len(watch.entries))
            if not chat:
                logprobs = completion_logprobs(new, codec, sent) if new else None
                sent += len(event.text)
                if event.text or final or logprobs:
                    yield sse(schemas.completion_chunk(rid, name, event.text, event.finish_reason, logprobs))
                continue
            deltas = fields.push(event.text, final) if fields else [{"content": event.text}] if event.text else []
            if new and not deltas:
                deltas = [{}]  # the tokens' log-probabilities while their text is held back
            for i, delta in enumerate(deltas):
                yield sse(
                    schemas.chat_chunk(rid, name, delta, None, chat_logprobs(new, codec) if new and not i else None)
                )
            if final:
                reason = "tool_calls" if fields and fields.called and event.finish_reason == "stop" else None
                yield sse(schemas.chat_chunk(rid, name, {}, reason or event.finish_reason))
        if include_usage:
            usage = schemas.Usage.of(ticket.prompt_tokens, ticket.completion_tokens)
            yield sse(schemas.usage_chunk(rid, name, "chat.completion.chunk" if chat else "text_completion", usage))
    except Gemma4LibError as exc:
        log.error("stream failed: %s", exc)
        yield sse(http_error(exc)[1])
    finally:  # also when the client disconnects: Starlette closes this generator
        ticket.cancel()
    yield sse("[DONE]")
