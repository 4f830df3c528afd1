"""Why equality is not enough: a prompt in Gemma 3's turn format passes SEQ_MATCH and answers
nonsense, and the random-weights witness whose near-ties turn a logit error into another token."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gemma4lab.notebook.display import Table, until_stop
from gemma4lab.notebook.formatting import readable_tokens
from gemma4lib import checks
from gemma4lib.models.loading import LoadedModel

if TYPE_CHECKING:  # type names only
    from gemma4lib.backends.base import CompiledGraphs
    from gemma4lib.runtime import Engine
    from gemma4lib.settings import PortSettings

# A hand-built prompt in Gemma 3's turn format: not Gemma-4 tokens (see `equality_is_not_enough`).
GEMMA3_STYLE_PROMPT = "<start_of_turn>user\n{prompt}<end_of_turn>\n<start_of_turn>model\n"


def gemma3_style_ids(model: LoadedModel, prompt: str) -> list[int]:
    """The 31B's bug: a chat prompt written by hand in Gemma 3's turn format. Gemma-4 has no such
    tokens, so each marker is split into ordinary pieces."""
    return list(model.tokenizer(GEMMA3_STYLE_PROMPT.format(prompt=prompt))["input_ids"])


def equality_is_not_enough(model: LoadedModel, runtime: Engine, settings: PortSettings) -> Table:
    """The same question through the real chat template and through a hand-built Gemma-3-style one,
    each run on the device graph and on the reference. Both prompts give SEQ_MATCH; only one answer
    makes sense."""
    from gemma4lib.port import eos_ids
    from gemma4lib.reference import reference_greedy

    if model.tokenizer is None:
        return Table(
            ["note"],
            [
                [
                    "random weights have no tokenizer and no meaningful answer: this demonstration "
                    "needs the trained fixture (or a real checkpoint)"
                ]
            ],
            "skipped",
        )
    eos = eos_ids(model)
    rows = []
    from gemma4lib.port import prompt_ids

    for label, ids in (
        ("tokenizer's chat template", prompt_ids(model, settings)),
        ("hand-built <start_of_turn> prompt", gemma3_style_ids(model, settings.prompt)),
    ):
        n = min(settings.max_new_tokens, runtime.context_length - runtime.draft_tokens - len(ids))
        device = runtime.generate(ids, n, eos_token_ids=eos).tokens
        reference = reference_greedy(model.lm, ids, n, eos)
        report = checks.evaluate(model.lm, model.tokenizer, ids, device, reference, expect=settings.expect)
        shown = readable_tokens(model.tokenizer, until_stop(device, eos))
        rows.append([label, len(ids), report.seq_match, report.coherent, report.answer, shown])
    return Table(
        ["prompt", "prompt tokens", "SEQ_MATCH", "coherent", "device answer", "device tokens, one by one"],
        rows,
        "device == reference proves the compiler faithful, not the input right",
        "The second answer is nonsense by design: <start_of_turn> is not a Gemma-4 token, so the model never "
        "sees a turn." + _byte_cell_note(rows),
    )


def _byte_cell_note(rows: list[list[Any]]) -> str:
    """Explain byte cells (`⟨E7⟩`) by one the table really shows, or say nothing."""
    import re

    found = re.search(r"⟨[^⟩]*⟩", " ".join(str(row[-1]) for row in rows))
    return f" Cells like {found.group(0)} are single bytes of a character the model never finished." if found else ""


def run_witness(settings: PortSettings, compiled: CompiledGraphs | None = None) -> dict[str, Any]:
    """The random-weights witness of this port (`port.run_witness`): the same variant, shapes and
    compiled programs with seeded random weights, checked for SEQ_MATCH and LOGITS_MATCH. With
    the trained run's `compiled` graphs it also says whether it ran the very same artifacts."""
    from gemma4lib.port import run_witness as _run

    artifacts = (getattr(compiled, "info", None) or {}).get("artifacts")
    return _run(settings, artifacts=artifacts)
