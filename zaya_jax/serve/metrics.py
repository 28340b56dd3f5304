"""The server's Prometheus metrics (GET /metrics), in a registry of its own.

  zaya_requests_waiting / zaya_requests_running      requests queued for a slot / holding one
  zaya_slots_total / zaya_slots_in_use               the engine's decode slots
  zaya_cache_bytes_in_use                            decode state of the slots in use + prefix cache
  zaya_prefix_cache_bytes, _entries, _hits_total, _queries_total, _tokens_reused_total, _evictions_total
  zaya_time_to_first_token_seconds                   histogram: arrival -> first token
  zaya_time_per_output_token_seconds                 histogram: a request's later tokens, per token
  zaya_prompt_tokens_total / zaya_generation_tokens_total
  zaya_generation_tokens_per_second                  output tokens over the last WINDOW_S seconds
  zaya_requests_total{finish_reason}                 finished requests: stop, length, abort (the client
                                                     left, or the server stopped first)
  zaya_engine_prompt_tokens_total / zaya_engine_generated_tokens_total   the engine's own work
  zaya_compilations_total                            XLA compilations after the engine's warm-up (0)
  zaya_http_errors_total{status}                     refused requests
"""

from __future__ import annotations

import collections
import threading
import time

import jax
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

WINDOW_S = 10.0
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    """What the request handlers count, and the engine's own figures read at each scrape."""

    def __init__(self, engine):
        """engine: the zaya_jax.engine.Engine whose stats() are read at each scrape."""
        self.registry = CollectorRegistry()
        self.engine = engine
        r = self.registry
        self.ttft = Histogram("zaya_time_to_first_token_seconds", "Arrival to first output token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("zaya_time_per_output_token_seconds", "Time per output token after the first.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("zaya_prompt_tokens", "Prompt tokens of admitted requests.", registry=r)
        self.generation_tokens = Counter("zaya_generation_tokens", "Output tokens sent.", registry=r)
        self.finished = Counter("zaya_requests", "Finished requests.", ["finish_reason"], registry=r)
        for reason in ("stop", "length", "abort"):
            self.finished.labels(reason)  # each series from 0
        self.errors = Counter("zaya_http_errors", "Refused requests.", ["status"], registry=r)
        self.compilations = Counter("zaya_compilations", "XLA compilations since the server started (after the "
                                    "engine's warm-up: 0 unless a shape escaped it).", registry=r)
        jax.monitoring.register_event_duration_secs_listener(self._compiled)
        r.register(_EngineCollector(self))
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self._lock = threading.Lock()

    def _compiled(self, event: str, _duration: float, **_) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            self.compilations.inc()

    def tokens_sent(self, count: int) -> None:
        self.generation_tokens.inc(count)
        with self._lock:
            self._recent.append((time.monotonic(), count))
            self._forget_old()

    def tokens_per_second(self) -> float:
        with self._lock:
            self._forget_old()
            return sum(c for _, c in self._recent) / WINDOW_S

    def _forget_old(self) -> None:
        """Drops the sends older than WINDOW_S (on every send, so the window stays bounded unscraped)."""
        now = time.monotonic()
        while self._recent and self._recent[0][0] < now - WINDOW_S:
            self._recent.popleft()

    def scrape(self) -> bytes:
        """The text exposition format (the engine's figures read now)."""
        return generate_latest(self.registry)


class _EngineCollector:
    """The engine's own figures at each scrape: gauges of its queue, slots and memory, and the
    prefix cache's counters (the engine counts them)."""

    GAUGES = (("zaya_requests_waiting", "Requests waiting for a slot.", "waiting"),
              ("zaya_requests_running", "Requests holding a slot.", "running"),
              ("zaya_slots_total", "Decode slots.", "slots"),
              ("zaya_slots_in_use", "Decode slots in use.", "running"),
              ("zaya_cache_bytes_in_use", "Bytes of decode state in use (slots in use and prefix cache).",
               "cache_bytes_in_use"),
              ("zaya_prefix_cache_bytes", "Bytes held by the prefix cache.", "prefix_bytes"),
              ("zaya_prefix_cache_entries", "Blocks held by the prefix cache.", "prefix_entries"))
    COUNTERS = (("zaya_prefix_cache_hits", "Requests that reused a cached prefix.", "prefix_hits"),
                ("zaya_prefix_cache_queries", "Requests that looked up the prefix cache.", "prefix_queries"),
                ("zaya_prefix_cache_tokens_reused", "Prompt tokens taken from the prefix cache.",
                 "prefix_tokens_reused"),
                ("zaya_prefix_cache_evictions", "Blocks evicted from the prefix cache.", "prefix_evictions"),
                ("zaya_engine_prompt_tokens", "Prompt tokens the engine prefilled (not those taken from the prefix "
                 "cache).", "prompt_tokens"),
                ("zaya_engine_generated_tokens", "Tokens the engine generated (also for requests that were then "
                 "aborted).", "generated_tokens"))

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def collect(self):
        engine = self.metrics.engine
        stats = engine.stats()
        stats.update(slots=engine.slots, prefix_queries=stats["prefix_hits"] + stats["prefix_misses"],
                     cache_bytes_in_use=stats["running"] * engine.slot_bytes() + stats["prefix_bytes"])
        for name, text, key in self.GAUGES:
            yield GaugeMetricFamily(name, text, value=stats[key])
        yield GaugeMetricFamily("zaya_generation_tokens_per_second",
                                f"Output tokens per second over the last {WINDOW_S:.0f} s.",
                                value=self.metrics.tokens_per_second())
        for name, text, key in self.COUNTERS:
            yield CounterMetricFamily(name, text, value=stats[key])
