"""A verify and a draft that return token ids (issue 46 item 2, its drafting half): where the logits
would cross a bus, a greedy verify returns its verdict (`k + 2` int32 a row: the drafts kept and the
target's `k + 1` argmaxes) and the assistant's draft its argmax, not `k + 1` and 1 rows of the
vocabulary's logits. The engine takes them whenever every row is greedy and nobody reads its logits; a
check (kept logits) or a sampled row takes the logits steps. The tokens are the same either way, equal
to transformers' greedy generate, and they answer the question."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from gemma4lib.backends.engine import engine_over
from gemma4lib.device.build import device_graphs
from gemma4lib.device.graph import greedy_verdicts
from gemma4lib.generation.acceptance import greedy_verdict
from gemma4lib.generation.drafters import make_drafter
from gemma4lib.models.assistant import load_assistant
from gemma4lib.port import PortSettings, eos_ids, load_model, prompt_rows
from gemma4lib.reference import reference_greedy
from gemma4lib.runtime import Request, Sampling

K = 4
NEW = 12


def _drafted(variant: str, draft: str):
    """(model, graphs with and without the ids steps, the batch's prompt rows) for an eager batch of 3."""
    settings = PortSettings(variant=variant, backend="eager", draft=draft, draft_tokens=K, batch_size=3)
    model = load_model(settings)
    assistant = load_assistant(model, settings) if draft == "assistant" else None
    graphs = {c: device_graphs(model, settings, chooses=c, assistant=assistant) for c in (False, True)}
    return settings, model, graphs, prompt_rows(model, settings)


def _engine(model, graphs, draft: str):
    """The engine over the graphs' named steps (each step's calls counted by name)."""
    calls: dict[str, int] = {}

    def counted(name, fn):
        def step(*args):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args)

        return step

    named = {name: counted(name, fn) for name, fn in graphs.named().items()}
    return engine_over(model, named, graphs, kv=graphs.new_kv(), drafter=make_drafter(draft)), calls


@pytest.fixture(scope="module", params=[("e2b", "assistant"), ("26b-a4b", "assistant"), ("e2b", "prompt_lookup")])
def drafted(request):
    return (*_drafted(*request.param), request.param[1])


def test_the_ids_steps_give_the_references_tokens(drafted):
    settings, model, graphs, rows, draft = drafted
    eos = tuple(eos_ids(model))
    requests = [Request(row.ids, NEW, Sampling(), eos) for row in rows]
    logits_engine, logits_calls = _engine(model, graphs[False], draft)
    want = logits_engine.generate_rows(requests, keep_logits=True)
    ids_engine, ids_calls = _engine(model, graphs[True], draft)
    got = ids_engine.generate_rows(requests)
    assert [r.tokens for r in got.rows] == [r.tokens for r in want.rows]
    assert [r.accepted for r in got.rows] == [r.accepted for r in want.rows]
    for row, result in zip(rows, got.rows, strict=True):  # device == reference, and it makes sense
        assert result.tokens == reference_greedy(model.lm, row.ids, NEW, eos)
        if row.expect is not None:
            assert row.expect in model.tokenizer.decode(result.tokens, skip_special_tokens=True)
    assert sum(sum(r.accepted) for r in got.rows) > 0  # drafts were kept, not only the verify's own token
    # every round of the ids run went through the ids steps; the checked run never did
    assert ids_calls.get("verify_ids", 0) == len(got.rows[0].emitted) and "verify" not in ids_calls
    assert ("draft_ids" in ids_calls) == (draft == "assistant") and "draft" not in ids_calls
    assert not {"verify_ids", "draft_ids"} & set(logits_calls)
    # kept logits (a check) take the logits steps on the same graphs
    ids_calls.clear()
    checked = ids_engine.generate_rows(requests[:1], keep_logits=True).rows[0]
    assert checked.tokens == want.rows[0].tokens and "verify_ids" not in ids_calls and "verify" in ids_calls


def test_a_sampled_row_takes_the_logits_steps(drafted):
    settings, model, graphs, rows, draft = drafted
    if draft != "assistant":
        pytest.skip("one case is enough: the assistant drafts from q")
    engine, calls = _engine(model, graphs[True], draft)
    requests = [Request(rows[0].ids, 6, Sampling(temperature=0.8, seed=5)), Request(rows[1].ids, 6, Sampling())]
    got = engine.generate_rows(requests)
    alone = _engine(model, graphs[False], draft)[0].generate_rows(requests).rows
    assert [r.tokens for r in got.rows] == [r.tokens for r in alone]
    assert {"verify", "draft"} <= set(calls) and not {"verify_ids", "draft_ids"} & set(calls)


def test_the_ids_graphs_return_bytes_not_the_vocabulary(drafted):
    settings, model, graphs, rows, draft = drafted
    verify = graphs[True].verify_ids
    b, hidden_width = verify.shape.batch, model.config.hidden_size
    out = verify(*verify.example_inputs())
    out = out if isinstance(out, tuple) else (out,)
    assert out[0].dtype == torch.int32 and out[0].shape == (b, K + 2)
    if draft == "assistant":  # and the one hidden state the next draft starts from
        assert out[1].shape == (b, hidden_width)
        ids, projected = graphs[True].draft_ids(*graphs[True].draft_ids.example_inputs())
        assert ids.dtype == torch.int32 and ids.shape == (b,) and projected.shape == (b, hidden_width)
        assert graphs[True].draft_ids.key_parts()["chooses"] is True
        assert "chooses" not in graphs[True].draft.key_parts()
    else:
        assert len(out) == 1
    assert verify.key_parts()["chooses"] is True and "chooses" not in graphs[True].verify.key_parts()
    assert graphs[False].verify_ids is None and graphs[False].draft_ids is None


def test_the_device_verdict_is_the_hosts():
    """`greedy_verdicts` against `acceptance.greedy_verdict` per row: drafts all right, right up to a
    point, all wrong, fewer than k (a row near its budget), none, and a row whose logits broke."""
    torch.manual_seed(0)
    b, k, vocab = 6, 4, 40
    logits = torch.randn(b, k + 1, vocab) * 3
    argmax = logits.argmax(-1)
    drafts = [argmax[0, :k].tolist(), [*argmax[1, :2].tolist(), 0, 1], [(int(a) + 1) % vocab for a in argmax[2, :k]]]
    drafts += [argmax[3, :2].tolist(), [], argmax[5, :k].tolist()]
    logits[5, 2, 7] = float("nan")
    padded = torch.full((b, k), -1, dtype=torch.int32)
    for r, d in enumerate(drafts):
        padded[r, : len(d)] = torch.tensor(d, dtype=torch.int32)
    length = torch.tensor([1 + len(d) for d in drafts], dtype=torch.int32)
    got = greedy_verdicts(logits, padded, length)
    assert got.dtype == torch.int32 and got.shape == (b, k + 2)
    for r in range(5):
        n_ok, tokens = greedy_verdict(logits[r], drafts[r])
        assert int(got[r, 0]) == n_ok and got[r, 1 : n_ok + 2].tolist() == tokens
    assert [int(got[r, 0]) for r in range(5)] == [4, 2, 0, 2, 0]
    assert int(got[5, 0]) == 2 and int(got[5, 3]) == -1  # kept up to the broken position, which says -1


def test_the_backends_that_choose_build_the_ids_steps():
    settings = PortSettings(variant="e2b", backend="xla", draft="prompt_lookup", draft_tokens=K)
    assert settings.builds_decode_ids and not replace(settings, backend="cpu").builds_decode_ids


def test_an_engine_with_only_the_ids_draft_refuses_a_sampled_row_before_it_runs():
    """Backend neuron compiles the draft's ids key alone (one key per input shapes): a sampled request
    is refused at `check` (a server's 400, before it queues), naming what to send; greedy ones run."""
    from gemma4lib.errors import SettingsError

    _, model, graphs, rows = _drafted("e2b", "assistant")
    named = {n: g for n, g in graphs[True].named().items() if n != "draft"}
    engine = engine_over(model, named, graphs[True], kv=graphs[True].new_kv(), drafter=make_drafter("assistant"))
    with pytest.raises(SettingsError, match="send temperature 0"):
        engine.check(Request(rows[0].ids, 4, Sampling(temperature=0.7, seed=1)))
    greedy = engine.generate_rows([Request(rows[0].ids, 6, Sampling())]).rows[0]
    assert greedy.tokens == reference_greedy(model.lm, rows[0].ids, 6)
