"""/metrics of the data-parallel front: the router's own series, then every replica's series labelled
replica="i", then totals over the replicas (the same names without a `replica` label) for counters,
histograms and the gauges that add up (requests running / waiting, KV blocks).

Sum per-replica series with `sum(x{replica!=""})`; the unlabelled series already is that sum.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

ADDITIVE_GAUGES = (
    "conveyor_num_requests_running",
    "conveyor_num_requests_waiting",
    "conveyor_kv_cache_free_blocks",
    "conveyor_kv_cache_total_blocks",
)
"""Gauges whose total over replicas means something (a ratio or a rate does not add up)."""


class FrontMetrics:
    def __init__(self, num_replicas: int) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.routed = Counter(
            "conveyor_dp_requests_routed", "Generation requests sent to each replica", ["replica"], registry=r
        )
        self.affinity_hits = Counter(
            "conveyor_dp_prefix_affinity_hits",
            "Requests routed to the replica that was last sent the same prompt prefix (whole KV blocks)",
            ["replica"],
            registry=r,
        )
        self.retried = Counter(
            "conveyor_dp_requests_retried",
            "Requests sent again to another replica because theirs could not be reached before answering",
            registry=r,
        )
        self.streams_lost = Counter(
            "conveyor_dp_streams_lost",
            "Streams ended with an error event because their replica stopped after sending tokens",
            registry=r,
        )
        self.up = Gauge("conveyor_dp_replica_up", "1 while the replica answers /health", ["replica"], registry=r)
        self.restarts = Gauge(
            "conveyor_dp_replica_restarts", "Times the replica came back after being down", ["replica"], registry=r
        )
        self.outstanding = Gauge(
            "conveyor_dp_outstanding_tokens",
            "Prompt + max new tokens of the requests in flight on the replica (what the router balances)",
            ["replica"],
            registry=r,
        )
        for i in range(num_replicas):  # every replica's series exists from the start, at 0
            for metric in (self.routed, self.affinity_hits, self.up, self.restarts, self.outstanding):
                metric.labels(str(i))

    def render(self, replica_texts: dict[int, str]) -> bytes:
        merged = CollectorRegistry()
        merged.register(_Relabelled(replica_texts))
        return generate_latest(self.registry) + generate_latest(merged)


class _Relabelled:
    """A collector (prometheus_client's protocol) over the replicas' scraped text."""

    def __init__(self, replica_texts: dict[int, str]) -> None:
        self.replica_texts = replica_texts

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        totals: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
        for replica, text in sorted(self.replica_texts.items()):
            for family in text_string_to_metric_families(text):
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation, family.type)
                    totals[family.name] = {}
                additive = family.type in ("counter", "histogram", "summary") or family.name in ADDITIVE_GAUGES
                for sample in family.samples:
                    if sample.name.endswith("_created"):
                        continue  # a per-process timestamp: neither labelled nor summed
                    merged.add_sample(sample.name, {**sample.labels, "replica": str(replica)}, sample.value)
                    if additive:
                        key = (sample.name, tuple(sorted(sample.labels.items())))
                        totals[family.name][key] = totals[family.name].get(key, 0.0) + sample.value
        for name, family in families.items():
            for (sample_name, labels), value in totals[name].items():
                family.add_sample(sample_name, dict(labels), value)
            yield family

    def describe(self) -> list[Any]:
        return []
