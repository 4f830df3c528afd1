"""The compiled-artifact cache: one folder per key, written atomically, checked before use.

A key is the sha256 of everything that changes the compiled program (`backends.program_key`). An
entry is a folder of the artifact files and a `meta.json` with their checksums, built in a temporary
sibling folder and renamed into place, so a compile killed half-way never leaves an entry a later run
would load; an unreadable entry is discarded with a warning and rebuilt once. Reading takes no lock
and writes nothing (a warm read-only cache serves its hits); only a build locks its key (`lock`).
Before a build the folder must be writable and hold the package's estimated size (`CacheLocationError`,
`CacheSpaceError`, naming GEMMA4LIB_CACHE): no silent uncached fallback, because an uncached Neuron
port recompiles for an hour on every run. A bundle (`cache.bundle`) is a read-only layer in front.
"""

from __future__ import annotations

import contextlib
import errno
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

from ..errors import ArtifactError, CacheLocationError, CacheSpaceError
from .lock import build_lock

log = logging.getLogger(__name__)

META = "meta.json"
CACHE_ENV = "GEMMA4LIB_CACHE"
# What a build needs beyond its estimate (the compiler's own files, meta.json), and the inodes.
SPACE_MARGIN_BYTES = 64 << 20
MIN_FREE_INODES = 64
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def default_cache_dir() -> Path:
    """`$GEMMA4LIB_CACHE`, else `~/.cache/gemma4lib` (outside the repository, shared by notebooks and tests)."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "gemma4lib")


def _fix_hint() -> str:
    return (
        f"set {CACHE_ENV} to a writable folder with room (e.g. `export {CACHE_ENV}=/tmp/gemma4lib-cache`; "
        f"in Python PortSettings(cache_dir=...)), or fix the folder"
    )


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


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
    """The cache at `root` (default: `default_cache_dir()`); `layers` are read-only folders of
    entries looked up first (an exported bundle); `refuse_build(key)`, when given, is the error
    raised instead of building a missing key (a run from a bundle never compiles)."""

    def __init__(
        self,
        root: Path | str | None = None,
        *,
        layers: tuple[Path, ...] = (),
        refuse_build: Callable[[str], Exception] | None = None,
        lock_wait_s: float | None = None,
    ):
        self.origin = "cache_dir" if root else (CACHE_ENV if os.environ.get(CACHE_ENV) else "the default location")
        self.root = Path(root) if root else default_cache_dir()
        self.layers = tuple(Path(p) for p in layers)
        self.refuse_build = refuse_build
        self.lock_wait_s = lock_wait_s

    def entry_dir(self, key: str) -> Path:
        return self.root / key[:24]

    # ---- the location ------------------------------------------------------------------------
    def ensure_writable(self) -> None:
        """The cache folder exists (made now if needed) and can take new files; else
        `CacheLocationError` saying so, naming GEMMA4LIB_CACHE."""
        where = f"the artifact cache {self.root} ({self.origin})"
        if self.root.exists() and not self.root.is_dir():
            raise CacheLocationError(f"{where} is a file, not a folder; {_fix_hint()}")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(dir=self.root, prefix=".probe-")
            os.close(fd)
            os.unlink(probe)
        except FileExistsError:
            raise CacheLocationError(f"{where}: a parent of it is a file, not a folder; {_fix_hint()}") from None
        except OSError as exc:
            if exc.errno in _NO_SPACE:
                raise CacheSpaceError(f"{where} is on a full disk ({exc.strerror}); {_fix_hint()}") from None
            raise CacheLocationError(
                f"{where} cannot be written ({exc.strerror or exc}); a compile has nowhere to go; {_fix_hint()}"
            ) from None

    def check_space(self, need_bytes: int) -> None:
        """Free space and inodes for a package of about `need_bytes`, before it is compiled."""
        stat = os.statvfs(self.root)
        free = stat.f_bavail * stat.f_frsize
        wanted = int(need_bytes) + SPACE_MARGIN_BYTES
        if free < wanted:
            raise CacheSpaceError(
                f"the artifact cache {self.root} ({self.origin}) has {_gib(free)} free; the package about to be "
                f"compiled needs about {_gib(wanted)} (estimated from the weights); free space there, or {_fix_hint()}"
            )
        if stat.f_files and stat.f_favail < MIN_FREE_INODES:
            raise CacheSpaceError(
                f"the file system of the artifact cache {self.root} has no free inodes left ({stat.f_favail}); "
                f"delete files there, or {_fix_hint()}"
            )

    @contextlib.contextmanager
    def _lock(self, key: str) -> Iterator[None]:
        self.ensure_writable()
        with build_lock(self.root / f"{key[:24]}.lock", self.lock_wait_s):
            yield

    # ---- reading -----------------------------------------------------------------------------
    def verify(self, key: str, path: Path | None = None) -> dict[str, Any]:
        """Return the entry's metadata if complete and intact; raise ArtifactError otherwise."""
        path = path or self.entry_dir(key)
        meta_file = path / META
        if not meta_file.is_file():
            raise ArtifactError(
                f"no complete cache entry at {path} (never built, or its build was interrupted); "
                f"get_or_build compiles it again"
            )
        try:
            meta = json.loads(meta_file.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, ValueError, OSError) as exc:  # torn, not JSON, not UTF-8, unreadable
            raise ArtifactError(f"unreadable {meta_file}: {type(exc).__name__}: {exc}") from None
        if not isinstance(meta, dict) or not isinstance(meta.get("files", {}), dict):
            raise ArtifactError(f"{meta_file} is not a cache entry's metadata (a JSON object with 'files')")
        if meta.get("key") != key:
            raise ArtifactError(f"{meta_file} belongs to another key")
        for name, digest in meta.get("files", {}).items():
            file = path / name
            try:
                intact = file.is_file() and sha256_file(file) == digest
            except OSError:
                intact = False
            if not intact:
                raise ArtifactError(f"cached artifact {file} is missing or corrupt (checksum mismatch)")
        return meta

    def _layer_entry(self, key: str) -> CacheEntry | None:
        for layer in self.layers:
            path = layer / key[:24]
            if path.exists():
                return CacheEntry(key, path, self.verify(key, path), hit=True)  # a bad bundle entry is an error
        return None

    def lookup(self, key: str) -> CacheEntry | None:
        """The intact entry of `key` (bundle layers first), or None; takes no lock, writes nothing."""
        entry = self._layer_entry(key)
        if entry is not None:
            return entry
        try:
            return CacheEntry(key, self.entry_dir(key), self.verify(key), hit=True)
        except ArtifactError:
            return None

    # ---- building ----------------------------------------------------------------------------
    def get_or_build(
        self,
        key: str,
        build: Callable[[Path], dict[str, Any]],
        describe: dict[str, Any] | None = None,
        need_bytes: int = 0,
    ) -> CacheEntry:
        """Load the entry for `key`, or call `build(tmp_dir)` to write its files and publish it.

        `build` writes artifact files into the folder it is given and returns extra metadata.
        `need_bytes` estimates what it writes: checked against the free space before it runs.
        """
        found = self.lookup(key)  # no lock, no write: a warm read-only cache serves hits
        if found is not None:
            return found
        if self.refuse_build is not None:
            raise self.refuse_build(key)
        with self._lock(key):
            path = self.entry_dir(key)
            if path.exists():
                try:
                    return CacheEntry(key, path, self.verify(key), hit=True)  # built by the run we waited for
                except ArtifactError as exc:
                    log.warning("discarding cache entry %s: %s; rebuilding", path.name, exc)
                    shutil.rmtree(path, ignore_errors=True)
            for stale in self.root.glob(f".building-{key[:12]}-*"):  # left by a builder killed outright
                log.info("removing %s, left by an interrupted build", stale.name)
                shutil.rmtree(stale, ignore_errors=True)
            self.check_space(need_bytes)
            try:
                return self._build(key, build, describe)
            except ArtifactError as exc:
                if self.root.is_dir():
                    raise
                log.warning("%s; compiling it once more", exc)
                self.ensure_writable()
                return self._build(key, build, describe)

    def _build(self, key: str, build: Callable[[Path], dict[str, Any]], describe: dict[str, Any] | None) -> CacheEntry:
        path = self.entry_dir(key)
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
        except BaseException as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(exc, OSError) and exc.errno in _NO_SPACE:
                raise CacheSpaceError(
                    f"the disk of the artifact cache {self.root} filled up while the package was written "
                    f"({exc.strerror}); nothing was published; {_fix_hint()}"
                ) from None
            if isinstance(exc, Exception) and not tmp.parent.is_dir():
                raise ArtifactError(
                    f"the cache folder {self.root} was removed while compiling ({type(exc).__name__}: {exc})"
                ) from None
            raise
        return CacheEntry(key, path, meta, hit=False)

    def clear(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
