"""Issue 20's findings, one row each: the artifact cache's faults, the loader's and the runner's.

`CASES` is the table (the same shape as tests/test_bad_inputs.py): the call that triggers the
fault, the exact error type (or a logged WARNING), a fragment of the message that says what to do,
and an `after` check that the next run is correct. Everything here is fast: fake builds on a
`tmp_path` cache, a tiny released-layout folder, the committed notebooks' parameters cells. The
program key's independence of the hash seed (finding 1) needs real exports in fresh processes:
tests/test_program_key.py.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gemma4lib.cache import artifacts
from gemma4lib.cache import lock as cache_lock
from gemma4lib.cache.artifacts import ArtifactCache
from gemma4lib.errors import (
    CacheLocationError,
    CacheLockError,
    CacheSpaceError,
    CheckpointError,
    MissingChatTemplateError,
)
from gemma4lib.models.checkpoint import load_checkpoint
from gemma4lib.models.variants import get_variant
from gemma4lib.runtime import encode_prompt
from papermill_runs import run as pm_run
from papermill_runs.parameters import check_overrides

KEY = "cd" * 32
LOGGED = "logged WARNING"
NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


@dataclass
class Ctx:
    tmp: Path
    mp: pytest.MonkeyPatch
    calls: list | None = None


@dataclass(frozen=True)
class Case:
    name: str
    trigger: Callable[[Ctx], Any]
    error: type[BaseException] | str
    fragment: str
    after: Callable[[Ctx], None] | None = None


def cache(ctx: Ctx, **kwargs) -> ArtifactCache:
    return ArtifactCache(ctx.tmp / "cache", **kwargs)


def good_build(folder: Path) -> dict:
    (folder / "graph.pt2").write_bytes(b"PT2" + bytes(range(256)) * 16)
    return {"recipe": "fake"}


def counting_build(ctx: Ctx) -> Callable[[Path], dict]:
    ctx.calls = []

    def build(folder: Path) -> dict:
        ctx.calls.append(folder)
        return good_build(folder)

    return build


def never_build(folder: Path) -> dict:
    raise AssertionError("the build ran although the error should have come first")


def rebuilt_once_then_hits(ctx: Ctx) -> None:
    assert ctx.calls is not None and len(ctx.calls) == 1, "the unreadable entry must be rebuilt exactly once"
    c = cache(ctx)
    assert c.lookup(KEY) is not None and c.get_or_build(KEY, never_build).hit


# ---- 2: an unreadable entry -----------------------------------------------------------------------


def damaged_meta(ctx: Ctx, damage: Callable[[Path], None]) -> None:
    c = cache(ctx)
    c.get_or_build(KEY, good_build)
    damage(c.entry_dir(KEY))
    assert c.lookup(KEY) is None  # a lookup never raises on a bad entry
    assert not c.get_or_build(KEY, counting_build(ctx)).hit


def non_utf8_meta(folder: Path) -> None:
    (folder / artifacts.META).write_bytes(b'{"key": "\xff\xfe\xfa"}')


def non_json_meta(folder: Path) -> None:
    (folder / artifacts.META).write_text("[1, 2, 3]")


def missing_file(folder: Path) -> None:
    (folder / "graph.pt2").unlink()


# ---- 3: where the cache lives --------------------------------------------------------------------


def env_names_a_file(ctx: Ctx) -> None:
    target = ctx.tmp / "not-a-folder"
    target.write_text("a regular file")
    ctx.mp.setenv("GEMMA4LIB_CACHE", str(target))
    ArtifactCache().get_or_build(KEY, never_build)


def home_unusable(ctx: Ctx) -> None:
    blocker = ctx.tmp / "home-is-a-file"
    blocker.write_text("x")
    ctx.mp.delenv("GEMMA4LIB_CACHE", raising=False)
    ctx.mp.setenv("HOME", str(blocker / "home"))  # ~/.cache cannot be made under a file
    ArtifactCache().get_or_build(KEY, never_build)


def read_only(ctx: Ctx, root: Path) -> None:
    """Every write under `root` fails as on a read-only mount (the suite may run as root, whom
    permission bits do not stop)."""
    real_open, real_mkstemp, real_mkdir = os.open, artifacts.tempfile.mkstemp, Path.mkdir

    def guarded(path) -> None:
        if str(Path(path).resolve()).startswith(str(root.resolve())):
            raise OSError(errno.EROFS, "Read-only file system", str(path))

    def fake_open(path, flags, *args, **kwargs):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            guarded(path)
        return real_open(path, flags, *args, **kwargs)

    def fake_mkstemp(*args, dir=None, **kwargs):
        guarded(dir)
        return real_mkstemp(*args, dir=dir, **kwargs)

    def fake_mkdir(self, *args, **kwargs):
        if not self.exists():
            guarded(self)
        return real_mkdir(self, *args, **kwargs)

    ctx.mp.setattr(os, "open", fake_open)
    ctx.mp.setattr(artifacts.tempfile, "mkstemp", fake_mkstemp)
    ctx.mp.setattr(Path, "mkdir", fake_mkdir)


def cold_read_only(ctx: Ctx) -> None:
    c = cache(ctx)
    c.root.mkdir(parents=True)
    read_only(ctx, c.root)
    c.get_or_build(KEY, never_build)


# ---- 4: a full disk ------------------------------------------------------------------------------


def statvfs_with(ctx: Ctx, free_bytes: int, free_inodes: int = 10**6) -> None:
    real = os.statvfs

    class Fake:
        def __init__(self, st):
            self.f_frsize, self.f_files = 4096, st.f_files or 10**6
            self.f_bavail, self.f_favail = free_bytes // 4096, free_inodes

    ctx.mp.setattr(os, "statvfs", lambda path: Fake(real(path)))


def disk_full_before_compile(ctx: Ctx) -> None:
    statvfs_with(ctx, free_bytes=10 << 20)
    cache(ctx).get_or_build(KEY, never_build, need_bytes=200 << 20)


def no_inodes_before_compile(ctx: Ctx) -> None:
    statvfs_with(ctx, free_bytes=100 << 30, free_inodes=3)
    cache(ctx).get_or_build(KEY, never_build)


def disk_fills_while_writing(ctx: Ctx) -> None:
    def build(folder: Path) -> dict:
        (folder / "graph.pt2").write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    cache(ctx).get_or_build(KEY, build)


def nothing_published(ctx: Ctx) -> None:
    c = cache(ctx)
    assert c.lookup(KEY) is None and not list(c.root.glob(".building-*"))
    ctx.mp.undo()
    assert not c.get_or_build(KEY, good_build).hit and c.get_or_build(KEY, never_build).hit


# ---- 5: a lock whose holder is stopped or gone ---------------------------------------------------

HOLDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from gemma4lib.cache.artifacts import ArtifactCache
    def build(folder):
        print("holding", flush=True)
        time.sleep(float(sys.argv[3]))
        (folder / "graph.pt2").write_bytes(b"built by the holder")
    ArtifactCache(sys.argv[1]).get_or_build(sys.argv[2], build)
    """
)


def stopped_holder(ctx: Ctx) -> None:
    root = ctx.tmp / "cache"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(root), KEY, "600"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        holder.send_signal(signal.SIGSTOP)  # Ctrl-Z
        ArtifactCache(root, lock_wait_s=2.0).get_or_build(KEY, never_build)
    finally:
        holder.send_signal(signal.SIGCONT)
        holder.kill()
        holder.wait()


def dead_holder_lock_is_broken(ctx: Ctx, monkeypatch) -> None:
    """The recorded holder is gone but its lock is still held (the descriptor leaked into a
    surviving child): the waiter breaks it after the grace period and builds."""
    import fcntl

    root = ctx.tmp / "cache"
    root.mkdir()
    lock_file = root / f"{KEY[:24]}.lock"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock_file.write_text(json.dumps({"pid": dead.pid, "host": os.uname().nodename, "since": "earlier"}))
    leaked = os.open(lock_file, os.O_RDWR)
    fcntl.flock(leaked, fcntl.LOCK_EX)  # held by this open file description, as by a leaked child
    monkeypatch.setattr(cache_lock, "DEAD_GRACE_S", 0.5)
    try:
        entry = ArtifactCache(root, lock_wait_s=20).get_or_build(KEY, counting_build(ctx))
    finally:
        os.close(leaked)
    assert not entry.hit and len(ctx.calls) == 1


# ---- 6: the cache folder removed during a compile -------------------------------------------------


def folder_removed_mid_compile(ctx: Ctx) -> None:
    ctx.calls = []

    def build(folder: Path) -> dict:
        ctx.calls.append(folder)
        if len(ctx.calls) == 1:
            shutil.rmtree(ctx.tmp / "cache")  # `rm -rf ~/.cache/gemma4lib` from another shell
            raise RuntimeError(f"Parent directory {folder} does not exist.")  # what torch's writer says
        return good_build(folder)

    entry = cache(ctx).get_or_build(KEY, build)
    assert not entry.hit and len(ctx.calls) == 2 and entry.file("graph.pt2").is_file()


# ---- 7, 8: the loader ----------------------------------------------------------------------------

_RELEASED: dict[str, Path] = {}


def released_copy(ctx: Ctx) -> Path:
    """A copy of a released-layout E2B folder (the trained tiny decoder), built once per session."""
    from gemma4lab.models.released import save_released_layout
    from gemma4lib.models.trained import load_trained

    if "e2b" not in _RELEASED:
        trained = load_trained("e2b")
        base = ctx.tmp.parent / "released-e2b-base"  # the session's pytest base folder
        shutil.rmtree(base, ignore_errors=True)
        _RELEASED["e2b"] = save_released_layout("e2b", base, trained.lm, trained.tokenizer)
    folder = ctx.tmp / "released"
    shutil.copytree(_RELEASED["e2b"], folder)
    return folder


def truncated_weights(ctx: Ctx) -> None:
    folder = released_copy(ctx)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    load_checkpoint(get_variant("e2b"), str(folder), dtype=__import__("torch").float32)


def no_chat_template(ctx: Ctx) -> None:
    folder = released_copy(ctx)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config = folder / "tokenizer_config.json"
    data = json.loads(config.read_text())
    data.pop("chat_template", None)
    config.write_text(json.dumps(data))
    load_checkpoint(get_variant("e2b"), str(folder), dtype=__import__("torch").float32)


def chat_prompt_without_template(ctx: Ctx) -> None:
    from gemma4lib.models.trained import load_trained

    tokenizer = load_trained("e2b").tokenizer
    tokenizer.chat_template = None
    encode_prompt(tokenizer, "What is the capital of France?")


# ---- 9: papermill parameters ---------------------------------------------------------------------


def misspelt_parameter(ctx: Ctx) -> None:
    check_overrides(pm_run.parse_overrides(["max_new_token=16"]), [NOTEBOOKS / "01_e2b.ipynb"])


CASES = [
    Case(
        "2: meta.json not UTF-8", lambda c: damaged_meta(c, non_utf8_meta), LOGGED, "rebuilding", rebuilt_once_then_hits
    ),
    Case(
        "2: meta.json not an object",
        lambda c: damaged_meta(c, non_json_meta),
        LOGGED,
        "rebuilding",
        rebuilt_once_then_hits,
    ),
    Case(
        "2: artifact file missing",
        lambda c: damaged_meta(c, missing_file),
        LOGGED,
        "rebuilding",
        rebuilt_once_then_hits,
    ),
    Case("3: GEMMA4LIB_CACHE names a file", env_names_a_file, CacheLocationError, "set GEMMA4LIB_CACHE to a writable"),
    Case(
        "3: HOME unusable, no GEMMA4LIB_CACHE", home_unusable, CacheLocationError, "set GEMMA4LIB_CACHE to a writable"
    ),
    Case("3: cold read-only cache", cold_read_only, CacheLocationError, "cannot be written (Read-only file system)"),
    Case("4: too little space before the compile", disk_full_before_compile, CacheSpaceError, "needs about"),
    Case("4: no inodes left", no_inodes_before_compile, CacheSpaceError, "no free inodes"),
    Case(
        "4: disk fills while writing",
        disk_fills_while_writing,
        CacheSpaceError,
        "nothing was published",
        nothing_published,
    ),
    Case("5: holder stopped (Ctrl-Z)", stopped_holder, CacheLockError, "(stopped)"),
    Case("7: truncated model.safetensors", truncated_weights, CheckpointError, "model.safetensors of"),
    Case("8: no chat_template.jinja", no_chat_template, MissingChatTemplateError, "would be sent as plain text"),
    Case(
        "8: chat prompt, tokenizer without template",
        chat_prompt_without_template,
        MissingChatTemplateError,
        "no chat template",
    ),
    Case("9: misspelt -p name", misspelt_parameter, SystemExit, "did you mean 'max_new_tokens'?"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_fault_gets_a_clear_error_and_the_next_run_works(case: Case, tmp_path, monkeypatch, caplog):
    ctx = Ctx(tmp_path, monkeypatch)
    if case.error == LOGGED:
        with caplog.at_level(logging.WARNING):
            case.trigger(ctx)
        records = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert records, "no WARNING was logged"
        message = "\n".join(r.getMessage() for r in records)
    else:
        with pytest.raises(case.error) as info:
            case.trigger(ctx)
        assert type(info.value) is case.error, f"{type(info.value).__name__}: {info.value}"
        message = str(info.value)
    assert case.fragment in message, message
    if case.after:
        case.after(ctx)


# ---- rows whose outcome is a correct run, not an error -------------------------------------------


def test_warm_read_only_cache_serves_hits_without_writing(tmp_path, monkeypatch):
    ctx = Ctx(tmp_path, monkeypatch)
    c = cache(ctx)
    c.get_or_build(KEY, good_build)
    read_only(ctx, c.root)
    entry = c.get_or_build(KEY, never_build)
    assert entry.hit and entry.file("graph.pt2").is_file()


def test_a_waiter_reports_the_holder_then_gets_the_entry(tmp_path, monkeypatch, caplog):
    """5: while another run compiles the key, the waiter logs who holds it (pid, since when); when
    the holder finishes, the waiter loads its entry without compiling."""
    monkeypatch.setattr(cache_lock, "REPORT_EVERY_S", 0.2)
    root = tmp_path / "cache"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(root), KEY, "1.5"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        with caplog.at_level(logging.WARNING):
            lock_path = root / f"{KEY[:24]}.lock"
            with cache_lock.build_lock(lock_path, wait_s=30, report_after_s=0.1):
                pass
        entry = ArtifactCache(root).get_or_build(KEY, never_build)
    finally:
        holder.kill()
        holder.wait()
    assert entry.hit
    waiting = [r.getMessage() for r in caplog.records if "waiting for the build lock" in r.getMessage()]
    assert waiting and f"pid {holder.pid}" in waiting[0] and "(running)" in waiting[0] and "since" in waiting[0]


def test_a_dead_holders_lock_is_broken(tmp_path, monkeypatch, caplog):
    with caplog.at_level(logging.WARNING):
        dead_holder_lock_is_broken(Ctx(tmp_path, monkeypatch), monkeypatch)
    assert any("breaking the build lock" in r.getMessage() for r in caplog.records)


def test_cache_folder_removed_during_a_compile_is_rebuilt(tmp_path, monkeypatch, caplog):
    with caplog.at_level(logging.WARNING):
        folder_removed_mid_compile(Ctx(tmp_path, monkeypatch))
    assert any("was removed while compiling" in r.getMessage() for r in caplog.records)


def test_scalar_for_a_list_parameter_is_a_one_element_list():
    """9: `-p prefill_buckets=64` is taken as [64] (said in a note), like PortSettings does."""
    overrides, notes = check_overrides(pm_run.parse_overrides(["prefill_buckets=64"]), [NOTEBOOKS / "01_e2b.ipynb"])
    assert overrides == {"prefill_buckets": [64]} and "one-element list" in notes[0]
    same, none = check_overrides({"prefill_buckets": [32, 64]}, [NOTEBOOKS / "01_e2b.ipynb"])
    assert same == {"prefill_buckets": [32, 64]} and none == []


def test_every_notebook_parameter_is_seen():
    """papermill's own parser skips a line whose comment holds quotes (01_e2b's `neuron_recipe`), so
    `-p neuron_recipe=trace` was silently dropped; the ast reader sees every assignment."""
    import re

    import papermill as pm

    from papermill_runs.parameters import declared_parameters

    for notebook in sorted(NOTEBOOKS.glob("0*.ipynb")):
        names = set(declared_parameters(notebook))
        cell = next(
            c for c in json.loads(notebook.read_text())["cells"] if "parameters" in c["metadata"].get("tags", [])
        )
        assigned = set(re.findall(r"^(\w+)\s*(?::[^=]+)?=", "".join(cell["source"]), re.M))
        assert names == assigned and set(pm.inspect_notebook(str(notebook))) <= names, notebook.name
    assert "neuron_recipe" in declared_parameters(NOTEBOOKS / "01_e2b.ipynb")
    assert check_overrides({"neuron_recipe": "trace"}, [NOTEBOOKS / "01_e2b.ipynb"])[0] == {"neuron_recipe": "trace"}


def test_the_released_folder_with_its_template_still_loads(tmp_path, monkeypatch):
    """The rows above are faults of a folder that otherwise loads: the intact copy ports its chat."""
    import torch

    model = load_checkpoint(get_variant("e2b"), str(released_copy(Ctx(tmp_path, monkeypatch))), dtype=torch.float32)
    ids = encode_prompt(model.tokenizer, "What is the capital of France?")
    assert ids[:2] == [2, 105]  # <bos><|turn>: the chat format, not plain text


def test_lock_wait_limit_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(cache_lock.LOCK_WAIT_ENV, "12.5")
    assert cache_lock.lock_wait_limit() == 12.5
    monkeypatch.setenv(cache_lock.LOCK_WAIT_ENV, "soon")
    with pytest.raises(CacheLocationError, match="number of seconds"):
        cache_lock.lock_wait_limit()
    assert cache_lock.process_state(os.getpid()) == "running"
