"""The optional chat box at the end of each notebook: the answer is streamed, token by token, from the
compiled graphs through the one generation engine (`runtime.Engine.generate`'s `on_token` callback)."""

from __future__ import annotations

import html
import logging
import warnings
from typing import TYPE_CHECKING

from gemma4lab.notebook.display import answer_text
from gemma4lib.errors import Gemma4LibError
from gemma4lib.models.loading import LoadedModel
from gemma4lib.runtime import room_for_new_tokens

if TYPE_CHECKING:  # type names only
    from gemma4lib.runtime import Engine
    from gemma4lib.settings import PortSettings

logger = logging.getLogger(__name__)


def prompt_limit(runtime: Engine) -> int:
    """The longest prompt (in tokens, chat template included) the compiled graphs take: it must leave
    the K/V room for one new token (and a verify's drafts); longer than a prefill bucket, it runs in chunks."""
    return runtime.context_length - runtime.draft_tokens


def too_long_line(n_tokens: int, limit: int) -> str:
    """The one line a too-long question gets: the limit, and how to get under it."""
    return (
        f"Question too long: {n_tokens} tokens with the chat template, the compiled graphs take at most {limit}. "
        f"Shorten it by {n_tokens - limit} or more tokens (roughly words), or rebuild with a larger "
        f"prefill_buckets and context_length."
    )


class ChatBox:
    """A question box and a streamed answer over one compiled runtime. Enter (or the ask button) sends.

    The widgets are plain attributes (`box`, `button`, `answer`, `widget`) so a test drives it without a
    browser: set `box.value`, call `send()`, read `answer.value`."""

    def __init__(self, runtime: Engine, model: LoadedModel, settings: PortSettings):
        import ipywidgets as widgets

        self.runtime, self.model, self.settings = runtime, model, settings
        self.box = widgets.Text(placeholder=settings.prompt, description="you:", layout=widgets.Layout(width="70%"))
        self.button = widgets.Button(description="ask")
        self.answer = widgets.HTML(value="")
        with warnings.catch_warnings():
            # ipywidgets 8 marks on_submit deprecated in favour of observing `value` with continuous_update=False,
            # but that also fires when the box loses focus and not at all for the same question twice: Enter
            # is what on_submit is, so it stays.
            warnings.simplefilter("ignore", DeprecationWarning)
            self.box.on_submit(lambda _: self.send())
        self.button.on_click(lambda _: self.send())
        self.widget = widgets.VBox([widgets.HBox([self.box, self.button]), self.answer])

    def _show(self, label: str, text: str) -> None:
        self.answer.value = f"<b>{label}</b> {html.escape(text)}"

    def send(self) -> str | None:
        """Answer what is in the box (or the settings' prompt when it is empty), updating `answer` after
        every generated token. Returns the answer, or None when the question was refused (one line says why)."""
        from gemma4lib.port import eos_ids
        from gemma4lib.runtime import encode_prompt

        question = self.box.value.strip() or self.settings.prompt
        try:
            ids = encode_prompt(self.model.tokenizer, question)
        except Gemma4LibError as error:
            self._show("can't ask:", str(error))
            return None
        except AttributeError as error:  # e.g. `model` rebound to its parameter string by re-running that cell
            self._show("error:", f"{error}; pass the loaded model (load_model(settings)) to nb.chat")
            return None
        limit = prompt_limit(self.runtime)
        if len(ids) > limit:
            self._show("can't ask:", too_long_line(len(ids), limit))
            return None
        pieces: list[int] = []

        def on_token(token: int) -> None:
            pieces.append(token)
            self._show("model:", answer_text(self.model, pieces) or "")

        self._show("model:", "…")
        n = min(
            self.settings.max_new_tokens,
            room_for_new_tokens(len(ids), self.runtime.context_length, self.runtime.draft_tokens),
        )
        try:
            self.runtime.generate(ids, n, eos_token_ids=eos_ids(self.model), on_token=on_token)
        except Gemma4LibError as error:  # anything the user can fix: one line, not a traceback
            self._show("can't ask:", str(error))
            return None
        except Exception as error:  # a widget callback's exception is otherwise lost: the box would just stay blank
            logger.exception("chat: generation failed")
            self._show("error:", f"{type(error).__name__}: {error}")
            return None
        return answer_text(self.model, pieces)


def chat(runtime: Engine, model: LoadedModel, settings: PortSettings):
    """A small chat box (ipywidgets) over the compiled runtime: type a question, press Enter, read the
    answer as it is generated. Returns the widget; the notebooks only build it when `interactive` is True."""
    return ChatBox(runtime, model, settings).widget
