"""A decode step that chooses its tokens on the device (issue 46 item 2): `DeviceGraph(chooses=True)`
returns 4 bytes a row where the plain decode returns the vocabulary's logits, and the engine takes it
whenever no row needs its logits. The device's rule is the host's (argmax, or the row's own draw in the
cumulative distribution of its top-p nucleus), so the tokens are the same whichever step ran: greedy,
sampled and nucleus-sampled, alone and in a batch."""

from __future__ import annotations

import pytest
import torch

from gemma4lib.backends.engine import engine_over
from gemma4lib.device.build import device_graphs
from gemma4lib.device.graph import choose_tokens
from gemma4lib.runtime import Request, Sampling, choose_token


@pytest.fixture(scope="module")
def e2b(ports):
    """The trained tiny E2B's model at batch 3 (eager graphs: the rule is the graph's, not a compiler's)."""
    return ports.get("e2b", model="auto", backend="eager")


def _engine(e2b, chooses: bool):
    """An engine over eager graphs of `e2b`'s settings at batch 3, with or without `decode_ids`; the
    ids step counts its calls."""
    from dataclasses import replace

    graphs = device_graphs(e2b.model, replace(e2b.settings, batch_size=3), chooses=chooses)
    named, calls = dict(graphs.named()), []
    if chooses:
        graph = named["decode_ids"]

        def counted(*args):
            calls.append(args[0].shape[0])
            return graph(*args)

        named["decode_ids"] = counted
    return engine_over(e2b.model, named, graphs, kv=graphs.new_kv()), calls


def _requests(e2b, samplings):
    return [Request(e2b.ids, 10, sampling, ()) for sampling in samplings]


@pytest.mark.parametrize(
    "samplings",
    [
        [Sampling(), Sampling(), Sampling()],
        [Sampling(temperature=0.9, seed=7), Sampling(), Sampling(temperature=1.5, seed=3)],
        [Sampling(temperature=0.9, seed=7), Sampling(temperature=1.0, top_p=0.8, seed=1)],
    ],
    ids=["greedy", "sampled", "a-nucleus-row"],
)
def test_the_device_chooses_the_tokens_the_host_would(e2b, samplings):
    host, _ = _engine(e2b, chooses=False)
    device, calls = _engine(e2b, chooses=True)
    want = host.generate_rows(_requests(e2b, samplings))
    got = device.generate_rows(_requests(e2b, samplings))
    assert [r.tokens for r in got.rows] == [r.tokens for r in want.rows]
    assert all(len(r.tokens) > 1 for r in got.rows)
    assert len(calls) == len(got.step_s) > 0  # every decode step returned ids, nucleus rows included
    # a sampled row alone draws the same tokens as in the batch (its own generator, one draw a token)
    alone = _engine(e2b, chooses=True)[0].generate_rows(_requests(e2b, samplings[:1])).rows[0]
    assert alone.tokens == got.rows[0].tokens


def test_kept_logits_take_the_logits_step(e2b):
    device, calls = _engine(e2b, chooses=True)
    row = device.generate_rows(_requests(e2b, [Sampling()]), keep_logits=True).rows[0]
    assert calls == [] and row.step_logits is not None and len(row.step_logits) == len(row.tokens)


def test_the_ids_graph_returns_four_bytes_a_row(e2b):
    graphs = device_graphs(e2b.model, e2b.settings, chooses=True)
    graph = graphs.decode_ids
    out = graph(*graph.example_inputs())
    assert out.dtype == torch.int32 and out.shape == (graph.shape.batch,)
    assert out.numel() * out.element_size() == 4 * graph.shape.batch
    assert graph.key_parts()["chooses"] is True and "chooses" not in graphs.decode.key_parts()


def test_choose_tokens_is_the_host_rule_and_flags_a_broken_row():
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 4
    sampling = torch.tensor([[0.0, 0.3, 1.0], [0.7, 0.05, 1.0], [1.3, 0.999, 0.5], [1.0, 1.0, 1.0], [1.0, 1.0, 0.3]])
    logits = torch.cat([logits, logits[3:]])
    got = choose_tokens(logits, sampling, 30.0).tolist()
    assert got[0] == int(logits[0].argmax())
    for r in range(1, len(got)):
        temperature, u, top_p = sampling[r].tolist()
        chosen = Sampling(temperature=temperature, top_p=top_p)
        assert got[r] == choose_token(logits[r], chosen, 30.0, _FixedDraw(u))
    assert got[4] != got[3]  # u = 1 takes the last token of the nucleus, not of the vocabulary
    broken = logits.clone()
    broken[2, 5] = float("nan")
    assert choose_tokens(broken, sampling, 30.0).tolist() == [*got[:2], -1, *got[3:]]


def test_the_nucleus_without_a_sort_is_the_sorted_nucleus():
    """`graph.nucleus` keeps what the sorted cumulative sum keeps (the tokens before the one that
    reaches top_p, and that one), on peaked and flat distributions, without sorting the vocabulary."""
    from gemma4lib.device.graph import nucleus

    torch.manual_seed(1)
    for scale in (0.5, 3.0, 8.0):
        probs = torch.softmax(torch.randn(6, 300) * scale, -1)
        for top_p in (0.05, 0.5, 0.9, 0.999):
            ordered, order = torch.sort(probs, -1, descending=True)
            sorted_keep = torch.cumsum(ordered, -1) - ordered < top_p
            want = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, sorted_keep)
            got = nucleus(probs, torch.full((6,), top_p)) > 0
            assert torch.equal(got, want), (scale, top_p, (got != want).sum())


class _FixedDraw:
    """Stands in for a row's generator: `runtime.draw` returns its `u` (patched below)."""

    def __init__(self, u: float):
        self.u = u


@pytest.fixture(autouse=True)
def _fixed_draws(monkeypatch):
    import gemma4lib.runtime as runtime

    real = runtime.draw
    monkeypatch.setattr(runtime, "draw", lambda g: g.u if isinstance(g, _FixedDraw) else real(g))
