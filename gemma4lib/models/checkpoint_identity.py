"""Which checkpoint a model came from, without reading its weights as float32: the digest of its
(file name, file digest) pairs. A hub snapshot's `*.safetensors` link to `blobs/<sha256>` (free); a
plain folder's files are hashed once and the digest remembered in the artifact cache's
`file-digests.json`, keyed by path, size, modification time and inode.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
from pathlib import Path

from ..cache.artifacts import atomic_write_json, default_cache_dir, sha256_file

log = logging.getLogger(__name__)

WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json")
MEMO = "file-digests.json"
_BLOB = re.compile(r"^[0-9a-f]{64}$")


def _memo_file() -> Path:
    return default_cache_dir() / MEMO


def _read_memo(path: Path) -> dict[str, str]:
    try:
        memo = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return memo if isinstance(memo, dict) else {}


def file_digest(path: Path, memo: dict[str, str] | None = None) -> str:
    """sha256 of one weights file: the hub blob's own name when it is one, else remembered or computed."""
    target = Path(os.path.realpath(path))
    if _BLOB.match(target.name) and target.parent.name == "blobs":
        return target.name
    stat = target.stat()
    stamp = f"{target}:{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ino}"
    if memo is not None and stamp in memo:
        return memo[stamp]
    digest = sha256_file(target)
    if memo is not None:
        memo[stamp] = digest
    return digest


def folder_identity(folder: Path) -> str:
    """sha256 over the (name, digest) of every weights file in `folder`."""
    memo_path = _memo_file()
    memo = _read_memo(memo_path)
    before = len(memo)
    files = sorted({p for pattern in WEIGHT_PATTERNS for p in Path(folder).glob(pattern)})
    digest = hashlib.sha256()
    for file in files:
        digest.update(f"{file.name}:{file_digest(file, memo)}\n".encode())
    if len(memo) != before:
        with contextlib.suppress(OSError):  # a read-only cache only loses the memo
            atomic_write_json(memo_path, memo)
    return f"checkpoint-files:{digest.hexdigest()}"
