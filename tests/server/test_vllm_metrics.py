"""`--vllm-metrics`: the main conveyor_* series again under vLLM's names, with vLLM's model_name label, and vLLM's
series without a conveyor_* twin (a server's counts of them: tests/server/test_vllm_surface.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from conveyor.config import EngineConfig
from conveyor.engine.stats import EngineStats
from conveyor.engine.timings import FinishedRequest, StreamTimings
from conveyor.server.metrics import Metrics
from conveyor.server.vllm_metrics import VLLM_NAMES, export_vllm_names


def _samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
    }


def test_vllm_names_mirror_the_conveyor_series() -> None:
    metrics = Metrics()
    export_vllm_names(metrics, "my-model")
    for v in (0.02, 0.3, 7.0):
        metrics.ttft.observe(v)
    metrics.itl.observe(0.04)
    metrics.prompt_tokens.inc(11)
    metrics.running.set(3)
    samples = _samples(metrics.render(None))
    mirrored = 0
    for (name, labels), value in samples.items():
        family = next((f for f in VLLM_NAMES if name.startswith(f)), None)
        if family is None:
            continue
        for vllm_name in VLLM_NAMES[family]:
            twin = (vllm_name + name[len(family) :], tuple(sorted(dict(labels, model_name="my-model").items())))
            assert samples[twin] == value, twin
            mirrored += 1
    assert mirrored > 40  # gauges, counters and every histogram bucket
    assert samples[("vllm:prompt_tokens_total", (("model_name", "my-model"),))] == 11
    assert samples[("vllm:time_to_first_token_seconds_count", (("model_name", "my-model"),))] == 3
    assert samples[("vllm:num_requests_running", (("model_name", "my-model"),))] == 3
    assert not any(name.startswith("vllm:request") for name, _ in samples)  # none before a request ended


def _stats(**changes: Any) -> EngineStats:
    fields: dict[str, Any] = {f.name: 0 for f in dataclasses.fields(EngineStats)} | {"async_batching": False}
    return EngineStats(**(fields | changes))


def test_vllm_series_without_a_conveyor_twin() -> None:
    metrics = Metrics()
    export_vllm_names(metrics, "m", EngineConfig(max_model_len=100, block_size=8))
    done = FinishedRequest(
        prompt_tokens=7, generation_tokens=9, n=2, max_tokens=5, finish_reasons=("stop", "length"),
        queue_s=0.5, prefill_s=0.25, decode_s=1.0,
    )  # fmt: skip
    never_scheduled = FinishedRequest(
        prompt_tokens=3, generation_tokens=0, n=1, max_tokens=4, finish_reasons=("abort",)
    )
    metrics.observe(StreamTimings(finished=[done, never_scheduled]))
    counts = [0] * 14
    counts[0], counts[1] = 5, 2  # five steps of one token, two of eight or fewer
    stats = _stats(
        num_waiting=3, num_preemptions=4, prefix_query_tokens=40, prefix_hit_tokens=16, kv_blocks_total=64,
        step_token_counts=tuple(counts), step_tokens_total=17,
    )  # fmt: skip
    samples = _samples(metrics.render(stats))
    m = (("model_name", "m"),)

    def got(name: str, *labels: tuple[str, str]) -> float:
        return samples[(name, tuple(sorted((*m, *labels))))]

    assert got("vllm:request_success_total", ("finished_reason", "stop")) == 1
    assert got("vllm:request_success_total", ("finished_reason", "abort")) == 1
    assert got("vllm:request_prompt_tokens_sum") == 10 and got("vllm:request_prompt_tokens_count") == 2
    assert got("vllm:request_prompt_tokens_bucket", ("le", "5.0")) == 1  # buckets 1, 2, 5, 10, 20, 50, 100
    assert got("vllm:request_prompt_tokens_bucket", ("le", "100.0")) == 2
    assert got("vllm:request_generation_tokens_sum") == 9 and got("vllm:request_params_n_sum") == 3
    assert got("vllm:request_params_max_tokens_sum") == 9
    assert got("vllm:request_queue_time_seconds_count") == 1  # the request never scheduled has no phase times
    assert got("vllm:request_inference_time_seconds_sum") == 1.25
    assert got("vllm:iteration_tokens_total_count") == 7 and got("vllm:iteration_tokens_total_sum") == 17
    assert got("vllm:iteration_tokens_total_bucket", ("le", "1.0")) == 5
    assert got("vllm:iteration_tokens_total_bucket", ("le", "8.0")) == 7
    assert got("vllm:iteration_tokens_total_bucket", ("le", "+Inf")) == 7
    assert got("vllm:num_preemptions_total") == 4
    assert got("vllm:prefix_cache_queries_total") == 40 and got("vllm:prefix_cache_hits_total") == 16
    assert got("vllm:num_requests_waiting_by_reason", ("reason", "capacity")) == 3
    assert got("vllm:num_requests_waiting_by_reason", ("reason", "deferred")) == 0
    config = (("block_size", "8"), ("cache_dtype", "auto"), ("enable_prefix_caching", "True"), ("num_gpu_blocks", "64"))
    assert got("vllm:cache_config_info", *config) == 1


def test_off_by_default() -> None:
    assert not any(name.startswith("vllm:") for name, _ in _samples(Metrics().render(None)))
