"""The vllm:* series that have no conveyor_* twin (`conveyor serve --vllm-metrics`): the ones vLLM's own metric
tests and dashboards read, with vLLM's names, types, label and buckets, each labelled model_name.

Per request (observed when it ends; a request is one prompt with its `n` samples):
    vllm:request_success_total{finished_reason}   samples ended, by finish reason (stop, length, abort, error)
    vllm:request_prompt_tokens, vllm:request_generation_tokens, vllm:request_params_n, vllm:request_params_max_tokens
    vllm:request_queue_time_seconds      arrival until first scheduled
    vllm:request_prefill_time_seconds    first scheduled until the first token
    vllm:request_decode_time_seconds     first token until the last
    vllm:request_inference_time_seconds  first scheduled until the last token (prefill + decode)
Read from the engine at each scrape:
    vllm:iteration_tokens_total          histogram of tokens per engine step, as vLLM counts them (core/step_tokens.py)
    vllm:num_preemptions_total, vllm:prefix_cache_queries_total, vllm:prefix_cache_hits_total (tokens)
    vllm:num_requests_waiting_by_reason{reason}   "capacity" (all waiting requests) and "deferred" (always 0:
                                          Conveyor defers none; vLLM's are those waiting on remote KV or grammars)
    vllm:cache_config_info               1, labelled with the KV cache's settings
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from conveyor.config import EngineConfig
from conveyor.core.step_tokens import STEP_TOKEN_BUCKETS
from conveyor.engine.stats import EngineStats
from conveyor.engine.timings import FinishedRequest, StreamTimings
from conveyor.server.metrics import Metrics

_TIME_BUCKETS = (
    *(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0),
    *(120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
)
"""vLLM's buckets for the per-request phase times."""
MAX_TOKEN_BUCKET = 10**6
"""The token-count histograms' buckets reach max_model_len when --max-model-len is given, else this."""


def one_two_five(limit: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's buckets for token counts)."""
    found: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > limit:
                return found
            found.append(float(value))
        exponent += 1


class VllmSeries(Collector):
    """The per-request histograms (observed through Metrics.observe) and the engine's series (collected)."""

    def __init__(self, registry: CollectorRegistry, metrics: Metrics, model_name: str, config: EngineConfig) -> None:
        self.metrics = metrics
        self.model_name = model_name
        self.config = config
        labels = ["model_name"]
        tokens = one_two_five(config.max_model_len or MAX_TOKEN_BUCKET)
        self.success = Counter(
            "vllm:request_success", "Count of successfully processed requests.", [*labels, "finished_reason"],
            registry=registry,
        )  # fmt: skip
        self.prompt = Histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", labels, registry=registry,
            buckets=tokens,
        )  # fmt: skip
        self.generation = Histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", labels, registry=registry,
            buckets=tokens,
        )  # fmt: skip
        self.n = Histogram(
            "vllm:request_params_n", "Histogram of the n request parameter.", labels, registry=registry,
            buckets=(1, 2, 5, 10, 20),
        )  # fmt: skip
        self.max_tokens = Histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", labels,
            registry=registry, buckets=tokens,
        )  # fmt: skip
        self.times = {
            name: Histogram(f"vllm:request_{name}_time_seconds", doc, labels, registry=registry, buckets=_TIME_BUCKETS)
            for name, doc in (
                ("queue", "Histogram of time spent in WAITING phase for request."),
                ("inference", "Histogram of time spent in RUNNING phase for request."),
                ("prefill", "Histogram of time spent in PREFILL phase for request."),
                ("decode", "Histogram of time spent in DECODE phase for request."),
            )
        }
        registry.register(self)

    def observe(self, timings: StreamTimings) -> None:
        for request in timings.finished:
            self._observe(request)

    def _observe(self, r: FinishedRequest) -> None:
        name = self.model_name
        for reason in r.finish_reasons:
            self.success.labels(name, reason).inc()
        self.prompt.labels(name).observe(r.prompt_tokens)
        self.generation.labels(name).observe(r.generation_tokens)
        self.n.labels(name).observe(r.n)
        self.max_tokens.labels(name).observe(r.max_tokens)
        if r.queue_s is None:
            return  # never scheduled: it spent no time in the other phases
        self.times["queue"].labels(name).observe(r.queue_s)
        if r.prefill_s is not None:
            self.times["prefill"].labels(name).observe(r.prefill_s)
            decode = r.decode_s or 0.0
            self.times["decode"].labels(name).observe(decode)
            self.times["inference"].labels(name).observe(r.prefill_s + decode)

    def collect(self) -> Iterable[Metric]:
        stats = self.metrics.last_stats
        if stats is None:
            return
        labels = {"model_name": self.model_name}
        waiting = GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason", "Number of requests waiting, by reason.", labels=[*labels, "reason"]
        )
        waiting.add_metric([self.model_name, "capacity"], stats.num_waiting)
        waiting.add_metric([self.model_name, "deferred"], 0)
        yield waiting
        for name, doc, value in (
            ("vllm:num_preemptions", "Cumulative number of preemptions from the engine.", stats.num_preemptions),
            ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
             stats.prefix_query_tokens),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
             stats.prefix_hit_tokens),
        ):  # fmt: skip
            counter = CounterMetricFamily(name, doc, labels=list(labels))
            counter.add_metric([self.model_name], value)
            yield counter
        yield self._step_tokens(stats)
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig.")
        info.samples = []
        config = {
            "block_size": str(self.config.block_size),
            "cache_dtype": self.config.kv_cache_dtype,
            "enable_prefix_caching": str(self.config.enable_prefix_caching),
            "num_gpu_blocks": str(stats.kv_blocks_total),
        }
        info.add_sample("vllm:cache_config_info", config | labels, 1.0)
        yield info

    def _step_tokens(self, stats: EngineStats) -> Metric:
        histogram = HistogramMetricFamily(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", labels=["model_name"]
        )
        counts = stats.step_token_counts or (0,) * (len(STEP_TOKEN_BUCKETS) + 1)
        cumulative: list[tuple[str, float]] = []
        running = 0
        for bound, count in zip([*map(str, map(float, STEP_TOKEN_BUCKETS)), "+Inf"], counts):
            running += count
            cumulative.append((bound, running))
        histogram.add_metric([self.model_name], cumulative, float(stats.step_tokens_total))
        return histogram
