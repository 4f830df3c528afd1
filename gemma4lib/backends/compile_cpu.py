"""The CPU recipe: torch.export the device graph and compile it with AOTInductor.

The result is a loadable package (`graph.pt2`) in the artifact cache, keyed by the exported program's
digest. The K/V are graph inputs the compiled code updates in place, so prefill and decode share one
set of host buffers. Parameters are handed to the package at load time (`load_constants`), the way a
NEFF without inlined weights is loaded with a checkpoint, so one compile serves every model of the
architecture (random, trained, a faulty copy); buffers are folded in, so their values are in the key.

Finding an entry by its program digest needs an export (seconds per graph), so a small index beside
the entries remembers which program key a graph had, keyed by everything the export reads (config,
shapes, the graph's parts, buffers, the modules' attributes, the library's source, the versions): a
graph seen before loads without exporting again, and any change to those misses the index.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from ..cache.artifacts import ArtifactCache, CacheEntry, atomic_write_json, make_key
from ..device.graph import DeviceGraph
from ..device.packed_linear import repack_all
from ..environment import program_versions
from ..models.weights_identity import weights_fingerprint
from .program_key import program_config, program_digest, source_digest

log = logging.getLogger(__name__)

# torch's own export copies its pytree leaf singleton (`LeafSpec`), and the copy trips a deprecation
# that torch raises against itself: nothing in a caller's code can act on it, and in a notebook it is
# the only stderr line of an otherwise clean run. Ignore exactly that message, nothing broader.
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning)

RECIPE = "cpu-aotinductor"
PACKAGE = "graph.pt2"
# Kernel and wrapper C++ at -O1: on a 2-core machine this halves compile time for a few % of
# run time on tiny graphs.
# realize_opcount_threshold 8 (default 30): Inductor lowers a one-query attention matmul on CPU to
# a multiply-and-sum loop and inlines the query's RoPE (cos/sin) into it, recomputing it for every
# K/V slot of every layer; a lower threshold stores the rotated query once. Measured on a 6-layer
# hidden-1024 decode graph at 512 slots: 130-145 -> 59-85 ms per step (docs/ROOFLINE.md).
# joint_graph_constant_folding off: Inductor otherwise computes a few tiny weights (q/k norms) into the
# program at compile time, so a model with other values (the random-weights witness, every fault-lab
# copy) needed a compile of its own; without it every weight is loaded at run time and one compile
# serves them all (measured: no folded parameter left in the E2B decode graph).
# always_keep_tensor_constants: Inductor otherwise inlines any weight of <= 8 values (the layers'
# `layer_scalar`) as literals, and each fixture's values need a program of their own.
# Read-only: AOTInductor writes its own keys into the dict it is given (`aot_inductor.package`), so a
# shared dict would change every later cache key in the process; each compile gets a copy.
DEFAULT_COMPILER_OPTIONS = MappingProxyType(
    {
        "aot_inductor.compile_wrapper_opt_level": "O1",
        "joint_graph_constant_folding": False,
        "always_keep_tensor_constants": True,
        "aot_inductor.package_constants_in_so": False,
        "realize_opcount_threshold": 8,
    }
)


def graph_key(
    graph: DeviceGraph, recipe: str, options: Mapping[str, Any], program: torch.export.ExportedProgram
) -> dict[str, Any]:
    """Everything that changes the compiled program: above all the exported program itself."""
    return {
        "format": 3,  # 3: keyed by the exported program's digest
        "recipe": recipe,
        "program": program_digest(program),
        "config": program_config(graph.model.config),
        "weights": weights_fingerprint(graph),
        "shape": graph.shape.key,
        "graph": graph.key_parts(),
        "options": dict(options),
        "versions": program_versions(),
    }


@dataclass
class CompiledStep:
    """A loaded compiled graph: call it like the DeviceGraph it came from."""

    runner: Any
    entry: CacheEntry
    compile_s: float  # time this call spent compiling (0.0 on a cache hit)
    load_s: float
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def cache_hit(self) -> bool:
        return self.entry.hit

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        return self.runner(*args)


def load_weights(runner: Any, graph: DeviceGraph) -> None:
    """Hand the graph's current parameters to a package compiled without them (shared, not copied).
    Packed copies of linears (`device.packed_linear`) are first re-derived from the current weights."""
    repack_all(graph)
    state = {**dict(graph.named_parameters()), **dict(graph.named_buffers())}
    wanted = runner.get_constant_fqns()
    missing = [name for name in wanted if name not in state]
    if missing:
        raise KeyError(f"compiled graph expects weights the model does not have: {missing[:5]}")
    runner.load_constants({name: state[name].detach() for name in wanted}, check_full_update=True, user_managed=True)


def export_graph(graph: DeviceGraph) -> torch.export.ExportedProgram:
    """Non-strict export: strict mode silently drops the in-place K/V updates (no error, only a
    warning about side effects, and wrong logits)."""
    with torch.no_grad():
        return torch.export.export(graph, graph.example_inputs(), strict=False)


def package_program(program: torch.export.ExportedProgram, package_path: str, options: Mapping[str, Any]) -> str:
    """AOTInductor: compile the exported program to C++ and write it as one loadable package
    (`.pt2`). The notebooks show these lines; `compile_graph` runs them on a cache miss."""
    return torch._inductor.aoti_compile_and_package(program, package_path=package_path, inductor_configs=dict(options))


def load_package(package_path: str, graph: DeviceGraph) -> Any:
    """Load a package and hand it the graph's weights (it was compiled without them), ready to call
    like the graph."""
    runner = torch._inductor.aoti_load_package(package_path)
    load_weights(runner, graph)
    return runner


# The compiled code itself: a few MB for the tiny graphs (measured 3.0-3.4 MB for E2B's two packages
# with ~3 MB of weights), allowed generously.
PACKAGE_CODE_BYTES = 32 << 20


def package_bytes_estimate(graph: DeviceGraph) -> int:
    """What a package of `graph` may take on disk: its weights (an upper bound: most are handed over
    at load time) plus the compiled code; checked against the free space before compiling."""
    state = {**dict(graph.named_parameters()), **dict(graph.named_buffers())}
    return sum(t.numel() * t.element_size() for t in state.values()) + PACKAGE_CODE_BYTES


def _folded_digest(graph: DeviceGraph, names: list[str]) -> str:
    """sha256 of the values of parameters the compiler folded into the program."""
    params = dict(graph.named_parameters())
    digest = hashlib.sha256()
    for name in sorted(names):
        digest.update(name.encode())
        digest.update(params[name].detach().reshape(-1).float().contiguous().numpy().tobytes())
    return digest.hexdigest()


def cache_package(
    graph: DeviceGraph,
    program: torch.export.ExportedProgram,
    cache: ArtifactCache,
    options: Mapping[str, Any],
    compile_package: Callable[[torch.export.ExportedProgram, str], Any],
    export_s: float = 0.0,
) -> CacheEntry:
    """The artifact-cache entry of `program`'s package, keyed by `graph_key`; on a miss
    `compile_package(program, package_path)` writes it (the notebooks pass AOTInductor's own call).
    Parameters Inductor folds into the program (tiny ones, an 8-wide q_norm weight) are recorded with
    the artifact, so a model whose folded values differ gets its own, never the first model's values."""
    parts = graph_key(graph, RECIPE, options, program)

    def build(folder: Path) -> dict[str, Any]:
        started = time.perf_counter()
        package = str(folder / PACKAGE)
        compile_package(program, package)
        loadable = set(torch._inductor.aoti_load_package(package).get_constant_fqns())
        folded = sorted(set(dict(graph.named_parameters())) - loadable)
        log.info(
            "compiled %s graph in %.1f s (%d parameters folded into the program)",
            graph.shape.phase,
            time.perf_counter() - started,
            len(folded),
        )
        return {
            "export_s": export_s,
            "compile_s": time.perf_counter() - started,
            "folded_params": folded,
            "folded_digest": _folded_digest(graph, folded),
            # the program's own key: an entry for other folded values sits at another key, but holds
            # the same program (which of the two a model gets depends on who compiled first)
            "program_key": make_key(parts),
        }

    describe, need = {"recipe": RECIPE, "shape": graph.shape.key}, package_bytes_estimate(graph)
    entry = cache.get_or_build(make_key(parts), build, describe=describe, need_bytes=need)
    folded = entry.meta.get("folded_params", [])
    if folded and entry.meta.get("folded_digest") != _folded_digest(graph, folded):
        key = make_key({**parts, "folded_values": _folded_digest(graph, folded)})
        entry = cache.get_or_build(key, build, describe=describe, need_bytes=need)
    return entry


SIMPLE = (int, float, str, bool, type(None))


def _module_parts(graph: DeviceGraph) -> list[Any]:
    """Every submodule's class and plain attributes (an edit to a module's settings changes the program)."""
    out = []
    for name, module in graph.named_modules():
        plain = sorted(
            (k, repr(v))
            for k, v in vars(module).items()
            if isinstance(v, SIMPLE) or (isinstance(v, tuple) and all(isinstance(x, SIMPLE) for x in v))
        )
        out.append([name, f"{type(module).__module__}.{type(module).__qualname__}", plain])
    return out


@functools.lru_cache(maxsize=1)
def _library_source() -> str:
    root = Path(__file__).resolve().parent.parent
    return source_digest(tuple(sorted(str(p.relative_to(root)) for p in root.rglob("*.py"))))


def index_key(graph: DeviceGraph, options: Mapping[str, Any]) -> str:
    """What the export of `graph` depends on, without exporting it (the index's key)."""
    return make_key(
        {
            "format": 1,
            "recipe": RECIPE,
            "config": program_config(graph.model.config),
            "weights": weights_fingerprint(graph),
            "shape": graph.shape.key,
            "graph": graph.key_parts(),
            "modules": _module_parts(graph),
            "options": dict(options),
            "versions": program_versions(),
            "source": _library_source(),
        }
    )


def _indexed(cache: ArtifactCache, index: str, graph: DeviceGraph) -> CacheEntry | None:
    """The entry the index names for `index`, if it is intact and its folded values are the graph's."""
    try:
        key = json.loads((cache.root / "index" / f"{index[:24]}.json").read_text())["key"]
    except (OSError, ValueError, KeyError):
        return None
    entry = cache.lookup(key)
    folded = entry.meta.get("folded_params", []) if entry is not None else []
    if entry is None or (folded and entry.meta.get("folded_digest") != _folded_digest(graph, folded)):
        return None
    return entry


def _remember(cache: ArtifactCache, index: str, key: str) -> None:
    if cache.layers or cache.refuse_build is not None:  # a run from a bundle writes nothing anywhere
        return
    try:
        (cache.root / "index").mkdir(parents=True, exist_ok=True)
        atomic_write_json(cache.root / "index" / f"{index[:24]}.json", {"key": key})
    except OSError as exc:  # a read-only cache still serves: the next run exports again
        log.info("program index not written (%s)", exc)


def compile_graph(
    graph: DeviceGraph, cache: ArtifactCache | None = None, options: Mapping[str, Any] | None = None
) -> CompiledStep:
    """Export + AOTInductor-compile `graph` (or load it from the cache) and return a callable:
    `export_graph` -> `cache_package` (`package_program` on a miss) -> `load_package`, the steps
    the notebooks' compile cell runs line by line."""
    cache = cache or ArtifactCache()
    options = {**DEFAULT_COMPILER_OPTIONS, **(options or {})}
    index = index_key(graph, options)
    entry, export_s, compile_s = _indexed(cache, index, graph), 0.0, 0.0
    if entry is None:  # not seen before: export, and the program's digest finds (or builds) the entry
        export_started = time.perf_counter()
        program = export_graph(graph)
        export_s = time.perf_counter() - export_started
        started = time.perf_counter()
        entry = cache_package(
            graph, program, cache, options, lambda prog, path: package_program(prog, path, options), export_s
        )
        compile_s = 0.0 if entry.hit else time.perf_counter() - started
        _remember(cache, index, entry.key)
    loaded = time.perf_counter()
    runner = load_package(str(entry.file(PACKAGE)), graph)
    load_s = time.perf_counter() - loaded
    return CompiledStep(runner, entry, compile_s, load_s, {"key": entry.key, "compiler": RECIPE, "export_s": export_s})
