"""Replay a job mix on the real kube-scheduler and gputopo-extender, pod by pod, beside the simulator.

The mix's nodes become simulated Nodes (no kubelet, no agent process): each carries the topology and
gpus-in-use annotations the agent would publish, a Lease as the agent's heartbeat (none for a node the
cluster file marks stale), and CPU and memory in proportion to its GPUs, as do the pods
(`CPU_PER_GPU`...), so kube-scheduler's LeastAllocated and BalancedAllocation have something to say
without ever refusing a pod the GPUs would take. GPUs a node has in use from the start are held by a
pod bound there (with its CPU and memory), reported under its UID as the agent would. A per-mix label
keeps the mix's pods on its nodes.

Jobs are fed in the mix's order: a single pod is created and followed until it is bound (its node and
the `gputopo.io/placement` GPUs) or kube-scheduler reports it unschedulable (PodScheduled=False,
Unschedulable); a group's members are all created, then followed until each is bound or refused for a
reason other than waiting for its members. An unplaced pod is deleted, as it would never fit later.
A plain pod's GPUs are the device plugin's choice (`Follower.plain_gpus`), published on its node as the
agent would. Before each job `gputopo.sim.fidelity.Follower` says what the engine would do in the
state the real placements left, and after it judges the real placement (docs/benchmarks.md, "The
simulator against the real kube-scheduler"). Every wait is bounded.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime

from prometheus_client.parser import text_string_to_metric_families

from gputopo.clusterfile import JobSpec
from gputopo.engine.state.reasons import Reason
from gputopo.engine.state.scoring import DEFAULT_WEIGHTS, ScoreWeights
from gputopo.engine.state.snapshot import NodeState
from gputopo.kube import KubeError
from gputopo.localcluster.kube import JSON, KubeClient, PodContainer, PodScheduling, SimNode, pod_manifest
from gputopo.localcluster.podwatch import PodTracker, pod_state, scheduling_message
from gputopo.localcluster.promstats import http_get
from gputopo.localcluster.stack import Stack
from gputopo.model import (
    GPUS_IN_USE_ANNOTATION,
    PLACEMENT_ANNOTATION,
    TOPOLOGY_ANNOTATION,
    GpusInUse,
    agent_lease_name,
    parse_placement,
)
from gputopo.sim.core import prepare_pods
from gputopo.sim.fidelity import EngineChoice, Follower, PodVerdict, RealPlacement
from gputopo.sim.records import SimPod
from gputopo.tiers import DEFAULT_TIERS, TierConfig

MIX_LABEL = "gputopo.io/fidelity-mix"
NUDGE_LABEL = "gputopo.io/fidelity-nudge"
# Node capacity and pod requests per GPU: a pod's share of CPU and memory is below its share of GPUs,
# so whatever the GPUs take also fits in CPU and memory (the simulator models GPUs only).
NODE_CPU_PER_GPU = 16
NODE_MEMORY_GIB_PER_GPU = 128
POD_CPU_PER_GPU = 12
POD_MEMORY_GIB_PER_GPU = 96
LEASE_DURATION_S = 3600
# kube-scheduler retries a pod an extender refused only on a cluster event: a group member refused
# while its group was incomplete may sit until one comes. A touch of a node label is such an event.
NUDGE_AFTER_S = 3.0


def sim_node(state: NodeState, mix: str, *, extra_labels: Mapping[str, str] | None = None) -> SimNode:
    """The Node a mix's node becomes: the agent's annotations, the node's labels and the mix label."""
    if state.topology is None:
        raise ValueError(f"node {state.name}: a replayed node needs a topology")
    n = len(state.topology.gpus)
    annotations = {
        TOPOLOGY_ANNOTATION: state.topology.to_annotation(),
        GPUS_IN_USE_ANNOTATION: GpusInUse(other=state.in_use).to_annotation(),
    }
    return SimNode(
        name=state.name,
        gpus=n,
        cpu=str(NODE_CPU_PER_GPU * max(n, 1)),
        memory=f"{NODE_MEMORY_GIB_PER_GPU * max(n, 1)}Gi",
        labels={**state.labels, **(extra_labels or {}), MIX_LABEL: mix},
        annotations=annotations,
    )


def pod_requests(gpus: int) -> tuple[str, str]:
    """(cpu, memory) requests of a pod with `gpus` GPUs, as a training pod asks for its share."""
    g = max(gpus, 1)
    return str(POD_CPU_PER_GPU * g), f"{POD_MEMORY_GIB_PER_GPU * g}Gi"


def _gauge(text: str, name: str, labels: Mapping[str, str] | None = None) -> float | None:
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in (labels or {}).items()):
                return float(s.value)
    return None


@dataclass
class JobRecord:
    """One job of the replay: the engine's choice, the real placements, the verdicts, and notes."""

    job: str
    choice: EngineChoice
    real: dict[str, RealPlacement | None]
    verdicts: list[PodVerdict]
    seconds: float
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class MixLimits:
    """How long one mix may take: `deadline_s` for all of it (feeding stops there, the run says it is
    incomplete), `pod_timeout_s` for each pod to be bound."""

    deadline_s: float
    pod_timeout_s: float = 30.0


@dataclass
class MixRun:
    name: str
    follower: Follower
    records: list[JobRecord]
    jobs_total: int
    seconds: float
    complete: bool  # every job was fed before the deadline
    notes: list[str] = field(default_factory=list)

    @property
    def verdicts(self) -> list[PodVerdict]:
        return [v for r in self.records for v in r.verdicts]

    @property
    def agreed(self) -> int:
        return sum(v.agrees for v in self.verdicts)


class Replay:
    """Runs mixes on a started `Stack` (its extender and kube-scheduler with the chart's configuration)."""

    def __init__(self, kube: KubeClient, stack: Stack, *, progress: Callable[[str], None] | None = None) -> None:
        if not stack.pods:
            raise ValueError("the stack's scheduler is not started")
        self.kube = kube
        self.stack = stack
        self._progress = progress
        self._in_use: dict[str, GpusInUse] = {}  # what each node's agent would report

    def _say(self, msg: str) -> None:
        if self._progress is not None:
            self._progress(msg)

    # -- nodes ------------------------------------------------------------------------------------

    def _lease(self, node: str, now: datetime) -> None:
        ns, name = self.stack.namespace, agent_lease_name(node)
        try:
            self.kube.create_lease(ns, name, holder=node, renew_time=now, duration_s=LEASE_DURATION_S)
        except KubeError as e:
            if e.status != 409:
                raise
            self.kube.renew_lease(ns, name, holder=node, renew_time=now, duration_s=LEASE_DURATION_S)

    def _metric(self, url: str, name: str, labels: Mapping[str, str] | None = None) -> float | None:
        status, text = http_get(url, timeout=5)
        return _gauge(text, name, labels) if status == 200 else None

    def _cache_counts(self) -> tuple[float | None, float | None]:
        """Nodes in the extender's cache and in kube-scheduler's (None where the page does not say)."""
        pod = self.stack.pods[0]
        ext = self._metric(pod.metrics_url, "gputopo_extender_cache_nodes")
        port = self.stack.cp.scheduler_port(pod.scheduler)
        url = f"https://127.0.0.1:{port}/metrics"
        sched = self._metric(url, "scheduler_cache_size", {"type": "nodes"})
        return ext, sched

    def add_nodes(self, nodes: Sequence[NodeState], mix: str, namespace: str, *, timeout: float = 60.0) -> list[str]:
        """Leases first (so no node is ever seen without its heartbeat), then the Nodes, then for each node's
        GPUs already in use a pod bound there that holds them (`hold`); returns once the extender's and
        kube-scheduler's caches hold the nodes (bounded; a shortfall is returned as a note)."""
        before = self._cache_counts()
        now = datetime.now(UTC)
        fresh = [n.name for n in nodes if n.problem is not Reason.TOPOLOGY_STALE]
        with ThreadPoolExecutor(max_workers=16) as ex:
            list(ex.map(lambda name: self._lease(name, now), fresh))
        self.kube.create_nodes([sim_node(n, mix) for n in nodes])
        for n in nodes:
            if n.in_use:
                self.hold(namespace, n.name, sorted(n.in_use))
        want = [None if b is None else b + len(nodes) for b in before]
        return self._wait_caches(want, timeout, "the mix's nodes")

    def hold(self, namespace: str, node: str, gpus: Sequence[int], *, name: str = "") -> str:
        """A pod bound to `node` (no scheduler) asking for `gpus` and its share of CPU and memory, and the
        node's gpus-in-use reporting those GPUs under its UID, as the node's agent would. Returns its name."""
        cpu, memory = pod_requests(len(gpus))
        manifest = pod_manifest(
            name or f"held-{node}"[:63].rstrip("-."),
            namespace=namespace,
            gpus=len(gpus),
            labels={"app": "gputopo-fidelity-held"},
            container=PodContainer(cpu=cpu, memory=memory),
        )
        manifest["spec"]["nodeName"] = node
        pod = self.kube.create_pod(manifest)
        self.report(node, str(pod["metadata"]["uid"]), gpus)
        return str(pod["metadata"]["name"])

    def report(self, node: str, uid: str, gpus: Sequence[int]) -> None:
        """Add `gpus` under pod `uid` to the node's gpus-in-use annotation (the agent's version 2 form)."""
        cur = self._in_use.get(node, GpusInUse())
        self._in_use[node] = GpusInUse(pods={**cur.pods, uid: frozenset(gpus)}, other=cur.other)
        self.kube.annotate_node(node, {GPUS_IN_USE_ANNOTATION: self._in_use[node].to_annotation()})

    def _wait_caches(self, want: Sequence[float | None], timeout: float, what: str, *, up: bool = True) -> list[str]:
        end = time.monotonic() + timeout
        got = self._cache_counts()
        while time.monotonic() < end:
            got = self._cache_counts()
            if all(w is None or (g is not None and (g >= w if up else g <= w)) for w, g in zip(want, got, strict=True)):
                return []
            time.sleep(0.2)  # polls two /metrics pages: a handful of reads, bounded by `timeout`
        return [f"caches not settled on {what} after {timeout:.0f}s: extender {got[0]}, scheduler {got[1]} nodes"]

    def remove_nodes(self, nodes: Iterable[str], *, timeout: float = 30.0) -> list[str]:
        """Delete the Nodes and their Leases; returns once both caches let them go (bounded, as a note)."""
        names = list(nodes)
        before = self._cache_counts()
        for name in names:
            self._in_use.pop(name, None)
            for path in (
                f"/api/v1/nodes/{name}",
                f"/apis/coordination.k8s.io/v1/namespaces/{self.stack.namespace}/leases/{agent_lease_name(name)}",
            ):
                try:
                    self.kube.request("DELETE", path)
                except KubeError as e:
                    if e.status != 404:
                        raise
        want = [None if b is None else b - len(names) for b in before]
        return self._wait_caches(want, timeout, "the removed nodes", up=False)

    # -- one mix ----------------------------------------------------------------------------------

    def run_mix(
        self,
        name: str,
        nodes: Sequence[NodeState],
        jobs: Sequence[JobSpec],
        limits: MixLimits,
        *,
        tiers: TierConfig = DEFAULT_TIERS,
        weights: ScoreWeights = DEFAULT_WEIGHTS,
        keep_nodes: bool = False,
    ) -> MixRun:
        """Feed `jobs` to the real scheduler on `nodes`, one job at a time, judging each against the engine,
        within `limits`. The nodes and pods are removed afterwards unless `keep_nodes`."""
        t0 = time.monotonic()
        end = t0 + limits.deadline_s
        mix = f"{name}-{secrets.token_hex(3)}"
        namespace = f"fidelity-{mix}"
        self.kube.create_namespace(namespace)
        notes = self.add_nodes(nodes, mix, namespace)
        follower = Follower(nodes, tiers, weights)
        prepared = prepare_pods(jobs, tiers)
        tracker = PodTracker(self.kube, namespace)
        tracker.start()
        records: list[JobRecord] = []
        ctx = _JobContext(self, tracker, namespace, mix, [n.name for n in nodes], limits.pod_timeout_s)
        try:
            for job, pods in zip(jobs, prepared, strict=True):
                if time.monotonic() >= end:
                    break
                if not pods:
                    continue
                records.append(ctx.run_job(follower, job, pods, end))
        finally:
            tracker.stop()
            for p in list(tracker.pods):
                self.kube.delete_pod(namespace, p)
            if not keep_nodes:
                notes += self.remove_nodes(n.name for n in nodes)
        complete = len(records) == sum(1 for p in prepared if p)
        return MixRun(name, follower, records, len(jobs), time.monotonic() - t0, complete, notes)


@dataclass
class _JobContext:
    replay: Replay
    tracker: PodTracker
    namespace: str
    mix: str
    node_names: list[str]
    pod_timeout_s: float
    nudges: int = 0

    @property
    def kube(self) -> KubeClient:
        return self.replay.kube

    def run_job(self, follower: Follower, job: JobSpec, pods: Sequence[SimPod], end: float) -> JobRecord:
        t0 = time.monotonic()
        choice = follower.decide(pods)
        names = [p.name for p in pods]
        manifests = []
        for i, p in enumerate(pods):
            cpu, memory = pod_requests(p.request.gpus)
            manifests.append(
                pod_manifest(
                    p.name,
                    namespace=self.namespace,
                    gpus=p.request.gpus,
                    annotations=job.pod_annotations(i),
                    labels={"app": "gputopo-fidelity"},
                    scheduling=PodScheduling(
                        scheduler_name=self.replay.stack.scheduler_name, node_selector={MIX_LABEL: self.mix}
                    ),
                    container=PodContainer(cpu=cpu, memory=memory),
                )
            )
        self.kube.create_pods(manifests, workers=min(16, len(manifests)))
        budget = min(self.pod_timeout_s + 2.0 * len(pods), max(1.0, end - time.monotonic()))
        notes: list[str] = []
        seen = self._follow(names, budget)
        real: dict[str, RealPlacement | None] = {}
        for p in pods:
            pod = seen.get(p.name)
            state = pod_state(pod)
            if state == "bound" and pod is not None:
                real[p.name] = self._placement(follower, p, pod, notes)
            else:
                if state == "pending":
                    notes.append(
                        f"{p.name} neither bound nor refused in {budget:.0f}s: {scheduling_message(pod)[:200]}"
                    )
                real[p.name] = None
                self.kube.delete_pod(self.namespace, p.name)
        verdicts = follower.observe(choice, real)
        return JobRecord(job.name, choice, real, verdicts, time.monotonic() - t0, notes)

    def _follow(self, names: Sequence[str], budget: float) -> dict[str, JSON]:
        """Until every named pod is bound or refused, or `budget` seconds pass; nudges while it waits."""
        end = time.monotonic() + budget

        def settled(pods: Mapping[str, JSON]) -> bool:
            return all(pod_state(pods.get(n)) != "pending" for n in names)

        while not self.tracker.wait(settled, min(NUDGE_AFTER_S, max(0.0, end - time.monotonic()))):
            if time.monotonic() >= end:
                break
            self._nudge()
        with self.tracker.cond:
            return {n: self.tracker.pods[n] for n in names if n in self.tracker.pods}

    def _nudge(self) -> None:
        self.nudges += 1
        node = self.node_names[self.nudges % len(self.node_names)]
        self.kube.patch_node(node, {"metadata": {"labels": {NUDGE_LABEL: str(self.nudges)}}})

    def _placement(self, follower: Follower, p: SimPod, pod: JSON, notes: list[str]) -> RealPlacement:
        node = str(pod["spec"]["nodeName"])
        text = (pod.get("metadata", {}).get("annotations") or {}).get(PLACEMENT_ANNOTATION)
        if text:
            pl = parse_placement(text)
            return RealPlacement(node, tuple(pl.gpus), pl.score, pl.reason)
        if p.opted_in:
            notes.append(f"{p.name} bound to {node} without a {PLACEMENT_ANNOTATION} annotation")
            return RealPlacement(node, ())
        # A plain pod: the device plugin picks its GPUs, and the agent reports them under its UID.
        gpus = follower.plain_gpus(node, p.request.gpus)
        if gpus:
            self.replay.report(node, str(pod["metadata"]["uid"]), gpus)
        return RealPlacement(node, gpus, 0, "plain pod: kube-scheduler's choice, the device plugin's GPUs")
