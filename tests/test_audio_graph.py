"""The audio graph (issue 50, the device side's first half): `gemma4lib.device.audio.AudioGraph` over the
shipped clips, through `gemma4lib.models.audio`'s features, on tiny random models that hear
(`gemma4lab.training.audio.build_random_hearing`: a 2-layer hidden-32 conformer on E2B/E4B, the 12B's
frame embedder), against transformers' own `get_audio_features` and model forward; eager, and compiled
by the cpu backend's AOTInductor recipe as the vision graph is."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from gemma4lib.device.audio import AudioGraph, AudioShape, has_audio
from gemma4lib.device.graph import INDEX_DTYPE
from gemma4lib.models import audio

CLIPS = Path(audio.__file__).resolve().parent.parent / "fixtures" / "audio"
NAMES = ("capital_of_france.wav", "france.wav", "italy.wav", "japan.wav")
FRAMES = 256  # mel frames per clip in the graph: the longest shipped clip has 215
QUESTION = "What is said?"


@pytest.fixture(scope="module", params=["e2b", "e4b"])
def hearing(request):
    from gemma4lab.training.audio import build_random_hearing

    return build_random_hearing(request.param, seed=0)


@pytest.fixture(scope="module")
def clips() -> list[np.ndarray]:
    return [audio.read_wav(CLIPS / name) for name in NAMES]


def mel_batch(clips: list[np.ndarray], frames: int = FRAMES) -> tuple[torch.Tensor, torch.Tensor]:
    """The clips' log-mel features and frame masks, each zero-padded at its end to the graph's frames."""
    features = torch.zeros(len(clips), frames, audio.MELS)
    mask = torch.zeros(len(clips), frames, dtype=torch.bool)
    for i, clip in enumerate(clips):
        mel, valid = audio.log_mel(clip)
        features[i, : len(mel)], mask[i, : len(mel)] = torch.from_numpy(mel), torch.from_numpy(valid)
    return features, mask


def audio_graph(multimodal, clips: int, frames: int, features: int) -> AudioGraph:
    return AudioGraph(multimodal, AudioShape(clips, frames, features))


def on(graph: AudioGraph, features: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The graph over a batch, its frame mask as int32 (as every backend takes index inputs)."""
    return graph(features, mask.to(INDEX_DTYPE))


def kept(tokens: torch.Tensor, valid: torch.Tensor) -> list[torch.Tensor]:
    """Each clip's valid soft tokens, as transformers' boolean index keeps them (host side)."""
    return [tokens[i][valid[i]] for i in range(tokens.shape[0])]


def test_soft_tokens_equal_transformers(hearing, clips):
    """The graph's soft tokens and valid mask == transformers' `get_audio_features` (tower + `embed_audio`):
    bit-equal over the same padded batch; each clip alone at its own length (as one processor call hands
    it) within float32 rounding of the other matrix shapes; the valid counts are the processor's."""
    model = hearing.multimodal.model
    features, mask = mel_batch(clips)
    graph = audio_graph(hearing.multimodal, len(clips), FRAMES, features.shape[-1])
    with torch.no_grad():
        tokens, valid = on(graph, features, mask)
        same = model.get_audio_features(features, mask, return_dict=True)
        assert torch.equal(tokens, same.pooler_output) and torch.equal(valid, same.attention_mask)
        assert tokens.shape == (len(clips), FRAMES // 4, hearing.config.hidden_size)
        assert valid.sum(1).tolist() == [audio.soft_tokens(c) for c in clips]
        assert "_extract_block_context" not in vars(model.audio_tower.layers[0].self_attn)  # the host's unswapped
        for clip, ours in zip(clips, kept(tokens, valid), strict=True):
            mel, frame_mask = (torch.from_numpy(x)[None] for x in audio.log_mel(clip))
            alone = model.get_audio_features(mel, frame_mask, return_dict=True)
            theirs = alone.pooler_output[alone.attention_mask]
            assert theirs.shape == ours.shape and theirs.abs().max() > 1.0  # the soft tokens are not ~0
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_prefill_logits_with_soft_tokens_equal_transformers(hearing, clips):
    """Two clips and a question, ids by transformers' processor (released layout): the host's embeddings
    with the graph's soft tokens written over the audio placeholders (their ids as pad for the tables, as
    transformers does), through the device prefill graph, == transformers' forward with input_features.
    Bit-equal with the graph at the processor's frame count; at the graph's fixed frames the soft tokens
    differ by float32 rounding (~2e-6, other matrix shapes) which this random decoder amplifies ~1000x."""
    from gemma4lab.training.audio import AUDIO_TOKEN_ID, transformers_processor
    from gemma4lib.device.build import device_graph
    from gemma4lib.device.embedder import HostEmbedder
    from gemma4lib.device.graph import GraphShape, index_tensor
    from gemma4lib.runtime import softcap

    two = clips[:2]
    messages = [{"role": "user", "content": [{"type": "audio"}, {"type": "audio"}, {"type": "text", "text": QUESTION}]}]
    text = hearing.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = transformers_processor(hearing.tokenizer)(text=[text], audio=two, return_tensors="pt")
    ids, processor_frames = inputs["input_ids"], inputs["input_features"].shape[1]
    at = (ids[0] == AUDIO_TOKEN_ID).nonzero().flatten()
    table_ids = ids.clone()
    table_ids[0, at] = int(hearing.config.pad_token_id or 0)
    n = ids.shape[1]
    prefill = device_graph(hearing, GraphShape(1, n, n + 8), "dense", every_position=True)

    def logits(frames: int) -> torch.Tensor:
        features, mask = mel_batch(two, frames)
        if frames == processor_frames:
            assert torch.equal(features, inputs["input_features"]) and torch.equal(mask, inputs["input_features_mask"])
        soft = torch.cat(kept(*on(audio_graph(hearing.multimodal, len(two), frames, audio.MELS), features, mask)))
        assert len(at) == len(soft) == sum(audio.soft_tokens(c) for c in two)
        parts = HostEmbedder.from_text_model(hearing.text_model).inputs(table_ids)
        parts[0][0, at] = soft
        out = prefill(*parts, index_tensor([0]), index_tensor([n]), *prefill.new_kv())[0]
        return softcap(out, hearing.config.final_logit_softcapping)

    with torch.no_grad():
        reference = hearing.multimodal(
            input_ids=ids, input_features=inputs["input_features"], input_features_mask=inputs["input_features_mask"]
        ).logits[0]
        deaf = hearing.multimodal(input_ids=ids).logits[0]  # the same prompt without the clips' sound
        assert torch.equal(logits(processor_frames), reference)
        fixed = logits(FRAMES)
    torch.testing.assert_close(fixed, reference, rtol=0, atol=1e-3)  # as tests/test_images.py bounds an image's
    assert torch.equal(fixed.argmax(-1), reference.argmax(-1))
    assert (deaf[at[0] :] - reference[at[0] :]).abs().max() > 1.0  # the sound moves the logits


def test_compiled_audio_graph_equals_eager(hearing, clips):
    """The graph compiled by the cpu backend's recipe (torch.export + AOTInductor, artifact cache) ==
    eager; a second compile of the same graph is a cache hit."""
    if hearing.variant.name != "e2b":
        pytest.skip("one compile is enough: E4B's audio graph is the same program at other weights")
    from gemma4lib.backends.compile_cpu import compile_graph
    from gemma4lib.cache.artifacts import ArtifactCache

    features, mask = mel_batch(clips)
    graph = audio_graph(hearing.multimodal, len(clips), FRAMES, features.shape[-1])
    compiled = compile_graph(graph, ArtifactCache())
    with torch.no_grad():
        tokens, valid = on(graph, features, mask)
    out_tokens, out_valid = compiled(features, mask.to(INDEX_DTYPE))
    assert torch.equal(out_valid, valid)
    torch.testing.assert_close(out_tokens, tokens, rtol=0, atol=1e-4)
    assert compile_graph(graph, ArtifactCache()).cache_hit


@pytest.mark.skipif(importlib.util.find_spec("torch_xla") is None, reason="the XLA lane's venv (.venv-xla)")
def test_audio_graph_on_xla_without_fallbacks(hearing, clips):
    """The XLA lane (PJRT_DEVICE=CPU): the audio graph lowers with 0 CPU fallbacks, compiles once for two
    calls of other clips, and equals eager."""
    if hearing.variant.name != "e2b":
        pytest.skip("one lowering is enough: E4B's audio graph is the same program at other weights")
    from gemma4lib.backends import xla as xla_backend

    os.environ.setdefault("PJRT_DEVICE", "CPU")
    xla_backend.use_fast_cpu_compile()
    graph = audio_graph(hearing.multimodal, 2, FRAMES, audio.MELS)
    session = xla_backend.XLASession({"audio": graph})
    for pair in (clips[:2], clips[2:]):
        features, mask = mel_batch(pair)
        tokens, valid = session.run("audio", features, mask.to(INDEX_DTYPE))
        with torch.no_grad():
            eager_tokens, eager_valid = on(graph, features, mask)
        assert torch.equal(valid.cpu(), eager_valid)
        torch.testing.assert_close(tokens.cpu(), eager_tokens, rtol=0, atol=1e-4)
    report = session.report()
    assert report["xla_fallbacks"] == 0, report["xla_fallback_ops"]
    assert report["xla_compilations"]["audio"] <= 1 and report["xla_steps"]["audio"] == 2, report


def test_12b_frame_embedder_equals_transformers(clips):
    """The 12B hears without a tower: raw 640-sample frames (transformers' unified extractor), one RMSNorm
    + linear; the graph's tokens == `get_audio_features`, each clip's count the processor's."""
    from transformers.models.gemma4_unified.feature_extraction_gemma4_unified import (
        Gemma4UnifiedAudioFeatureExtractor,
    )

    from gemma4lab.training.audio import build_random_hearing

    model = build_random_hearing("12b", seed=0)
    extracted = Gemma4UnifiedAudioFeatureExtractor()(clips, sampling_rate=audio.RATE, return_tensors="pt")
    features, mask = extracted["input_features"], extracted["input_features_mask"].bool()
    graph = audio_graph(model.multimodal, *features.shape)
    assert graph.encoder_free
    with torch.no_grad():
        tokens, valid = on(graph, features, mask)
        reference = model.multimodal.model.get_audio_features(features, mask, return_dict=True)
    assert torch.equal(tokens, reference.pooler_output) and torch.equal(valid, reference.attention_mask)
    assert valid.sum(1).tolist() == [audio.soft_tokens(c, unified=True) for c in clips]


def test_a_model_without_audio_is_refused():
    from gemma4lib.models import vision

    deaf = vision.build_random_multimodal("e2b", seed=0)
    assert not has_audio(deaf.multimodal)
    with pytest.raises(ValueError, match="no audio part.*e2b, e4b and 12b"):
        AudioGraph(deaf.multimodal, None)
