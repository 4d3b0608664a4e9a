"""`--vllm-metrics`: the main conveyor_* series again under vLLM's names, with vLLM's model_name label."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

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
    assert not any(name.startswith("vllm:") and name.startswith("vllm:request") for name, _ in samples)


def test_off_by_default() -> None:
    assert not any(name.startswith("vllm:") for name, _ in _samples(Metrics().render(None)))
