"""Prometheus metrics of the extender, in a registry per app (tests create many apps).

Names follow prometheus.io naming: `gputopo_` prefix, base units, `_total` counters; label values are
bounded (verbs, outcomes, `gputopo.engine.state.reasons.Reason` values), never pod or node names.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from gputopo.engine.cluster.fragmentation import DEFAULT_SIZES, Figures, cluster_figures
from gputopo.engine.state.snapshot import NodeState
from gputopo.kube import KIND_NAMES

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
        self.wire_bytes = Counter(
            "gputopo_extender_wire_bytes",
            "Bytes of extender calls, by verb and direction (in: request body, out: answer body).",
            ["verb", "direction"],
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
            "Objects the cache could not read (skipped, or a node kept as unreadable), by kind.",
            ["kind"],
            registry=self.registry,
        )
        self.free_cliques = Gauge(
            "gputopo_extender_free_cliques",
            "Disjoint fully NVLink-connected sets of free GPUs, by size, over the nodes that take gputopo pods "
            "(the most of each size alone; gputopo defrag's default pod sizes).",
            ["size"],
            registry=self.registry,
        )
        self.stranded_gpus = Gauge(
            "gputopo_extender_stranded_gpus",
            "Free healthy GPUs that no packing of free NVLink cliques of gputopo defrag's default pod sizes covers.",
            registry=self.registry,
        )
        self.relists = Counter(
            "gputopo_extender_relists",
            "Full LISTs the informers asked the API server for, by kind: one at start, then one after each "
            "410 Gone, failed list, or recheck of a kind the API server did not serve.",
            ["kind"],
            registry=self.registry,
        )
        self.gates_lifted = Counter(
            "gputopo_extender_group_gates_lifted",
            "gputopo.io/group-complete scheduling gates the extender lifted, by why: complete (the group is "
            "whole and planned), no-group, held-elsewhere (Kueue or a PodGroup holds the pod), cannot-place, timeout.",
            ["reason"],
            registry=self.registry,
        )
        self.fragmentation: FragmentationTracker | None = None  # track_fragmentation sets it
        for kind in KIND_NAMES:  # every watched kind's series exists from the start, at 0
            self.bad_objects.labels(kind)
            self.relists.labels(kind)
        # Each call records its duration and bytes: the children are looked up once, here.
        self.durations = {verb: self.duration.labels(verb) for verb in VERBS}
        self.bytes_in = {verb: self.wire_bytes.labels(verb, "in") for verb in VERBS}
        self.bytes_out = {verb: self.wire_bytes.labels(verb, "out") for verb in VERBS}

    def relisted(self, kind: str) -> None:
        """An informer asked for a full LIST of `kind` (its `on_relist`)."""
        self.relists.labels(kind).inc()

    def decision(self, verb: str, outcome: str, reason: str = "") -> None:
        self.decisions.labels(verb, outcome, reason).inc()

    def track_holds(self, held: Callable[[], Mapping[str, int]]) -> None:
        """Serve the GPUs group reservations hold per namespace (`held`, read when /metrics is scraped)."""
        self.registry.register(_HeldGpus(held))

    def track_fragmentation(
        self,
        generation: Callable[[], int],
        states: Callable[[], Sequence[NodeState]],
        clock: Callable[[], float],
        *,
        min_interval: float = 10.0,
        max_age: float = 60.0,
    ) -> FragmentationTracker:
        """Serve the fragmentation gauges from the cache's node states (`FragmentationTracker`)."""
        tracker = FragmentationTracker(generation, states, clock, min_interval=min_interval, max_age=max_age)
        self.fragmentation = tracker
        for i, k in enumerate(tracker.sizes):
            self.free_cliques.labels(size=str(k)).set_function(_clique_count(tracker, i))
        self.stranded_gpus.set_function(lambda: tracker.figures().stranded)
        return tracker


class _HeldGpus(Collector):
    """gputopo_extender_held_gpus{namespace}: GPUs held by group reservations for members not bound yet
    (at most one series per namespace with a reservation: bounded by the reservation book)."""

    def __init__(self, held: Callable[[], Mapping[str, int]]) -> None:
        self.held = held

    def describe(self) -> list[GaugeMetricFamily]:
        return [self._family()]

    def collect(self) -> list[GaugeMetricFamily]:
        family = self._family()
        for namespace, gpus in sorted(self.held().items()):
            family.add_metric([namespace], gpus)
        return [family]

    @staticmethod
    def _family() -> GaugeMetricFamily:
        return GaugeMetricFamily(
            "gputopo_extender_held_gpus",
            "GPUs group reservations hold for members not bound yet (JobSet followers not created yet "
            "included), by namespace.",
            labels=["namespace"],
        )


def _clique_count(tracker: FragmentationTracker, i: int) -> Callable[[], float]:
    return lambda: tracker.figures().cliques[i]


class FragmentationTracker:
    """The fragmentation figures, recomputed when a scrape reads them, only if the cache changed since
    the last computation (`generation`) and at most every `min_interval` seconds, or after `max_age`
    seconds regardless (nodes go stale with time alone). Never on a filter or prioritize call: those
    stay O(their nodes). One computation costs a pass over the nodes, each distinct node kind once."""

    def __init__(
        self,
        generation: Callable[[], int],
        states: Callable[[], Sequence[NodeState]],
        clock: Callable[[], float],
        *,
        min_interval: float = 10.0,
        max_age: float = 60.0,
        sizes: tuple[int, ...] = DEFAULT_SIZES,
    ) -> None:
        self.generation, self.states, self.clock = generation, states, clock
        self.min_interval, self.max_age, self.sizes = min_interval, max_age, sizes
        self.computed = 0  # computations so far (tests check the throttle with it)
        self._lock = threading.Lock()
        self._at = -math.inf
        self._seen = -1
        self._figures = Figures(0, tuple(0 for _ in sizes), tuple(0 for _ in sizes), 0)

    def figures(self) -> Figures:
        with self._lock:
            now = self.clock()
            age = now - self._at
            gen = self.generation()
            if age >= self.max_age or (gen != self._seen and age >= self.min_interval):
                self._seen = gen  # read before the states: a change while computing is seen next time
                self._figures = cluster_figures(self.states(), self.sizes)
                self._at = now
                self.computed += 1
            return self._figures
