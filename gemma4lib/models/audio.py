"""The host side of an audio prompt (issue 50): read a WAV, transformers' `Gemma4AudioFeatureExtractor`
log-mel and mask by its numpy operations (bit-equal), the 12B's raw frames, the soft tokens by
`Gemma4Processor`'s rule, the placeholders; the tiny random model that hears (`build_random_hearing`)."""

from __future__ import annotations

import hashlib
import io
import json
import wave
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import AudioInputError

HEARING_VARIANTS = ("e2b", "e4b", "12b")  # the released configs with an audio_config (31B, 26B-A4B: null)
RATE, MAX_SECONDS = 16_000, 30  # the extractor's rate; its max_length 480,000 samples (750 soft tokens)
FRAME, HOP, FFT, MELS, PAD_TO, MEL_FLOOR = 320, 160, 512, 128, 128, 1e-3  # 20 ms window, 10 ms hop
TRANSCRIBE = "Transcribe the audio."  # the port's default prompt after the clips (the fixtures' task T1)
UNIFIED_SAMPLES = 640  # the 12B: raw 40 ms frames, one soft token each
# the tiny tokenizer's fillers 6, 7, 8 carry the released audio tokens `<|audio>`, `<audio|>`, `<|audio|>`
BOA_ID, EOA_ID, AUDIO_TOKEN_ID = 6, 7, 8
# 2 layers of width 32; the first conv keeps 128 channels (the projection after it: (channels[0] // 4) * channels[1])
TINY_AUDIO = {
    "hidden_size": 32,
    "num_attention_heads": 2,
    "num_hidden_layers": 2,
    "subsampling_conv_channels": [128, 4],
    "output_proj_dims": 32,
}


def _mel_filters() -> np.ndarray:
    """transformers' `mel_filter_bank` (HTK scale, no norm, float64): triangles over the rfft bins."""
    mels = np.linspace(0.0, 2595.0 * np.log10(1.0 + 8000.0 / 700.0), MELS + 2)
    edges = 700.0 * (np.power(10, mels / 2595.0) - 1.0)
    slopes = edges[None, :] - np.linspace(0, RATE // 2, FFT // 2 + 1)[:, None]
    down, up = -slopes[:, :-2] / np.diff(edges)[:-1], slopes[:, 2:] / np.diff(edges)[1:]
    return np.maximum(np.zeros(1), np.minimum(down, up))


_WINDOW = np.hanning(FRAME + 1)[:-1].astype(np.float32)  # periodic Hann
_FILTERS = _mel_filters()


def read_wav(source: str | Path | bytes) -> np.ndarray:
    """The float32 samples of a 16 kHz 16-bit WAV or 16 kHz MP3 (path or bytes), channels averaged; other
    rates are refused: a resampler here would not be transformers' (torchcodec or soxr)."""
    name = "the audio data" if isinstance(source, bytes) else repr(str(source))
    try:
        raw = source if isinstance(source, bytes) else Path(source).read_bytes()
        if raw[:3] == b"ID3" or raw[:2] >= b"\xff\xe0":  # an ID3 tag or an MPEG frame's sync bits: an MP3
            try:
                import soundfile  # its wheel's libsndfile (>= 1.1 decodes MPEG), pinned in the `serve` extra
            except ImportError:
                raise AudioInputError("an MP3 needs `soundfile` (pip install -e '.[serve]'); or send a WAV") from None
            samples, rate, width = *soundfile.read(io.BytesIO(raw), dtype="float32", always_2d=True), 2
        else:
            with wave.open(io.BytesIO(raw), "rb") as clip:
                rate, width, channels = clip.getframerate(), clip.getsampwidth(), clip.getnchannels()
                data = clip.readframes(clip.getnframes())
            samples = np.frombuffer(data[: len(data) // (2 * channels) * 2 * channels], "<i2").reshape(-1, channels)
            samples = samples.astype(np.float32) / 32768.0
    except (wave.Error, EOFError, OSError, RuntimeError) as error:  # soundfile's LibsndfileError is a RuntimeError
        raise AudioInputError(f"{name} is not a WAV file nor an MP3 ({error}); send a 16 kHz WAV or MP3") from None
    if width != 2 or rate != RATE:
        raise AudioInputError(
            f"{name} is {8 * width}-bit at {rate} Hz; Gemma-4 hears 16-bit PCM at {RATE} Hz: convert it first, "
            f"e.g. `ffmpeg -i IN -ar {RATE} -ac 1 -sample_fmt s16 OUT.wav`"
        )
    return check_length(samples.mean(axis=1, dtype=np.float32))


def check_length(samples: np.ndarray) -> np.ndarray:
    """Refuse a clip over 30 s (transformers would cut it silently) or too short for one soft token."""
    if len(samples) > RATE * MAX_SECONDS:
        raise AudioInputError(
            f"the clip is {len(samples) / RATE:.2f} s; Gemma-4 hears at most {MAX_SECONDS} s (750 soft tokens) "
            f"per clip: cut it into clips of at most {MAX_SECONDS} s"
        )
    if len(samples) < FRAME // 2 + 1:
        raise AudioInputError(f"the clip has {len(samples)} samples, too short for one soft token; send over 10 ms")
    return samples


def log_mel(samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The extractor's (features [frames, 128] float32, mask [frames] bool) for one clip: padded to a
    multiple of 128 samples, 160 zeros before (semicausal), a frame valid when its last sample is real."""
    n = len(check_length(samples))
    padded = np.pad(samples.astype(np.float32), (FRAME // 2, -n % PAD_TO))
    frames = np.lib.stride_tricks.sliding_window_view(padded, FRAME + 1)[None, ::HOP, :-1] * _WINDOW
    spectrum = np.log(np.matmul(np.abs(np.fft.rfft(frames, n=FFT, axis=-1)), _FILTERS) + np.array(MEL_FLOOR))
    mask = _valid_frames(n)
    return spectrum[0].astype(np.float32) * mask[:, None], mask


def _valid_frames(n: int) -> np.ndarray:
    """`log_mel`'s mask from the clip's length alone (no spectrum): the soft-token count needs only this."""
    real = np.pad(np.ones(n, dtype=np.int32), (FRAME // 2, -n % PAD_TO))
    return real[np.arange((len(real) - FRAME - 1) // HOP + 1) * HOP + FRAME].astype(bool)


CLIPS_DIR = Path(__file__).resolve().parent.parent / "fixtures" / "audio"  # the shipped clips, PROVENANCE.json


def shipped_text(clips: Sequence[Any]) -> str | None:
    """The words of one shipped clip (a path or bytes matched by sha256 in the clips' PROVENANCE.json), what
    a transcription must say; None for anything else (no coherence rule applies)."""
    if len(clips) != 1 or not isinstance(clips[0], (str, Path, bytes)):
        return None
    data = clips[0] if isinstance(clips[0], bytes) else Path(clips[0]).read_bytes()
    files = json.loads((CLIPS_DIR / "PROVENANCE.json").read_text())["files"]
    return next((f["text"] for f in files.values() if f["sha256"] == hashlib.sha256(data).hexdigest()), None)


def features(samples: np.ndarray, unified: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The audio graph's input for one clip, (values [frames, width], valid [frames] bool): the log-mel, or
    for the 12B transformers' unified extractor's raw 640-sample frames (zero-padded at the end, all valid)."""
    if not unified:
        return log_mel(samples)
    n = len(check_length(samples))
    frames = np.pad(samples.astype(np.float32), (0, -n % UNIFIED_SAMPLES)).reshape(-1, UNIFIED_SAMPLES)
    return frames, np.ones(len(frames), dtype=bool)


def graph_shape(clips: Sequence[Any], unified: bool = False) -> tuple[int, int, int]:
    """The audio graph's (clips a call, frames, values a frame) for `clips` (paths, bytes): one a call at the
    longest one's frames, as transformers pads them; none (a server that hears): 30 s."""
    samples = [read_wav(c) for c in clips] or [np.zeros(RATE * MAX_SECONDS, np.float32)]
    return 1, max(len(features(s, unified)[0]) for s in samples), UNIFIED_SAMPLES if unified else MELS


def soft_tokens(samples: np.ndarray, unified: bool = False) -> int:
    """The placeholder count: the mel mask through the encoder's two stride-2 convolutions (every 4th
    frame), or for the 12B one per started 640-sample frame."""
    if unified:
        return -(-len(check_length(samples)) // UNIFIED_SAMPLES)
    return int(_valid_frames(len(check_length(samples)))[::4].sum())


def expand_audio(tokenizer: Any, rendered: list[int], clips: Sequence[np.ndarray], unified: bool = False) -> list[int]:
    """Each audio token of the rendered prompt (the chat template's `{"type": "audio"}` part) becomes
    boa + that clip's soft tokens + eoa, with the tokenizer's own tokens (released: `<|audio>`,
    `<|audio|>`, `<audio|>`), as transformers' processor expands them."""
    from .vision import expand_image_tokens

    names = [getattr(tokenizer, name, None) for name in ("audio_token", "boa_token", "eoa_token")]
    if None in names:
        raise AudioInputError("no audio tokens in this tokenizer: load a model that hears (e2b, e4b, 12b; 'random')")
    token, begin, end = tokenizer.convert_tokens_to_ids(names)
    if rendered.count(token) != len(clips):
        raise AudioInputError(
            f'{len(clips)} clips for {rendered.count(token)} audio parts in the prompt; give one {{"type": "audio"}} '
            "content part per clip"
        )
    return expand_image_tokens(rendered, [soft_tokens(clip, unified) for clip in clips], token, begin, end)


def build_random_hearing(variant: str = "e2b", seed: int = 0) -> Any:
    """A seeded random-weight tiny multimodal model that hears (no tokenizer): `build_random_multimodal`'s
    with an audio part added (`with_hearing`)."""
    from . import vision
    from .weights_identity import declare_identity

    base = vision.build_random_multimodal(variant, seed=seed)
    full = with_hearing(base.variant, base.multimodal, seed)
    model = vision.loaded(base.variant, full.eval(), None, base.processor, f"tiny-random-audio(seed={seed})")
    declare_identity(model.lm, f"tiny-random-audio-lm:{base.variant.name}:{seed}")
    return model


def with_hearing(variant: Any, multimodal: Any, seed: int = 0) -> Any:
    """`multimodal` (a tiny vision model: random, or the fixture the hearing recipe trains) rebuilt with an
    audio part, its weights kept: E2B/E4B the `TINY_AUDIO` conformer, the 12B its encoder-free 640-sample
    frame embedder, seeded apart; the audio token ids are this module's."""
    import torch
    import transformers

    from .checkpoint import conditional_class

    unified = variant.unified
    part = transformers.Gemma4UnifiedAudioConfig() if unified else transformers.Gemma4AudioConfig(**TINY_AUDIO)
    ids = dict(audio_token_id=AUDIO_TOKEN_ID, boa_token_id=BOA_ID, eoa_token_id=EOA_ID, eoa_token_index=EOA_ID)
    config = multimodal.config.to_dict() | ids | {"audio_config": part.to_dict()}
    config = (transformers.Gemma4UnifiedConfig if unified else transformers.Gemma4Config)(**config)
    with torch.random.fork_rng():
        torch.manual_seed(seed + 1000)
        full = conditional_class(variant)._from_config(
            config, dtype=torch.float32, attn_implementation=variant.attn_implementation
        )
        projection = full.model.embed_audio.embedding_projection  # soft tokens at the word embeddings' size
        torch.nn.init.normal_(projection.weight, std=2.0 / projection.in_features**0.5)
    missing, unexpected = full.load_state_dict(multimodal.state_dict(), strict=False)
    if unexpected or any("audio" not in name for name in missing):
        raise AssertionError(f"the hearing model lost weights: {unexpected[:3]} {missing[:3]}")
    full.tie_weights()
    return full
