"""Where a drafted port runs: the one dispatch point for `draft="assistant"`.

- tp_degree 1 on cpu / eager / xla: the single-device graphs (`speculative.run_single_device_drafted`);
- tp_degree > 1 on cpu / eager: the gloo ranks, each drafting and verifying over its own shard of
  the target's K/V (`tp.draft_gloo`, graphs in `tp.draft_rank_graph`);
- backend neuron (the ModelBuilder recipe, any TP degree): prefill/verify/draft keys over one set
  of device K/V states (`recipes.neuron_drafting`), cached like the plain recipe's artifact.

Every path returns the same record fields (tokens, the logits that chose each, acceptance,
transformers' assisted-generate tokens), so the port checks them all alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..backends.base import DeviceRun
from ..device.drafting import RoomyLayout
from ..errors import SettingsError
from .speculative import hf_assisted

if TYPE_CHECKING:
    from ..models.assistant import LoadedAssistant
    from ..models.loading import LoadedModel
    from ..runtime import Sampling
    from ..settings import PortSettings


def run_device_drafted(
    model: LoadedModel,
    settings: PortSettings,
    ids: list[int],
    eos: list[int],
    *,
    progress: bool = False,
    bench: bool = True,
    sampling: Sampling | None = None,
) -> DeviceRun:
    """The drafted port's device run on the path its settings select (module docstring).
    `sampling` (not greedy): rejection-sampling verification, on the single-device graphs only;
    the gloo ranks and the ModelBuilder keys refuse it rather than run greedy."""
    if settings.tp_degree == 1 and settings.backend != "neuron":
        from .speculative import run_single_device_drafted as single_device

        return single_device(model, settings, ids, eos, progress=progress, bench=bench, sampling=sampling)
    if sampling is not None and not sampling.greedy:
        where = "the ModelBuilder drafting keys" if settings.backend == "neuron" else "the gloo TP ranks"
        raise SettingsError(
            f"sampling-mode (rejection-sampling) verification runs on the single-device graphs (tp_degree 1, "
            f"backend cpu/eager/xla); {where} (tp_degree {settings.tp_degree}, backend {settings.backend!r}) "
            f"verify greedily: pass sampling=None, or tp_degree=1 with a CPU backend"
        )
    from ..models.assistant import load_assistant

    assistant = load_assistant(model, settings)
    if settings.backend == "neuron":
        fields = neuron_drafted(model, assistant, settings, ids, eos)
    else:
        from ..tp.draft_gloo import run_tp_drafted

        fields = run_tp_drafted(model, assistant, settings, ids, eos, bench=bench)
    return with_assistant_fields(fields, model, assistant, settings, ids, eos)


def assistant_digest(assistant: LoadedAssistant) -> str:
    """sha256 over the assistant's tensors (names, shapes, bytes): part of the Neuron cache key."""
    import hashlib

    digest = hashlib.sha256()
    for name, tensor in sorted(assistant.model.state_dict().items()):
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        digest.update(tensor.detach().float().contiguous().numpy().tobytes())
    return digest.hexdigest()


def neuron_drafted(
    model: LoadedModel, assistant: LoadedAssistant, settings: PortSettings, ids: list[int], eos: list[int]
) -> dict:
    """The ModelBuilder drafting keys: compiled (or found in the artifact cache), loaded on the
    cores, driven by `DraftedRuntime` (inf2-only through the recipe's SDK calls)."""
    import time

    import torch

    from ..backends.neuron import compiler_workdir, neuron_cache_key, own_directory
    from ..cache.artifacts import make_key
    from ..cache.bundle import cache_for
    from ..device.embedder import HostEmbedder
    from ..recipes import cores, neuron_drafting, neuron_env, neuron_model_builder
    from .speculative import DraftedRuntime

    neuron_env.require("torch_neuronx", f"drafting on backend 'neuron' ({model.variant.name})")
    tp, k = int(settings.tp_degree), int(settings.draft_tokens)
    buckets = tuple(sorted(int(b) for b in settings.prefill_buckets))
    dtype = model.lm_head.weight.dtype
    shapes = neuron_drafting.drafting_shapes(settings.context_length, buckets, k, settings.ring_kv)
    _, parts = neuron_cache_key(model, neuron_drafting.RECIPE, tp, shapes, neuron_env.COMPILER_ARGS, dtype)
    parts["assistant"] = {"config": assistant.model.config.to_json_string(use_diff=False)}
    parts["assistant"]["digest"] = assistant_digest(assistant)
    key = make_key(parts)
    started = time.perf_counter()

    def build(folder):
        with compiler_workdir() as workdir, own_directory():
            neuron_drafting.compile_drafting(
                model,
                assistant,
                tp,
                folder,
                context_length=settings.context_length,
                buckets=buckets,
                draft_tokens=k,
                ring=settings.ring_kv,
                dtype=dtype,
                compiler_workdir=workdir,
            )
        return {"recipe": neuron_drafting.RECIPE, "tp": tp}

    need = (model.param_count() + sum(p.numel() for p in assistant.model.parameters())) * dtype.itemsize
    entry = cache_for(settings, model).get_or_build(
        key, build, describe={n: v for n, v in parts.items() if n != "config"}, need_bytes=need
    )
    compile_s = 0.0 if entry.hit else time.perf_counter() - started
    label = f"{model.variant.name} (drafting keys, TP={tp}) from {entry.path}"
    cores.check_free(0, tp, label)
    traced = cores.claim(neuron_model_builder.load_model_builder(entry.path, tp), 0, tp, label)
    steps = neuron_drafting.drafting_steps(
        traced, buckets, bool(getattr(model.config, "hidden_size_per_layer_input", 0))
    )
    runtime = DraftedRuntime.over(HostEmbedder.from_text_model(model.text_model), steps, [], k, dtype)
    generation = runtime.generate(ids, settings.max_new_tokens, eos_token_ids=eos)
    return {
        "tokens": generation.tokens,
        "step_logits": generation.step_logits.to(torch.float32),
        "compiler": f"neuron-{neuron_drafting.RECIPE}",
        "compile_s": compile_s,
        "cache_hits": [entry.hit],
        "prefill_ms": generation.prefill_s * 1000,
        "decode_tok_s": generation.decode_tok_s,
        "decode_tok_s_with_draft": generation.decode_tok_s,
        "verify_steps": len(generation.emitted),
        "accepted_per_step": generation.accepted_per_step,
        "drafts_accepted": generation.accepted,
        "artifacts": {"drafting": str(entry.path)},
    }


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
