"""Audio through the library (issue 50): `port --audio` on the tiny random models that hear
(`gemma4lib.models.audio.build_random_hearing`: E2B/E4B a 2-layer conformer, the 12B its frame embedder),
the audio graph compiled beside prefill and decode, its soft tokens written over the placeholders by the
engine, judged by SEQ_MATCH and LOGITS_MATCH (audio prefill included) against transformers' own
`generate(input_features=..., input_features_mask=...)`; the media prompt (images and clips in one
prompt), the fit check, and what coherence expects of a shipped clip."""

from __future__ import annotations

from pathlib import Path

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
    vision graph and the audio graph (a clip a call at the longer one's frames) both run, and the
    device equals transformers' forward with pixel_values and input_features together."""
    record = run(
        "e2b", ["france.wav", "italy.wav"], images=[str(RED_CIRCLE)], context_length=256, prefill_buckets=(128,)
    )
    assert record["seq_match"] and record["logits_match"], record["failed_checks"]
    assert record["images"]["soft_tokens"] == [16] and len(record["audio"]["soft_tokens"]) == 2
    assert record["images"]["last_position"] < record["audio"]["positions"][0]  # in the prompt's order
    assert record["audio"]["audio_graph"][:2] == [1, max(record["audio"]["frames"])]  # one clip a call


def test_audio_on_the_cpu_backend_and_from_a_bundle(tmp_path):
    """The cpu backend compiles the audio graph with AOTInductor into the artifact cache beside prefill and
    decode (a second compile of the same program is a hit: tests/test_audio_graph.py); `export` carries it in
    the bundle (its manifest names the graph and its shape), a port from the bundle compiles nothing and still
    matches transformers, and a clip of another length is refused by the manifest before loading."""
    from gemma4lib.errors import BundleError
    from gemma4lib.export import export_bundle

    kwargs = dict(variant="e2b", model="random", backend="cpu", max_new_tokens=6, iters=1, warmup=0)
    clip = [str(CLIPS / "capital_of_france.wav")]  # the notebooks' clip: one audio program for both
    manifest = export_bundle(PortSettings(audio=clip, **kwargs), tmp_path / "bundle")
    (build,) = manifest["builds"]
    assert build["graphs"][-1] == "audio" and build["settings"]["audio_graph"] == [1, 215, 128]
    record = run("e2b", ["capital_of_france.wav"], backend="cpu", artifacts=str(tmp_path / "bundle"))
    assert record["seq_match"] and record["logits_match"], record["failed_checks"]
    assert record["compiler"] != "none" and "audio" in record["artifacts"], record["artifacts"]
    assert all(record["cache_hits"]) and record["compile_s"] == 0.0
    shorter = PortSettings(audio=[str(CLIPS / "france.wav")], artifacts=str(tmp_path / "bundle"), **kwargs)
    with pytest.raises(BundleError, match=r"audio_graph"):
        port(shorter)


def test_audio_soft_tokens_count_in_the_fit_check():
    """A clip's soft tokens count in the engine's one fit check, refused before any device work."""
    from gemma4lib.errors import PromptTooLongError

    with pytest.raises(PromptTooLongError, match="24 of them image or audio soft tokens"):
        run("e2b", ["france.wav"], context_length=48, prefill_buckets=(32,))


def test_audio_placeholders_miscounted_are_an_audio_error_the_server_answers_400():
    """The engine's media check: a prompt whose audio positions disagree with its clips' soft tokens is an
    `AudioInputError` (not an image error), which the server answers with a 400 naming `messages`."""
    from dataclasses import replace

    from gemma4lib.backends.registry import compile_graphs
    from gemma4lib.errors import AudioInputError
    from gemma4lib.port import prompt_rows, requests_for
    from gemma4lib.server.errors import http_error

    settings = PortSettings(variant="e2b", model="random", backend="eager", audio=[str(CLIPS / "italy.wav")])
    model = audio.build_random_hearing("e2b", seed=settings.seed)
    engine = compile_graphs(model, settings).runtime
    (request,) = requests_for(prompt_rows(model, settings), settings, [])
    engine.check(request)  # the right prompt fits
    short = replace(request.media, audio_positions=request.media.audio_positions[:-1])
    with pytest.raises(AudioInputError, match=r"1 audio parts with 20 soft tokens.*19 audio token positions") as err:
        engine.check(replace(request, media=short))
    status, body, _ = http_error(err.value)
    assert status == 400 and body["error"]["param"] == "messages" and body["error"]["code"] == "invalid_audio"


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
            "audio runs with one prompt on backend 'cpu', 'eager', 'xla', 'neuron' .cpu and eager at TP > 1",
        ),
        (dict(variant="e4b", tp_degree=2, batch_size=2), "not batch_size 2 on backend 'cpu' at tp_degree 2"),
    ],
)
def test_audio_settings_refused_before_loading(kwargs, says):
    from gemma4lib.errors import SettingsError

    with pytest.raises(SettingsError, match=says):
        PortSettings(audio=[str(CLIPS / "france.wav")], **kwargs)


# ---- the endpoint: input_audio parts and /v1/audio/transcriptions on a server that hears ----------------
@pytest.fixture(scope="module")
def hearing_server():
    """`serve --hear` over the random E2B that hears, with the lab's audio tokenizer (the library's random
    models have none), eager: one 30 s clip per audio-graph call."""
    from gemma4lab.serving.background import BackgroundServer
    from gemma4lab.training.audio import build_random_hearing
    from gemma4lib.backends.registry import compile_graphs
    from gemma4lib.port import eos_ids
    from gemma4lib.server.launch import build_served

    settings = PortSettings(
        variant="e2b", model="random", backend="eager", hears=True, batch_size=2, context_length=128, max_new_tokens=6
    )
    model = build_random_hearing("e2b", seed=settings.seed)
    engine = compile_graphs(model, settings).runtime
    assert engine.audio_shape == (1, len(audio.features(audio.read_wav(_silence(30)))[0]), audio.MELS)
    served = build_served(engine, model.tokenizer, model_name="e2b", eos_ids=tuple(eos_ids(model)))
    with BackgroundServer(served) as background:
        yield background, model


def _silence(seconds: float) -> bytes:
    import io
    import wave

    out = io.BytesIO()
    with wave.open(out, "wb") as clip:
        clip.setnchannels(1), clip.setsampwidth(2), clip.setframerate(audio.RATE)
        clip.writeframes(bytes(2 * int(seconds * audio.RATE)))
    return out.getvalue()


def transformers_reply(model, messages, clip: bytes, max_new: int | None = 6) -> str:
    """transformers' own greedy `generate(input_features=...)` on the prompt the server makes of `messages`
    (`max_new` None: the server's default budget, the rest of its 128-token context)."""
    from gemma4lib.port import eos_ids
    from gemma4lib.reference import reference_for, reference_greedy
    from gemma4lib.runtime import room_for_new_tokens
    from gemma4lib.server.text import Codec

    codec = Codec(model.tokenizer)
    codec.hearing = (1, 1, audio.MELS)
    ids, media = codec.chat_with_images(messages, [], [audio.read_wav(clip)])
    eos, max_new = eos_ids(model), max_new or room_for_new_tokens(len(ids), 128)
    tokens = reference_greedy(reference_for(model, media), ids, max_new, eos)
    return codec.decode([t for t in tokens if t not in eos])


def test_openai_client_sends_input_audio_and_a_transcription(hearing_server):
    """The official `openai` client: a chat with an `input_audio` part, and `audio.transcriptions.create`
    (multipart), each answered as transformers' `generate(input_features=...)` answers the same prompt; a
    31 s clip and a file that is not a WAV are clear 400s."""
    import base64

    import openai
    from test_server import openai_client

    server, model = hearing_server
    client = openai_client(server)
    clip = (CLIPS / "capital_of_france.wav").read_bytes()
    content = [
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(clip).decode(), "format": "wav"}},
        {"type": "text", "text": "What is said?"},
    ]
    reply = client.chat.completions.create(
        model="e2b", messages=[{"role": "user", "content": content}], max_tokens=6, temperature=0
    )
    messages = [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "What is said?"}]}]
    assert reply.choices[0].message.content == transformers_reply(model, messages, clip)
    text = client.audio.transcriptions.create(model="e2b", file=("france.wav", (CLIPS / "france.wav").read_bytes()))
    asked = [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": audio.TRANSCRIBE}]}]
    expected = transformers_reply(model, asked, (CLIPS / "france.wav").read_bytes(), max_new=None)
    assert text.text == expected
    for data, says in ((_silence(31), "at most 30 s"), (b"\x89PNG\r\n\x1a\n" + bytes(64), "not a WAV file")):
        with pytest.raises(openai.BadRequestError) as caught:
            client.audio.transcriptions.create(model="e2b", file=("clip.wav", data))
        assert caught.value.body["param"] == "file" and says in caught.value.body["message"], caught.value.body


def mp3_of(name: str) -> bytes:
    """A shipped clip as a 16 kHz MP3 (MPEG-2 Layer III) written by the pinned soundfile (libsndfile + LAME)."""
    import io

    soundfile = pytest.importorskip("soundfile")
    out = io.BytesIO()
    soundfile.write(out, audio.read_wav(CLIPS / name), audio.RATE, format="MP3", subtype="MPEG_LAYER_III")
    return out.getvalue()


@pytest.fixture(scope="module")
def trained_hearing_server():
    """`serve --hear` over the shipped E2B fixture that hears (trained: the words of a clip are judged), eager."""
    from gemma4lab.serving.background import BackgroundServer
    from gemma4lib.backends.registry import compile_graphs
    from gemma4lib.port import eos_ids, load_model
    from gemma4lib.server.launch import build_served

    settings = PortSettings(variant="e2b", backend="eager", hears=True, context_length=128, max_new_tokens=12)
    assert settings.model_source == "trained"
    model = load_model(settings)
    engine = compile_graphs(model, settings).runtime
    served = build_served(engine, model.tokenizer, model_name="e2b", eos_ids=tuple(eos_ids(model)))
    with BackgroundServer(served) as background:
        yield background


def test_openai_client_sends_mp3_as_input_audio_and_for_transcription(trained_hearing_server):
    """OpenAI's `input_audio` format "mp3" and an MP3 upload to the transcription route, the MP3 made in the test
    from a shipped clip: decoded by libsndfile at 16 kHz (the WAV's length and soft-token count, lossy samples),
    the trained E2B's replies equal the WAV's (the clip's words; the spoken question answered); a corrupt MP3 is
    a clear 400."""
    import base64

    import openai
    from test_server import openai_client

    client = openai_client(trained_hearing_server)
    wav, mp3 = (CLIPS / "capital_of_france.wav").read_bytes(), mp3_of("capital_of_france.wav")
    heard, samples = audio.read_wav(mp3), audio.read_wav(wav)
    assert len(heard) == len(samples) and audio.soft_tokens(heard) == audio.soft_tokens(samples)
    assert 0 < float(abs(heard - samples).max()) < 0.1  # lossy, not silence

    def spoken(data: bytes, kind: str) -> str:  # task T2: the clip alone, a spoken question
        part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": kind}}
        reply = client.chat.completions.create(
            model="e2b", messages=[{"role": "user", "content": [part]}], max_tokens=12, temperature=0
        )
        return reply.choices[0].message.content

    assert spoken(mp3, "mp3") == spoken(wav, "wav") == "The capital of France is Paris."
    words = [client.audio.transcriptions.create(model="e2b", file=f).text for f in (("q.mp3", mp3), ("q.wav", wav))]
    assert words[0] == words[1] == audio.shipped_text([wav])
    with pytest.raises(openai.BadRequestError) as caught:
        client.audio.transcriptions.create(model="e2b", file=("clip.mp3", mp3[:64] + bytes(4096)))
    assert caught.value.body["param"] == "file" and "not a WAV file nor an MP3" in caught.value.body["message"]


# ---- the other backends: the gloo TP ranks and neuron (SDK stood in) ------------------------------------------
def test_audio_at_tp2_on_the_gloo_ranks():
    """TP 2 on the gloo ranks: the audio graph unsharded in the parent (it reads no K/V, as the vision graph),
    the decoder sharded; tokens and logits as transformers' `generate(input_features=...)`. The 12B passes the
    same way (docs/AUDIO.md); one variant here for CI's time."""
    record = run("e4b", ["capital_of_france.wav"], backend="cpu", tp_degree=2)
    assert record["compiler"] == "cpu-gloo-tp" and record["world"]["processes"] == 2 and record["ranks_agree"]
    assert record["seq_match"] and record["logits_match"] and not record["failed_checks"], record["failed_checks"]
    assert record["audio_graph"] == "unsharded, in the parent process (it reads no K/V)"
    assert record["audio"]["audio_graph"] == [1, 215, 128]


def test_audio_on_neuron_traces_its_own_artifact_beside_rank_0(tmp_path, monkeypatch):
    """Backend neuron with the SDK stood in (the decoder keys stubbed as tests/test_neuron_vision.py does;
    `torch_neuronx.trace` answers with a TorchScript module of fixed soft tokens and the eager graph's valid
    mask for the clip): the audio graph is traced once, with the media towers' flags, into its own cache entry
    under its own key (another clip length, another key; another prompt, the same), loaded on rank 0's core
    beside the decoder; the engine writes the loaded module's valid soft tokens; a second compile reuses it."""
    import gc
    import types

    from conftest import held_cores, release_core_claims
    from test_neuron_vision import _stub_decoder
    from torch import nn

    from gemma4lib.backends import neuron, registry
    from gemma4lib.device.build import audio_graph
    from gemma4lib.port import load_model, prompt_rows
    from gemma4lib.recipes import neuron_env, neuron_vision

    monkeypatch.setenv("GEMMA4LIB_INSTANCE_TYPE", "inf2.8xlarge")
    monkeypatch.setattr(neuron_env, "require_sdk", lambda *a, **k: None)
    clip = str(CLIPS / "france.wav")
    settings = PortSettings(variant="e2b", model="random", backend="neuron", audio=[clip], cache_dir=str(tmp_path))
    model = load_model(settings)
    graph = audio_graph(model, settings)
    media = prompt_rows(model, settings)[0].media.prompt
    features, valid = media.audio[0]
    with torch.no_grad():
        _, kept = graph(features[None], valid[None].to(torch.int32))
    pattern = torch.arange(kept.numel() * model.config.hidden_size, dtype=torch.float32).reshape(*kept.shape, -1)

    class Traced(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("pattern", pattern)
            self.register_buffer("kept", kept)

        def forward(self, features: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.pattern.to(features.dtype), self.kept

    traces, placements = [], []

    class Cores:
        def __init__(self, start_nc=-1, nc_count=-1):
            placements.append((start_nc, nc_count))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def trace(func, example_inputs, **kwargs):
        traces.append({"func": func, "shapes": [tuple(t.shape) for t in example_inputs], **kwargs})
        return torch.jit.script(Traced())

    sdk = types.SimpleNamespace(trace=trace, neuron_cores_context=Cores)
    monkeypatch.setattr(neuron_env, "require", lambda module, purpose="": sdk)
    decoders = _stub_decoder(monkeypatch, model)
    release_core_claims()
    try:
        compiled = registry.compile_graphs(model, settings)
        assert len(traces) == 1 and traces[0]["compiler_args"] == neuron_vision.compiler_args()
        assert traces[0]["shapes"] == [(1, len(features), 128), (1, len(features))]
        assert placements == [(0, 1)] and sorted(held_cores()) == [(0, 0), (0, 0)]  # decoder and audio: core 0
        artifacts = compiled.info["artifacts"]
        assert set(artifacts) == {"decoder", "audio"} and (Path(artifacts["audio"]) / "audio.pt").is_file()
        assert torch.equal(compiled.runtime.audio_tokens(media), pattern[kept])
        args = neuron_vision.COMPILER_ARGS
        key = neuron.tower_cache_key(model, graph, args)[0]
        other = PortSettings(variant="e2b", model="random", audio=[str(CLIPS / "capital_of_france.wav")])
        assert neuron.tower_cache_key(model, audio_graph(model, other), args)[0] != key
        again = PortSettings(variant="e2b", model="random", audio=[clip], prompt="Say it twice.")
        assert neuron.tower_cache_key(model, audio_graph(model, again), args)[0] == key
        del compiled, decoders[:]
        gc.collect()
        assert registry.compile_graphs(model, settings).cache_hits == [True, True] and len(traces) == 1
    finally:
        release_core_claims()
