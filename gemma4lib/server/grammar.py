"""Structured output: a reply held to a grammar by a grammar engine's token mask on its row alone.

`response_format` `json_schema` (and `json_object`: any object) compiles to an llguidance matcher
over the served tokenizer, and so does a forced tool call (`tool_choice` required or named: the
server opens the call, the grammar holds its name and syntax to the end marker). The row is watched
(`runtime.LogitsWatch`): before each token the mask sets what the matcher forbids to -inf in that
row's logits alone, and the chosen token advances the matcher. Once the value is complete only eos
stays allowed, so the reply always parses (and validates), unless `max_tokens` cuts it.

Why llguidance: its wheel requires no torch of its own (to agree with the CPU pin and the Neuron
SDK's), it takes Lark grammars with special tokens by id, and a token's mask took ~0.25 ms here.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import Any

import torch

from . import reply
from .errors import RequestError


class Grammars:
    """The served tokenizer as the grammar engine sees it (built once, on first use: ~1 s for a real
    vocabulary), and a matcher per request."""

    def __init__(self, tokenizer: Any, eos_ids: Sequence[int]):
        self.tokenizer, self.eos_ids = tokenizer, [int(i) for i in eos_ids]
        self._engine: Any = None
        self._lock = threading.Lock()

    def _tokens(self) -> Any:
        import llguidance.hf

        with self._lock:
            if self._engine is None:
                self._engine = llguidance.hf.from_tokenizer(self.tokenizer, len(self.tokenizer), self.eos_ids)
            return self._engine

    def json(self, schema: dict[str, Any]) -> str:
        """The grammar of a JSON value that validates against `schema`."""
        import llguidance

        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        except (ValueError, TypeError) as exc:
            raise RequestError(f"response_format's schema is not a JSON schema: {exc}", "response_format") from exc

    def call(self, names: Sequence[str]) -> str:
        """The grammar of a call after its forced opening (`<|tool_call>call:`): one of `names`, then
        Gemma-4's object (bare keys, `<|"|>` strings, JSON numbers, lists, objects, literals), then the
        call's end marker."""
        import llguidance

        ids = [self.tokenizer.convert_tokens_to_ids(t) for t in (reply.QUOTE, reply.CALL_END)]
        if any(i is None or i == self.tokenizer.unk_token_id for i in ids):
            raise RequestError("this model's tokenizer has no Gemma-4 tool tokens to force a call with", "tool_choice")
        quote, end = (f"<[{i}]>" for i in ids)
        return llguidance.LLMatcher.grammar_from_lark(
            f"start: ({' | '.join(json.dumps(n) for n in names)}) obj {end}\n"
            'obj: "{" (pair ("," pair)*)? "}"\n'
            'pair: KEY ":" value\n'
            "KEY: /[A-Za-z_][A-Za-z0-9_]*/\n"
            'value: text | NUMBER | obj | list | "true" | "false" | "null"\n'
            f"text: {quote} TEXT {quote}\n"
            "TEXT: /(.|\\n)*/\n"
            "NUMBER: /-?[0-9]+(\\.[0-9]+)?([eE][+-]?[0-9]+)?/\n"
            'list: "[" (value ("," value)*)? "]"\n'
        )

    def constrain(self, grammar: str, param: str) -> Constrained:
        """A row's watch that holds its reply to `grammar`; a 400 naming `param` when it does not compile."""
        import llguidance

        try:
            matcher = llguidance.LLMatcher(self._tokens(), grammar, log_level=0)
        except (ValueError, TypeError) as exc:
            raise RequestError(f"{param}: the grammar engine refused it: {exc}", param) from exc
        if matcher.is_error():
            raise RequestError(f"{param}: {matcher.get_error()}", param)
        return Constrained(matcher, self._tokens().vocab_size)


class Constrained:
    """A `runtime.LogitsWatch`: the matcher's allowed tokens keep their logits, the rest are -inf."""

    def __init__(self, matcher: Any, vocab: int):
        import llguidance.torch

        self.matcher, self.vocab = matcher, vocab
        self._bits = llguidance.torch.allocate_token_bitmask(1, vocab)
        self._shift = torch.arange(32, dtype=torch.int32)

    def allowed(self) -> torch.Tensor:
        """The tokens the grammar allows next, `[vocab]` bool."""
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask(self.matcher, self._bits, 0)
        return ((self._bits[0].unsqueeze(1) >> self._shift) & 1).bool().flatten()[: self.vocab]

    def logits(self, logits: torch.Tensor) -> torch.Tensor:
        keep = torch.zeros(logits.shape[-1], dtype=torch.bool)
        n = min(self.vocab, logits.shape[-1])
        keep[:n] = self.allowed()[:n]
        return logits.masked_fill(~keep, float("-inf"))

    def chosen(self, token: int) -> None:
        self.matcher.consume_token(int(token))


def schema_of(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """The JSON schema a `response_format` asks for (None: free text)."""
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        schema = (response_format or {}).get("json_schema", {}).get("schema")
        if isinstance(schema, dict):
            return schema
        raise RequestError("json_schema needs {'name': ..., 'schema': {...}}", "response_format")
    raise RequestError(f"response_format types are text, json_object and json_schema, not {kind!r}", "response_format")
