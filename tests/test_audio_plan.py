"""The audio part in the inf2 plans (issue 50, item 5): its bytes are the audio parameters of the variant's whole
multimodal model at real widths (built on the meta device from transformers' own class, not from the plan's
modules); it sits beside vision on rank 0's core, and the doctor and the family tables show it."""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers

from gemma4lab.inf2.plans import core_summary
from gemma4lab.tools.inf2_tables import format_plan_table
from gemma4lib.errors import UnknownNameError
from gemma4lib.inf2.audio_plan import audio_plan
from gemma4lib.inf2.hardware import GIB
from gemma4lib.inf2.memory_plan import plan_core_memory
from gemma4lib.inf2.vision_plan import PLACEMENT, vision_plan
from gemma4lib.models.checkpoint import conditional_class
from gemma4lib.models.loading import text_config
from gemma4lib.models.variants import get_variant

AUDIO_PREFIXES = ("model.audio_tower.", "model.embed_audio.")


def released_audio_numels(variant: str) -> tuple[int, int]:
    """(parameters, buffers) under `model.audio_tower` and `model.embed_audio` of the variant's whole
    `*ForConditionalGeneration` (real-width text config, transformers' default audio config), on the meta device."""
    v = get_variant(variant)
    kind, audio = (
        (transformers.Gemma4UnifiedConfig, transformers.Gemma4UnifiedAudioConfig())
        if v.unified
        else (transformers.Gemma4Config, transformers.Gemma4AudioConfig())
    )
    config = kind(text_config=text_config(v, "real").to_dict(), audio_config=audio.to_dict())
    with torch.device("meta"):
        model = conditional_class(v)._from_config(config)
    params = sum(math.prod(p.shape) for n, p in model.named_parameters() if n.startswith(AUDIO_PREFIXES))
    buffers = sum(math.prod(b.shape) for n, b in model.named_buffers() if n.startswith(AUDIO_PREFIXES))
    return params, buffers


@pytest.mark.parametrize("variant", ["e2b", "12b"])
def test_audio_bytes_are_the_real_width_models_audio_parameters(variant):
    params, buffers = released_audio_numels(variant)
    plan = audio_plan(variant)
    assert plan.params == params and plan.weights_gib * GIB == (params + buffers) * 2
    assert plan.soft_tokens == 750 and plan.tower == "audio" and "unverified" in plan.source
    if variant == "12b":  # encoder-free: the embedder alone, one 640-sample frame per soft token
        assert plan.tower_params == 0 and plan.layers == 0 and plan.patches == 750
    else:
        assert plan.tower_params + plan.embedder_params == params and plan.layers == 12 and plan.patches > 4 * 749
    assert plan.activations_gib > 0


def test_audio_sits_beside_vision_on_rank_0s_core_and_the_summary_says_so():
    plain = plan_core_memory("e4b", 2)
    both = plan_core_memory("e4b", 2, vision=True, audio=True)
    grown = both.total_gib - plain.total_gib
    assert grown == pytest.approx(vision_plan("e4b").total_gib + audio_plan("e4b").total_gib, abs=1e-12)
    assert both.weights_gib == plain.weights_gib and both.vision_placement == PLACEMENT  # not sharded: no TP
    line = core_summary(both)
    assert f"{both.audio_gib:.2f} GiB audio (on the core of rank 0" in line and "GiB vision +" in line
    only = plan_core_memory("12b", 2, audio=True)
    assert only.vision_gib == 0 and "audio" in core_summary(only) and "GiB vision" not in core_summary(only)
    table = format_plan_table([plain, both])
    assert "audio (rank 0's core)" in table and "vision (rank 0's core)" in table
    with pytest.raises(UnknownNameError, match="e2b, e4b, 12b"):
        plan_core_memory("31b", 8, audio=True)


def test_doctor_and_plan_show_the_audio_part(capsys):
    from gemma4lab.cli import main as lab_main

    assert lab_main(["doctor", "--variant", "e2b", "--vision", "--audio", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)["plan"]
    assert printed["audio_gib"] == pytest.approx(audio_plan("e2b").total_gib) and "GiB audio" in printed["summary"]


def test_the_full_profiles_preflight_counts_the_audio_part(monkeypatch):
    """A port that hears is planned with its audio part on rank 0's core and in the serving host's RAM: at the
    largest batch where the E2B at TP 1 fits a core without audio but not with it, the preflight refuses the
    run that hears (naming the audio part) and passes the same run deaf; the serving host's model grows by the
    audio weights."""
    from gemma4lib.backends.preflight import preflight
    from gemma4lib.errors import DeviceMemoryError
    from gemma4lib.inf2.serving_host import serving_host_plan
    from gemma4lib.recipes import neuron_env
    from gemma4lib.settings import PortSettings

    monkeypatch.setenv("GEMMA4LIB_INSTANCE_TYPE", "inf2.xlarge")
    monkeypatch.setattr(neuron_env, "require_sdk", lambda *a, **k: None)
    monkeypatch.setattr("gemma4lib.backends.preflight.require_serving_host", lambda *a, **k: None)
    batches = [b for b in range(1, 129) if plan_core_memory("e2b", 1, context_length=32768, batch=b).fits]
    batch = batches[-1]  # its K/V grows with the batch; the audio part does not
    assert not plan_core_memory("e2b", 1, context_length=32768, batch=batch, audio=True).fits
    run = {"variant": "e2b", "backend": "neuron", "profile": "full", "context_length": 32768, "batch_size": batch}
    preflight(PortSettings(**run))
    with pytest.raises(DeviceMemoryError, match="GiB of audio weights and activations"):
        preflight(PortSettings(**run, hears=True))
    deaf, hearing = serving_host_plan("e2b", 1), serving_host_plan("e2b", 1, audio=True)
    assert hearing.model_gb - deaf.model_gb == pytest.approx(audio_plan("e2b").weights_gib * GIB / 1e9)
    assert f"audio {hearing.audio_gb:.2f}" in hearing.summary()
