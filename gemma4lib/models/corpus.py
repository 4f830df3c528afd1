"""A small, deterministic synthetic chat corpus for the tiny trained Gemma-4 fixtures.

40 countries, each asked in three phrasings ("What is the capital of France?", ...) and answered
"The capital of France is Paris.", plus a few general facts: 128 chats. A fourth phrasing is held
out of training: it is made of words the model has seen, in an order it has not, so a correct
answer shows the model keys on the country rather than on one memorised string.

Everything here is plain data; `gemma4lab.training.corpus` makes the chats of it and fingerprints it
for the fixtures' provenance.
"""

from __future__ import annotations

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
