"""`python -m gemma4lib serve --variant e4b --tp 2` on CPU: the gloo ranks behind the endpoint.

The server is the command a user runs, as a child process on 127.0.0.1 (`server.process`), asked once
with the official `openai` client; its greedy answer must name Paris and be token for token what
`port --tp 2` generates. The server is stopped at the end, and its rank processes with it.
"""

from __future__ import annotations

import os

import pytest

from gemma4lab.serving.process import ServerProcess
from gemma4lib.port import PortSettings, port

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def ported():
    """`port --variant e4b --tp 2`'s record (its greedy tokens, and its tokenizer's eos)."""
    return port(PortSettings(variant="e4b", tp_degree=2, iters=1, warmup=0))


def _children(pid: int) -> set[int]:
    """Every process below `pid` (Linux /proc)."""
    found, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        for task in os.listdir(f"/proc/{parent}/task"):
            try:
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    kids = {int(k) for k in f.read().split()}
            except OSError:
                continue
            todo.extend(kids - found)
            found |= kids
    return found


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts the server's rank processes in /proc")
def test_serve_tp2_on_cpu_answers_paris_with_the_port_tokens(ported):
    from openai import OpenAI

    from gemma4lib.port import load_model

    max_tokens = PortSettings(variant="e4b").max_new_tokens
    server = ServerProcess(["--variant", "e4b", "--tp", "2", "--max-new-tokens", str(max_tokens)])
    server.start(timeout_s=300)
    try:
        ranks = _children(server.proc.pid)
        assert len(ranks) >= 2, ranks  # the gloo rank processes, started by the server's compile
        client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        reply = client.chat.completions.create(
            model="e4b", messages=[{"role": "user", "content": QUESTION}], max_tokens=max_tokens, temperature=0.0
        )
    finally:
        code = server.stop(timeout_s=60)
    text = reply.choices[0].message.content
    assert "Paris" in text and "Paris" in ported["answer"]
    tokens = list(ported["tokens"])
    tokenizer = load_model(PortSettings(variant="e4b")).tokenizer
    spoken = tokens[:-1] if reply.choices[0].finish_reason == "stop" else tokens  # the eos is not text
    assert reply.usage.completion_tokens == len(tokens)
    assert tokenizer.encode(text, add_special_tokens=False) == spoken
    assert text == tokenizer.decode(spoken, skip_special_tokens=True)
    assert code == 0 and not any(os.path.exists(f"/proc/{pid}") for pid in ranks)  # no rank left behind
