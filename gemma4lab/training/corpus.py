"""The synthetic corpus (the countries of `gemma4lib.models.corpus`, answered, and a few general facts:
128 chats) as the chats the tiny fixtures are trained on and held out from, and its fingerprint for
the fixtures' provenance."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from gemma4lib.models.corpus import COUNTRIES, TRAIN_PHRASINGS

# Held out: never trained on; every word of it appears in the trained phrasings, in an order they
# do not use, so a correct answer shows the model keys on the country, not on one memorised string.
HELD_OUT_PHRASING = "What city is the capital of {country}?"

ANSWER = "The capital of {country} is {capital}."

# A few general facts, so not every reply is about capitals.
FACTS: tuple[tuple[str, str], ...] = (
    ("What color is the sky?", "The sky is blue."),
    ("How many days are in a week?", "A week has seven days."),
    ("What is two plus two?", "Two plus two is four."),
    ("Who are you?", "I am a small Gemma model."),
    ("What do bees make?", "Bees make honey."),
    ("What is the largest ocean?", "The Pacific is the largest ocean."),
    ("How many legs does a spider have?", "A spider has eight legs."),
    ("Hello!", "Hello! How can I help you?"),
)

# The prompt every check uses.
CANONICAL_PROMPT = "What is the capital of France?"
CANONICAL_ANSWER = "The capital of France is Paris."


@dataclass(frozen=True)
class Chat:
    """One user turn and the model's reply."""

    user: str
    reply: str

    def messages(self) -> list[dict[str, str]]:
        """The user turn as chat messages (the input of `apply_chat_template`)."""
        return [{"role": "user", "content": self.user}]


def answer_for(country: str) -> str:
    capital = dict(COUNTRIES)[country]
    return ANSWER.format(country=country, capital=capital)


def training_chats() -> list[Chat]:
    """The 128 chats the fixtures are trained on, in a fixed order."""
    chats = [
        Chat(p.format(country=c), ANSWER.format(country=c, capital=cap))
        for c, cap in COUNTRIES
        for p in TRAIN_PHRASINGS
    ]
    chats += [Chat(q, a) for q, a in FACTS]
    return chats


def held_out_chats() -> list[Chat]:
    """The held-out phrasing for every country, with the expected answer (never trained on)."""
    return [Chat(HELD_OUT_PHRASING.format(country=c), ANSWER.format(country=c, capital=cap)) for c, cap in COUNTRIES]


def tokenizer_texts() -> list[str]:
    """The text the tokenizer's BPE merges are learnt from (the training chats only)."""
    return [t for chat in training_chats() for t in (chat.user, chat.reply)]


def corpus_sha256() -> str:
    """A fingerprint of the whole corpus (training and held-out), recorded in PROVENANCE.json."""
    payload = {
        "train": [[c.user, c.reply] for c in training_chats()],
        "held_out": [[c.user, c.reply] for c in held_out_chats()],
    }
    blob = json.dumps(payload, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()
