"""The engine's view of the cluster: immutable node states with everything precomputed once.

Adapters (the extender's cache, the simulator, the CLI) build `NodeState`s when a node changes; the
engine then answers many pods against them without re-deriving masks. Nodes that look the same to a
pod (same link shape, same free/failed GPUs, same HBM and NICs) share an equivalence key, so one
decision over thousands of nodes evaluates each distinct kind once.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, replace

from gputopo.engine.state.cliques import mask_of
from gputopo.engine.state.reasons import Reason
from gputopo.engine.state.scoring import NEAR_NIC
from gputopo.model import (
    FabricHealth,
    Health,
    LabelError,
    NetworkKind,
    NodeTopology,
    gpu_rail_masks,
    nic_rails,
    tray_health,
)
from gputopo.tiers import DEFAULT_TIERS, TierConfig


@dataclass(frozen=True, eq=False)
class Shape:
    """How a node's GPUs are wired, independent of which node it is. Interned: compare by identity."""

    n: int
    links: tuple[tuple[int, ...], ...]
    adj: tuple[int, ...]
    nvswitch: bool
    generation: int
    gbps_per_link: float
    numa: tuple[int | None, ...]

    def min_link(self, gpus: tuple[int, ...]) -> int:
        if len(gpus) < 2:
            return 0
        return min(self.links[a][b] for i, a in enumerate(gpus) for b in gpus[i + 1 :])


_SHAPES: dict[tuple[object, ...], Shape] = {}
_KEYS: dict[tuple[object, ...], int] = {}
# Keys come from a counter that never repeats, not from the table's size: the decision threads and the
# node-state cache intern concurrently, and `len + 1` could hand two kinds one key (the verdict memo would
# then answer one kind with the other's verdict). `next()` on a count and `dict.setdefault` are each
# atomic under the GIL, so racing callers agree on one key per tuple.
_NEXT_KEY = itertools.count(1)
# Kinds change with GPUs in use and health: the tables are cleared past this many entries. A key is never
# reused after a clear, so a memo entry under an old key only misses, never answers for another kind.
MAX_INTERNED = 1 << 16


def _intern_key(parts: tuple[object, ...]) -> int:
    """A small int per distinct equivalence tuple: hashing an int per lookup, not a nested tuple."""
    key = _KEYS.get(parts)
    if key is None:
        if len(_KEYS) >= MAX_INTERNED:
            _KEYS.clear()
        key = _KEYS.setdefault(parts, next(_NEXT_KEY))
    return key


def _kind_key(
    shape: Shape,
    failed: int,
    impaired: int,
    in_use_mask: int,
    memory: tuple[int, ...],
    nics: tuple[NicView, ...],
    rails: tuple[int, ...],
) -> int:
    """A healthy node's equivalence key: everything a verdict on it depends on (not its name or location)."""
    return _intern_key((shape, failed, impaired, in_use_mask, memory, nics, rails))


def shape_of(topology: NodeTopology) -> Shape:
    n = len(topology.gpus)
    links = topology.nvlink.links or tuple(tuple(0 for _ in range(n)) for _ in range(n))
    numa = tuple(g.numa_node for g in topology.gpus)
    key = (links, topology.nvlink.nvswitch, topology.nvlink.generation, topology.nvlink.gbps_per_link, numa)
    shape = _SHAPES.get(key)
    if shape is None:
        adj = tuple(mask_of([j for j in range(n) if j != i and links[i][j] > 0]) for i in range(n))
        shape = Shape(
            n, links, adj, topology.nvlink.nvswitch, topology.nvlink.generation, topology.nvlink.gbps_per_link, numa
        )
        if len(_SHAPES) >= MAX_INTERNED:
            _SHAPES.clear()
        shape = _SHAPES.setdefault(key, shape)
    return shape


@dataclass(frozen=True)
class NicView:
    kind: str  # infiniband | roce
    active: bool
    rate_gbps: float
    near_mask: int  # GPUs at PIX/PXB from this NIC


@dataclass(frozen=True, eq=False)
class NodeState:
    """One node as the engine sees it. Build with `node_state()`."""

    name: str
    labels: Mapping[str, str]
    topology: NodeTopology | None
    problem: Reason | None  # topology missing / invalid / stale: the node takes no gputopo pod
    problem_detail: str
    in_use: frozenset[int]
    location: Mapping[str, str | None]  # tier name -> switch id (path-qualified, widest first)
    shape: Shape | None = None
    all_mask: int = 0
    failed_mask: int = 0
    impaired_mask: int = 0  # degraded GPUs and GPUs with a degraded or down NVLink link
    in_use_mask: int = 0
    memory_mib: tuple[int, ...] = ()
    nics: tuple[NicView, ...] = ()
    # Per GPU, the fabric rails of its nearest NICs (bit r: rail r; gputopo.model.gpu_rail_masks).
    gpu_rails: tuple[int, ...] = ()
    key: int = 0  # equivalence class: nodes with equal keys get equal verdicts for any pod
    # The multi-node NVLink fabric of the node's GPUs (gputopo.model.tray_health) and, unless healthy,
    # why: only a TP group spanning nodes reads it, so it is not part of `key`.
    fabric: FabricHealth = FabricHealth.UNKNOWN
    fabric_detail: str = "no fabric info"
    # The tier set (hardware shape) whose tiers read the node's labels; "" for the top-level tiers. A group
    # is planned within one set (gputopo.engine.gang.tiersets).
    tier_set: str = ""

    @property
    def gpu_count(self) -> int:
        return self.shape.n if self.shape else 0

    @property
    def free_mask(self) -> int:
        return self.all_mask & ~self.in_use_mask & ~self.failed_mask

    def has_network(self, kind: NetworkKind) -> bool:
        if kind is NetworkKind.ANY:
            return True
        return any(n.active and (kind is NetworkKind.RDMA or n.kind == kind.value) for n in self.nics)

    def near_nic_mask(self, kind: NetworkKind) -> int:
        m = 0
        for n in self.nics:
            if n.active and (kind in (NetworkKind.ANY, NetworkKind.RDMA) or n.kind == kind.value):
                m |= n.near_mask
        return m


def locate(labels: Mapping[str, str], topology: NodeTopology | None, tiers: TierConfig) -> dict[str, str | None]:
    """Each tier's switch id, qualified by the wider tiers above it (ToR names repeat per spine), read by
    the node's tier set."""
    out: dict[str, str | None] = {}
    path: list[str] = []
    for t in tiers.for_labels(labels)[1]:
        sw = t.switch(labels)
        if sw is None and t.name == "nvlink-domain" and topology is not None and topology.fabric is not None:
            sw = topology.fabric.clique
        if t.name == "nvlink-domain":
            out[t.name] = sw  # NVLink domains are global ids, not under a leaf
            continue
        if sw is None:
            out[t.name] = None
            continue
        path.append(sw)
        out[t.name] = "/".join(path)
    return out


def node_state(
    name: str,
    topology: NodeTopology | None,
    *,
    labels: Mapping[str, str] | None = None,
    in_use: frozenset[int] = frozenset(),
    problem: Reason | None = None,
    problem_detail: str = "",
    tiers: TierConfig = DEFAULT_TIERS,
) -> NodeState:
    labels = dict(labels or {})
    location = locate(labels, topology, tiers)
    tier_set = tiers.for_labels(labels)[0]
    if topology is None or problem is not None:
        return NodeState(
            name=name,
            labels=labels,
            topology=topology,
            problem=problem or Reason.TOPOLOGY_MISSING,
            problem_detail=problem_detail,
            in_use=in_use,
            location=location,
            key=_intern_key(("problem", problem or Reason.TOPOLOGY_MISSING)),
            tier_set=tier_set,
        )
    try:
        rails = gpu_rail_masks(topology, nic_rails(topology, labels))
    except LabelError as e:
        # A rails label that does not match the node is never guessed at: the node is unreadable, and
        # the reason (naming the label and its value) shows in gputopo explain.
        return node_state(
            name,
            topology,
            labels=labels,
            in_use=in_use,
            problem=Reason.TOPOLOGY_INVALID,
            problem_detail=str(e),
            tiers=tiers,
        )
    shape = shape_of(topology)
    n = shape.n
    failed = mask_of([g.index for g in topology.gpus if g.health is Health.FAILED])
    impaired = mask_of([g.index for g in topology.gpus if g.health is Health.DEGRADED])
    impaired |= mask_of([d.gpu for d in topology.degraded_links])
    in_use_mask = mask_of([i for i in in_use if 0 <= i < n])
    memory = tuple(g.memory_mib for g in topology.gpus)
    nics = tuple(
        NicView(
            kind=nic.rdma_kind,
            active=nic.active,
            rate_gbps=nic.rate_gbps,
            near_mask=mask_of([g for g, d in enumerate(nic.gpu_affinity) if d in NEAR_NIC]),
        )
        for nic in topology.nics
    )
    key = _kind_key(shape, failed, impaired, in_use_mask, memory, nics, rails)
    fabric, fabric_detail = tray_health(topology.gpus)
    return NodeState(
        name=name,
        labels=labels,
        topology=topology,
        problem=None,
        problem_detail="",
        in_use=frozenset(i for i in in_use if 0 <= i < n),
        location=location,
        shape=shape,
        all_mask=(1 << n) - 1,
        failed_mask=failed,
        impaired_mask=impaired,
        in_use_mask=in_use_mask,
        memory_mib=memory,
        nics=nics,
        gpu_rails=rails,
        key=key,
        fabric=fabric,
        fabric_detail=fabric_detail,
        tier_set=tier_set,
    )


def taking(node: NodeState, in_use: frozenset[int]) -> NodeState:
    """`node` with exactly `in_use` taken: equal to what `node_state` builds for the same node, labels and
    tiers with that set, reusing every part that does not depend on it (a bind gives its node a new set;
    rebuilding its location, rails and shape each time was most of a bind's own CPU). A node with a
    problem is returned with the new set and nothing else changed, as `node_state` would build it."""
    shape = node.shape
    if shape is None or node.problem is not None:
        return replace(node, in_use=in_use)
    taken = frozenset(i for i in in_use if 0 <= i < shape.n)
    mask = mask_of(taken)
    key = _kind_key(shape, node.failed_mask, node.impaired_mask, mask, node.memory_mib, node.nics, node.gpu_rails)
    return replace(node, in_use=taken, in_use_mask=mask, key=key)


def with_in_use(node: NodeState, extra: frozenset[int], tiers: TierConfig = DEFAULT_TIERS) -> NodeState:
    """The same node with more GPUs taken (used when planning several pods onto one node). It keeps its tier
    set: a group planned within one set reads that set's tiers alone (TierConfig.of_set)."""
    state = node_state(
        node.name,
        node.topology,
        labels=node.labels,
        in_use=node.in_use | extra,
        problem=node.problem,
        problem_detail=node.problem_detail,
        tiers=tiers,
    )
    return state if state.tier_set == node.tier_set else replace(state, tier_set=node.tier_set)
