"""Score components and their weights, the link-type score table, the one mapping of a request's
scores to the extender wire (`wire_scores`), and the 0..10 grade people read (`grade`)."""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Mapping, Sequence
from itertools import compress, repeat
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, Field

from gputopo.model import LinkType, PcieDistance

# One score table for how well two GPUs talk (go-gpuallocator's ordering: PCIe tiers, then NVLink
# scaled by link count). Used to rank sets that are not full NVLink cliques.
LINK_SCORE: Mapping[LinkType, int] = {
    LinkType.CROSS_CPU: 10,
    LinkType.SAME_CPU: 20,
    LinkType.HOST_BRIDGE: 30,
    LinkType.MULTI_SWITCH: 40,
    LinkType.SINGLE_SWITCH: 50,
    LinkType.NVLINK: 100,  # per NVLink link
}

# A GPU counts as "close to a NIC" at these PCIe distances (GPUDirect RDMA without a host bridge).
NEAR_NIC = frozenset({PcieDistance.PIX, PcieDistance.PXB})


class ScoreWeights(BaseModel):
    """Relative weight of each score component; components are each in [0, 1]."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    clique: float = Field(3.0, ge=0, description="the GPUs form one fully NVLink-connected set")
    bandwidth: float = Field(4.0, ge=0, description="estimated collective bandwidth of the set vs NVLink 4 NV18")
    pack: float = Field(1.5, ge=0, description="the node ends up fuller (keeps other nodes whole)")
    intact: float = Field(2.0, ge=0, description="the GPUs left free still form a clique")
    memory: float = Field(1.0, ge=0, description="HBM just above the pod's minimum (no waste)")
    nic: float = Field(1.0, ge=0, description="chosen GPUs sit at PIX/PXB from an accepted NIC")
    health: float = Field(1.0, ge=0, description="no degraded links or GPUs on the node")

    def combine(self, components: Mapping[str, float]) -> float:
        total = 0.0
        weight = 0.0
        for name, value in components.items():
            w = float(getattr(self, name))
            total += w * value
            weight += w
        return total / weight if weight else 0.0


DEFAULT_WEIGHTS = ScoreWeights()


K = TypeVar("K", bound=Hashable)

# kube-scheduler's MaxExtenderPriority: an extender's scores are 0..10, multiplied by 10 and its weight.
MAX_EXTENDER_SCORE = 10


def grade(score: float) -> int:
    """An internal score in [0, 1] as the whole number 0..10 people read (a placement's `score`, the
    explain table). Not what goes on the wire: adjacent grades hide the engine's order (`wire_scores`)."""
    if score != score:  # NaN
        return 0
    return max(0, min(MAX_EXTENDER_SCORE, round(score * 10)))


def wire_scores(
    names: Sequence[str],
    kinds: Sequence[K],
    scores: Mapping[K, float],
    order: Mapping[str, tuple[int | str, ...]] | None = None,
) -> list[int]:
    """The one place internal scores become kube-scheduler's extender scores, per request: the engine's
    order of the request's fitting nodes (`placement.rank`: score, then name) as ranks, the first node
    10, the second 9, down to the tenth 1; every other node 0.

    `names[i]` is of kind `kinds[i]`; `scores` holds each fitting kind's engine score (equivalent nodes
    share one), so a request over thousands of nodes reads one score per kind and only the names of the
    best levels. Rank, not magnitude: kube-scheduler adds `score x 10 x weight` to its plugins' sum and
    binds to the highest total, so only the order can carry the engine's choice, and 11 absolute steps
    put 0.71 and 0.74 on the same 7. Ties go by name, as the simulator breaks them: what `gputopo
    simulate` decides is what kube-scheduler does, not its random pick among equals.

    `order`: each node's key in best fit above the node (`domains.TieKeys`: `DomainFree.tie_key`, the
    fullest domains with room first, then the name), which breaks ties instead of the name alone, as
    `placement.rank` does when given the same free GPUs per domain."""
    top: dict[str, int] = {}
    key = None if order is None else order.__getitem__
    for level in sorted({s for s in scores.values() if s == s}, reverse=True):
        at = {k for k, s in scores.items() if s == level}
        fitting = compress(names, map(at.__contains__, kinds))
        for name in heapq.nsmallest(MAX_EXTENDER_SCORE - len(top), fitting, key=key):
            top[name] = MAX_EXTENDER_SCORE - len(top)
        if len(top) >= MAX_EXTENDER_SCORE:
            break
    return list(map(top.get, names, repeat(0)))


def first_ranked(
    names: Sequence[str],
    kinds: Sequence[K],
    scores: Mapping[K, float],
    order: Mapping[str, tuple[int | str, ...]] | None = None,
) -> int | None:
    """The index of the node `wire_scores` gives 10 (None: no node fits), found without ranking the others:
    a filter that passes one node needs only that one."""
    levels = [s for s in scores.values() if s == s]
    if not levels:
        return None
    best = max(levels)
    at = {k for k, s in scores.items() if s == best}
    fitting = compress(names, map(at.__contains__, kinds))
    name = min(fitting, key=order.__getitem__) if order is not None else min(fitting)
    return names.index(name)
