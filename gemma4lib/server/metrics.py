"""The endpoint's Prometheus metrics, in a registry of its own (one per server or replica).

prometheus-client is the reference client of the format every scraper reads; a registry per server
keeps two servers in one process (tests, a notebook) from sharing or clashing on names.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# time to first token: a prefill on inf2 is ~10-100 ms; on the tiny CPU models a few ms, under load seconds
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
RATE_WINDOW_S = 10.0


class ServerMetrics:
    """What `GET /metrics` shows: queue depth, rows in use, tokens/s, TTFT and inter-token latency."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, rows: int, replica: str = ""):
        self.registry = CollectorRegistry()
        self.replica = replica
        r = self.registry
        self.queue_depth = Gauge("gemma4lib_queue_depth", "requests waiting for a free row", registry=r)
        self.rows_in_use = Gauge("gemma4lib_rows_in_use", "compiled batch rows generating now", registry=r)
        self.rows = Gauge("gemma4lib_rows", "compiled batch rows", registry=r)
        self.rows.set(rows)
        self.tokens = Counter("gemma4lib_generated_tokens", "tokens generated", registry=r)
        self.reused_tokens = Counter(
            "gemma4lib_reused_prompt_tokens", "prompt tokens not prefilled: a free row's kept K/V held them", registry=r
        )
        self.requests = Counter(
            "gemma4lib_requests", "requests finished, by finish reason", ["finish_reason"], registry=r
        )
        self.http = Counter(
            "gemma4lib_http_responses", "HTTP responses by route and status", ["route", "status"], registry=r
        )
        self.ttft = Histogram(
            "gemma4lib_time_to_first_token_seconds", "submit to first token", buckets=TTFT_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "gemma4lib_inter_token_latency_seconds", "time between a row's tokens", buckets=ITL_BUCKETS, registry=r
        )
        self.tokens_per_s = Gauge(
            "gemma4lib_tokens_per_second", f"tokens/s over the last {RATE_WINDOW_S:g} s", registry=r
        )
        self.tokens_per_s.set_function(self._rate)
        info = Gauge("gemma4lib_replica_info", "this server's replica id (label)", ["replica"], registry=r)
        info.labels(replica=replica or "local").set(1)
        self._recent: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()

    def generated(self, n: int) -> None:
        self.tokens.inc(n)
        now = time.monotonic()
        with self._lock:
            self._recent.append((now, n))
            self._trim(now)

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
            self._recent.popleft()

    def _rate(self) -> float:
        now = time.monotonic()
        with self._lock:
            self._trim(now)
            return sum(n for _, n in self._recent) / RATE_WINDOW_S

    def render(self) -> bytes:
        return generate_latest(self.registry)
