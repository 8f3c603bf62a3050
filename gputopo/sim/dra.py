"""kube-scheduler's DRA allocator, emulated for gputopo's devices, and the simulator run on top of it. Pure.

Under DRA the scheduler, not the device plugin, picks a pod's GPUs: its DynamicResources plugin runs the
structured allocator (k8s.io/dynamic-resource-allocation/structured) on every candidate node. What that
allocator does, as read in its v0.34.4 source (list values: as the v0.37.2 API documents them), and as
`allocate` repeats it for one claim on one node:

- a request's `firstAvailable` subrequests are tried in order; the first one that can be met wins;
- for each device the request still needs, the devices of the node's pool are tried in slice order,
  skipping those already allocated, those the class's and request's selectors reject, and those a
  constraint rejects; the search backtracks on a dead end and stops at the first full solution;
- `matchAttribute` needs the attribute on every chosen device; the values are compared as sets (a
  scalar is a one-element set, the list-typed attributes of KEP-5491 are their elements) and the
  chosen devices' sets must intersect. Over scalars alone that is plain equality, as before 1.36.

Upstream tries every ordering of the devices of a request. The constraint is a property of the set,
not of the order, so its first solution is the lexicographically least feasible set in slice order,
and so is the first of a search that only tries devices in increasing order: `allocate` searches that
way and finds the same devices, without walking every permutation when no solution exists.

Failed GPUs are never chosen: the agent taints them NoSchedule, or leaves them out of the slice.

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
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations
from typing import Any, Literal

from gputopo.clusterfile import JobSpec
from gputopo.engine.cliques import popcount
from gputopo.engine.dra import (
    ATTR_CLIQUES,
    DRIVER,
    PARTITIONS,
    Device,
    block_id,
    devices,
    encoding,
    partition_attribute,
    partition_cover,
    qualified,
)
from gputopo.engine.draclaims import ClaimShape, claim_shape, device_claim
from gputopo.engine.explain import gpu_ranges
from gputopo.engine.groups import GroupFailure, Member, plan_group
from gputopo.engine.placement import evaluate_pod, rank
from gputopo.engine.reasons import summarize_failures
from gputopo.engine.scoring import DEFAULT_WEIGHTS, ScoreWeights
from gputopo.engine.snapshot import NodeState, with_in_use
from gputopo.model import NodeTopology, NvlinkPolicy, PodRequest
from gputopo.sim.checks import broken_requests
from gputopo.sim.core import SimResult, prepare_pods
from gputopo.sim.metrics import is_group_job, summarize
from gputopo.sim.records import Decision, PodPlacement, SimPod, UnplacedPod
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

Encoding = Literal["none", "partitions", "list"]
NodeChoice = Literal["gputopo", "first", "scored"]
ENCODINGS: tuple[Encoding, ...] = ("none", "partitions", "list")
NODE_CHOICES: tuple[NodeChoice, ...] = ("gputopo", "first", "scored")

MAX_SUBREQUESTS = 8  # resource.k8s.io/v1 FirstAvailableDeviceRequestMaxSize
MAX_DEVICES = 32  # resource.k8s.io/v1 AllocationResultsMaxSize

# kube-scheduler's DynamicResources Filter message for a node where the claim cannot be allocated.
CANNOT_ALLOCATE = "cannot allocate all claims"


# --------------------------------------------------------------------------------------------------
# Claims


@dataclass(frozen=True)
class Subrequest:
    """One way to meet the claim: `count` devices of gputopo's class with at least `min_memory_mib`
    (a CEL selector on the `memory` capacity), all sharing `match_attribute` when one is given (a
    `matchAttribute` constraint naming this subrequest)."""

    name: str
    count: int
    min_memory_mib: int = 0
    match_attribute: str | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("subrequest name must not be empty")
        if not 1 <= self.count <= MAX_DEVICES:
            raise ValueError(f"subrequest {self.name!r}: count {self.count} must be between 1 and {MAX_DEVICES}")
        if self.min_memory_mib < 0:
            raise ValueError(f"subrequest {self.name!r}: min_memory_mib {self.min_memory_mib} must be >= 0")
        if self.match_attribute is not None and "/" not in self.match_attribute:
            raise ValueError(
                f"subrequest {self.name!r}: match_attribute {self.match_attribute!r} must be fully qualified"
            )


@dataclass(frozen=True)
class Claim:
    """A one-request ResourceClaim: one subrequest is a plain `exactly` request, several are its
    `firstAvailable` list, tried in order."""

    subrequests: tuple[Subrequest, ...]

    def __post_init__(self) -> None:
        if not 1 <= len(self.subrequests) <= MAX_SUBREQUESTS:
            raise ValueError(f"claim has {len(self.subrequests)} subrequests; it needs 1 to {MAX_SUBREQUESTS}")
        names = [s.name for s in self.subrequests]
        if len(set(names)) != len(names):
            raise ValueError(f"claim subrequest names repeat: {', '.join(names)}")


def claim_from_spec(devices: Mapping[str, Any], min_memory_mib: int = 0) -> Claim:
    """The Claim a ResourceClaim's `spec.devices` asks for (one request: `exactly`, or `firstAvailable`
    subrequests tried in order; `matchAttribute` constraints naming the request or a subrequest).
    `min_memory_mib` stands for the builder's CEL memory selector, which this emulation does not parse."""
    (request,) = devices["requests"]
    constraints = {tuple(c["requests"]): c["matchAttribute"] for c in devices.get("constraints", [])}
    name = request["name"]
    if "exactly" in request:
        return Claim((Subrequest(name, request["exactly"]["count"], min_memory_mib, constraints.get((name,))),))
    return Claim(
        tuple(
            Subrequest(s["name"], s["count"], min_memory_mib, constraints.get((f"{name}/{s['name']}",)))
            for s in request["firstAvailable"]
        )
    )


def _built(count: int, nvlink: NvlinkPolicy, min_memory_mib: int, *, list_attributes: bool) -> Claim:
    """The claim gputopo's claim builder (the webhook's) makes for this shape."""
    shape = ClaimShape(count, nvlink, min_memory_mib or None, list_attributes)
    return claim_from_spec(device_claim(shape), min_memory_mib)


def unconstrained_claim(count: int, min_memory_mib: int = 0) -> Claim:
    """`count` GPUs, no constraint: what KEP-5004's `nvidia.com/gpu: N` becomes (with no memory selector)."""
    return _built(count, NvlinkPolicy.IGNORE, min_memory_mib, list_attributes=False)


def list_claim(count: int, min_memory_mib: int = 0, *, fallback: bool = False) -> Claim:
    """`count` GPUs that share a maximal NVLink clique (the list attribute); `fallback`: then any GPUs."""
    nvlink = NvlinkPolicy.PREFERRED if fallback else NvlinkPolicy.REQUIRED
    return _built(count, nvlink, min_memory_mib, list_attributes=True)


def partition_claim(count: int, min_memory_mib: int = 0, *, fallback: bool = False) -> Claim:
    """`count` GPUs in one block of scalar partition 0, else of partition 1, ...; `fallback`: then any."""
    nvlink = NvlinkPolicy.PREFERRED if fallback else NvlinkPolicy.REQUIRED
    return _built(count, nvlink, min_memory_mib, list_attributes=False)


def claim_for(request: PodRequest, encoding_: Encoding, *, opted_in: bool = True) -> Claim:
    """The claim a pod gets. `none`: KEP-5004's count alone, whatever the pod's annotations. Otherwise
    the claim builder's (the webhook's): min HBM as a selector, and for an NVLink-wanting multi-GPU
    pod the clique constraint (`preferred` adds an unconstrained last subrequest). A plain pod keeps
    KEP-5004's."""
    if encoding_ not in ENCODINGS:
        raise ValueError(f"unknown encoding {encoding_!r}; known: {', '.join(ENCODINGS)}")
    if encoding_ == "none" or not opted_in:
        return unconstrained_claim(request.gpus)
    shape = claim_shape(request, list_attributes=encoding_ == "list")
    return claim_from_spec(device_claim(shape), shape.min_memory_mib or 0)


# --------------------------------------------------------------------------------------------------
# The allocator


Values = frozenset[tuple[str, object]]  # an attribute's values as a set of (type, value)


def _values(v: object) -> Values:
    items = v if isinstance(v, tuple) else (v,)
    # Typed: upstream never matches an int against a string or a bool (and Python's True == 1).
    return frozenset((type(x).__name__, x) for x in items)


class NodeDevices:
    """A node's published devices in slice order, with what the allocator reads of them cached."""

    def __init__(self, published: Sequence[Device]) -> None:
        self.devices = tuple(published)
        self.position = {d.name: i for i, d in enumerate(self.devices)}
        if len(self.position) != len(self.devices):
            raise ValueError("devices: device names repeat")
        self._attr: dict[str, tuple[Values | None, ...]] = {}

    def __len__(self) -> int:
        return len(self.devices)

    def values(self, attribute: str) -> tuple[Values | None, ...]:
        """Per device, the attribute's values (None: the device lacks it), looked up as upstream does:
        the full name, else the bare name when the domain is the driver's."""
        cached = self._attr.get(attribute)
        if cached is None:
            domain, _, bare = attribute.partition("/")
            out: list[Values | None] = []
            for d in self.devices:
                v = d.attributes.get(attribute)
                if v is None and domain == DRIVER:
                    v = d.attributes.get(bare)
                out.append(None if v is None else _values(v))
            cached = tuple(out)
            self._attr[attribute] = cached
        return cached


@dataclass(frozen=True)
class Allocation:
    subrequest: str  # the subrequest that was met
    devices: tuple[str, ...]  # device names, in the order chosen
    gpus: tuple[int, ...]  # their GPU indices, ascending


def _first_fit(cands: Sequence[int], values: Sequence[Values | None] | None, k: int) -> tuple[int, ...] | None:
    """The first `k` of `cands` (positions, ascending) that meet the constraint, depth first."""
    chosen: list[int] = []

    def dfs(start: int, common: Values | None) -> bool:
        if len(chosen) == k:
            return True
        for j in range(start, len(cands) - (k - len(chosen)) + 1):
            pos = cands[j]
            nxt = common
            if values is not None:
                v = values[pos]
                if v is None:
                    continue
                nxt = v if common is None else common & v
                if not nxt:
                    continue
            chosen.append(pos)
            if dfs(j + 1, nxt):
                return True
            chosen.pop()
        return False

    return tuple(chosen) if dfs(0, None) else None


def allocate(node: NodeDevices | Sequence[Device], claim: Claim, allocated: Collection[str] = ()) -> Allocation | None:
    """The devices kube-scheduler's allocator gives `claim` on a node whose `allocated` devices (by
    name) are taken, or None when it cannot be met there."""
    nd = node if isinstance(node, NodeDevices) else NodeDevices(node)
    unknown = [a for a in allocated if a not in nd.position]
    if unknown:
        raise ValueError(f"allocated: no such device on the node: {', '.join(sorted(unknown))}")
    taken = {nd.position[a] for a in allocated}
    for sub in claim.subrequests:
        cands = [
            i
            for i, d in enumerate(nd.devices)
            if i not in taken and not d.failed and d.memory_mib >= sub.min_memory_mib
        ]
        if len(cands) < sub.count:
            continue
        values = nd.values(sub.match_attribute) if sub.match_attribute else None
        got = _first_fit(cands, values, sub.count)
        if got is not None:
            names = tuple(nd.devices[i].name for i in got)
            return Allocation(sub.name, names, tuple(sorted(nd.devices[i].index for i in got)))
    return None


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
        self.nodes[i] = with_in_use(self.nodes[i], frozenset(gpus), self.tiers)

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
        for v in rank(evaluate_pod(self.nodes, pod.request, self.weights)):
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
    summary = summarize(
        pods_per_job,
        run.placements,
        [u.pod for u in run.unplaced],
        tuple(nodes),
        tuple(run.nodes),
        tiers,
        weights,
        exhaustive=exhaustive,
    )
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
