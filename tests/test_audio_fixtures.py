"""The vision fixtures that hear (issue 50, `scripts/train_audio.py`): with transformers' own processor and
greedy `generate(input_features=...)` (eager, no gemma4lib wiring), each transcribes the shipped clips
(T1) and answers the spoken capital question (T2); the shipped tokenizer gained the audio tokens and
still renders images and text as the vision tokenizer did."""

from __future__ import annotations

import pytest

from gemma4lab.training import hearing
from gemma4lib.models import audio, vision

# the fixtures shipped hearing (scripts/train_audio.py; PROVENANCE.json "audio"): add a variant when it ships
HEARING_FIXTURES: tuple[str, ...] = ("e2b", "e4b", "12b")  # the fixtures that hear (PROVENANCE.json `audio`)


@pytest.fixture(scope="module")
def tokenizer():
    from gemma4lib.models.tokenizer import load_tokenizer

    return load_tokenizer(vision.VISION_DIR / "tokenizer")


@pytest.mark.parametrize("name", HEARING_FIXTURES)
def test_fixture_transcribes_and_answers_the_shipped_clips(name, tokenizer):
    model = vision.load_vision_fixture(name).multimodal
    assert model.config.audio_config is not None
    got = {}
    for clip, (words, answer) in hearing.SHIPPED.items():
        samples = audio.read_wav(hearing.CLIPS / clip)
        got[(clip, "T1")] = (hearing.answer_clip(model, tokenizer, samples, "T1"), words)
        if answer is not None:
            got[(clip, "T2")] = (hearing.answer_clip(model, tokenizer, samples, "T2"), answer)
    wrong = {k: v for k, v in got.items() if v[0] != v[1]}
    assert not wrong, f"misanswered (got, expected): {wrong}"
    assert got[("capital_of_france.wav", "T2")][0] == "The capital of France is Paris."


def test_shipped_tokenizer_hears_and_renders_images_and_text_as_before():
    from gemma4lab.training.audio import AUDIO_TOKEN, BOA, EOA
    from gemma4lab.training.vision import vision_tokenizer
    from gemma4lib.models.tokenizer import load_tokenizer
    from gemma4lib.models.trained import load_trained

    tokenizer = load_tokenizer(vision.VISION_DIR / "tokenizer")  # its own copy: the processor adds to one it wraps

    before = vision_tokenizer(load_trained("e2b").tokenizer)
    assert tokenizer.convert_tokens_to_ids([BOA, EOA, AUDIO_TOKEN]) == [6, 7, 8]
    assert (tokenizer.audio_token, tokenizer.boa_token, tokenizer.eoa_token) == (AUDIO_TOKEN, BOA, EOA)
    renamed = {"<unused6>": BOA, "<unused7>": EOA, "<unused8>": AUDIO_TOKEN}
    assert {renamed.get(t, t): i for t, i in before.get_vocab().items()} == tokenizer.get_vocab()
    chats = [
        [{"role": "user", "content": "What is the capital of France?"}],
        vision.image_messages("What is in the image?", 2),
        [{"role": "user", "content": [{"type": "text", "text": " Hi "}, {"type": "image"}]}],
    ]
    for messages in chats:
        for kwargs in ({"tokenize": False}, {"tokenize": True, "return_dict": False}):
            assert tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs) == (
                before.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
            )
    spoken = tokenizer.apply_chat_template(hearing.transcribe_messages(), add_generation_prompt=True, tokenize=False)
    assert spoken == f"<bos><|turn>user\n{AUDIO_TOKEN}{hearing.TRANSCRIBE}<turn|>\n<|turn>model\n"


def test_distill_rehearsal_holds_the_decoder_to_its_own_logits_before_hearing():
    """`HearTrainConfig.rehearse`: the KL is zero at the teacher's distribution and positive away from it,
    only the label positions count, and "both" adds the CE the default ("ce") uses alone."""
    import torch

    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    labels = torch.full((2, 5), -100)
    labels[:, 2:4] = torch.tensor([[3, 7], [1, 1]])
    teacher = logits.log_softmax(-1)
    ce = torch.nn.functional.cross_entropy(logits[labels != -100], labels[labels != -100])
    assert torch.allclose(hearing.rehearsal_loss(logits, labels, None, "ce"), ce)
    assert float(hearing.rehearsal_loss(logits, labels, teacher, "distill")) == pytest.approx(0.0, abs=1e-6)
    assert torch.allclose(hearing.rehearsal_loss(logits, labels, teacher, "both"), ce)
    moved = teacher.clone()
    moved[:, :2] = torch.randn(2, 2, 11).log_softmax(-1)  # off the label positions: not counted
    assert float(hearing.rehearsal_loss(logits, labels, moved, "distill")) == pytest.approx(0.0, abs=1e-6)
    away = torch.randn(2, 5, 11).log_softmax(-1)
    assert float(hearing.rehearsal_loss(logits, labels, away, "distill")) > 0.1


def test_vision_repair_hash_covers_all_but_the_vision_part_and_the_decoder_subset_is_the_last_layers():
    """`vision_repair.frozen_sha256` (the repair's proof that text and audio were not touched) moves with any
    decoder or audio weight and ignores the vision part's; `hearing.decoder_trains` picks the last N layers and
    the final norm (all of the decoder at 0)."""
    import torch
    from torch import nn

    from gemma4lab.training import vision_repair

    model = nn.Module()
    model.model = nn.Module()
    model.model.embed_vision = nn.Linear(3, 2)
    model.model.embed_audio = nn.Linear(3, 2)
    model.model.language_model = nn.Linear(2, 2)
    assert vision_repair.repair_parameters(model) == list(model.model.embed_vision.parameters())
    before = vision_repair.frozen_sha256(model)
    with torch.no_grad():
        model.model.embed_vision.weight.add_(1.0)
    assert vision_repair.frozen_sha256(model) == before
    for part in (model.model.embed_audio, model.model.language_model):
        with torch.no_grad():
            part.bias[0] = torch.nextafter(part.bias[0], torch.tensor(1e9))  # one ulp
        assert vision_repair.frozen_sha256(model) != before
        before = vision_repair.frozen_sha256(model)
    names = [f"model.language_model.layers.{i}.mlp.up_proj.weight" for i in range(6)]
    names += ["model.language_model.norm.weight", "model.language_model.embed_tokens.weight", "model.embed_audio.x"]
    assert [n for n in names if hearing.decoder_trains(n, 6, 2)] == names[4:7]
    assert [n for n in names if hearing.decoder_trains(n, 6, 0)] == names[:8]
