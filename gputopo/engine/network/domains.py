"""Free GPUs per fabric domain: how many GPUs are free under each switch of each tier (a leaf, a spine,
an NVLink domain), over the nodes given. Pure: the engine's best fit above the node reads it to keep large
empty domains whole for the next big gang ("fill the fullest domain that still fits").

A node whose topology is missing, invalid or stale counts no free GPU (it takes no gputopo pod). A node
with no label for a tier is a domain of its own at that tier (`?<node>`), as group packing counts it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from gputopo.engine.state.snapshot import NodeState
from gputopo.tiers import DEFAULT_TIERS, TierConfig


def domain_of(node: NodeState, tier: str) -> str:
    """The node's switch at `tier`, or a domain of its own when no label names one."""
    return node.location.get(tier) or f"?{node.name}"


def free_gpus(node: NodeState) -> int:
    """GPUs on the node that no pod holds and that have not failed; 0 for a node with a problem."""
    return 0 if node.problem is not None else node.free_mask.bit_count()


@dataclass(frozen=True)
class DomainFree:
    """Free GPUs per domain, per tier (tier -> domain -> free GPUs), and per node."""

    by_tier: Mapping[str, Mapping[str, int]]
    by_node: Mapping[str, int]

    def of(self, node: NodeState, tier: str) -> int:
        """Free GPUs in the node's domain at `tier` (0 for a tier not counted)."""
        return self.by_tier.get(tier, {}).get(domain_of(node, tier), 0)

    def path(self, node: NodeState, tiers: Iterable[str]) -> tuple[int, ...]:
        """Free GPUs of the node's domains at `tiers`, in the order given (e.g. narrowest first)."""
        return tuple(self.of(node, t) for t in tiers)

    def tie_key(self, node: NodeState, narrow: Sequence[str]) -> TieKey:
        """Best fit above the node, the one order among nodes of equal engine score (`placement.rank`, the
        extender's wire order): the node whose domains hold the fewest free GPUs, tier by tier from the
        closest (`narrow`, see `narrow_first`), then its name. A fitting node's domains all have room for
        the pod, so the fullest of them that still fits comes first and large empty domains stay whole."""
        return (*self.path(node, narrow), node.name)


TieKey = tuple[int | str, ...]  # free GPUs of the node's domains, closest tier first, then the node's name


def narrow_first(tiers: TierConfig = DEFAULT_TIERS) -> tuple[str, ...]:
    """The tiers closest first (NVLink domain, leaf, spine, ...): the order best fit compares them in."""
    return tuple(reversed(tiers.names))


class TieKeys(dict[str, TieKey]):
    """Each known node's `DomainFree.tie_key`: a caller ranking thousands of names at one score reads one
    C-level lookup per name. A node not known when the keys were taken comes after every known one."""

    def __missing__(self, name: str) -> TieKey:
        return (sys.maxsize, name)


def tie_keys(nodes: Iterable[NodeState], free: DomainFree, narrow: Sequence[str]) -> TieKeys:
    """`TieKeys` of `nodes`."""
    return TieKeys((n.name, free.tie_key(n, narrow)) for n in nodes)


class FreeTracker:
    """`domain_free` kept current while nodes change one at a time (a simulator's run): `figures` is a view
    over the tracker's own sums, which `replace` moves by one node's change instead of recounting every
    node for every pod."""

    def __init__(self, nodes: Iterable[NodeState], tiers: TierConfig = DEFAULT_TIERS) -> None:
        start = domain_free(nodes, tiers)
        self._by_tier = {t: dict(d) for t, d in start.by_tier.items()}
        self._by_node = dict(start.by_node)
        self.figures = DomainFree(self._by_tier, self._by_node)

    def replace(self, old: NodeState, new: NodeState) -> None:
        """`old` became `new` (its GPUs in use changed; its name and location did not)."""
        free = free_gpus(new)
        delta = free - self._by_node.get(old.name, 0)
        self._by_node[new.name] = free
        if delta:
            for tier, sums in self._by_tier.items():
                key = domain_of(new, tier)
                sums[key] = sums.get(key, 0) + delta


def domain_free(nodes: Iterable[NodeState], tiers: TierConfig = DEFAULT_TIERS) -> DomainFree:
    """Free GPUs per domain of every tier in `tiers` (network tiers and the NVLink domain), over `nodes`."""
    names = tiers.names
    by_tier: dict[str, dict[str, int]] = {t: {} for t in names}
    by_node: dict[str, int] = {}
    for node in nodes:
        free = free_gpus(node)
        by_node[node.name] = free
        for t in names:
            d = by_tier[t]
            key = domain_of(node, t)
            d[key] = d.get(key, 0) + free
    return DomainFree(by_tier, by_node)
