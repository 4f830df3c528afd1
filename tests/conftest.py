"""Shared fixtures. Compiled graphs are built once per test session (and cached on disk across
sessions by the artifact cache), then shared by every test that needs them."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

# One thread: the CPU numerics (and the seeds chosen for the tiny models) assume it, and the two
# cores of a CI machine are shared with the notebook kernels.
torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

VARIANT_NAMES = ["e2b", "e4b", "12b", "31b", "26b-a4b"]


@dataclass
class Ported:
    settings: object
    model: object
    ids: list
    prefill: dict
    decode: object
    compiled: object

    @property
    def runtime(self):
        return self.compiled.runtime


class _Ports:
    """Lazily compiled random-weight tiny models, one per (variant, model source)."""

    def __init__(self):
        self._done: dict[tuple, Ported] = {}

    def get(self, variant: str, model: str = "random", **overrides) -> Ported:
        from gemma4lib.port import PortSettings, build_graphs, compile_graphs, load_model, prompt_ids

        key = (variant, model, tuple(sorted(overrides.items())))
        if key not in self._done:
            settings = PortSettings(variant=variant, model=model, **overrides)
            loaded = load_model(settings)
            prefill, decode = build_graphs(loaded, settings)
            compiled = compile_graphs(loaded, settings, graphs=(prefill, decode))
            self._done[key] = Ported(settings, loaded, prompt_ids(loaded, settings), prefill, decode, compiled)
        return self._done[key]


@pytest.fixture(scope="session")
def ports() -> _Ports:
    return _Ports()
