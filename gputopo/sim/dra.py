"""The simulator over DRA: a job mix placed as DRA would place it, over kube-scheduler's allocator as
`gputopo.sim.draallocator` emulates it, and what each claim encoding can express on a node. Pure.

`simulate_dra` places a job mix under one of the claim encodings (`ENCODINGS`) and one of three node
choices: `gputopo` (the engine ranks the nodes, as the extender does, and the pod lands on the best
ranked node where the allocator can meet its claim; the allocator, not the engine, picks the GPUs);
`first` (kube-scheduler 1.34 alone: it scores no DRA device, so every node that fits ties and the
first by name stands for its random pick); `scored` (kube-scheduler 1.35 and later, which scores a
node by the `firstAvailable` subrequest its allocation met, earlier is better, per
kubernetes/kubernetes#134711: the first node by name among those that meet the earliest one).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations
from typing import Literal

from gputopo.clusterfile import JobSpec
from gputopo.engine.cluster.explain import gpu_ranges
from gputopo.engine.dra.devices import (
    ATTR_CLIQUES,
    PARTITIONS,
    block_id,
    devices,
    encoding,
    partition_attribute,
    partition_cover,
    qualified,
)
from gputopo.engine.gang.groups import plan_group
from gputopo.engine.gang.plan import GroupFailure, Member
from gputopo.engine.network.domains import FreeTracker
from gputopo.engine.node.placement import evaluate_pod, rank
from gputopo.engine.state.cliques import popcount
from gputopo.engine.state.reasons import summarize_failures
from gputopo.engine.state.scoring import DEFAULT_WEIGHTS, ScoreWeights
from gputopo.engine.state.snapshot import NodeState, with_in_use
from gputopo.model import NodeTopology
from gputopo.sim.checks import broken_requests
from gputopo.sim.core import SimResult, prepare_pods
from gputopo.sim.draallocator import (
    ENCODINGS,
    Allocation,
    Claim,
    Encoding,
    NodeDevices,
    Subrequest,
    Values,
    allocate,
    claim_for,
    list_claim,
    partition_claim,
    unconstrained_claim,
)
from gputopo.sim.metrics import is_group_job, summarize
from gputopo.sim.records import Decision, Measures, PodPlacement, RunRecord, SimPod, UnplacedPod
from gputopo.tiers import DEFAULT_TIERS, TierConfig

__all__ = [
    "CANNOT_ALLOCATE",
    "ENCODINGS",
    "NODE_CHOICES",
    "Allocation",
    "Claim",
    "Expressiveness",
    "KSets",
    "NodeDevices",
    "Subrequest",
    "allocate",
    "claim_for",
    "expressiveness",
    "list_claim",
    "partition_claim",
    "simulate_dra",
    "unconstrained_claim",
]

NodeChoice = Literal["gputopo", "first", "scored"]
NODE_CHOICES: tuple[NodeChoice, ...] = ("gputopo", "first", "scored")

# kube-scheduler's DynamicResources Filter message for a node where the claim cannot be allocated.
CANNOT_ALLOCATE = "cannot allocate all claims"


# --------------------------------------------------------------------------------------------------
# What each encoding can express on a node


@dataclass(frozen=True)
class KSets:
    k: int
    all: int  # k-sets of healthy GPUs
    connected: int  # of those, fully NVLink-connected
    by_partitions: int  # connected k-sets inside one block of one scalar partition
    by_list: int  # k-sets whose clique lists intersect (equals `connected` when the list is exact)


@dataclass(frozen=True)
class Expressiveness:
    gpus: int
    cliques: tuple[int, ...]  # maximal cliques of 2+ GPUs, masks
    partitions_needed: int  # scalar partitions that hold every maximal clique as a block
    left_out: tuple[int, ...]  # maximal cliques the published PARTITIONS partitions miss
    ksets: tuple[KSets, ...]

    def clique_ids(self) -> list[str]:
        return [block_id(c) for c in self.cliques]

    def left_out_ids(self) -> list[str]:
        return [block_id(c) for c in self.left_out]


def expressiveness(topology: NodeTopology, ks: Sequence[int] = (2, 4, 8)) -> Expressiveness:
    """Per k, how many of the node's fully connected k-sets each encoding's published attributes let a
    claim ask for (read from the devices as published, as the allocator reads them)."""
    enc = encoding(topology)
    n = len(topology.gpus)
    big = [c for c in enc.cliques if popcount(c) >= 2]
    full_cover, _ = partition_cover(n, enc.cliques, limit=n * n + 1)
    needed = len(full_cover) if big else 0
    nd = NodeDevices(devices(topology, list_attributes=True))
    healthy = [i for i, d in enumerate(nd.devices) if not d.failed]
    lists = nd.values(qualified(ATTR_CLIQUES))
    parts = [nd.values(qualified(partition_attribute(p))) for p in range(PARTITIONS)]
    links = topology.nvlink.links
    out: list[KSets] = []
    for k in ks:
        if k > len(healthy):
            continue
        total = conn = by_p = by_l = 0
        for s in combinations(healthy, k):
            total += 1
            idx = [nd.devices[i].index for i in s]
            connected = bool(links) and all(links[a][b] > 0 for a, b in combinations(idx, 2))
            conn += connected
            by_l += _intersect(lists, s)
            by_p += connected and any(_intersect(p, s) for p in parts)
        out.append(KSets(k, total, conn, by_p, by_l))
    return Expressiveness(n, tuple(big), needed, tuple(c for c in enc.left_out if popcount(c) >= 2), tuple(out))


def _intersect(values: Sequence[Values | None], positions: Sequence[int]) -> bool:
    common: Values | None = None
    for i in positions:
        v = values[i]
        if v is None:
            return False
        common = v if common is None else common & v
        if not common:
            return False
    return True


# --------------------------------------------------------------------------------------------------
# The simulator over DRA


class _DraRun:
    def __init__(
        self,
        nodes: Sequence[NodeState],
        encoding_: Encoding,
        node_choice: NodeChoice,
        tiers: TierConfig,
        weights: ScoreWeights,
    ) -> None:
        self.nodes = list(nodes)
        self.free = FreeTracker(self.nodes, tiers)
        self.index = {n.name: i for i, n in enumerate(self.nodes)}
        self.by_name = sorted(range(len(self.nodes)), key=lambda i: self.nodes[i].name)
        self.encoding = encoding_
        self.node_choice = node_choice
        self.tiers = tiers
        self.weights = weights
        # Nodes that share a topology object publish the same devices: one view each.
        views: dict[int, NodeDevices] = {}
        self.views: list[NodeDevices | None] = []
        self._keep: list[NodeTopology] = []
        for n in self.nodes:
            topo = n.topology
            if topo is None or not topo.gpus:
                self.views.append(None)
                continue
            view = views.get(id(topo))
            if view is None:
                view = NodeDevices(devices(topo, list_attributes=encoding_ == "list"))
                views[id(topo)] = view
                self._keep.append(topo)  # keeps id(topo) from being reused while the run lasts
            self.views.append(view)
        self.memo: dict[tuple[int, int, Claim], Allocation | None] = {}
        self.placements: list[PodPlacement] = []
        self.unplaced: list[UnplacedPod] = []
        self.decisions: list[Decision] = []

    def try_node(self, i: int, claim: Claim) -> Allocation | None:
        view = self.views[i]
        node = self.nodes[i]
        if view is None or popcount(node.free_mask) < min(s.count for s in claim.subrequests):
            return None  # cheap: fewer free GPUs than any subrequest wants
        key = (id(view), node.in_use_mask, claim)
        if key not in self.memo:
            taken = [view.devices[p].name for p in range(len(view)) if view.devices[p].index in node.in_use]
            self.memo[key] = allocate(view, claim, taken)
        return self.memo[key]

    def take(self, i: int, gpus: Sequence[int]) -> None:
        old, self.nodes[i] = self.nodes[i], with_in_use(self.nodes[i], frozenset(gpus), self.tiers)
        self.free.replace(old, self.nodes[i])

    def record(self, pod: SimPod, i: int, got: Allocation, why: str) -> None:
        node = self.nodes[i]
        broken = broken_requests(node, got.gpus, pod.request) if pod.opted_in else []
        words = f"{why}; the DRA allocator ({self.encoding}) gave GPU{'s' if len(got.gpus) > 1 else ''} "
        words += f"{gpu_ranges(got.gpus)} (subrequest {got.subrequest})"
        if broken:
            words += "; against the pod's request: " + "; ".join(w for _, w in broken)
        self.placements.append(PodPlacement(pod.name, pod.job, node.name, got.gpus, 0, words))
        self.take(i, got.gpus)

    def fail(self, pod: SimPod) -> None:
        n = len(self.nodes)
        self.unplaced.append(UnplacedPod(pod.name, pod.job, summarize_failures([CANNOT_ALLOCATE] * n, n)))

    def first_fit_node(self, pod: SimPod, scored: bool) -> None:
        claim = claim_for(pod.request, self.encoding, opted_in=pod.opted_in)
        rank_of = {s.name: r for r, s in enumerate(claim.subrequests)}
        best: tuple[int, int, Allocation] | None = None
        for i in self.by_name:
            got = self.try_node(i, claim)
            if got is None:
                continue
            r = rank_of[got.subrequest]
            if best is None or r < best[0]:
                best = (r, i, got)
            if not scored or r == 0:  # nothing scores higher than the first subrequest
                break
        if best is None:
            self.fail(pod)
            return
        _, i, got = best
        why = f"kube-scheduler: {self.nodes[i].name} is the first node by name that fits"
        if scored and len(claim.subrequests) > 1:
            why += f" with its subrequest {got.subrequest} (earlier subrequests score higher)"
        self.record(pod, i, got, why)

    def engine_single(self, pod: SimPod) -> None:
        claim = claim_for(pod.request, self.encoding, opted_in=pod.opted_in)
        verdicts = evaluate_pod(self.nodes, pod.request, self.weights)
        ranked = rank(verdicts, self.free.figures, self.tiers)  # ties as the extender breaks them
        for v in ranked:
            i = self.index[v.name]
            got = self.try_node(i, claim)
            if got is not None:
                self.record(pod, i, got, f"the engine ranked {v.name} best of the nodes the allocator can serve")
                return
        self.fail(pod)

    def engine_group(self, pods: Sequence[SimPod]) -> None:
        lead = pods[0].request
        if (lead.group_size or len(pods)) != len(pods):  # the rest of the gang has not arrived
            for p in pods:
                self.fail(p)
            return
        members = [Member(p.name, p.request) for p in pods]
        plan = plan_group(lead.group or pods[0].job, members, self.nodes, self.tiers, self.weights)
        if isinstance(plan, GroupFailure):
            for p in pods:
                self.fail(p)
            return
        saved = list(self.nodes)
        mark = len(self.placements)
        for a in plan.assignments:
            pod = next(p for p in pods if p.name == a.member)
            i = self.index[a.node.name]
            got = self.try_node(i, claim_for(pod.request, self.encoding, opted_in=pod.opted_in))
            if got is None:  # the allocator refuses a planned node: the gang waits, nothing is held
                self.nodes = saved
                del self.placements[mark:]
                for p in pods:
                    self.fail(p)
                return
            self.record(pod, i, got, f"the engine's group plan put this member on {a.node.name}")


def simulate_dra(
    nodes: Sequence[NodeState],
    jobs: Sequence[JobSpec],
    encoding_: Encoding,
    node_choice: NodeChoice = "gputopo",
    tiers: TierConfig = DEFAULT_TIERS,
    *,
    weights: ScoreWeights = DEFAULT_WEIGHTS,
    exhaustive: bool = False,
) -> SimResult:
    """Place `jobs` in order on `nodes` as DRA would: the claim each pod gets under `encoding_`, the
    node `node_choice` gives, the devices the allocator gives. Deterministic: no tie is random."""
    if encoding_ not in ENCODINGS:
        raise ValueError(f"unknown encoding {encoding_!r}; known: {', '.join(ENCODINGS)}")
    if node_choice not in NODE_CHOICES:
        raise ValueError(f"unknown node choice {node_choice!r}; known: {', '.join(NODE_CHOICES)}")
    pods_per_job = prepare_pods(jobs, tiers)
    run = _DraRun(nodes, encoding_, node_choice, tiers, weights)
    for pods in pods_per_job:
        if not pods:
            continue
        t0 = time.perf_counter()
        if node_choice != "gputopo" or not pods[0].opted_in:  # plain pods: kube-scheduler decides alone
            for pod in pods:
                t1 = time.perf_counter()
                run.first_fit_node(pod, node_choice == "scored")
                run.decisions.append(Decision(pod.job, 1, time.perf_counter() - t1))
            continue
        if is_group_job(pods):
            run.engine_group(pods)
        else:
            run.engine_single(pods[0])
        run.decisions.append(Decision(pods[0].job, len(pods), time.perf_counter() - t0))
    record = RunRecord(pods_per_job, run.placements, [u.pod for u in run.unplaced], tuple(nodes), tuple(run.nodes))
    summary = summarize(record, tiers, weights, Measures(exhaustive=exhaustive))
    return SimResult(
        policy=f"dra-{encoding_}/{node_choice}",
        seed=0,
        jobs=tuple(pods_per_job),
        placements=tuple(run.placements),
        unplaced=tuple(run.unplaced),
        initial=tuple(nodes),
        final=tuple(run.nodes),
        decisions=tuple(run.decisions),
        summary=summary,
    )
