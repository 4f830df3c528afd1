"""Audio on the host side (issue 50): `gemma4lib.models.audio`'s features, mask, soft-token counts and
placeholders against transformers' own `Gemma4AudioFeatureExtractor` / `Gemma4Processor` (the 12B:
`Gemma4UnifiedProcessor`), the WAV reader, and the refusals (clip too long, not a 16 kHz 16-bit WAV,
a variant that does not hear, the server without an audio path)."""

from __future__ import annotations

import io
import json
import sys
import wave
from pathlib import Path

import numpy as np
import pytest

from gemma4lib.errors import AudioInputError
from gemma4lib.models import audio

CLIPS = Path(audio.__file__).resolve().parent.parent / "fixtures" / "audio"
QUESTION = "What is said?"


def wav_bytes(samples: np.ndarray, rate: int = audio.RATE, width: int = 2) -> bytes:
    """A WAV of int samples ([frames] or [frames, channels]) as `wave` writes it."""
    frames = samples.reshape(len(samples), -1)
    out = io.BytesIO()
    with wave.open(out, "wb") as clip:
        clip.setnchannels(frames.shape[1])
        clip.setsampwidth(width)
        clip.setframerate(rate)
        clip.writeframes(frames.astype("<i2" if width == 2 else "u1").tobytes())
    return out.getvalue()


def noise(seconds: float, seed: int = 0) -> np.ndarray:
    n = int(round(seconds * audio.RATE))
    return (np.random.default_rng(seed).standard_normal(n) * 0.1).astype(np.float32)


@pytest.fixture(scope="module")
def tokenizer():
    from gemma4lab.training.audio import audio_tokenizer
    from gemma4lib.models.trained import load_trained

    return audio_tokenizer(load_trained("e2b").tokenizer)


# ---- the features: bit-equal to transformers' extractor ------------------------------------------
SECONDS = [0.5, 1.0, 0.0101, 1.0081, 2.3456, 29.9, 30.0]


@pytest.mark.parametrize("seconds", SECONDS)
def test_log_mel_equals_transformers(seconds):
    """Features, mask and soft-token count equal transformers' to the bit, at lengths on and off the
    128-sample padding, from 10 ms to the 30 s limit."""
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

    samples = noise(seconds)
    reference = Gemma4AudioFeatureExtractor()([samples], return_tensors="np")
    features, mask = audio.log_mel(samples)
    assert features.dtype == np.float32 and features.shape == reference["input_features"][0].shape
    assert np.array_equal(features, reference["input_features"][0])  # max abs diff 0
    assert np.array_equal(mask, reference["input_features_mask"][0])


def test_shipped_clips_equal_transformers_and_their_provenance():
    """The espeak-ng clips: 16 kHz mono 16-bit, as PROVENANCE.json says, small, and their features
    bit-equal to transformers'."""
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

    provenance = json.loads((CLIPS / "PROVENANCE.json").read_text())
    assert sum(p.stat().st_size for p in CLIPS.iterdir()) < 2**20
    for name, fact in provenance["files"].items():
        samples = audio.read_wav(CLIPS / name)
        assert len(samples) == fact["samples"] and fact["seconds"] < audio.MAX_SECONDS
        raw = np.frombuffer(wave.open(str(CLIPS / name)).readframes(fact["samples"]), "<i2")
        assert np.array_equal(samples, raw.astype(np.float32) / 32768.0)
        reference = Gemma4AudioFeatureExtractor()([samples], return_tensors="np")
        assert np.array_equal(audio.log_mel(samples)[0], reference["input_features"][0]), name


def test_soft_token_counts_are_the_processors(tokenizer):
    """25 per second, 750 at 30 s: the mask rule of `replace_audio_token` and the arithmetic of
    `_compute_audio_num_tokens` agree with ours at every length tried; the 12B: one per 640 samples."""
    from gemma4lab.training.audio import transformers_processor

    processor, unified = transformers_processor(tokenizer), transformers_processor(tokenizer, unified=True)
    counts = {}
    for seconds in [*SECONDS, 0.04, 0.041, 7.77]:
        samples = noise(seconds, seed=1)
        ours = audio.soft_tokens(samples)
        assert ours == processor._compute_audio_num_tokens(samples, audio.RATE)
        assert ours == int(processor.feature_extractor([samples])["input_features_mask"][0][::4].sum())
        assert audio.soft_tokens(samples, unified=True) == unified._compute_audio_num_tokens(samples, audio.RATE)
        counts[seconds] = ours
    assert counts[1.0] == 25 and counts[0.5] == 13 and counts[30.0] == 750


# ---- the placeholders: the processor's ids ---------------------------------------------------------
@pytest.mark.parametrize("unified", [False, True], ids=["e2b-e4b", "12b"])
def test_placeholders_equal_the_processors_ids(tokenizer, unified):
    """Two clips and a question: the template's ids with each audio part expanded equal the ids
    transformers' processor makes of the same messages and clips."""
    from gemma4lab.training.audio import transformers_processor

    clips = [audio.read_wav(CLIPS / "france.wav"), audio.read_wav(CLIPS / "capital_of_france.wav")]
    messages = [{"role": "user", "content": [{"type": "audio"}, {"type": "audio"}, {"type": "text", "text": QUESTION}]}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    ids = audio.expand_audio(tokenizer, list(rendered), clips, unified=unified)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = transformers_processor(tokenizer, unified)(text=[text], audio=clips, add_special_tokens=False)
    assert ids == expected["input_ids"][0]
    marked = [i for i, kind in enumerate(expected["mm_token_type_ids"][0]) if kind]  # its soft tokens (type 3)
    assert marked == [i for i, t in enumerate(ids) if t == tokenizer.audio_token_id]
    assert ids.count(tokenizer.audio_token_id) == sum(audio.soft_tokens(c, unified) for c in clips) > 50


def test_placeholders_refuse_a_miscount_and_a_deaf_tokenizer(tokenizer):
    from gemma4lab.training.vision import vision_tokenizer
    from gemma4lib.models.trained import load_trained

    messages = [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": QUESTION}]}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    clip = noise(1.0)
    with pytest.raises(AudioInputError, match=r'2 clips for 1 audio parts.*\{"type": "audio"\}'):
        audio.expand_audio(tokenizer, list(rendered), [clip, clip])
    with pytest.raises(AudioInputError, match="no audio tokens.*e2b.*e4b.*12b"):
        audio.expand_audio(vision_tokenizer(load_trained("e2b").tokenizer), list(rendered), [clip])


# ---- reading WAV files, and what is refused ------------------------------------------------------
def test_read_wav_mono_stereo_and_bytes(tmp_path):
    """16-bit samples scaled by 1/32768 (libsndfile's float convention); stereo averaged."""
    left = np.arange(-800, 800, dtype=np.int16) * 40
    right = -left // 2
    path = tmp_path / "stereo.wav"
    path.write_bytes(wav_bytes(np.stack([left, right], axis=1)))
    expected = (np.stack([left, right], 1).astype(np.float32) / 32768.0).mean(axis=1, dtype=np.float32)
    assert np.array_equal(audio.read_wav(path), expected)
    assert np.array_equal(audio.read_wav(wav_bytes(left)), left.astype(np.float32) / 32768.0)


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (
            wav_bytes(np.zeros(31 * audio.RATE, np.int16)),
            r"31\.00 s; Gemma-4 hears at most 30 s .*clips of at most 30 s",
        ),
        (wav_bytes(np.zeros(30 * audio.RATE + 1, np.int16)), r"30\.00 s; Gemma-4 hears at most 30 s"),
        (wav_bytes(np.zeros(160, np.int16)), "too short for one soft token"),
        (wav_bytes(np.zeros(22050, np.int16), rate=22050), r"16-bit at 22050 Hz.*ffmpeg -i IN -ar 16000"),
        (wav_bytes(np.full(16000, 128, np.uint8), width=1), r"8-bit at 16000 Hz"),
        (b"\x89PNG\r\n\x1a\n" + bytes(64), "not a WAV file"),
        (b"", "not a WAV file"),
    ],
    ids=["31s", "30s+1", "10ms-", "22kHz", "8bit", "png", "empty"],
)
def test_clips_refused_with_what_to_do(data, says):
    with pytest.raises(AudioInputError, match=says):
        audio.read_wav(data)


def test_missing_file_is_refused():
    with pytest.raises(AudioInputError, match="'no/such.wav' is not a WAV file"):
        audio.read_wav("no/such.wav")


def test_an_mp3_without_soundfile_says_what_to_install(monkeypatch):
    """An install without the `serve` extra meets an MP3 with an AudioInputError (a 400), not an ImportError."""
    monkeypatch.setitem(sys.modules, "soundfile", None)  # `import soundfile` raises ImportError
    with pytest.raises(AudioInputError, match=r"an MP3 needs `soundfile` \(pip install -e '.\[serve\]'\)"):
        audio.read_wav(b"ID3" + bytes(64))


# ---- `port --audio`: refused before anything loads ---------------------------------------------------
@pytest.mark.parametrize(
    ("variant", "says"),
    [
        ("31b", r"the 31b does not hear \(no audio tower in its config\): pick e2b, e4b, 12b for audio"),
        ("26b-a4b", r"the 26b-a4b does not hear .*pick e2b, e4b, 12b"),
    ],
)
def test_port_audio_is_refused_before_loading(monkeypatch, capsys, variant, says):
    """`port --audio` exits 2 with a SettingsError before `port` is called (nothing loads): the deaf
    variants name the ones that hear (the hearing ones run: tests/test_audio_wiring.py)."""
    import re

    import gemma4lib.port
    from gemma4lib.cli import main
    from gemma4lib.errors import SettingsError
    from gemma4lib.port import PortSettings

    def no_port(*args, **kwargs):
        raise AssertionError("port ran: the audio refusal came after loading")

    monkeypatch.setattr(gemma4lib.port, "port", no_port)
    clip = str(CLIPS / "france.wav")
    assert main(["port", "--variant", variant, "--audio", clip, "--json"]) == 2
    assert re.search(says, capsys.readouterr().err)
    with pytest.raises(SettingsError, match=says):
        PortSettings(variant=variant, audio=(clip,), images=(str(CLIPS.parent / "vision/images/red_circle.png"),))


# ---- the endpoint's `input_audio` parts: decoded and checked, then a clear 400 ------------------------
@pytest.fixture(scope="module")
def served():
    from test_server import serve_fake

    from gemma4lib.models.tokenizer import load_tokenizer
    from gemma4lib.models.trained import TOKENIZER_DIR

    server, _ = serve_fake(load_tokenizer(TOKENIZER_DIR))
    yield server
    server.stop()


def b64(data: bytes) -> str:
    import base64

    return base64.b64encode(data).decode()


@pytest.mark.parametrize(
    ("input_audio", "where", "says"),
    [
        ({"data": b64((CLIPS / "france.wav").read_bytes()), "format": "wav"}, "", "this server does not hear"),
        (
            {"data": b64(wav_bytes(np.zeros(31 * audio.RATE, np.int16))), "format": "wav"},
            ".input_audio",
            "at most 30 s",
        ),
        ({"data": b64(b"\x89PNG\r\n\x1a\n" + bytes(64)), "format": "wav"}, ".input_audio", "not a WAV file"),
        ({"data": b64(wav_bytes(np.zeros(800, np.int16), rate=8000)), "format": "wav"}, ".input_audio", "8000 Hz"),
        ({"data": "not base64!", "format": "wav"}, ".input_audio", "not base64"),
        ({"data": b64(b"ID3" + bytes(64)), "format": "mp3"}, ".input_audio", "not a WAV file nor an MP3"),
        ({"data": b64((CLIPS / "france.wav").read_bytes()), "format": "flac"}, ".input_audio", "'wav' or 'mp3'"),
        ({"data": "A" * (3 * 2**20), "format": "wav"}, ".input_audio", "larger than 2 MiB"),
    ],
    ids=["france", "31s", "png", "8kHz", "base64", "corrupt-mp3", "flac", "huge"],
)
def test_openai_input_audio_parts_get_clear_400s(served, input_audio, where, says):
    """The official `openai` client's `input_audio` part: a valid clip is read and checked, then
    refused because this text server does not hear; a clip over 30 s, a non-WAV file, another rate, bad
    base64, a corrupt mp3, another format and an oversized payload are each a 400 naming the part and what to do."""
    import openai
    from test_server import MODEL, openai_client

    content = [{"type": "input_audio", "input_audio": input_audio}, {"type": "text", "text": QUESTION}]
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client(served).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=4
        )
    error = caught.value.body
    assert error["param"] == "messages[0].content[0]" + where and says in error["message"], error
