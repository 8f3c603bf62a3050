"""Estimated communication time of a placement, from the engine's cost model (gputopo.engine.network.cost and
gputopo.engine.network.estimate, described in docs/cost-model.md).

- TP: one ring allreduce of `message_bytes` over a pod's GPUs, at the set's bottleneck bandwidth
  (NVLink generation and link count, or PCIe inside or across sockets).
- PP: one activation transfer of `message_bytes` across each stage boundary of a group (stage i to
  i+1): over the slower node's best NIC and the switch tiers between the nodes (each tier's
  oversubscription from the tier configuration), or over the GPUs' own link when both stages share a
  node. A node with no active NIC of the group's kind falls back to any active NIC, then to a plain
  25 Gb/s host Ethernet path (assumption).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from gputopo.engine.network.cost import intra_node_bandwidth, tp_allreduce_seconds
from gputopo.engine.network.estimate import FALLBACK_NIC_GBIT, best_nics, node_shape, stage_transfer_seconds
from gputopo.engine.state.snapshot import NodeState, Shape
from gputopo.model import NetworkKind
from gputopo.tiers import DEFAULT_TIERS, Tier, TierConfig

__all__ = ["FALLBACK_NIC_GBIT", "nic_gbit", "node_shape", "pp_seconds", "tp_seconds"]


@lru_cache(maxsize=65536)
def nic_gbit(node: NodeState, kind: NetworkKind) -> float:
    """Best active NIC rate (Gb/s) of `kind`, else of any kind, else the host Ethernet fallback."""
    return best_nics(node, kind)[0]


def tp_seconds(shape: Shape | None, gpus: Sequence[int], message_bytes: float) -> float:
    if shape is None or len(gpus) < 2:
        return 0.0
    bw = intra_node_bandwidth(shape.links, shape.nvswitch, shape.gbps_per_link, shape.numa, tuple(gpus))
    return tp_allreduce_seconds(message_bytes, len(gpus), bw)


def _tier_config(network_tiers: Sequence[str] | TierConfig) -> TierConfig:
    """Tier names alone (what older callers pass) take the default tiers' oversubscription by name."""
    if isinstance(network_tiers, TierConfig):
        return network_tiers
    return _named_tiers(tuple(network_tiers))


@lru_cache(maxsize=64)  # the exhaustive search asks for the same few tier lists millions of times
def _named_tiers(names: tuple[str, ...]) -> TierConfig:
    known = {t.name: t for t in DEFAULT_TIERS.tiers}
    return TierConfig(tiers=tuple(known.get(n) or Tier(name=n, labels=(f"gputopo.io/network-{n}",)) for n in names))


def pp_seconds(
    a: NodeState,
    gpus_a: Sequence[int],
    b: NodeState,
    gpus_b: Sequence[int],
    kind: NetworkKind,
    message_bytes: float,
    network_tiers: Sequence[str] | TierConfig,
) -> float:
    """One transfer between consecutive stages placed on `a` and `b`."""
    return stage_transfer_seconds(a, gpus_a, b, gpus_b, message_bytes, _tier_config(network_tiers), kind)
