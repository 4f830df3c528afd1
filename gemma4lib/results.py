"""One JSON file per run: parameters, versions, metrics. Written atomically."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

from .cache.artifacts import atomic_write_json


def result_filename(result: dict[str, Any]) -> str:
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    name = f"{result.get('variant', 'run')}-{result.get('profile', 'x')}-tp{result.get('tp_degree', 1)}-{stamp}"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name) + ".json"


def write_result(result: dict[str, Any], folder: Path, name: str | None = None) -> Path:
    """Write `result` as `folder/name` (default: variant-profile-tp-timestamp.json) and return the path."""
    path = Path(folder) / (name or result_filename(result))
    atomic_write_json(path, result)
    return path


def read_result(path: Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())
