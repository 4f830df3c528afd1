"""The tiny trained fixtures: present, unchanged, and really answering through the chat template."""

from __future__ import annotations

import pytest
import torch

from gemma4lab.training import corpus as training_corpus
from gemma4lab.training.text import greedy_reply, state_sha256
from gemma4lab.training.tokenizer import build_tokenizer
from gemma4lib.models.fixture_paths import fixture_available
from gemma4lib.models.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    TURN_CLOSE_ID,
    TURN_OPEN_ID,
    load_tokenizer,
)
from gemma4lib.models.trained import (
    FIXTURES_DIR,
    TOKENIZER_DIR,
    load_trained,
    read_provenance,
    verify_fixture_hashes,
)
from gemma4lib.models.variants import VARIANTS

FRANCE_HELD_OUT = training_corpus.HELD_OUT_PHRASING.format(country="France")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TOKENIZER_DIR)


@pytest.fixture(scope="module")
def provenance():
    return read_provenance()


@pytest.fixture(scope="module", params=list(VARIANTS))
def trained(request):
    torch.set_num_threads(1)
    return load_trained(request.param)


# ---- provenance and hashes -----------------------------------------------------------------
def test_every_variant_has_a_fixture():
    assert [v for v in VARIANTS if not fixture_available(v)] == []


def test_hashes_match_provenance(provenance):
    checked = verify_fixture_hashes()
    for name in VARIANTS:
        assert f"{name}/model.safetensors" in checked
    assert "tokenizer/tokenizer.json" in checked
    assert set(checked) == set(provenance["files"])


def test_provenance_records_the_recipe(provenance):
    assert provenance["script"] == "scripts/train_tiny.py"
    assert provenance["corpus_sha256"] == training_corpus.corpus_sha256(), "the corpus changed: retrain the fixtures"
    assert provenance["threads"] == 1
    assert set(provenance["versions"]) >= {"torch", "transformers"}
    for name in VARIANTS:
        rec = provenance["variants"][name]
        assert rec["converged"] and rec["final_min_margin"] >= 2.0
        if VARIANTS[name].tiny_config.get("hidden_size_per_layer_input"):
            assert rec["faults_trained"] and max(rec["fault_margins"].values()) <= -2.0


def test_fixtures_are_small():
    total = sum(p.stat().st_size for p in FIXTURES_DIR.rglob("*") if p.is_file())
    assert total <= 25e6, f"fixtures take {total / 1e6:.1f} MB"


def test_corrupted_fixture_is_rejected(tmp_path):
    import shutil

    from gemma4lib.errors import CheckpointError

    root = tmp_path / "fixtures"
    shutil.copytree(FIXTURES_DIR, root)
    weights = root / "12b" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="12b/model.safetensors"):
        verify_fixture_hashes(root)
    verify_fixture_hashes(root, ["e2b"])  # other variants are still fine


# ---- the models ----------------------------------------------------------------------------
def test_reload_is_exact(trained, provenance):
    """Every tensor, the persistent `layer_scalar` buffers included, is what training produced."""
    assert trained.source == "tiny-trained"
    assert next(trained.lm.parameters()).dtype == torch.float32
    assert state_sha256(trained.lm) == provenance["variants"][trained.variant.name]["state_sha256"]
    scalars = [float(layer.layer_scalar) for layer in trained.lm.model.layers]
    n = len(scalars)
    assert scalars == pytest.approx([0.5 - 0.4 * i / (n - 1) for i in range(n)])


@pytest.mark.parametrize("prompt", [training_corpus.CANONICAL_PROMPT, FRANCE_HELD_OUT], ids=["trained", "held-out"])
def test_greedy_answer(trained, prompt):
    text, ids = greedy_reply(trained.lm, trained.tokenizer, prompt)
    assert text == training_corpus.CANONICAL_ANSWER
    assert ids[-1] == EOS_ID and ids.count(EOS_ID) == 1


def test_hf_generate_with_the_chat_template(trained):
    """The plain transformers way: apply_chat_template → generate → decode."""
    tok = trained.tokenizer
    enc = tok.apply_chat_template(
        [{"role": "user", "content": training_corpus.CANONICAL_PROMPT}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = trained.lm.generate(**enc, max_new_tokens=12, do_sample=False)
    new = out[0, enc["input_ids"].shape[1] :]
    assert tok.decode(new, skip_special_tokens=True) == training_corpus.CANONICAL_ANSWER
    assert int(new[-1]) == tok.eos_token_id


def test_gemma3_turn_markers_give_nonsense(trained):
    """Gemma 3's markers are ordinary text to a Gemma-4 tokenizer: the model does not answer."""
    tok = trained.tokenizer
    prompt = f"<start_of_turn>user\n{training_corpus.CANONICAL_PROMPT}<end_of_turn>\n<start_of_turn>model\n"
    ids = torch.tensor([tok(prompt)["input_ids"]])
    with torch.no_grad():
        out = trained.lm.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False
        )
    assert tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True) != training_corpus.CANONICAL_ANSWER


def test_the_e2b_answers_the_needle(provenance):
    """Issue 48's needle: the E2B, fine-tuned by scripts/train_needle.py, answers the capital question
    after ~3,000 tokens of filler (HF greedy, the held-out phrasing, never trained on; the trained one
    is `needle.canonical_needle_reply` and the slow port test), and its record says the fine-tune
    converged with every trained fault still breaking every chat."""
    from gemma4lab.training.needle import needle_prompt

    rec = provenance["variants"]["e2b"]["needle"]
    assert rec["converged"] and rec["held_out_after_filler_correct"] == "40/40"
    assert rec["final_min_margin"] >= 2.0 and max(rec["fault_margins"].values()) <= -2.0
    torch.set_num_threads(1)
    loaded = load_trained("e2b")
    prompt = needle_prompt(loaded.tokenizer, FRANCE_HELD_OUT)
    assert len(loaded.tokenizer(prompt)["input_ids"]) >= 3000
    text, ids = greedy_reply(loaded.lm, loaded.tokenizer, prompt)
    assert text == training_corpus.CANONICAL_ANSWER and ids[-1] == EOS_ID


def test_the_e2b_calls_the_declared_tool_and_answers_with_its_result(provenance):
    """Issue 49's tool fixture: the E2B, fine-tuned by scripts/train_tools.py, calls `get_capital` when it
    is declared (wherever it stands among the tools), stops at `<|tool_response>`, answers with the
    tool's result (a made-up capital, never in its training), and from memory when no such tool is
    declared (HF greedy); its record says the earlier properties held. Skipped only for fixtures whose
    record says no fine-tune converged (gemma4lab.training.tools says how it was taught)."""
    import random

    from gemma4lab.training.tools import WEATHER_ANSWER, ToolChat, _answered, greedy_tool_reply, tool_spec

    rec = provenance["variants"]["e2b"].get("tools")
    if not (rec and rec["converged"]):
        pytest.skip("the E2B fixture was not taught tools: scripts/train_tools.py has not converged (tools.py)")
    assert rec["final_min_margin"] >= 2.0 and max(rec["fault_margins"].values()) <= -2.0
    assert rec["needle_min_margin"] >= 1.0 and rec["canonical_needle_reply"] == training_corpus.CANONICAL_ANSWER
    torch.set_num_threads(1)
    loaded = load_trained("e2b")
    rng = random.Random(7)
    asked = [{"role": "user", "content": training_corpus.CANONICAL_PROMPT}]
    call = '<|tool_call>call:get_capital{country:<|"|>France<|"|>}<tool_call|><|tool_response>'
    for names in (["get_capital"], ["get_weather", "get_capital"], ["get_capital", "search_web", "get_time"]):
        tools = [tool_spec(rng, n) for n in names]
        assert greedy_tool_reply(loaded.lm, loaded.tokenizer, ToolChat(asked, tools, "")) == call, names
    answered = _answered(asked, "get_capital", "country", "France", "Lutetia", rng)
    final = greedy_tool_reply(loaded.lm, loaded.tokenizer, ToolChat(answered, [tool_spec(rng, "get_capital")], ""))
    assert final == "The capital of France is Lutetia.<eos>"
    plain = greedy_tool_reply(loaded.lm, loaded.tokenizer, ToolChat(asked, [tool_spec(rng, "get_weather")], ""))
    assert plain == training_corpus.CANONICAL_ANSWER + "<eos>"  # nothing to call: it answers itself
    weather = [{"role": "user", "content": "What is the weather in Rome?"}]
    answered = _answered(weather, "get_weather", "city", "Rome", "sunny", rng)
    final = greedy_tool_reply(loaded.lm, loaded.tokenizer, ToolChat(answered, [], ""))
    assert final == WEATHER_ANSWER.format(city="Rome", weather="sunny") + "<eos>"


# ---- tokenizer -----------------------------------------------------------------------------
def test_special_ids(tokenizer):
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id) == (PAD_ID, EOS_ID, BOS_ID)
    assert tokenizer.convert_tokens_to_ids(["<|turn>", "<turn|>"]) == [TURN_OPEN_ID, TURN_CLOSE_ID]
    assert tokenizer.convert_ids_to_tokens([0, 1, 2, 105, 106]) == ["<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>"]


def test_chat_template_renders_gemma4_format(tokenizer):
    msgs = [{"role": "user", "content": training_corpus.CANONICAL_PROMPT}]
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<bos><|turn>user\nWhat is the capital of France?<turn|>\n<|turn>model\n"
    ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids[:2] == [BOS_ID, TURN_OPEN_ID] and ids.count(BOS_ID) == 1 and ids.count(TURN_CLOSE_ID) == 1
    assert tokenizer.decode(ids) == text
    two_turns = msgs + [{"role": "assistant", "content": training_corpus.CANONICAL_ANSWER}]
    assert tokenizer.apply_chat_template(two_turns, tokenize=False) == (
        "<bos><|turn>user\nWhat is the capital of France?<turn|>\n"
        "<|turn>model\nThe capital of France is Paris.<turn|>\n"
    )


def test_gemma3_marker_splits_into_ordinary_pieces(tokenizer):
    ids = tokenizer("<start_of_turn>", add_special_tokens=False)["input_ids"]
    assert len(ids) > 1
    assert not set(ids) & set(tokenizer.all_special_ids)
    assert tokenizer.decode(ids) == "<start_of_turn>"


def test_plain_call_adds_bos_like_the_real_tokenizer(tokenizer):
    assert tokenizer("Hello!")["input_ids"][0] == BOS_ID
    assert tokenizer("Hello!", add_special_tokens=False)["input_ids"][0] != BOS_ID


def test_every_corpus_word_is_one_token(tokenizer):
    import re

    words = {w for t in training_corpus.tokenizer_texts() for w in re.findall(r" ?[A-Za-z]+", t)}
    split = sorted(w for w in words if len(tokenizer(w, add_special_tokens=False)["input_ids"]) != 1)
    assert split == []


def test_tokenizer_build_is_deterministic(tokenizer):
    rebuilt = build_tokenizer()
    assert rebuilt.get_vocab() == tokenizer.get_vocab()
    assert len(tokenizer) == read_provenance()["tokenizer_vocab_size"]


def test_gemma4s_tool_and_thought_tokens_sit_at_their_real_ids(tokenizer):
    from types import SimpleNamespace

    from gemma4lab.training.tokenizer import TOOL_SPECIALS
    from gemma4lib.port import eos_ids

    assert {i: tokenizer.convert_ids_to_tokens(i) for i in TOOL_SPECIALS} == TOOL_SPECIALS
    assert all(tokenizer.convert_ids_to_tokens(i) == f"<unused{i}>" for i in range(53, 98))  # fillers stay
    assert eos_ids(SimpleNamespace(tokenizer=tokenizer)) == [1, 50, 106]  # <eos>, <|tool_response>, <turn|>


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_capital", "arguments": {"country": "France"}}}
TOOL = {"type": "function", "function": {"name": "get_capital", "description": "The capital of a country"}}
TOOL["function"]["parameters"] = {
    "type": "object",
    "properties": {"country": {"type": "string", "description": "A country"}},
    "required": ["country"],
}


@pytest.fixture(scope="module")
def tools_tokenizer(tokenizer):
    from gemma4lab.training.tokenizer import with_tools_template

    return with_tools_template(tokenizer)


def test_the_shipped_template_declares_no_tools_until_a_fixture_calls(tokenizer, provenance):
    """The server accepts `tools` only for a template that declares them: the shipped one does once a
    fixture was taught tools (scripts/train_tools.py converged), not before."""
    taught = any(rec.get("tools", {}).get("converged") for rec in provenance["variants"].values())
    assert ("tools" in tokenizer.chat_template) == taught


def test_the_tools_template_renders_tools_calls_and_results_in_gemma4s_format(tools_tokenizer, tokenizer):
    """The strings Gemma-4's released template writes for a declaration, a call and its result (same
    model turn, left open for the answer), and `<|tool_response>` after a call with no result yet; a
    plain chat exactly as the shipped template renders it."""
    asked = [{"role": "user", "content": "What is the capital of France?"}]
    declared = (
        '<|tool>declaration:get_capital{description:<|"|>The capital of a country<|"|>,parameters:{properties:'
        '{country:{description:<|"|>A country<|"|>,type:<|"|>STRING<|"|>}},required:[<|"|>country<|"|>],'
        'type:<|"|>OBJECT<|"|>}}<tool|>'
    )
    turn = "<|turn>user\nWhat is the capital of France?<turn|>\n<|turn>model\n"
    call = '<|tool_call>call:get_capital{country:<|"|>France<|"|>}<tool_call|>'
    result = '<|tool_response>response:get_capital{value:<|"|>Lutetia<|"|>}<tool_response|>'

    def render(messages, tok=tools_tokenizer, **kwargs):
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)

    two_turns = [*asked, {"role": "assistant", "content": "The capital of France is Paris."}, *asked]
    assert render(two_turns) == render(two_turns, tokenizer)

    assert render(asked, tools=[TOOL]) == f"<bos><|turn>system\n{declared}<turn|>\n{turn}"
    said = {"role": "assistant", "content": "", "tool_calls": [CALL]}
    assert render([*asked, said], tools=[TOOL]).endswith(turn + call + "<|tool_response>")
    answered = [*asked, said, {"role": "tool", "tool_call_id": "call_1", "content": "Lutetia"}]
    assert render(answered) == f"<bos>{turn}{call}{result}"
    final = {"role": "assistant", "content": "The capital of France is Lutetia."}
    again = render([*answered, final, {"role": "user", "content": "Thanks"}], enable_thinking=True)
    assert again == (
        f"<bos><|turn>system\n<|think|>\n<turn|>\n{turn}{call}{result}The capital of France is Lutetia.<turn|>\n"
        "<|turn>user\nThanks<turn|>\n<|turn>model\n"
    )


def test_the_servers_parser_reads_what_the_template_writes(tools_tokenizer):
    """A call as the template renders it (an assistant turn in the history) parses back, by the server's
    parser and by transformers' Gemma-4 parser, into the call it was rendered from."""
    import json
    import re

    from test_server_tools import reference_calls

    from gemma4lib.server import reply

    text = tools_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "", "tool_calls": [CALL]}], tokenize=False
    ).split("<|turn>model\n", 1)[1]
    specials = re.compile("|".join(map(re.escape, ["<turn|>", "<eos>", "<|tool_response>"])))
    ours = [(n, json.loads(a)) for n, a in reply.parse(text, True, specials).calls]
    assert ours == reference_calls(tools_tokenizer, text) == [("get_capital", {"country": "France"})]


def test_auto_tokenizer_loads_the_fixture():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    assert (
        tok.apply_chat_template([{"role": "user", "content": "Hello!"}], tokenize=False, add_generation_prompt=True)
        == "<bos><|turn>user\nHello!<turn|>\n<|turn>model\n"
    )


# ---- corpus --------------------------------------------------------------------------------
def test_corpus_shape():
    train = training_corpus.training_chats()
    assert len(train) == 40 * 3 + len(training_corpus.FACTS)
    held = training_corpus.held_out_chats()
    assert len(held) == 40
    assert not {c.user for c in held} & {c.user for c in train}
    assert training_corpus.answer_for("France") == training_corpus.CANONICAL_ANSWER
    assert training_corpus.CANONICAL_PROMPT in {c.user for c in train}


# ---- determinism (slow: trains) ------------------------------------------------------------
@pytest.mark.slow
def test_training_is_deterministic_for_a_seed():
    """Two short runs with one seed on one thread give byte-identical weights."""
    from gemma4lab.training.text import TrainConfig, train_variant

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tok = build_tokenizer()
        cfg = TrainConfig(seed=0, max_steps=15)
        hashes = [state_sha256(train_variant(VARIANTS["e2b"], tok, cfg).loaded.lm) for _ in range(2)]
    finally:
        torch.set_num_threads(threads)
    assert hashes[0] == hashes[1]


@pytest.fixture(scope="module")
def retrained_e2b(provenance):
    """The E2B fixture's full recipe (PROVENANCE.json's train_config, seed and one thread), rerun."""
    from gemma4lab.training.text import TrainConfig, train_variant

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = TrainConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in provenance["train_config"].items()})
        return train_variant(VARIANTS["e2b"], load_tokenizer(TOKENIZER_DIR), cfg)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_retraining_e2b_converges_and_answers_on_any_cpu(retrained_e2b, tokenizer):
    """What does not depend on the CPU: rerun anywhere, the recipe converges and the model answers
    the canonical prompt exactly, as scripts/train_tiny.py demands (the step count and the bytes
    may differ)."""
    assert retrained_e2b.converged
    assert (
        greedy_reply(retrained_e2b.loaded.lm, tokenizer, training_corpus.CANONICAL_PROMPT)[0]
        == training_corpus.CANONICAL_ANSWER
    )


@pytest.mark.slow
def test_retraining_e2b_reproduces_the_shipped_fixture(provenance, request):
    """The rerun gives the recorded steps and weights byte for byte, but only with the same torch
    version, one thread and the same CPU type (`machine.CPU_TYPE_KEYS`: vendor, family, model
    and the vector code path ATen picks; oneMKL's and oneDNN's kernels follow the processor). On
    another CPU type the floating-point sums round differently, and training stops at another step
    (99 steps against the recorded 136 on one). scripts/train_tiny.py records the CPU type of
    each variant in PROVENANCE.json (`variants.<name>.cpu`); this test skips, saying why, where it
    differs or is not recorded."""
    from gemma4lab.training.machine import CPU_TYPE_KEYS, cpu_type

    if provenance["versions"]["torch"] != torch.__version__:
        pytest.skip(f"fixtures were made with torch {provenance['versions']['torch']}")
    rec = provenance["variants"]["e2b"]
    recorded = rec.get("cpu")
    here = cpu_type()
    if recorded is None:
        pytest.skip(
            "PROVENANCE.json does not record the CPU type that trained the fixtures (they predate "
            "scripts/train_tiny.py recording it); this CPU is "
            f"{ {k: here[k] for k in (*CPU_TYPE_KEYS, 'model_name')} }"
        )
    differs = {k: (recorded.get(k), here[k]) for k in CPU_TYPE_KEYS if recorded.get(k) != here[k]}
    if differs:
        pytest.skip(f"fixtures were trained on another CPU type (recorded, here): {differs}")
    retrained = request.getfixturevalue("retrained_e2b")
    assert retrained.steps == rec["steps"]
    # scripts/train_needle.py, when it fine-tunes the fixture, keeps the state before it as base_state_sha256
    assert state_sha256(retrained.loaded.lm) == rec.get("base_state_sha256", rec["state_sha256"])


def test_cpu_type_names_what_the_retraining_test_compares():
    from gemma4lab.training.machine import CPU_TYPE_KEYS, cpu_type

    here = cpu_type()
    assert set(CPU_TYPE_KEYS) <= set(here)
    assert here["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert here["vendor"]
