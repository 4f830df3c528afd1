"""`python -m gemma4lib export`: compile a port once and write it as a bundle (`gemma4lib.cache.bundle`).

The compile runs as `port` would (same backend, same cache: a warm cache makes the export a copy), for
the settings' model (drafting: also the plain decode its benchmark compares against) and its
random-weights witness when the port runs one; the cache entries those graphs used are copied into
`DIR/entries/` and the manifest is written last, so a half-written bundle is never loaded. Nothing
here is backend-specific: inf2's ModelBuilder entries are copied like the CPU's packages.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

from .backends.registry import without_draft
from .cache.artifacts import atomic_write_json
from .cache.bundle import ENTRIES, MANIFEST, manifest_for
from .errors import BundleError
from .port import PortSettings, compile_graphs, load_model, witness_settings

log = logging.getLogger(__name__)


def _entry_paths(info: dict[str, Any]) -> list[Path]:
    """The cache entries a backend reports in `CompiledGraphs.info["artifacts"]` (a dict of graph
    name -> path on CPU, one path on inf2)."""
    found = info.get("artifacts")
    if isinstance(found, dict):
        return [Path(p) for p in found.values()]
    if isinstance(found, str):
        return [Path(found)]
    raise BundleError("this backend reports no cache entries to export (backends cpu and neuron do)")


def _readable(folder: Path) -> None:
    """Entries are private in the cache (mkdtemp, mkstemp: 0700/0600); a bundle is for others to read."""
    folder.chmod(0o755)
    for path in folder.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


def _prepare(out: Path) -> None:
    if out.exists() and any(out.iterdir()) and not (out / MANIFEST).is_file():
        raise BundleError(f"{out} exists and is not a bundle; export into an empty or new folder")
    (out / MANIFEST).unlink(missing_ok=True)  # the manifest goes last: no half bundle is ever loadable
    shutil.rmtree(out / ENTRIES, ignore_errors=True)
    (out / ENTRIES).mkdir(parents=True)


def export_bundle(settings: PortSettings, out: Path | str, progress: bool = False) -> dict[str, Any]:
    """Compile (or load from the cache) every graph a port of `settings` runs and write the bundle at
    `out`; returns the manifest. A drafting port also runs the plain decode (its benchmark's
    comparison): those graphs go in too."""
    if settings.artifacts:
        raise BundleError("export writes a bundle; drop artifacts= (it names a bundle to run from)")
    out = Path(out).expanduser()
    _prepare(out)
    runs = [("model", settings)]
    if settings.draft is not None:
        runs.append(("model", without_draft(settings)))
    if settings.wants_witness:
        runs.append(("witness", witness_settings(settings)))
    models, compilers, entries = {}, {}, {}
    for role, run_settings in runs:
        model = models.get(role) or load_model(run_settings)
        compiled = compile_graphs(model, replace(run_settings, artifacts=None), progress=progress)
        models[role], compilers[role] = model, compiled.compiler
        for path in _entry_paths(compiled.info):
            if path.name not in entries:
                shutil.copytree(path, out / ENTRIES / path.name)
                _readable(out / ENTRIES / path.name)
                entries[path.name] = role
        log.info("%s: %d graphs, compiled in %.1f s", role, len(compiled.cache_hits), compiled.compile_s)
    builds = [run_settings for role, run_settings in runs if role == "model"]
    manifest = {**manifest_for(builds, models, compilers), "entries": entries}
    atomic_write_json(out / MANIFEST, manifest)
    return manifest
