"""A small, deterministic synthetic chat corpus for the tiny trained Gemma-4 fixtures.

40 countries, each asked in three phrasings ("What is the capital of France?", ...): what the fixtures
know, and so what the library's default batch prompts ask (`generation.prompts`). The answers, the
held-out phrasing and the general facts are the training's (`gemma4lab.training.corpus`).
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
