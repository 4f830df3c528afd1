"""The serve bench's side by side with `transformers serve` (`gemma4lab.benchmarks.side_by_side`): the
peer's command line, the ratios and the goal verdict, the fixed-length and equality counts, the
medium folder's grown tokenizer. No server starts and no timing is asserted: the full run is a
benchmark (`python -m gemma4lab bench --sections serve`), its figures in docs/measurements."""

from __future__ import annotations

import pytest

from gemma4lab.benchmarks.side_by_side import (
    GOAL_TOKENS_PER_S,
    SIDES,
    compare_references,
    goal_summary,
    level_ratios,
    off_length,
)
from gemma4lab.models.served_folder import FILLER, base_variant, grow_vocabulary, served_models
from gemma4lab.serving.load import Reply
from gemma4lab.serving.peer import CONTINUOUS_BATCHING_FLAG, PeerServer, error_names, peer_command
from gemma4lib.errors import UnknownNameError
from gemma4lib.server.launch import LOOPBACK


def test_peer_command_serves_the_folder_on_cpu_on_the_loopback():
    command = peer_command("/models/e2b", 18000)
    assert command[command.index("serve") + 1] == "/models/e2b"
    assert command[command.index("--device") + 1] == "cpu"
    assert command[command.index("--host") + 1] == LOOPBACK
    assert command[command.index("--port") + 1] == "18000"
    assert CONTINUOUS_BATCHING_FLAG not in command
    assert peer_command("/models/e2b", 18000, continuous_batching=True)[-1] == CONTINUOUS_BATCHING_FLAG


def test_peer_server_gets_the_thread_count_and_a_port_of_its_own():
    peer = PeerServer("/models/e2b", threads=3)
    assert peer.env == {"OMP_NUM_THREADS": "3"} and peer.proc is None  # nothing started
    assert peer.command == peer_command("/models/e2b", peer.port) and peer.url.startswith(f"http://{LOOPBACK}:")


def test_error_names_of_a_log():
    log = "ERROR - loop failed\ntransformers.x.AmbiguousGlobalPerLayerAttributeError: 'head_dim'\nValueError: x\n"
    assert error_names(log) == ["AmbiguousGlobalPerLayerAttributeError", "ValueError"]
    assert error_names("all fine") == []


def _side(tok_s: float, p50: float, p99: float, *, mixed: int = 0, off: int = 0) -> dict:
    return {"tokens_per_s": tok_s, "ttft_p50_s": p50, "ttft_p99_s": p99, "mixed": mixed, "errors": 0, "off_length": off}


def _row(clients: int, ours: dict, peer: dict) -> dict:
    return {"clients": clients, SIDES[0]: ours, SIDES[1]: peer, "ratios": level_ratios(clients, ours, peer)}


def test_level_ratios_against_the_goal():
    r = level_ratios(1, _side(300.0, 0.05, 0.2), _side(100.0, 0.3, 0.4))
    assert r["tokens_per_s_ratio"] == pytest.approx(3.0) and r["ttft_p50_ratio"] == pytest.approx(6.0)
    assert r["ttft_p99_ratio"] == pytest.approx(2.0)
    assert r["goal_tokens_per_s_ratio"] == GOAL_TOKENS_PER_S[1] and r["meets_tokens_per_s_goal"] is True
    assert r["lower_ttft_p50"] is True
    short = level_ratios(8, _side(300.0, 0.5, 0.6), _side(100.0, 0.3, 0.4))  # 3x where 4x is the goal
    assert short["meets_tokens_per_s_goal"] is False and short["lower_ttft_p50"] is False
    assert level_ratios(4, _side(1.0, 0.1, 0.1), _side(1.0, 0.1, 0.1))["meets_tokens_per_s_goal"] is None  # no goal
    assert level_ratios(1, _side(1.0, 0.1, 0.1), _side(0.0, None, None))["tokens_per_s_ratio"] is None


def test_goal_summary_needs_every_part():
    refs = {"prompts": 2, "equal": 2, "mismatches": []}
    good = [
        _row(1, _side(300.0, 0.05, 0.1), _side(100.0, 0.3, 0.4)),
        _row(8, _side(900.0, 0.05, 0.1), _side(200.0, 0.3, 0.4)),
    ]
    summary = goal_summary(good, refs)
    assert summary["goal_met"] is True and summary["tokens_per_s_ratios"] == {"1": 3.0, "8": 4.5}
    slow = [good[0], _row(8, _side(700.0, 0.05, 0.1), _side(200.0, 0.3, 0.4))]
    assert goal_summary(slow, refs)["tokens_per_s_goal_met"] is False and not goal_summary(slow, refs)["goal_met"]
    late = [_row(1, _side(300.0, 0.5, 0.6), _side(100.0, 0.3, 0.4)), good[1]]
    assert goal_summary(late, refs)["lower_ttft_p50_every_level"] is False
    mixed = [_row(1, _side(300.0, 0.05, 0.1, mixed=1), _side(100.0, 0.3, 0.4)), good[1]]
    assert goal_summary(mixed, refs)["greedy_equal"] is False
    assert goal_summary(good, {"prompts": 2, "equal": 1, "mismatches": [{}]})["greedy_equal"] is False
    short = [_row(1, _side(300.0, 0.05, 0.1), _side(100.0, 0.3, 0.4, off=2)), good[1]]
    assert goal_summary(short, refs)["fixed_length"] is False and not goal_summary(short, refs)["goal_met"]


def test_off_length_and_reference_equality():
    replies = [Reply("a", "x", tokens=8), Reply("b", "y", tokens=7), Reply("c", "", tokens=8, error="boom")]
    assert off_length(replies, 8) == 2
    peer = [Reply("a", "x", tokens=8), Reply("b", "z", tokens=7), Reply("c", "", tokens=8)]
    same = compare_references(replies[:1], peer[:1])
    assert same == {"prompts": 1, "equal": 1, "mismatches": []}
    diff = compare_references(replies, peer)
    assert diff["equal"] == 1 and [m["prompt"] for m in diff["mismatches"]] == ["b", "c"]


def test_medium_folder_tokenizer_grows_to_the_vocabulary():
    from gemma4lib.models.fixture_paths import FIXTURES_DIR
    from gemma4lib.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(FIXTURES_DIR / "tokenizer")
    start = len(tokenizer)
    assert grow_vocabulary(tokenizer, start + 40) == 40 and len(tokenizer) == start + 40
    assert grow_vocabulary(tokenizer, start) == 0
    ids = [start, start + 17, start + 39]
    assert tokenizer.decode(ids) == "".join(FILLER.format(i) for i in ids)  # every new id decodes to text of its own
    capital = tokenizer.encode("What is the capital of France?", add_special_tokens=False)
    assert max(capital) < start  # ordinary text still encodes with the small tokenizer's own tokens


def test_served_models_and_their_serve_variant():
    assert {"e2b", "medium-dense"} <= set(served_models())
    assert base_variant("e2b") == "e2b" and base_variant("medium-dense") == "31b"
    with pytest.raises(UnknownNameError):
        base_variant("no-such-model")
