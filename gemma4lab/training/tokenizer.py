"""Building the tiny fixtures' tokenizer (`gemma4lib.models.tokenizer` says what it shares with the real
one): a byte-level BPE learnt from the synthetic corpus, Gemma-4's specials at their ids, its chat
template."""

from __future__ import annotations

from pathlib import Path

from gemma4lab.training.corpus import tokenizer_texts
from gemma4lib.models.tokenizer import BOS, BOS_ID, EOS, PAD, TURN_CLOSE, TURN_CLOSE_ID, TURN_OPEN, TURN_OPEN_ID

DEFAULT_VOCAB_SIZE = 1024
# Gemma-4's format. Assistant turns are written with role "model"; contents are stripped.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<|turn>' + role + '\\n' + (message['content'] | trim) + '<turn|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|turn>model\\n' }}{% endif %}"
)


def special_tokens() -> list[str]:
    """Special tokens in id order: index == id (0..106)."""
    tokens = [PAD, EOS, BOS] + [f"<unused{i}>" for i in range(3, TURN_OPEN_ID)] + [TURN_OPEN, TURN_CLOSE]
    assert tokens.index(TURN_OPEN) == TURN_OPEN_ID and tokens.index(TURN_CLOSE) == TURN_CLOSE_ID
    return tokens


def build_backend(texts: list[str] | None = None, vocab_size: int = DEFAULT_VOCAB_SIZE):
    """The raw `tokenizers.Tokenizer`: byte-level BPE trained on `texts` (default: the corpus).

    `vocab_size` is a cap; with the default corpus the merges run out first (810 tokens).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if texts is None:
        # The role names of the chat template are learnt too: one token each, as in Gemma's vocabulary.
        texts = tokenizer_texts() + ["user\n", "model\n"]
    specials = special_tokens()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in specials],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)]
    )
    for i, t in enumerate(specials):
        if tok.token_to_id(t) != i:
            raise AssertionError(f"special token {t!r} landed at id {tok.token_to_id(t)}, not {i}")
    return tok


def wrap(backend):
    """Wrap a backend tokenizer as a transformers fast tokenizer with the Gemma-4 chat template."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=None,
        padding_side="left",
        add_bos_token=True,
        add_eos_token=False,
        model_max_length=4096,
        chat_template=CHAT_TEMPLATE,
    )
    return tokenizer


def build_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE, texts: list[str] | None = None):
    """A deterministic tokenizer for the tiny trained models (same corpus → same vocabulary)."""
    return wrap(build_backend(texts, vocab_size))


def save_tokenizer(tokenizer, path: str | Path) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(path))
    return path
