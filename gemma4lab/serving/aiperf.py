"""A load generator nobody here wrote (NVIDIA's aiperf) driving the endpoint (issue 49 item 6).

aiperf cannot share the project's .venv: 0.13.0 pins huggingface-hub<2, pandas~=2.3, pillow~=12.3,
psutil~=7.0, pyzmq~=26.4 and rich~=14.1, each against a pin here. So it lives in its own venv
(`scripts/setup_aiperf_env.sh` -> `.venv-aiperf`, ~1.2 GB, no torch) and runs as a child process:
against 127.0.0.1 only, bounded by a request count and a duration, and by a timeout over both.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlparse

from gemma4lib.server.launch import LOOPBACK

AIPERF_VERSION = "0.13.0"
ROOT = Path(__file__).resolve().parents[2]
EXPORT = "profile_export_aiperf.json"


def find_aiperf() -> Path | None:
    """`$GEMMA4LIB_AIPERF`, else `.venv-aiperf/bin/aiperf` in the repo; None when neither exists."""
    for candidate in (os.environ.get("GEMMA4LIB_AIPERF"), ROOT / ".venv-aiperf" / "bin" / "aiperf"):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


@dataclass(frozen=True)
class AiperfRun:
    """What aiperf measured, read from its JSON export (its own figures, not recomputed here)."""

    requests: int
    errors: int
    complete: bool
    completion_tokens: int  # as the server's `usage` reported them (--use-server-token-count)
    ttft_p50_ms: float
    ttft_p99_ms: float
    output_tokens_per_s: float
    duration_s: float

    @classmethod
    def from_export(cls, data: dict) -> AiperfRun:
        ttft = data["time_to_first_token"]
        return cls(
            requests=int(data["request_count"]["avg"]),
            errors=len(data.get("error_summary") or []),
            complete=bool(data["is_complete"]) and not data["was_cancelled"],
            completion_tokens=int(data["total_usage_completion_tokens"]["avg"]),
            ttft_p50_ms=float(ttft["p50"]),
            ttft_p99_ms=float(ttft["p99"]),
            output_tokens_per_s=float(data["output_token_throughput"]["avg"]),
            duration_s=float(data["benchmark_duration"]["avg"]),
        )

    def as_dict(self) -> dict:
        return asdict(self)


def aiperf_command(
    binary: Path, url: str, model: str, tokenizer_dir: Path, out: Path, *, concurrency: int, requests: int,
    input_tokens: int, output_tokens: int, duration_s: float,
) -> list[str]:  # fmt: skip
    """aiperf's streamed chat profile of `url`, bounded in requests and seconds; 127.0.0.1 only."""
    if urlparse(url).hostname != LOOPBACK:
        raise ValueError(f"aiperf drives a server on {LOOPBACK} only, not {url}: start the server there")
    command = [str(binary), "profile", "--model", model, "--url", url, "--endpoint-type", "chat", "--streaming"]
    command += ["--tokenizer", str(tokenizer_dir), "--use-server-token-count", "--random-seed", "0"]
    command += ["--concurrency", str(concurrency), "--request-count", str(requests)]
    command += ["--benchmark-duration", str(duration_s), "--isl", str(input_tokens), "--isl-stddev", "0"]
    command += ["--osl", str(output_tokens), "--workers-max", "1", "--ui-type", "none", "--no-auto-plot"]
    return command + ["--output-artifact-dir", str(out)]


def run_aiperf(command: list[str], out: Path, timeout_s: float) -> AiperfRun:
    """Run `command` (from `aiperf_command`) and read its export; a failure says where its log is."""
    # a local tokenizer folder loads as a path only while the hub is not forced offline (aiperf 0.13.0)
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0 or not (out / EXPORT).is_file():
        raise RuntimeError(
            f"aiperf exited {done.returncode}; its log: {out / 'logs' / 'aiperf.log'}; its output's tail:\n"
            f"{(done.stdout + done.stderr)[-2000:]}"
        )
    return AiperfRun.from_export(json.loads((out / EXPORT).read_text()))
