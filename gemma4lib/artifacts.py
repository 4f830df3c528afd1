"""The compiled-artifact cache: one folder per key, written atomically, checked before use.

A key is the sha256 of everything that changes the compiled program: model config, a fingerprint
of the weights baked in, recipe, shapes, compiler settings, and library/torch versions. An entry
is a folder holding the artifact files and `meta.json` with their checksums; it is built in a
temporary sibling folder and renamed into place, so a compile killed half-way never leaves an
entry that a later run would load. A corrupt entry (checksum mismatch) is discarded and rebuilt.
A file lock per key stops two processes from compiling the same key at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ArtifactError

log = logging.getLogger(__name__)

META = "meta.json"


def default_cache_dir() -> Path:
    """`$GEMMA4LIB_CACHE`, else `~/.cache/gemma4lib` (outside the repository, shared by notebooks and tests)."""
    return Path(os.environ.get("GEMMA4LIB_CACHE") or Path.home() / ".cache" / "gemma4lib")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def make_key(parts: dict[str, Any]) -> str:
    """Stable sha256 of a JSON-serialisable description."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def atomic_write_text(path: Path, text: str) -> None:
    """Write via a temporary file in the same folder and rename: readers see old or new, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_json(path: Path, data: Any) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


@dataclass
class CacheEntry:
    key: str
    path: Path
    meta: dict[str, Any]
    hit: bool  # True when loaded from the cache, False when built by this call

    def file(self, name: str) -> Path:
        return self.path / name


class ArtifactCache:
    def __init__(self, root: Path | str | None = None):
        self.root = Path(root) if root else default_cache_dir()

    def entry_dir(self, key: str) -> Path:
        return self.root / key[:24]

    @contextlib.contextmanager
    def _lock(self, key: str) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / f"{key[:24]}.lock", "w") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def verify(self, key: str) -> dict[str, Any]:
        """Return the entry's metadata if complete and intact; raise ArtifactError otherwise."""
        path = self.entry_dir(key)
        meta_file = path / META
        if not meta_file.is_file():
            raise ArtifactError(
                f"no complete cache entry at {path} (never built, or its build was interrupted); "
                f"get_or_build compiles it again"
            )
        try:
            meta = json.loads(meta_file.read_text())
        except json.JSONDecodeError as exc:
            raise ArtifactError(f"unreadable {meta_file}: {exc}") from None
        if meta.get("key") != key:
            raise ArtifactError(f"{meta_file} belongs to another key")
        for name, digest in meta.get("files", {}).items():
            file = path / name
            if not file.is_file() or sha256_file(file) != digest:
                raise ArtifactError(f"cached artifact {file} is missing or corrupt (checksum mismatch)")
        return meta

    def lookup(self, key: str) -> CacheEntry | None:
        try:
            return CacheEntry(key, self.entry_dir(key), self.verify(key), hit=True)
        except ArtifactError:
            return None

    def get_or_build(
        self, key: str, build: Callable[[Path], dict[str, Any]], describe: dict[str, Any] | None = None
    ) -> CacheEntry:
        """Load the entry for `key`, or call `build(tmp_dir)` to write its files and publish it.

        `build` writes artifact files into the folder it is given and returns extra metadata.
        """
        with self._lock(key):
            path = self.entry_dir(key)
            if path.exists():
                try:
                    return CacheEntry(key, path, self.verify(key), hit=True)
                except ArtifactError as exc:
                    log.warning("discarding cache entry %s: %s; rebuilding", path.name, exc)
                    shutil.rmtree(path, ignore_errors=True)
            for stale in self.root.glob(f".building-{key[:12]}-*"):  # left by a builder killed outright
                log.info("removing %s, left by an interrupted build", stale.name)
                shutil.rmtree(stale, ignore_errors=True)
            tmp = Path(tempfile.mkdtemp(dir=self.root, prefix=f".building-{key[:12]}-"))
            try:
                started = time.perf_counter()
                extra = build(tmp) or {}
                files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
                meta = {
                    "key": key,
                    "files": files,
                    "build_s": time.perf_counter() - started,
                    "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "describe": describe or {},
                    **extra,
                }
                atomic_write_json(tmp / META, meta)
                os.replace(tmp, path)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            return CacheEntry(key, path, meta, hit=False)

    def clear(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
