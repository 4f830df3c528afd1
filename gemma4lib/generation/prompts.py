"""The prompts of a batch when none are given: B different capital questions, each with its answer.

The tiny trained fixtures know the 40 capitals of `corpus.COUNTRIES` in three phrasings, and so does
a released Gemma-4, so one default serves every profile. The phrasings rotate so the rows have
different lengths (right-padding and per-row positions are exercised, not only per-row data); row 0
is the canonical "What is the capital of France?".
"""

from __future__ import annotations

from ..errors import SettingsError
from ..models.corpus import COUNTRIES, TRAIN_PHRASINGS

# row i asks phrasing _PHRASING_ORDER[i % 3]: "What is..." (7 words), "Which city is..." (8), "Tell me..." (7)
_PHRASING_ORDER = (0, 2, 1)


def capital_questions(batch_size: int) -> tuple[tuple[str, str], ...]:
    """`batch_size` (prompt, expected capital) pairs, a different country in every row (up to 40)."""
    if not 1 <= batch_size <= len(COUNTRIES):
        raise SettingsError(
            f"the default batch holds at most {len(COUNTRIES)} capital questions, not {batch_size}; pass "
            f"your own prompts=(...) (and expects=) for a batch of {batch_size}"
        )
    pairs = []
    for i in range(batch_size):
        country, capital = COUNTRIES[i]
        pairs.append((TRAIN_PHRASINGS[_PHRASING_ORDER[i % 3]].format(country=country), capital))
    return tuple(pairs)


def random_prompt_lengths(base: int, batch_size: int) -> list[int]:
    """Token counts of a random-weights batch's rows: `base`, then shorter by 3 per row (at least 2),
    so a witness batch also has rows of different lengths."""
    return [max(2, base - 3 * i) for i in range(batch_size)]
