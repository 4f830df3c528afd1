"""Where a drafted port runs: the one dispatch point for `draft="assistant"`.

- tp_degree 1 on cpu / eager: the single-device graphs (`speculative.run_device_drafted`);
- tp_degree > 1 on cpu / eager: the gloo ranks, each drafting and verifying over its own shard of
  the target's K/V (`tp.draft_gloo`, graphs in `tp.draft_rank_graph`).

Every path returns the same record fields (tokens, the logits that chose each, acceptance,
transformers' assisted-generate tokens), so the port checks them all alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..backends.base import DeviceRun
from ..device.drafting import RoomyLayout
from .speculative import hf_assisted

if TYPE_CHECKING:
    from ..models.assistant import LoadedAssistant
    from ..models.loading import LoadedModel
    from ..settings import PortSettings


def run_device_drafted(
    model: LoadedModel,
    settings: PortSettings,
    ids: list[int],
    eos: list[int],
    *,
    progress: bool = False,
    bench: bool = True,
) -> DeviceRun:
    """The drafted port's device run on the path its settings select (module docstring)."""
    if settings.tp_degree == 1 and settings.backend != "neuron":
        from .speculative import run_device_drafted as single_device

        return single_device(model, settings, ids, eos, progress=progress, bench=bench)
    from ..models.assistant import load_assistant

    assistant = load_assistant(model, settings)
    from ..tp.draft_gloo import run_tp_drafted

    fields = run_tp_drafted(model, assistant, settings, ids, eos, bench=bench)
    return with_assistant_fields(fields, model, assistant, settings, ids, eos)


def with_assistant_fields(
    fields: dict, model: LoadedModel, assistant: LoadedAssistant, settings: PortSettings, ids: list[int], eos: list[int]
) -> DeviceRun:
    """The drafting fields every drafted record carries, and transformers' assisted generate with
    the same assistant (its tokens must equal the device's: `hf_assisted_match`)."""
    hf_tokens, hf_steps = hf_assisted(model.lm, assistant.model, ids, settings.max_new_tokens, eos)
    ring = RoomyLayout.around(model.layout, settings.draft_tokens + 1)
    fields.update(
        draft=settings.draft,
        draft_tokens=settings.draft_tokens,
        assistant_source=assistant.source,
        assistant_reads_layers=assistant.read_layers,
        sliding_ring_slots=ring.slots("sliding_attention", settings.context_length, settings.ring_kv),
        hf_assisted_tokens=hf_tokens,
        hf_assisted_match=hf_tokens == fields["tokens"],
        hf_verify_steps=hf_steps,
        hf_accepted_per_step=(len(hf_tokens) - 1) / hf_steps if hf_steps else None,
    )
    return DeviceRun.from_fields(fields)


__all__ = ["run_device_drafted", "with_assistant_fields"]
