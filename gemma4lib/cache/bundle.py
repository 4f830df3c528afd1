"""A compiled port that travels: a bundle folder of cache entries plus a manifest that says what
they were compiled for.

`python -m gemma4lib export ... --out DIR` writes it; `PortSettings(artifacts=DIR)` runs from it, the
entries a read-only layer in front of the artifact cache: nothing is compiled or written.

    DIR/manifest.json          its builds: the settings and the graphs they build (a drafting port's
                               plain-decode build too, which its benchmark compares against)
    DIR/entries/<key[:24]>/    cache entries as the artifact cache holds them: meta.json with the
                               checksums, and the programs (CPU: AOTInductor `graph.pt2`; inf2: the
                               ModelBuilder `model.pt` with its NEFFs and per-rank `weights/`, or the
                               trace recipe's `model.pt`)

A bundle that does not fit the run (other settings or shapes, package versions, a CPU without the
vector instructions it was built for, another checkpoint's identity) is a `BundleError` naming what
differs, before any device work (`check_settings`, `check_model`). Each graph is still found by its
full cache key, so a change the manifest does not name (the library's graph code, a compiler option)
is a `BundleError` too, never a wrong program.
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..backends.facts import facts as backend_facts
from ..environment import program_versions as environment_versions
from ..errors import BundleError
from ..models.weights_identity import weights_identity
from .artifacts import ArtifactCache

if TYPE_CHECKING:
    from ..models.loading import LoadedModel
    from ..settings import PortSettings

FORMAT = 2
MANIFEST = "manifest.json"
ENTRIES = "entries"
# Settings a compiled program depends on (the rest, e.g. the prompt or max_new_tokens, are run time).
SHAPE_FIELDS = tuple(
    "variant backend tp_degree batch_size draft draft_tokens prefill_buckets"
    " context_length ring_kv decode_experts verify_experts row_prefill".split()
)
FORMAT_FIELDS = ("weights", "neuron_recipe")
# Versions that change a compiled program (`environment.program_versions`: the commit does not).
VERSION_FIELDS = ("torch", "transformers", "python", "gemma4lib", "torch-neuronx", "neuronx-cc", "neuronx-distributed")
CPU_LEVELS = ("DEFAULT", "VSX", "ZVECTOR", "AVX2", "AVX512")  # torch.backends.cpu.get_cpu_capability()


def program_versions() -> dict[str, str]:
    found = environment_versions()
    return {k: str(found[k]) for k in VERSION_FIELDS if k in found}


def machine_facts(backend: str) -> dict[str, Any]:
    """What the compiled code needs from the machine: the CPU's vector level (AOTInductor builds
    for it), or the Neuron instance type."""
    facts: dict[str, Any] = {"processor": platform.machine()}
    if backend_facts(backend).device_bound:  # inf2-only: a NEFF is built for one NeuronCore generation
        from ..inf2.hardware import host_instance_type

        facts["instance_type"] = host_instance_type()
    else:
        facts["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    return facts


def settings_facts(settings: PortSettings) -> dict[str, Any]:
    facts = {name: getattr(settings, name) for name in (*SHAPE_FIELDS, *FORMAT_FIELDS)}
    facts["prefill_buckets"] = list(facts["prefill_buckets"])
    if settings.context_buckets:  # only when set: bundles exported without them still match their runs
        facts["context_buckets"] = list(settings.context_buckets)
    if settings.wants_audio:  # likewise: the audio graph's shape (its clips' frames)
        from ..models.audio import graph_shape

        facts["audio_graph"] = list(graph_shape(settings.audio, settings.variant_spec.unified))
    return facts


def graph_names(settings: PortSettings) -> list[str]:
    """The names `device.build.device_graphs` gives the graphs of `settings` (`GraphSet.named()`),
    known before anything loads: a prefill per bucket (and a one-row prefill per bucket with
    `row_prefill` at batch > 1), then decode, or verify (+ the assistant's draft)."""
    prefill = [f"prefill{b}" for b in settings.prefill_buckets]
    if settings.builds_row_prefill:
        prefill += [f"row_prefill{b}" for b in settings.prefill_buckets]
    media = [n for n, on in (("vision", settings.wants_vision), ("audio", settings.wants_audio)) if on]
    if settings.draft is None:
        return [*prefill, "decode", *media]
    return [*prefill, "verify", *(["draft"] if settings.draft == "assistant" else []), *media]


def build_facts(settings: PortSettings) -> dict[str, Any]:
    """One build of a bundle: the settings its programs were compiled for, and its graphs' names."""
    return {"settings": settings_facts(settings), "graphs": graph_names(settings)}


def read_manifest(folder: Path | str) -> dict[str, Any]:
    """The manifest of the bundle at `folder`; `BundleError` when there is none or it is unreadable."""
    path = Path(folder).expanduser() / MANIFEST
    if not path.is_file():
        raise BundleError(
            f"{Path(folder)} is not a compiled-port bundle (no {MANIFEST}); write one with "
            f"`python -m gemma4lib export --variant <v> --out {folder}`, or drop artifacts= to compile"
        )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError, OSError) as exc:
        raise BundleError(f"{path} is unreadable ({exc}); export the bundle again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise BundleError(
            f"{path} has format {manifest.get('format') if isinstance(manifest, dict) else '?'}, this library "
            f"reads format {FORMAT}; export the bundle again with this version"
        )
    return manifest


def _differences(wanted: dict[str, Any], found: dict[str, Any]) -> list[str]:
    return [
        f"{k}: bundle {wanted.get(k)!r}, this run {found.get(k)!r}" for k in wanted if wanted.get(k) != found.get(k)
    ]


def _cpu_level(name: str | None) -> int:
    return CPU_LEVELS.index(name) if name in CPU_LEVELS else 0


def check_settings(settings: PortSettings) -> dict[str, Any]:
    """Before anything loads: the bundle was compiled for these shapes and formats, with these
    package versions, for this kind of machine. Returns the manifest."""
    folder = settings.artifacts
    manifest = read_manifest(folder)
    fix = "export a bundle for this run (`python -m gemma4lib export ... --out DIR`), or drop artifacts= to compile"
    builds = manifest.get("builds") or [{}]
    wanted = build_facts(settings)
    if not any(build.get("settings") == wanted["settings"] for build in builds):
        own = builds[0]
        differ = _differences(own.get("settings", {}), wanted["settings"])
        missing = [name for name in wanted["graphs"] if name not in own.get("graphs", ())]
        lacks = f"; it has no {', '.join(missing)} graph for this run" if missing else ""
        raise BundleError(f"the bundle {folder} was compiled for other settings ({'; '.join(differ)}){lacks}; {fix}")
    differ = _differences(manifest.get("versions", {}), program_versions())
    if differ:
        raise BundleError(
            f"the bundle {folder} was compiled with other package versions ({'; '.join(differ)}): its programs "
            f"would not load or would differ; install those versions, or {fix}"
        )
    machine = manifest.get("machine", {})
    here = machine_facts(settings.backend)
    if machine.get("processor") != here["processor"]:
        raise BundleError(
            f"the bundle {folder} was built for {machine.get('processor')}, this is {here['processor']}; {fix}"
        )
    if backend_facts(settings.backend).device_bound:  # inf2-only: a NEFF runs on its NeuronCore generation
        family = str(machine.get("instance_type") or "").partition(".")[0]
        if family and family != str(here.get("instance_type") or "").partition(".")[0]:
            raise BundleError(
                f"the bundle {folder} was compiled on {machine.get('instance_type')}, this is "
                f"{here.get('instance_type')}: another instance family (another NeuronCore generation) cannot "
                f"run its NEFFs; compile on this family, or {fix}"
            )
    elif _cpu_level(machine.get("cpu_capability")) > _cpu_level(here["cpu_capability"]):
        raise BundleError(
            f"the bundle {folder} was compiled for {machine.get('cpu_capability')} vector instructions, this CPU has "
            f"{here['cpu_capability']}; {fix}"
        )
    return manifest


def check_model(settings: PortSettings, model: LoadedModel) -> None:
    """After loading, before device work: the model is the checkpoint the bundle was exported from
    (or its witness). Uses the loader's declared identity, no pass over the weights."""
    manifest = read_manifest(settings.artifacts)
    known = {role: block.get("identity") for role, block in manifest.get("models", {}).items()}
    identity = weights_identity(model.lm)
    if identity not in known.values():
        exported = "; ".join(f"{role}: {manifest['models'][role].get('source')}" for role in known)
        raise BundleError(
            f"the bundle {settings.artifacts} was exported from other weights ({exported}), this run loads "
            f"{model.source} (identity {identity[:40]}...); on inf2 the shards and inlined weights would be "
            f"another model's. Export a bundle from this checkpoint, or point checkpoint= at the exported one"
        )


def cache_for(settings: PortSettings, model: LoadedModel | None = None) -> ArtifactCache:
    """The artifact cache a backend compiles into; with `settings.artifacts` the bundle in front of it,
    building refused (after the model check, when a model is given)."""
    if not getattr(settings, "artifacts", None):
        return ArtifactCache(settings.cache_dir)
    if model is not None:
        check_model(settings, model)
    folder = Path(settings.artifacts).expanduser()

    def refuse(key: str) -> BundleError:
        return BundleError(
            f"the bundle {folder} has no compiled graph for key {key[:24]}: this run's program differs from the "
            f"exported one although the manifest matches (the library's graph code, a compiler option, a graph "
            f"edit); export the bundle again from this version, or drop artifacts= to compile"
        )

    return ArtifactCache(settings.cache_dir, layers=(folder / ENTRIES,), refuse_build=refuse)


def manifest_for(
    builds: list[PortSettings], models: dict[str, LoadedModel], compilers: dict[str, str]
) -> dict[str, Any]:
    """The manifest of a bundle exported from `builds` (the port's settings first; models: role ->
    loaded model)."""
    settings = builds[0]
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "builds": [build_facts(b) for b in builds],
        "profile": settings.profile,
        "compiler": compilers,
        "dtype": {role: str(m.lm_head.weight.dtype) for role, m in models.items()},
        "versions": program_versions(),
        "machine": machine_facts(settings.backend),
        "models": {role: {"source": m.source, "identity": weights_identity(m.lm)} for role, m in models.items()},
    }
    if backend_facts(settings.backend).device_bound:  # inf2-only facts: the SDK set found, the compiler arguments
        from ..recipes import neuron_env

        manifest["sdk"] = {r["package"]: r["found"] for r in neuron_env.check_versions()}
        manifest["compiler_args"] = neuron_env.COMPILER_ARGS
    return manifest
