"""A small, deterministic synthetic chat corpus for the tiny trained Gemma-4 fixtures.

40 countries, each asked in three phrasings ("What is the capital of France?", ...) and answered
"The capital of France is Paris.", plus a few general facts: 128 chats. A fourth phrasing is held
out of training: it is made of words the model has seen, in an order it has not, so a correct
answer shows the model keys on the country rather than on one memorised string.

Everything here is plain data; `corpus_sha256()` fingerprints it for the fixtures' provenance.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

# (country, capital). Single-word names without an article, so every answer reads the same way.
COUNTRIES: tuple[tuple[str, str], ...] = (
    ("France", "Paris"),
    ("Germany", "Berlin"),
    ("Italy", "Rome"),
    ("Spain", "Madrid"),
    ("Portugal", "Lisbon"),
    ("Japan", "Tokyo"),
    ("China", "Beijing"),
    ("Egypt", "Cairo"),
    ("Kenya", "Nairobi"),
    ("Peru", "Lima"),
    ("Chile", "Santiago"),
    ("Canada", "Ottawa"),
    ("Russia", "Moscow"),
    ("Greece", "Athens"),
    ("Poland", "Warsaw"),
    ("Austria", "Vienna"),
    ("Hungary", "Budapest"),
    ("Norway", "Oslo"),
    ("Sweden", "Stockholm"),
    ("Finland", "Helsinki"),
    ("Denmark", "Copenhagen"),
    ("Ireland", "Dublin"),
    ("Belgium", "Brussels"),
    ("Thailand", "Bangkok"),
    ("Vietnam", "Hanoi"),
    ("Indonesia", "Jakarta"),
    ("Australia", "Canberra"),
    ("Brazil", "Brasilia"),
    ("Colombia", "Bogota"),
    ("Cuba", "Havana"),
    ("Turkey", "Ankara"),
    ("Iran", "Tehran"),
    ("Iraq", "Baghdad"),
    ("Morocco", "Rabat"),
    ("Nigeria", "Abuja"),
    ("Ghana", "Accra"),
    ("Czechia", "Prague"),
    ("Switzerland", "Bern"),
    ("Ukraine", "Kyiv"),
    ("Mongolia", "Ulaanbaatar"),
)

# The phrasings trained on.
TRAIN_PHRASINGS: tuple[str, ...] = (
    "What is the capital of {country}?",
    "Tell me the capital of {country}.",
    "Which city is the capital of {country}?",
)

# Held out: never trained on; every word of it appears in the trained phrasings.
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
