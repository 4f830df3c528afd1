"""Tokens to streamed text: the tokenizer behind one lock, incremental decoding, stop strings.

A streamed response and a plain one are the same deltas (the plain one joins them), so `stream=True`
gives the plain call's text by construction. Each delta is a prefix of the decode of every token so
far: a half-decoded UTF-8 character is held back, and so is a tail that might start a stop string.
Decoding is incremental (as text-generation-inference and vLLM do): a new token's text is the decode
of a window starting a few tokens back minus the same window's without it; re-decoding the whole
reply cost the scheduler thread time that grew with the reply.
"""

from __future__ import annotations

import copy
import re
import threading
from collections.abc import Sequence
from typing import Any

from ..errors import AudioInputError, BadPromptError, NoVisionError
from ..models.tokenizer import require_chat_template

PLACEHOLDER = "\ue000"  # a private-use character: where a special string of the content was


class Codec:
    """The tokenizer: encoding on the HTTP side's workers, decoding on the scheduler thread, each with its
    own copy and lock (a fast tokenizer used by two threads at once can fail "Already borrowed"), so a
    long encode never holds up the decode of every stream.

    Control tokens stay text unless `allow_control_tokens` (trusted clients): the template renders content
    with its special strings as placeholders, so its own markers are the only control tokens, and each
    stretch between them is encoded as text (`<|turn>` typed by a user is six characters). The tokenizer
    encodes between markers independently too: a prompt without special strings gets the ids it always did.
    """

    def __init__(
        self, tokenizer: Any, processor: Any = None, image_token_id: int | None = None, allow_control_tokens=False
    ):
        require_chat_template(tokenizer)
        self.tokenizer, self._decoder = tokenizer, copy.deepcopy(tokenizer)
        # the image processor and image token of a model served with its vision part (`serve --vision`)
        self.processor, self.image_token_id = processor, image_token_id
        self.hearing = None  # the engine's audio graph shape (`Engine.audio_shape`, `build_served`); None: deaf
        self.allow_control_tokens = allow_control_tokens
        self._lock, self._decode_lock = threading.Lock(), threading.Lock()
        specials = sorted({str(t) for t in tokenizer.added_tokens_decoder.values()} | {PLACEHOLDER}, key=len)[::-1]
        self._specials = {s: i for i, s in enumerate(specials)}
        self._special_re = re.compile("|".join(map(re.escape, specials)))
        self._marker_re = re.compile("|".join(re.escape(s) for s in specials if s != PLACEHOLDER))
        self.longest_token = max(len(t) for t in tokenizer.get_vocab())  # characters: a prompt's bound
        # The Rust tokenizer's own decode: the same text when transformers would not clean up spaces,
        # without transformers' per-call Python work (most of a short decode's time: the scheduler
        # thread decodes once or twice per row and token).
        fast = getattr(self._decoder, "backend_tokenizer", None)
        self._fast = fast if fast is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True) else None

    def chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, thinking=False, opening=""
    ) -> list[int]:
        """Messages (and the `tools` declared to the model, `thinking` switched on) through the model's
        own chat template, ending with the model's turn, then `opening`: the server's own start of the
        reply (a forced tool call's marker)."""
        if not messages:
            raise BadPromptError("messages is empty; send at least one {'role': 'user', 'content': ...} message")
        extra: dict[str, Any] = {"enable_thinking": True} if thinking else {}
        if tools:
            extra["tools"] = self._hide(tools)
        with self._lock:  # every string a client sent is hidden (unless trusted): tools, calls, names too
            text = self.tokenizer.apply_chat_template(
                self._hide(messages), add_generation_prompt=True, tokenize=False, **extra
            )
        return self._encode(text + opening)

    def _hide(self, content: Any) -> Any:
        """Content with every special string (and the placeholder character) as a placeholder."""
        if self.allow_control_tokens:
            return content
        if isinstance(content, str):
            return self._special_re.sub(lambda m: f"{PLACEHOLDER}{self._specials[m.group()]};", content)
        if isinstance(content, dict):
            return {k: self._hide(v) for k, v in content.items()}
        return [self._hide(v) for v in content] if isinstance(content, list) else content

    @property
    def specials(self) -> re.Pattern[str]:
        """The tokenizer's special strings: what a reply decoded with them (`decode(raw=True)`) drops
        once its thought and calls are parsed out."""
        return self._marker_re

    def _encode(self, text: str) -> list[int]:
        """`text` as ids: its special strings are control tokens, the placeholders' are text."""
        specials, found = list(self._specials), self._marker_re.findall(text)
        ids: list[int] = []
        with self._lock:
            for i, piece in enumerate(self._marker_re.split(text)):
                plain = re.sub(PLACEHOLDER + r"(\d+);", lambda m: specials[int(m.group(1))], piece)
                if plain:
                    ids += self.tokenizer(plain, add_special_tokens=False, split_special_tokens=True)["input_ids"]
                if i < len(found):
                    ids.append(self.tokenizer.convert_tokens_to_ids(found[i]))
        return ids

    def chat_with_images(self, messages: list[dict[str, Any]], images: list[Any], clips=()) -> tuple[list[int], Any]:
        """Messages with `{"type": "image"}` / `{"type": "audio"}` parts, one per image (PIL) / clip (samples):
        the prompt ids with each part expanded to its soft tokens, and the engine's `MediaPrompt`."""
        from ..images import media_prompt
        from ..models.audio import HEARING_VARIANTS, UNIFIED_SAMPLES

        if clips and self.hearing is None:
            raise AudioInputError(
                f"this server does not hear: start it with --hear ({', '.join(HEARING_VARIANTS)}) to send clips"
            )
        if (images or not clips) and (self.processor is None or self.image_token_id is None):
            raise NoVisionError(
                "this server was started without a vision part; start it with --vision (a model with a vision "
                "part) to send image_url content parts, or send text only"
            )
        rendered = self.chat(messages)
        with self._lock:
            kwargs = dict(audio=clips, rendered=rendered, unified=bool(clips) and self.hearing[-1] == UNIFIED_SAMPLES)
            inputs = media_prompt(
                self.tokenizer, self.processor, images, "", image_token_id=self.image_token_id or -1, **kwargs
            )
        return inputs.ids, inputs.prompt

    def text(self, prompt: str) -> list[int]:
        """A completion prompt as plain text (no chat turns), with the tokenizer's own special tokens: the
        client writes the whole prompt (its own template, as lm-eval does); there is no turn to forge."""
        if not prompt.strip():
            raise BadPromptError("prompt is empty; send the text the model should continue")
        with self._lock:
            ids, bos = list(self.tokenizer(prompt)["input_ids"]), self.tokenizer.bos_token_id
        if bos is not None and ids[:2] == [bos, bos] and prompt.startswith(self.tokenizer.bos_token):
            return ids[1:]  # the client wrote its own <bos> (a rendered chat template): not a second one
        return ids

    def decode(self, ids: Sequence[int], raw: bool = False) -> str:
        """The text of `ids`; `raw`: with the special tokens (a reply to parse for its thought and calls)."""
        with self._decode_lock:
            if self._fast is not None:
                return self._fast.decode(list(ids), skip_special_tokens=not raw)
            return self._decoder.decode(list(ids), skip_special_tokens=not raw)


class TextStream:
    """One response's text as its tokens arrive; `stopped` once a stop string has appeared. `raw`
    keeps the special tokens in the text (`reply.parse` takes them out)."""

    def __init__(self, codec: Codec, stop: Sequence[str] = (), raw: bool = False):
        self.codec, self.raw = codec, raw
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded text already handed out
        self.stopped = False
        self.text = ""  # the decode of ids[:read], grown incrementally
        self._prefix = 0  # the window's first token: decoded only as context for the next ones
        self._read = 0  # tokens whose text is in self.text

    def push(self, ids: Sequence[int]) -> str:
        """Add tokens; return the text that is now settled (may be empty)."""
        if self.stopped:
            return ""
        self.ids.extend(ids)
        self._advance(final=False)
        text = self.text
        cut = self._stop_at(text)
        if cut is not None:
            self.stopped = True
            return self._take(text[:cut])
        return self._take(text[: len(text) - self._held(text)])

    def finish(self) -> str:
        """The rest of the text once the request is over (what `push` held back for a stop string)."""
        if self.stopped:
            return ""
        self._advance(final=True)
        return self._take(self.text)

    def _advance(self, final: bool) -> None:
        """Add the new tokens' text to `self.text`, unless it ends in half a UTF-8 character (then the
        next token completes it), or `final` (then the replacement character is the text)."""
        before = self.codec.decode(self.ids[self._prefix : self._read], self.raw)
        after = self.codec.decode(self.ids[self._prefix :], self.raw)
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self.text += after[len(before) :]
            self._prefix, self._read = self._read, len(self.ids)

    def _take(self, settled: str) -> str:
        delta = settled[self.sent :]
        self.sent = max(self.sent, len(settled))
        return delta

    def _stop_at(self, text: str) -> int | None:
        longest = max((len(s) for s in self.stop), default=0)
        start = max(0, self.sent - longest)
        hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _held(self, text: str) -> int:
        """Length of the longest tail of `text` that a stop string starts with (it may still complete)."""
        held = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text) - self.sent), held, -1):
                if text.endswith(s[:n]):
                    held = n
                    break
        return held
