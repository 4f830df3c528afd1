"""aiperf, a load generator nobody here wrote, driving the endpoint on 127.0.0.1 (issue 49 item 6).

aiperf runs from its own venv (`scripts/setup_aiperf_env.sh`; its pins conflict with .venv's), so the
live test runs where that venv exists and says how to make it where it does not. The engine is
tests/test_server.py's fake: what this proves is the protocol (aiperf's own streamed chat requests,
its token counts from our `usage`), not speed.
"""

from __future__ import annotations

import httpx
import pytest
from test_server import serve_fake, tokenizer  # noqa: F401 (a fixture)

from gemma4lab.serving.aiperf import aiperf_command, find_aiperf, run_aiperf
from gemma4lib.models.trained import TOKENIZER_DIR

BOUNDS = dict(concurrency=2, requests=8, input_tokens=12, output_tokens=16, duration_s=60)


def test_the_command_is_bounded_and_loopback_only(tmp_path):
    command = aiperf_command(tmp_path / "aiperf", "http://127.0.0.1:8000", "m", TOKENIZER_DIR, tmp_path, **BOUNDS)
    for flag, value in (("--request-count", "8"), ("--benchmark-duration", "60"), ("--concurrency", "2")):
        assert command[command.index(flag) + 1] == value
    with pytest.raises(ValueError, match="127.0.0.1 only"):
        aiperf_command(tmp_path / "aiperf", "http://10.0.0.2:8000", "m", TOKENIZER_DIR, tmp_path, **BOUNDS)


def test_aiperf_drives_the_endpoint(tokenizer, tmp_path):  # noqa: F811
    binary = find_aiperf()
    if binary is None:
        pytest.skip("no aiperf: run scripts/setup_aiperf_env.sh (or set GEMMA4LIB_AIPERF to its executable)")
    server, _ = serve_fake(tokenizer, batch=2, context_length=128)
    try:
        url = server.url
        command = aiperf_command(binary, url, "fake", TOKENIZER_DIR, tmp_path, **BOUNDS)
        run = run_aiperf(command, tmp_path, timeout_s=300)
        metrics = httpx.get(url + "/metrics", timeout=10).text
    finally:
        server.stop()
    generated = next(
        float(x.split()[-1]) for x in metrics.splitlines() if x.startswith("gemma4lib_generated_tokens_total")
    )
    print(run.as_dict())
    assert run.complete and run.requests == BOUNDS["requests"] and run.errors == 0
    assert run.completion_tokens == generated  # aiperf's total is the server's own counter
    assert 0 < run.ttft_p50_ms <= run.ttft_p99_ms and run.output_tokens_per_s > 0


def test_the_serve_bench_records_aiperfs_own_figures_beside_its_own(tokenizer):  # noqa: F811
    """`bench --sections serve` hands its running server to aiperf at 1 and 8 streams (`aiperf_levels`)."""
    from gemma4lab.benchmarks.serve import aiperf_levels

    if find_aiperf() is None:
        assert aiperf_levels("http://127.0.0.1:1", "m", 16, 30)["ran"] is False  # says why, runs nothing
        pytest.skip("no aiperf: run scripts/setup_aiperf_env.sh (or set GEMMA4LIB_AIPERF to its executable)")
    server, _ = serve_fake(tokenizer, batch=2, context_length=128)
    try:
        report = aiperf_levels(server.url, "fake", 16, 120)
    finally:
        server.stop()
    assert report["ran"] and [row["clients"] for row in report["levels"]] == [1, 8]
    for row in report["levels"]:
        assert row["complete"] and row["requests"] == 16 and row["errors"] == 0, row
        assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"] and row["output_tokens_per_s"] > 0, row
