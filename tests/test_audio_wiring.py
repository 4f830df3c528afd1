"""Audio through the library (issue 50): `port --audio` on the tiny random models that hear
(`gemma4lib.models.audio.build_random_hearing`: E2B/E4B a 2-layer conformer, the 12B its frame embedder),
the audio graph compiled beside prefill and decode, its soft tokens written over the placeholders by the
engine, judged by SEQ_MATCH and LOGITS_MATCH (audio prefill included) against transformers' own
`generate(input_features=..., input_features_mask=...)`; the media prompt (images and clips in one
prompt), the fit check, and what coherence expects of a shipped clip."""

from __future__ import annotations

import pytest
import torch

from gemma4lib.models import audio
from gemma4lib.port import PortSettings, port

CLIPS = audio.CLIPS_DIR
RED_CIRCLE = CLIPS.parent / "vision" / "images" / "red_circle.png"


def run(variant: str, clips: list[str], backend: str = "eager", **kwargs) -> dict:
    settings = PortSettings(
        variant=variant,
        model="random",
        backend=backend,
        audio=[str(CLIPS / c) for c in clips],
        max_new_tokens=6,
        iters=1,
        warmup=0,
        **kwargs,
    )
    return port(settings)


def deaf_gap(variant: str, record: dict) -> float:
    """How far transformers' own logits move when the prompt's clips are not heard (the same ids, no
    input_features), over the record's tokens: a port that dropped the sound would be off by this much."""
    from gemma4lib.port import prompt_rows
    from gemma4lib.reference import reference_for, teacher_forced_logits

    settings = PortSettings(variant=variant, model="random", audio=record["parameters"]["audio"])
    model = audio.build_random_hearing(variant, seed=settings.seed)
    row = prompt_rows(model, settings)[0]
    assert len(row.ids) == record["prompt_tokens"]
    with torch.no_grad():
        heard = teacher_forced_logits(reference_for(model, row.media.prompt), row.ids, record["tokens"])
        deaf = teacher_forced_logits(model.multimodal, row.ids, record["tokens"])
    return float((heard - deaf).abs().max())


@pytest.mark.parametrize(
    ("variant", "clip"), [("e2b", "france.wav"), ("e4b", "capital_of_france.wav"), ("12b", "japan.wav")]
)
def test_port_audio_matches_transformers(variant, clip):
    """One clip, the default prompt ("Transcribe the audio." after it): tokens equal transformers' greedy
    `generate(input_features=...)`, logits within its spread from the prefill on; the soft tokens are the
    processor's count (25 a second; the 12B one per 640 samples), the graph's shape the clip's frames; and
    the sound matters: transformers without the clip is further off than the tolerance."""
    record = run(variant, [clip])
    assert record["seq_match"] and record["logits_match"] and not record["failed_checks"], record["failed_checks"]
    assert record["parameters"]["prompt"] == audio.TRANSCRIBE and record["coherent"] is None  # random: no words
    samples = audio.read_wav(CLIPS / clip)
    unified = variant == "12b"
    frames = len(audio.features(samples, unified)[0])
    assert record["audio"]["soft_tokens"] == [audio.soft_tokens(samples, unified)]
    assert record["audio"]["audio_graph"] == [1, frames, 640 if unified else 128]
    assert deaf_gap(variant, record) > record["logits_tolerance"]


def test_clips_and_an_image_in_one_prompt():
    """Two clips and an image in one prompt (the media prompt: image part, audio parts, then the text): the
    vision graph and the audio graph (both clips in one call at the longer one's frames) both run, and the
    device equals transformers' forward with pixel_values and input_features together."""
    record = run(
        "e2b", ["france.wav", "italy.wav"], images=[str(RED_CIRCLE)], context_length=256, prefill_buckets=(128,)
    )
    assert record["seq_match"] and record["logits_match"], record["failed_checks"]
    assert record["images"]["soft_tokens"] == [16] and len(record["audio"]["soft_tokens"]) == 2
    assert record["images"]["last_position"] < record["audio"]["first_position"]  # in the prompt's order
    assert record["audio"]["audio_graph"][:2] == [2, max(record["audio"]["frames"])]


def test_audio_on_the_cpu_backend():
    """The cpu backend compiles the audio graph with AOTInductor under its program digest (the artifact
    cache: a second port is a hit for every graph) and the port still matches transformers."""
    record = run("e2b", ["france.wav"], backend="cpu")
    assert record["seq_match"] and record["logits_match"], record["failed_checks"]
    assert "audio" in record["artifacts"]
    again = run("e2b", ["france.wav"], backend="cpu")
    assert all(again["cache_hits"]) and again["artifacts"] == record["artifacts"]


def test_audio_soft_tokens_count_in_the_fit_check():
    """A clip's soft tokens count in the engine's one fit check, refused before any device work."""
    from gemma4lib.errors import PromptTooLongError

    with pytest.raises(PromptTooLongError, match="24 of them image or audio soft tokens"):
        run("e2b", ["france.wav"], context_length=48, prefill_buckets=(32,))


def test_shipped_clips_expect_their_words(tmp_path):
    """Coherence expects a shipped clip's words (PROVENANCE.json, matched by sha256, path or bytes); another
    file, or several clips, expect nothing; `expect` given wins."""
    france = CLIPS / "france.wav"
    assert audio.shipped_text([france]) == "France" and audio.shipped_text([france.read_bytes()]) == "France"
    assert audio.shipped_text([str(CLIPS / "capital_of_france.wav")]) == "What is the capital of France?"
    copy = tmp_path / "other.wav"
    copy.write_bytes(france.read_bytes()[:-2])
    assert audio.shipped_text([copy]) is None and audio.shipped_text([france, france]) is None
    settings = PortSettings(variant="e2b", audio=[str(france)])
    assert settings.prompt == audio.TRANSCRIBE and settings.expect is None
    assert PortSettings(variant="e2b", audio=[str(france)], expect="France!").expect == "France!"


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        (dict(variant="31b"), r"the 31b does not hear .*pick e2b, e4b, 12b"),
        (
            dict(variant="e2b", batch_size=2),
            "audio runs with one prompt on backend 'cpu', 'eager', 'xla' at tp_degree 1",
        ),
        (dict(variant="e4b", tp_degree=2), "not batch_size 1 on backend 'cpu' at tp_degree 2"),
    ],
)
def test_audio_settings_refused_before_loading(kwargs, says):
    from gemma4lib.errors import SettingsError

    with pytest.raises(SettingsError, match=says):
        PortSettings(audio=[str(CLIPS / "france.wav")], **kwargs)
