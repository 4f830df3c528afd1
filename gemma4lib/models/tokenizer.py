"""A small tokenizer with Gemma-4's special tokens, ids and chat template, for the tiny trained models.

No Gemma-4 tokenizer ships in any package (the real one comes with the checkpoint), so the tiny
fixtures use this stand-in. It shares with the real one what the host runtime depends on: the special
tokens at the real ids (`<pad>` 0, `<eos>` 1, `<bos>` 2, `<|turn>` 105, `<turn|>` 106); `<bos>` added
by plain `tokenizer(text)` but rendered by the chat template itself; the chat template; and Gemma 3's
`<start_of_turn>` / `<end_of_turn>` NOT special, so in a prompt they split into ordinary pieces, the
failure the real tokenizer shows. The rest is a byte-level BPE learnt from the synthetic corpus.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import CheckpointError, MissingChatTemplateError

PAD, EOS, BOS, TURN_OPEN, TURN_CLOSE = "<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>"
PAD_ID, EOS_ID, BOS_ID, TURN_OPEN_ID, TURN_CLOSE_ID = 0, 1, 2, 105, 106


def load_tokenizer(path: str | Path):
    """Load a saved tokenizer (the shipped fixture's, or `gemma4lab.training.tokenizer.save_tokenizer`'s)
    and check its specials."""
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        raise CheckpointError(
            f"{path} has no tokenizer.json; build one with "
            f"`gemma4lab.training.tokenizer.save_tokenizer(build_tokenizer(), path)`"
        )
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path))
    check_special_ids(tokenizer)
    return tokenizer


def check_special_ids(tokenizer) -> None:
    """Raise if the Gemma-4 special tokens are not at their real ids."""
    expected = {PAD: PAD_ID, EOS: EOS_ID, BOS: BOS_ID, TURN_OPEN: TURN_OPEN_ID, TURN_CLOSE: TURN_CLOSE_ID}
    got = {t: tokenizer.convert_tokens_to_ids(t) for t in expected}
    if got != expected:
        raise CheckpointError(f"tokenizer special ids {got} differ from Gemma-4's {expected}")
    if (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id) != (PAD_ID, EOS_ID, BOS_ID):
        raise CheckpointError("tokenizer pad/eos/bos are not <pad>/<eos>/<bos>")


def require_chat_template(tokenizer, source: str = "this tokenizer") -> None:
    """Refuse a tokenizer that cannot render Gemma-4's chat format (no `chat_template`)."""
    if not getattr(tokenizer, "chat_template", None):
        raise MissingChatTemplateError(
            f"{source} has no chat template (chat_template.jinja, or chat_template in tokenizer_config.json); "
            f"without it a chat prompt would be sent as plain text, with no <|turn> markers: the model answers "
            f"nonsense and the device reproduces it, so SEQ_MATCH passes on garbage. Download the checkpoint's "
            f"chat_template.jinja again (e.g. `hf download <hub id> chat_template.jinja --local-dir <folder>`), "
            f"or for a base model encode a completion prompt with encode_prompt(..., chat=False)"
        )
