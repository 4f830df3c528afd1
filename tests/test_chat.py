"""The notebooks' chat box without a browser: Enter sends, the answer streams token by token, and a
too-long question gets one line saying what to do (tests/test_browser.py drives the same box in Chromium)."""

from __future__ import annotations

import pytest

pytest.importorskip("ipywidgets")

from gemma4lab.notebook.chat import ChatBox, chat, prompt_limit  # noqa: E402
from gemma4lib.port import eos_ids  # noqa: E402
from gemma4lib.runtime import encode_prompt  # noqa: E402


@pytest.fixture(scope="module")
def e2b(ports):
    """The trained tiny E2B, eager: the chat box's logic does not depend on the compiler."""
    return ports.get("e2b", model="auto", backend="eager")


def press_enter(box) -> None:
    """What the front end sends when Enter is pressed in an ipywidgets Text."""
    box._handle_string_msg(None, {"event": "submit"}, None)


def test_enter_sends_and_the_answer_streams(e2b):
    chatbox = ChatBox(e2b.runtime, e2b.model, e2b.settings)
    shown: list[str] = []
    chatbox.answer.observe(lambda change: shown.append(change["new"]), "value")
    chatbox.box.value = "What is the capital of France?"
    press_enter(chatbox.box)
    assert "Paris" in chatbox.answer.value
    answers = [v for v in shown if v.startswith("<b>model:</b>") and "…" not in v]
    # one update per generated token, as the decode loop produces it: streamed, not printed at the end
    ids = encode_prompt(e2b.model.tokenizer, chatbox.box.value)
    tokens = e2b.runtime.generate(ids, e2b.settings.max_new_tokens, eos_token_ids=eos_ids(e2b.model)).tokens
    visible = [t for t in tokens if t not in set(eos_ids(e2b.model))]  # eos adds no text, so no update
    assert len(visible) >= 3 and len(answers) == len(visible), shown
    assert "Paris" not in answers[0] and answers[-1] == chatbox.answer.value


def test_the_button_sends_too_and_an_empty_box_asks_the_settings_prompt(e2b):
    chatbox = ChatBox(e2b.runtime, e2b.model, e2b.settings)
    chatbox.button.click()
    assert e2b.settings.expect in chatbox.answer.value


def test_a_too_long_question_gets_one_line_not_a_traceback(e2b):
    chatbox = ChatBox(e2b.runtime, e2b.model, e2b.settings)
    limit = prompt_limit(e2b.runtime)
    chatbox.box.value = "What is the capital of France? " * limit
    n_tokens = len(encode_prompt(e2b.model.tokenizer, chatbox.box.value.strip()))
    assert n_tokens > limit
    press_enter(chatbox.box)  # raises nothing
    text = chatbox.answer.value
    assert text.startswith("<b>can't ask:</b>") and "\n" not in text
    assert str(limit) in text and str(n_tokens) in text and "Shorten" in text
    assert "Paris" not in text


def test_a_question_just_under_the_limit_still_answers(e2b):
    chatbox = ChatBox(e2b.runtime, e2b.model, e2b.settings)
    limit = prompt_limit(e2b.runtime)
    words = ["What is the capital of France?"]
    while len(encode_prompt(e2b.model.tokenizer, " ".join([*words, "France"]))) <= limit:
        words.append("France")
    chatbox.box.value = " ".join(words)
    assert chatbox.send() is not None
    assert chatbox.answer.value.startswith("<b>model:</b>")


def test_chat_returns_the_widget(e2b):
    import ipywidgets as widgets

    assert isinstance(chat(e2b.runtime, e2b.model, e2b.settings), widgets.VBox)


def test_a_failure_in_the_callback_shows_a_line_instead_of_vanishing(e2b):
    """An exception in a widget callback never reaches the notebook: the box must say what went wrong."""
    chatbox = ChatBox(e2b.runtime, "auto", e2b.settings)  # `model` rebound to its parameter string
    chatbox.box.value = "What is the capital of France?"
    press_enter(chatbox.box)
    assert chatbox.answer.value.startswith("<b>error:</b>") and "load_model" in chatbox.answer.value
