"""Shared fixtures. Compiled graphs are built once per test session, then shared by every test
that needs them.

The artifact cache of a test session is a fresh temporary folder, removed at the end, unless the
caller sets GEMMA4LIB_CACHE: tests never read or fill the user's ~/.cache/gemma4lib.
`scripts/run_tests.sh` and `.ci/run` set it to .cache/gemma4lib-tests in the repository
(gitignored), so a second run there reuses the compiles of the first."""

from __future__ import annotations

import base64
import gc
import io
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from gemma4lib.models.shapes import COLOURS, SHAPES
from gemma4lib.models.variants import VARIANTS
from gemma4lib.recipes import cores

# One thread: the CPU numerics (and the seeds chosen for the tiny models) assume it, and the two
# cores of a CI machine are shared with the notebook kernels.
torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

VARIANT_NAMES = list(VARIANTS)  # the variants table, in its order
# The variant notebooks' smoke shapes (their parameters cell; tests/test_notebooks.py checks they agree):
# the headless run compiles every variant's prefill and decode at these, so a test compiling a variant at
# them shares those programs through the artifact cache instead of compiling its own.
SMOKE_SHAPES = {"context_length": 192, "prefill_buckets": (128,)}

_SESSION_CACHE: str | None = None


def pytest_configure(config):
    """Before collection: the session's artifact cache (subprocesses, such as the papermill kernels
    of tests/test_notebooks.py, inherit it through the environment)."""
    global _SESSION_CACHE
    if not os.environ.get("GEMMA4LIB_CACHE"):
        _SESSION_CACHE = tempfile.mkdtemp(prefix="gemma4lib-test-cache-")
        os.environ["GEMMA4LIB_CACHE"] = _SESSION_CACHE


# The longest file first: under `--dist loadfile` (scripts/run_tests.sh) a worker takes a whole file,
# and the notebooks' headless run (the main job, minutes) started last would finish alone at the end.
FIRST = ("test_notebooks.py",)


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.path.name not in FIRST)  # stable: the rest keep their order


def pytest_unconfigure(config):
    global _SESSION_CACHE
    if _SESSION_CACHE is not None:
        if os.environ.get("GEMMA4LIB_CACHE") == _SESSION_CACHE:
            del os.environ["GEMMA4LIB_CACHE"]
        shutil.rmtree(_SESSION_CACHE, ignore_errors=True)
        _SESSION_CACHE = None


@dataclass
class Ported:
    settings: object
    model: object
    ids: list
    graphs: object  # device.build.GraphSet
    compiled: object

    @property
    def prefill(self) -> dict:
        return self.graphs.prefill

    @property
    def decode(self):
        return self.graphs.decode

    @property
    def runtime(self):
        """The generation engine over the compiled graphs."""
        return self.compiled.runtime


class _Ports:
    """Lazily compiled random-weight tiny models, one per (variant, model source)."""

    def __init__(self):
        self._done: dict[tuple, Ported] = {}

    def get(self, variant: str, model: str = "random", **overrides) -> Ported:
        from gemma4lib.port import PortSettings, compile_graphs, load_model, prompt_ids

        key = (variant, model, tuple(sorted(overrides.items())))
        if key not in self._done:
            settings = PortSettings(variant=variant, model=model, **overrides)
            loaded = load_model(settings)
            compiled = compile_graphs(loaded, settings)
            self._done[key] = Ported(settings, loaded, prompt_ids(loaded, settings), compiled.graphs, compiled)
        return self._done[key]


@pytest.fixture(scope="session")
def ports() -> _Ports:
    return _Ports()


# ---- helpers the tests share ------------------------------------------------------------------
def wait_healthy(url: str, timeout_s: float = 60.0) -> None:
    """Until a server started in a child process answers `/health` with 200 (or `timeout_s` passes:
    the test's own requests then fail and say why)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.1)


def data_url(image: Any, kind: str = "png") -> str:
    """A PIL image (or a path to an image file) as the data URL a client sends."""
    if isinstance(image, (str, Path)):
        raw = Path(image).read_bytes()
        kind = Path(image).suffix.lstrip(".").lower().replace("jpg", "jpeg") or kind
    else:
        buffer = io.BytesIO()
        image.save(buffer, format=kind.upper())
        raw = buffer.getvalue()
    return f"data:image/{kind};base64,{base64.b64encode(raw).decode('ascii')}"


def held_cores() -> list[tuple[int, int]]:
    """(first, last) NeuronCore of every live claim (`recipes.cores`)."""
    return [(c.cores.start, c.cores.stop - 1) for c in cores._live()]


def release_core_claims() -> None:
    """Forget every NeuronCore claim, so a test starts and ends with none (one outlives a failed test
    otherwise). It frees no device memory: the claimed models go when nothing references them."""
    cores._CLAIMS.clear()
    gc.collect()


def parse_answer(text: str) -> tuple[str | None, str | None]:
    """The colour and shape an answer names (None where it names none)."""
    words = text.lower().replace(".", " ").split()
    colour = next((w for w in words if w in COLOURS), None)
    shape = next((w for w in words if w in SHAPES), None)
    return colour, shape
