"""Communication estimates of a placement across nodes: the pipeline transfer between consecutive
stages and the data-parallel all-reduce across a group's members (docs/cost-model.md).

Pure: computed from the node states' NICs and fabric locations and the tier configuration. A node with
no active NIC falls back to a plain 25 Gb/s host Ethernet path (assumption).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from gputopo.engine.network.cost import (
    NVLINK_DOMAIN_BUSBW_GBPS,
    NVLINK_STEP_LATENCY_S,
    PCIE_STEP_LATENCY_S,
    allreduce_seconds,
    domain_allreduce_seconds,
    intra_node_bandwidth,
    network_allreduce_seconds,
    nic_gbps,
    pp_transfer_seconds,
    tier_share,
    tiers_crossed,
)
from gputopo.engine.state.snapshot import NodeState, Shape, shape_of
from gputopo.model import NetworkKind
from gputopo.tiers import DEFAULT_TIERS, TierConfig

# Without an RDMA NIC, traffic goes over the host's ordinary Ethernet (assumed 25 Gb/s).
FALLBACK_NIC_GBIT = 25.0


def node_shape(node: NodeState) -> Shape | None:
    """The node's link shape, also for nodes the engine refuses (stale topology still has links)."""
    if node.shape is not None:
        return node.shape
    if node.topology is not None and node.topology.gpus:
        return shape_of(node.topology)
    return None


def best_nics(node: NodeState, kind: NetworkKind = NetworkKind.ANY) -> tuple[float, int]:
    """(rate in Gb/s, how many active NICs run at it): of `kind`, else of any kind, else the host
    Ethernet fallback. Several NICs at the best rate are the rails NCCL spreads one collective over."""
    active = [n for n in node.nics if n.active]
    wanted = [n.rate_gbps for n in active if kind in (NetworkKind.ANY, NetworkKind.RDMA) or n.kind == kind.value]
    rates = wanted or [n.rate_gbps for n in active]
    if not rates:
        return FALLBACK_NIC_GBIT, 1
    best = max(rates)
    return best, sum(1 for r in rates if r == best)


def domain_busbw(tiers: TierConfig) -> float:
    """The bus bandwidth inside one multi-node NVLink domain: the nvlink-domain tier's, else the default."""
    return next(
        (t.busbw_gbps for t in tiers.tiers if t.name == "nvlink-domain" and t.busbw_gbps), NVLINK_DOMAIN_BUSBW_GBPS
    )


def stage_transfer_seconds(
    a: NodeState,
    gpus_a: Sequence[int],
    b: NodeState,
    gpus_b: Sequence[int],
    message_bytes: float,
    tiers: TierConfig = DEFAULT_TIERS,
    kind: NetworkKind = NetworkKind.ANY,
) -> float:
    """One activation transfer between consecutive stages on `a` and `b`: over the GPUs' own link when
    both share a node, else over the slower node's best NIC and the switch tiers between them, as the
    tiers of `a`'s set read them (both stages are in one set: a group never spans two)."""
    tiers = tiers.of_set(a.tier_set)
    if a.name == b.name:
        shape = node_shape(a)
        if shape is None or not gpus_a or not gpus_b or gpus_a[0] == gpus_b[0]:
            return 0.0
        bw = intra_node_bandwidth(shape.links, shape.nvswitch, shape.gbps_per_link, shape.numa, (gpus_a[0], gpus_b[0]))
        return message_bytes / (bw.gbps * 1e9)
    domain = a.location.get("nvlink-domain")
    if domain is not None and domain == b.location.get("nvlink-domain"):
        return message_bytes / (domain_busbw(tiers) * 1e9)  # trays of one NVLink domain: over NVLink
    crossed = tiers_crossed(dict(a.location), dict(b.location), tiers.network_tiers())
    rate = min(best_nics(a, kind)[0], best_nics(b, kind)[0])
    return pp_transfer_seconds(message_bytes, rate, crossed, tiers.narrow_first_oversubscription())


def group_allreduce_seconds(
    members: Sequence[tuple[NodeState, Sequence[int]]],
    message_bytes: float,
    tiers: TierConfig = DEFAULT_TIERS,
    kind: NetworkKind = NetworkKind.ANY,
) -> float:
    """A ring all-reduce of `message_bytes` with one rank per member (data parallelism across the
    group). Across nodes each member sends over its rail NICs (one per GPU, at most as many as the
    node has at its best rate), shared by the members on the same node; the slowest member and the
    widest tier between any two members bound the ring. The tiers are those of the first member's set."""
    m = len(members)
    if m < 2:
        return 0.0
    tiers = tiers.of_set(members[0][0].tier_set)
    names = {node.name for node, _ in members}
    if len(names) == 1:
        node = members[0][0]
        shape = node_shape(node)
        firsts = tuple(gpus[0] for _, gpus in members if gpus)
        if shape is None or len(set(firsts)) < 2:
            return 0.0
        bw = intra_node_bandwidth(shape.links, shape.nvswitch, shape.gbps_per_link, shape.numa, firsts)
        latency = PCIE_STEP_LATENCY_S if bw.via == "pcie" else NVLINK_STEP_LATENCY_S
        return allreduce_seconds(message_bytes, m, bw.gbps, latency)
    domains = {node.location.get("nvlink-domain") for node, _ in members}
    if len(domains) == 1 and None not in domains:
        # Trays of one multi-node NVLink domain: the ring runs over NVLink, not the NICs.
        return domain_allreduce_seconds(message_bytes, m, domain_busbw(tiers))
    sharing = Counter(node.name for node, _ in members)
    per_member = []
    for node, gpus in members:
        rate, count = best_nics(node, kind)
        rails = max(1, min(len(gpus), count))
        per_member.append(rails * nic_gbps(rate) / sharing[node.name])
    crossed = widest_crossing([node for node, _ in members], tiers.network_tiers())
    share = tier_share(crossed, tiers.narrow_first_oversubscription())
    return network_allreduce_seconds(message_bytes, m, min(per_member), crossed, share)


def widest_crossing(nodes: Sequence[NodeState], network_tiers: Sequence[str]) -> int:
    """The largest `tiers_crossed` between any two of `nodes`, in one pass: switch ids are qualified by
    the wider tiers (a leaf id names its spine), so every pair shares a tier exactly when all nodes sit
    under one switch of it."""
    narrow_first = list(reversed(network_tiers))
    for depth, tier in enumerate(narrow_first, start=1):
        switches = {node.location.get(tier) for node in nodes}
        if len(switches) == 1 and None not in switches:
            return depth
    return len(narrow_first) + 1


@dataclass(frozen=True)
class GroupEstimate:
    stage_transfer_seconds: float | None  # to the next stage (the last stage: from the previous one)
    group_allreduce_seconds: float | None


def member_estimate(
    stages: Sequence[tuple[NodeState, Sequence[int]]],
    i: int,
    message_bytes: float,
    tiers: TierConfig = DEFAULT_TIERS,
    ring: float | None = None,
) -> GroupEstimate:
    """Estimates for member `i` of a group whose members, in stage order, are (node, GPUs); `ring`, the
    group's all-reduce when already known (it is the same for every member)."""
    if not 0 <= i < len(stages) or len(stages) < 2:
        return GroupEstimate(None, None)
    a, b = (i, i + 1) if i + 1 < len(stages) else (i - 1, i)
    na, ga = stages[a]
    nb, gb = stages[b]
    transfer = stage_transfer_seconds(na, ga, nb, gb, message_bytes, tiers)
    if ring is None:
        ring = group_allreduce_seconds(stages, message_bytes, tiers)
    return GroupEstimate(transfer, ring)
