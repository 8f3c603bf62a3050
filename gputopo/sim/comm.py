"""Estimated communication time of a placement, from the engine's cost model (gputopo.engine.cost).

- TP: one ring allreduce of `message_bytes` over a pod's GPUs, at the set's bottleneck bandwidth
  (NVLink generation and link count, or PCIe inside or across sockets).
- PP: one activation transfer of `message_bytes` across each stage boundary of a group (stage i to
  i+1): over the slower node's best NIC and the switch tiers between the nodes, or over the GPUs' own
  link when both stages share a node. A node with no active NIC of the group's kind falls back to
  any active NIC, then to a plain 25 Gb/s host Ethernet path (assumption).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from gputopo.engine.cost import intra_node_bandwidth, pp_transfer_seconds, tiers_crossed, tp_allreduce_seconds
from gputopo.engine.snapshot import NodeState, Shape, shape_of
from gputopo.model import NetworkKind

# Without an RDMA NIC, stage traffic goes over the host's ordinary Ethernet (assumed 25 Gb/s).
FALLBACK_NIC_GBIT = 25.0


def node_shape(node: NodeState) -> Shape | None:
    """The node's link shape, also for nodes the engine refuses (stale topology still has links)."""
    if node.shape is not None:
        return node.shape
    if node.topology is not None and node.topology.gpus:
        return shape_of(node.topology)
    return None


@lru_cache(maxsize=65536)
def nic_gbit(node: NodeState, kind: NetworkKind) -> float:
    """Best active NIC rate (Gb/s) of `kind`, else of any kind, else the host Ethernet fallback."""
    topo = node.topology
    nics = [n for n in topo.nics if n.active] if topo is not None else []
    wanted = [n.rate_gbps for n in nics if kind.accepts(n)]
    if wanted:
        return max(wanted)
    if nics:
        return max(n.rate_gbps for n in nics)
    return FALLBACK_NIC_GBIT


def tp_seconds(shape: Shape | None, gpus: Sequence[int], message_bytes: float) -> float:
    if shape is None or len(gpus) < 2:
        return 0.0
    bw = intra_node_bandwidth(shape.links, shape.nvswitch, shape.gbps_per_link, shape.numa, tuple(gpus))
    return tp_allreduce_seconds(message_bytes, len(gpus), bw)


def pp_seconds(
    a: NodeState,
    gpus_a: Sequence[int],
    b: NodeState,
    gpus_b: Sequence[int],
    kind: NetworkKind,
    message_bytes: float,
    network_tiers: Sequence[str],
) -> float:
    """One transfer between consecutive stages placed on `a` and `b`."""
    if a.name == b.name:
        shape = node_shape(a)
        if shape is None or not gpus_a or not gpus_b or gpus_a[0] == gpus_b[0]:
            return 0.0
        bw = intra_node_bandwidth(shape.links, shape.nvswitch, shape.gbps_per_link, shape.numa, (gpus_a[0], gpus_b[0]))
        return message_bytes / (bw.gbps * 1e9)
    crossed = tiers_crossed(dict(a.location), dict(b.location), network_tiers)
    rate = min(nic_gbit(a, kind), nic_gbit(b, kind))
    return pp_transfer_seconds(message_bytes, rate, crossed)
