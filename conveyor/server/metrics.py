"""Prometheus metrics of one server (its own registry)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from conveyor.engine.stats import EngineStats
from conveyor.engine.timings import StreamTimings

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("conveyor_num_requests_running", "Requests being computed", registry=r)
        self.waiting = Gauge("conveyor_num_requests_waiting", "Requests waiting to be scheduled", registry=r)
        self.kv_usage = Gauge("conveyor_kv_cache_usage_ratio", "Share of KV blocks held by requests", registry=r)
        self.kv_free = Gauge("conveyor_kv_cache_free_blocks", "KV blocks free or evictable", registry=r)
        self.kv_total = Gauge("conveyor_kv_cache_total_blocks", "KV blocks in all", registry=r)
        self.prefix_hit = Gauge(
            "conveyor_prefix_cache_hit_rate",
            "Prompt tokens served from the prefix cache / prompt tokens looked up",
            registry=r,
        )
        self.idle = Gauge("conveyor_device_idle_fraction", "Share of active time the device waited", registry=r)
        self.ttft = Histogram(
            "conveyor_time_to_first_token_seconds", "Time to first token", registry=r, buckets=_LATENCY_BUCKETS
        )
        self.itl = Histogram(
            "conveyor_inter_token_latency_seconds",
            "Time between tokens of a request",
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.e2e = Histogram(
            "conveyor_e2e_request_latency_seconds", "Arrival to last token", registry=r, buckets=_LATENCY_BUCKETS
        )
        self.prompt_tokens = Counter("conveyor_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter("conveyor_generation_tokens", "Tokens generated", registry=r)
        self.requests = Counter(
            "conveyor_requests",
            "Finished HTTP generation requests by status: ok, error, abort (the client went away)",
            ["status"],
            registry=r,
        )
        self.non_finite = Counter(
            "conveyor_non_finite_requests",
            "Requests ended with an error because the model's logits for them held NaN or infinity",
            registry=r,
        )
        self._generated_seen = 0
        self._non_finite_seen = 0
        self.extra_registries: list[CollectorRegistry] = []
        """Rendered after this one (vllm_metrics.py: the same series under vLLM's names, and vLLM's own)."""
        self.timing_listeners: list[Callable[[StreamTimings], None]] = []
        """Also given every observation (vllm_series.py)."""
        self.last_stats: EngineStats | None = None
        """The engine's stats at the latest scrape (None before one, or while the model loads)."""

    def observe(self, timings: StreamTimings) -> None:
        for v in timings.ttft:
            self.ttft.observe(v)
        for v in timings.inter_token:
            self.itl.observe(v)
        for v in timings.e2e:
            self.e2e.observe(v)
        for listener in self.timing_listeners:
            listener(timings)

    def render(self, stats: EngineStats | None) -> bytes:
        self.last_stats = stats
        if stats is not None:
            self.running.set(stats.num_running)
            self.waiting.set(stats.num_waiting)
            self.kv_total.set(stats.kv_blocks_total)
            self.kv_free.set(stats.kv_blocks_free)
            self.kv_usage.set(1 - stats.kv_blocks_free / max(stats.kv_blocks_total, 1))
            self.prefix_hit.set(
                stats.prefix_hit_tokens / stats.prefix_query_tokens if stats.prefix_query_tokens else 0.0
            )
            self.idle.set(stats.device_idle_fraction)
            if stats.num_generated_tokens > self._generated_seen:
                self.generation_tokens.inc(stats.num_generated_tokens - self._generated_seen)
                self._generated_seen = stats.num_generated_tokens
            if stats.num_non_finite > self._non_finite_seen:
                self.non_finite.inc(stats.num_non_finite - self._non_finite_seen)
                self._non_finite_seen = stats.num_non_finite
        return generate_latest(self.registry) + b"".join(generate_latest(r) for r in self.extra_registries)
