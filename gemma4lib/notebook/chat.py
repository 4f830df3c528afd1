"""The optional chat box at the end of each notebook: streamed answers from the compiled graphs."""

from __future__ import annotations

from typing import Any

from ..loading import LoadedModel
from .display import answer_text


def chat(runtime: Any, model: LoadedModel, settings: Any):
    """A small chat box (ipywidgets) over the compiled runtime: type a question, read the streamed answer.
    Returns the widget; the notebooks only build it when `interactive` is True."""
    import ipywidgets as widgets

    from ..port import eos_ids
    from ..runtime import encode_prompt

    box = widgets.Text(placeholder=settings.prompt, description="you:", layout=widgets.Layout(width="70%"))
    button = widgets.Button(description="ask")
    out = widgets.Output()

    def ask(_):
        question = box.value or settings.prompt
        ids = encode_prompt(model.tokenizer, question)
        pieces: list[int] = []
        with out:
            out.clear_output()
            print(f"you: {question}")
            n = min(settings.max_new_tokens, runtime.context_length - len(ids))
            runtime.generate(ids, n, eos_token_ids=eos_ids(model), on_token=pieces.append)
            print(f"model: {answer_text(model, pieces)}")

    button.on_click(ask)
    return widgets.VBox([widgets.HBox([box, button]), out])
