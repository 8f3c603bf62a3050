"""Prometheus metrics of the extender, in a registry per app (tests create many apps).

Names follow prometheus.io naming: `gputopo_` prefix, base units, `_total` counters; label values are
bounded (verbs, outcomes, `gputopo.engine.reasons.Reason` values), never pod or node names.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

KINDS = ("nodes", "pods", "leases")  # extender.kube.KINDS, without importing the API client here
VERBS = ("filter", "prioritize", "bind", "preempt", "mutate")
BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.015, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Metrics:
    def __init__(self, cache_age: Callable[[], float], registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.duration = Histogram(
            "gputopo_extender_request_duration_seconds",
            "Time to answer one extender call, by verb.",
            ["verb"],
            buckets=BUCKETS,
            registry=self.registry,
        )
        self.decisions = Counter(
            "gputopo_extender_decisions",
            "Extender decisions by verb, outcome and reason (the dominant failure reason when nothing fits).",
            ["verb", "outcome", "reason"],
            registry=self.registry,
        )
        self.cache_age = Gauge(
            "gputopo_extender_cache_age_seconds",
            "Seconds since the cache last heard from the API server (0 in snapshot mode).",
            registry=self.registry,
        )
        self.cache_age.set_function(cache_age)
        self.cache_nodes = Gauge("gputopo_extender_cache_nodes", "Nodes in the cache.", registry=self.registry)
        self.placement_mismatches = Counter(
            "gputopo_extender_placement_mismatches",
            "Pods whose node reported other GPUs than their placement (once per pod), by whether the "
            "actual GPUs still form a full NVLink clique.",
            ["clique"],
            registry=self.registry,
        )
        self.bad_objects = Counter(
            "gputopo_extender_bad_objects",
            "Node, Pod and Lease objects the cache could not read (skipped, or a node kept as unreadable), by kind.",
            ["kind"],
            registry=self.registry,
        )
        for kind in KINDS:
            self.bad_objects.labels(kind)
        for verb in VERBS:
            self.duration.labels(verb)

    def decision(self, verb: str, outcome: str, reason: str = "") -> None:
        self.decisions.labels(verb, outcome, reason).inc()
