"""Gemma-4's reply to OpenAI's message fields: the thought, the text and the tool calls.

The model writes its thought as `<|channel>thought\\n…<channel|>` and each call as
`<|tool_call>call:NAME{key:<|"|>text<|"|>,n:3}<tool_call|>` (keys bare, strings between `<|"|>`
marks, the rest JSON). A request that declared tools or turned thinking on has its reply decoded
with special tokens kept and parsed here (a prompt's content never holds a marker, `text.Codec`, so
a marker is one the model wrote). Streamed and plain replies are one parse: a stream re-parses the
text so far at each event and sends what grew, holding back what may still change.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

THOUGHT, THOUGHT_END, THOUGHT_NAME = "<|channel>", "<channel|>", "thought\n"
CALL, CALL_END, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
MARKERS = (THOUGHT, CALL)
_CALL = re.compile(r"call:(\w+)(.*)", re.S)
# in a call's arguments: a <|"|> string, a JSON string, a bare key (before its colon)
_ARGUMENT = re.compile(r'<\|"\|>(.*?)<\|"\|>|("(?:[^"\\]|\\.)*")|([A-Za-z_][\w-]*)(?=\s*:)', re.S)


def arguments_json(text: str) -> str | None:
    """A call's `{key:<|"|>v<|"|>,…}` as a JSON object's text, or None when it is not one."""

    def quoted(m: re.Match[str]) -> str:
        return json.dumps(m.group(1)) if m.group(1) is not None else m.group(2) or json.dumps(m.group(3))

    try:
        value = json.loads(_ARGUMENT.sub(quoted, text))
    except json.JSONDecodeError:
        return None
    return json.dumps(value) if isinstance(value, dict) else None


@dataclass
class Parsed:
    """A reply's fields so far: `content`, `reasoning`, the closed `calls` ((name, JSON arguments)),
    and `held`: how many of the content's and the reasoning's last characters may still change."""

    content: str = ""
    reasoning: str = ""
    calls: list[tuple[str, str]] = field(default_factory=list)
    held: tuple[int, int] = (0, 0)  # characters of content, reasoning that may still change


def parse(text: str, final: bool, specials: re.Pattern[str] | None = None) -> Parsed:
    """The fields of `text` (the reply so far, special tokens kept). `specials` removes the other
    control tokens (the turn's end) from the text; `final`: nothing more comes (nothing is held)."""
    out, content, reasoning, at, call_open = Parsed(), [], [], 0, False
    while at < len(text):
        starts = [(i, m) for m in MARKERS if (i := text.find(m, at)) >= 0]
        if not starts:
            content.append(text[at:])
            break
        start, marker = min(starts)
        content.append(text[at:start])
        end_marker = THOUGHT_END if marker == THOUGHT else CALL_END
        end = text.find(end_marker, start)
        inner = text[start + len(marker) : len(text) if end < 0 else end]
        if marker == THOUGHT:
            if inner.startswith(THOUGHT_NAME) or end >= 0 or final:
                inner = inner.removeprefix(THOUGHT_NAME)
            elif THOUGHT_NAME.startswith(inner):  # the channel's name may still be arriving
                inner = ""
            reasoning.append(inner)
        elif end >= 0 and (call := _CALL.fullmatch(inner)) and (args := arguments_json(call.group(2))) is not None:
            out.calls.append((call.group(1), args))
        elif end >= 0 or final:  # not a call after all: the model's text
            content.append(text[start : len(text) if end < 0 else end + len(end_marker)])
        else:
            call_open = True  # the content waits for it
        if end < 0:
            break
        at = end + len(end_marker)
    clean = (lambda s: specials.sub("", s)) if specials is not None else (lambda s: s)
    out.content, out.reasoning = clean("".join(content)).lstrip(), clean("".join(reasoning)).lstrip()
    if final:
        out.content, out.reasoning = out.content.rstrip(), out.reasoning.rstrip()
        return out
    tail = max(
        (n for m in (*MARKERS, CALL_END, THOUGHT_END) for n in range(1, len(m)) if out.content.endswith(m[:n])),
        default=0,
    )
    held_content = len(out.content) if call_open else max(tail, len(out.content) - len(out.content.rstrip()))
    out.held = (held_content, len(out.reasoning) - len(out.reasoning.rstrip()))
    return out


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_calls(calls: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """OpenAI's `tool_calls` of a message (each with its own id)."""
    return [{"id": new_call_id(), "type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]


def message(text: str, specials: re.Pattern[str], thinking: bool, reason: str | None) -> tuple[dict[str, Any], str]:
    """A whole reply as OpenAI's message fields, and its finish reason ("tool_calls" when it called one)."""
    parsed = parse(text, True, specials)
    fields: dict[str, Any] = {"content": parsed.content or (None if parsed.calls else "")}
    if thinking:
        fields["reasoning_content"] = parsed.reasoning or None
    if parsed.calls:
        fields["tool_calls"] = tool_calls(parsed.calls)
    return fields, "tool_calls" if parsed.calls and reason == "stop" else reason or "stop"


class ReplyStream:
    """One streamed reply's deltas: `push` the new raw text, get OpenAI `delta`s (reasoning, content,
    each call whole once it closes); `finish` sends what was held back."""

    def __init__(self, specials: re.Pattern[str] | None, opening: str = ""):
        self.specials, self.text = specials, opening  # the server's own start of the reply (a forced call)
        self.sent = [0, 0, 0]  # content characters, reasoning characters, calls

    def push(self, text: str, final: bool = False) -> list[dict[str, Any]]:
        self.text += text
        now = parse(self.text, final, self.specials)
        deltas: list[dict[str, Any]] = []
        reasoning = now.reasoning[: len(now.reasoning) - now.held[1]]
        if len(reasoning) > self.sent[1]:
            deltas.append({"reasoning_content": reasoning[self.sent[1] :]})
            self.sent[1] = len(reasoning)
        content = now.content[: len(now.content) - now.held[0]]
        if len(content) > self.sent[0]:
            deltas.append({"content": content[self.sent[0] :]})
            self.sent[0] = len(content)
        for i, call in enumerate(tool_calls(now.calls[self.sent[2] :]), start=self.sent[2]):
            deltas.append({"tool_calls": [{"index": i, **call}]})
        self.sent[2] = len(now.calls)
        return deltas

    @property
    def called(self) -> bool:
        return self.sent[2] > 0
