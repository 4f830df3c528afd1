"""What a port's settings need beyond their own values, checked once before anything loads.

`PortSettings` checks what its values alone tell (names, ranges, which backend runs what: the facts
rows). What needs more is here: the inf2 recipe the variant compiles with, the memory plan that
must fit the NeuronCores (the vision graph's included) and the serving host, the Neuron SDK, and a
bundle's manifest. The composition roots call `preflight(settings)` before any
weight loads (`port.port`, `cli.load_engine`, `export`, `registry.compile_graphs`), so a
mistake fails in a second, not after a checkpoint load or half an hour of compiling.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..cache.bundle import check_settings as check_bundle
from ..errors import SettingsError
from ..inf2.hardware import host_instance_type
from ..inf2.memory_plan import neuron_recipe, require_fit, require_neuron_tp
from ..inf2.serving_host import require_serving_host
from ..recipes import neuron_env
from .facts import row_at

if TYPE_CHECKING:
    from ..settings import PortSettings


def preflight(settings: PortSettings) -> None:
    """Raise the `SettingsError` (or the planner's, the SDK's, the bundle's error) that says what to
    change, before anything loads; return quietly when the settings can run here."""
    row = row_at(settings.backend, settings.tp_degree)
    recipe = None  # the inf2 recipe (an unknown name, or trace at TP > 1, raises)
    if settings.neuron_recipe is not None or row.device_bound:
        recipe = neuron_recipe(settings.variant_spec, settings.tp_degree, settings.neuron_recipe)
    if settings.weights == "int8" and row.quantizes_itself and recipe != "model_builder":
        raise SettingsError(
            f"weights='int8' on backend {row.name!r} uses the ModelBuilder recipe (NxD's quantized layers); "
            f"{settings.variant_spec.name} at TP={settings.tp_degree} compiles with {recipe!r}: drop "
            f"neuron_recipe={settings.neuron_recipe!r} (ModelBuilder is the default), or use weights='bf16'"
        )
    asks = settings.draft is not None or settings.builds_row_prefill or settings.context_buckets
    if asks and row.device_bound and recipe == "trace":
        raise SettingsError(
            f"draft={settings.draft!r}, row_prefill={settings.row_prefill}, "
            f"context_buckets={settings.context_buckets}: drafting needs verify and prefill graphs, a join a "
            "one-row prefill key, a context bucket a key of its own, over one set of device K/V states; the "
            "one-graph trace recipe has a single decode graph: use the ModelBuilder recipe (neuron_recipe=None), "
            "or draft=None, row_prefill=False and context_buckets=()"
        )
    if settings.weights == "int8" and settings.draft is not None and row.quantizes_itself:
        raise SettingsError(  # else bf16 keys under a plan sized for int8, with no int8 in their key
            f"weights='int8' with draft={settings.draft!r} on backend {row.name!r}: the drafting keys hold "
            "target and assistant in one module that NxD's quantized layers are not wired into (its checkpoint "
            "has no int8 form); use weights='bf16' to draft, or draft=None for int8"
        )
    if row.device_bound:
        _check_inf2(settings)
    if settings.artifacts:
        check_bundle(settings)  # shapes, formats, versions, machine: before anything loads


def _check_inf2(settings: PortSettings) -> None:
    """The TP degree, the cores' and the serving host's memory fit inf2, and the SDK is here."""
    variant, instance = settings.variant_spec, host_instance_type()
    if settings.profile == "full":  # the released model: weights + K/V must fit each core
        require_fit(
            variant,
            settings.tp_degree,
            instance=instance,
            context_length=settings.context_length,
            ring=settings.ring_kv,
            recipe=settings.neuron_recipe,
            weights=settings.weights,
            batch=settings.batch_size,
            draft_tokens=settings.draft_tokens if settings.draft else None,
            vision=settings.wants_vision,  # on rank 0's core (`neuron_vision.vision_core`), and audio beside it
            audio=settings.wants_audio,
        )
        require_serving_host(  # the host that serves and checks: model, shards, reference, spread
            variant,
            settings.tp_degree,
            instance,
            context_length=settings.context_length,
            ring=settings.ring_kv,
            prompt_tokens=settings.prefill_buckets[-1],
            new_tokens=settings.max_new_tokens,
            weights=settings.weights,
            vision=settings.wants_vision,  # the host's multimodal reference holds their weights too
            audio=settings.wants_audio,
        )
    else:  # tiny models fit anywhere; the degree must still be one inf2 can run
        require_neuron_tp(variant, settings.tp_degree, instance)
    neuron_env.require_sdk(f"backend {settings.backend!r} ({variant.name})")
