"""The main conveyor_* series again under vLLM's names (`conveyor serve --vllm-metrics`), each with vLLM's
`model_name` label, so that dashboards made for vLLM (its Grafana examples) work unchanged.

The values are the same samples, read from the server's registry at each scrape; nothing is counted twice.
Conveyor series without a vLLM counterpart keep only their own name (see docs/server.md, "Metrics"); vLLM's series
without a Conveyor counterpart are in vllm_series.py.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from conveyor.config import EngineConfig
from conveyor.server.metrics import Metrics
from conveyor.server.vllm_series import VllmSeries

VLLM_NAMES: dict[str, tuple[str, ...]] = {
    "conveyor_num_requests_running": ("vllm:num_requests_running",),
    "conveyor_num_requests_waiting": ("vllm:num_requests_waiting",),
    "conveyor_kv_cache_usage_ratio": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),  # both 0..1
    "conveyor_prompt_tokens": ("vllm:prompt_tokens",),  # counters: the samples end in _total, as vLLM's
    "conveyor_generation_tokens": ("vllm:generation_tokens",),
    "conveyor_time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    "conveyor_inter_token_latency_seconds": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
    "conveyor_e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
}
"""conveyor family -> vLLM's name(s) for it (the second is the name older vLLM versions and dashboards use)."""


class VllmNames(Collector):
    """Re-exports the families of VLLM_NAMES from `source` under vLLM's names, labelled model_name."""

    def __init__(self, source: CollectorRegistry, model_name: str) -> None:
        self.source = source
        self.model_name = model_name

    def collect(self) -> Iterable[Metric]:
        for family in self.source.collect():
            for name in VLLM_NAMES.get(family.name, ()):
                renamed = Metric(name, family.documentation + " (vLLM's name)", family.type, family.unit)
                renamed.samples = [
                    Sample(
                        name + s.name[len(family.name) :],
                        {**s.labels, "model_name": self.model_name},
                        s.value,
                        s.timestamp,
                        s.exemplar,
                    )
                    for s in family.samples
                ]
                yield renamed


def export_vllm_names(metrics: Metrics, model_name: str, config: EngineConfig | None = None) -> None:
    """Render the vllm:* series after the conveyor_* ones on /metrics (their own registry: collecting the
    source registry from inside it would recurse): the renamed ones, and vLLM's series without a conveyor_* twin
    (vllm_series.py)."""
    renamed = CollectorRegistry(auto_describe=False)
    renamed.register(VllmNames(metrics.registry, model_name))
    series = VllmSeries(renamed, metrics, model_name, config if config is not None else EngineConfig())
    metrics.timing_listeners.append(series.observe)
    metrics.extra_registries.append(renamed)
