"""Structured output: a reply held to a JSON schema by a grammar engine's token mask on its row alone.

`response_format` `json_schema` (and `json_object`: any object) compiles to an llguidance matcher
over the served tokenizer; the row is watched (`runtime.LogitsWatch`): before each token the
matcher's mask sets every token it forbids to -inf in that row's logits (the other rows' logits are
never touched), and the chosen token advances the matcher. Once the value is complete only the eos
tokens stay allowed, so the reply always parses and validates.

llguidance over xgrammar: it needs no torch of its own (xgrammar's wheel requires one, which would
have to agree with the CPU pin and the Neuron SDK's), and it builds a schema's matcher and the
tokenizer's trie in milliseconds; on the tiny fixtures' tokenizer a mask took ~0.25 ms a token.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

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

    def constrain(self, schema: dict[str, Any]) -> Constrained:
        """A row's watch that holds its reply to `schema` (a JSON schema); a 400 when it is not one."""
        import llguidance

        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
            matcher = llguidance.LLMatcher(self._tokens(), grammar, log_level=0)
        except (ValueError, TypeError) as exc:
            raise RequestError(
                f"response_format's schema is not one the grammar engine takes: {exc}", "response_format"
            ) from exc
        if matcher.is_error():
            raise RequestError(f"response_format's schema: {matcher.get_error()}", "response_format")
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
