"""The tool corpus's encoding (gemma4lab.training.tools): which reply tokens are the copies the fine-tune
weights and diagnoses, and the padding it shares with the plain chats."""

import random

import torch

from gemma4lab.training.corpus import Chat
from gemma4lab.training.text import IGNORE, encode_chats, pad_rows
from gemma4lab.training.tokenizer import with_tools_template
from gemma4lab.training.tools import (
    ASKED,
    NAME,
    OTHER,
    VALUE,
    ToolConfig,
    encode_tool_chats,
    kind_shares,
    retrieval_eval_chats,
    token_kinds,
    tool_chat,
)
from gemma4lib.models.tokenizer import load_tokenizer
from gemma4lib.models.trained import TOKENIZER_DIR


def _tokenizer():
    return with_tools_template(load_tokenizer(TOKENIZER_DIR))


def test_pad_rows_labels_only_the_reply_shifted_by_one():
    batch = pad_rows([([5, 6, 7], [8, 9]), ([5], [4])], pad_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 4, 0, 0, 0]]
    assert batch.labels.tolist() == [[IGNORE, IGNORE, 8, 9, IGNORE], [4, IGNORE, IGNORE, IGNORE, IGNORE]]
    assert batch.prompt_lengths == [3, 1]


def test_plain_chats_still_end_with_eos():
    tok = _tokenizer()
    batch = encode_chats(tok, [Chat("What is the capital of France?", "The capital of France is Paris.")])
    reply = batch.labels[0][batch.labels[0] != IGNORE].tolist()
    assert tok.decode(reply) == "The capital of France is Paris.<eos>"


def test_token_kinds_mark_the_called_name_the_copied_argument_and_the_used_result():
    tok = _tokenizer()
    rng = random.Random(0)
    call = tool_chat(rng, "capital_call", "France")
    answer = tool_chat(rng, "capital_answer", "France", capital_result="Zanmor")
    weather = tool_chat(rng, "weather_answer", "France")
    chats = [call, answer, weather]
    batch = encode_tool_chats(tok, chats)
    kinds = token_kinds(tok, chats, batch)

    def text_of(row: int, kind: int) -> str:
        picked = (kinds[row] == kind) & (batch.labels[row] != IGNORE)
        return tok.decode(batch.labels[row][picked].tolist())

    assert text_of(0, NAME) == "get_capital" and text_of(0, VALUE) == "France"
    # the result as the answer spells it; a lone space piece before it (" Zanmor" is "Ġ", "Z", ...) is not weighted
    assert text_of(1, VALUE) == "Zanmor" and text_of(1, NAME) == ""
    assert text_of(1, ASKED) == " France" and text_of(0, ASKED) == ""  # the question's country, in the answer
    assert text_of(2, ASKED) == " Paris" and text_of(2, VALUE).strip() == weather.value  # the city, the result
    assert torch.all(kinds[batch.labels == IGNORE] == OTHER)


def test_retrieval_chats_repeat_the_asked_country_after_a_growing_gap_in_the_calls_form():
    """The curriculum's chats: no tools, the question's country or city as the reply's value (marked VALUE, so
    weighted and diagnosed), further from the question as the gap grows; off unless configured."""
    tok = _tokenizer()
    chats = retrieval_eval_chats(tok, (10, 30, 70))
    assert ToolConfig().retrieval_steps == 0  # the recorded runs had no curriculum
    batch = encode_tool_chats(tok, chats)
    kinds = token_kinds(tok, chats, batch)
    distance: dict[str, list[int]] = {}
    for row, chat in enumerate(chats):
        assert chat.tools == [] and chat.value in str(chat.messages[-1]["content"])
        picked = (kinds[row] == VALUE) & (batch.labels[row] != IGNORE)
        assert tok.decode(batch.labels[row][picked].tolist()).strip() == chat.value
        distance.setdefault(chat.kind, []).append(batch.prompt_lengths[row])
    means = [sum(d) / len(d) for d in (distance["retrieve_10"], distance["retrieve_30"], distance["retrieve_70"])]
    assert means[0] + 15 < means[1] and means[1] + 30 < means[2]
    assert any(c.reply.startswith(('country:<|"|>', 'city:<|"|>')) for c in chats)  # the no-space form a call needs


def test_result_retrieval_chats_copy_a_quoted_result_into_an_answers_spelling():
    """The curriculum's result chats (off unless configured): a tool result's quoted value in the user turn, the
    reply repeating it as an answer spells it (its pieces marked VALUE); and the kinds' shares parse by name."""
    tok = _tokenizer()
    assert ToolConfig().retrieval_result_share == 0.0
    chats = [c for c in retrieval_eval_chats(tok, (10, 30), results=True) if c.kind.startswith("retrieve_result")]
    assert len(chats) == 2 * 34
    batch = encode_tool_chats(tok, chats)
    kinds = token_kinds(tok, chats, batch)
    for row, chat in enumerate(chats):
        assert f'value:<|"|>{chat.value}<|"|>' in chat.messages[-1]["content"] and chat.reply.endswith(
            f" {chat.value}."
        )
        picked = (kinds[row] == VALUE) & (batch.labels[row] != IGNORE)
        assert tok.decode(batch.labels[row][picked].tolist()).strip() == chat.value
    assert dict(kind_shares("weather_answer=0.3"))["weather_answer"] == 0.3
    assert dict(kind_shares(""))["capital_call"] == 0.3


def test_made_up_results_are_unseen_names_of_any_letters_and_the_options_fail_early():
    """A made-up capital result is never a real capital nor the tests' held-out "Lutetia", and is drawn from
    any letters (the copy it teaches is of any piece); the recorded runs' syllable names stay drawable."""
    import re

    import pytest

    from gemma4lab.training.tools import _SYLLABLES, HELD_OUT_RESULT, result_name, retrieval_gaps
    from gemma4lib.models.corpus import COUNTRIES

    rng = random.Random(0)
    names = [result_name(rng) for _ in range(2000)]
    assert not {HELD_OUT_RESULT, *dict(COUNTRIES).values()} & set(names)
    assert set("".join(names).lower()) == set("abcdefghijklmnopqrstuvwxyz") and len(set(names)) > 1900
    runs = re.compile(f"({'|'.join(_SYLLABLES)}){{2,3}}")  # a run of two or three training syllables
    assert all(runs.fullmatch(result_name(rng, "syllables").lower()) for _ in range(200))
    with pytest.raises(ValueError, match="use one of"):
        result_name(rng, "real")
    assert retrieval_gaps("0,4,70") == (0, 4, 70)
    with pytest.raises(ValueError, match="whole numbers"):
        retrieval_gaps("0,x")


def test_thinking_kinds_render_the_switch_and_think_first_only_when_given_a_share():
    """The thinking kinds (`THOUGHT_KINDS`) are drawn and evaluated only with a share, so the runs recorded before
    them draw the same chats; their prompt carries `<|think|>` and their reply opens with a short thought in
    Gemma-4's channel that says what comes next (the answer, or the call)."""
    from gemma4lab.training.tools import (
        KINDS,
        THOUGHT_KINDS,
        draw_tool_chats,
        tool_eval_chats,
        tool_prompt_ids,
    )

    tok = _tokenizer()
    plain = tool_eval_chats()
    taught = tool_eval_chats(shares=kind_shares("capital_thought=0.15,capital_call_thought=0.15"))
    assert len(plain) == 34 * 6 and len(taught) == 34 * 8 and taught[: len(plain)] == plain
    assert not any(c.thinking for c in plain) and {c.kind for c in taught if c.thinking} == set(THOUGHT_KINDS)
    before = tuple((k, share) for k, share in KINDS if k not in THOUGHT_KINDS)  # the kinds of the recorded runs
    drawn = [(c.kind, c.reply) for c in draw_tool_chats(random.Random(4), 300)]
    assert drawn == [(c.kind, c.reply) for c in draw_tool_chats(random.Random(4), 300, shares=before)]
    assert not {kind for kind, _ in drawn} & set(THOUGHT_KINDS)
    thought = next(c for c in taught if c.kind == "capital_thought")
    call = next(c for c in taught if c.kind == "capital_call_thought")
    assert "<|think|>" in tok.decode(tool_prompt_ids(tok, thought.messages, thought.tools, thought.thinking))
    assert "<|think|>" not in tok.decode(tool_prompt_ids(tok, plain[0].messages, plain[0].tools))
    assert thought.reply.startswith("<|channel>thought\nI know the capital of ") and thought.reply.endswith(".")
    assert "<channel|>The capital of " in thought.reply and not thought.calls
    assert call.reply.startswith("<|channel>thought\nI will call get_capital for ") and call.calls
    assert "get_capital" in {t["function"]["name"] for t in call.tools}
    batch = encode_tool_chats(tok, [call])
    kinds = token_kinds(tok, [call], batch)
    value = tok.decode(batch.labels[0][kinds[0] == VALUE].tolist())
    assert value == call.reply.split('<|"|>')[1]  # the call's argument, weighted
