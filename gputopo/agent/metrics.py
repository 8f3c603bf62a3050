"""The agent's Prometheus metrics, on a registry of its own so tests can build many agents."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gputopo.agent.confirmedwrite import PublishResult


class AgentMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.discovery_duration = Histogram(
            "gputopo_agent_discovery_duration_seconds",
            "Time to discover the node's topology and GPUs in use, per cycle.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
            registry=self.registry,
        )
        self.publish_total = Counter(
            "gputopo_agent_publish_total",
            "Publish attempts to the Node, by result (changed, unchanged, error).",
            ["result"],
            registry=self.registry,
        )
        self.links_degraded = Gauge(
            "gputopo_agent_nvlink_links_degraded",
            "NVLink links currently down or degraded on this node.",
            registry=self.registry,
        )
        self.dra_counters_dropped = Gauge(
            "gputopo_agent_dra_counters_dropped",
            "1 when --dra-blocks is on and the API server dropped the blocks' counters: single GPUs only.",
            registry=self.registry,
        )
        for result in PublishResult:  # export zeros so rate() works from the first scrape
            self.publish_total.labels(result=result.value)
