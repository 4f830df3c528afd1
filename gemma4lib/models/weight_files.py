"""Weights files that open: a truncated or unreadable `*.safetensors` named before the load.

safetensors checks at open that the header is whole and that the data covers every tensor, so
opening each file (its header only; nothing is read into memory) finds a cut download in
milliseconds, where transformers would fail later with a bare `SafetensorError` naming no file.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import CheckpointError


def check_weight_files(folder: Path, checkpoint: str | None = None) -> None:
    """Raise `CheckpointError` naming the first `*.safetensors` in `folder` that does not open."""
    from safetensors import SafetensorError, safe_open

    for file in sorted(Path(folder).glob("*.safetensors")):
        try:
            with safe_open(str(file), "pt") as handle:
                handle.keys()
        except (SafetensorError, OSError) as exc:
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            source = f" of {checkpoint!r}" if checkpoint else ""
            raise CheckpointError(
                f"the weights file {file}{source} is truncated or unreadable ({reason}; {file.stat().st_size:,} "
                f"bytes on disk); the download was cut or the file damaged: delete it and download the checkpoint "
                f"again (e.g. `hf download <hub id> --force-download`), or copy it again"
            ) from None
