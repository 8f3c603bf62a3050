"""Which of the victims kube-scheduler offers on a node to evict so that a pod's GPU set comes free. Pure.

kube-scheduler's DefaultPreemption picks victims by count: it removes lower-priority pods until the
pod's `nvidia.com/gpu` request fits, then reprieves the most important ones that can stay. On a
topology-aware node that can evict four 1-GPU pods on four different NVLink quads and still leave no
free quad. The extender's preempt verb gets those candidates (node -> victims) and answers, per node,
the victims to evict instead; this module chooses them:

- only victims kube-scheduler offered (they are all of lower priority than the preemptor and their
  eviction is what its own checks accounted for);
- the fewest pods that let `evaluate_node` place the pod, then the lowest priorities: the smallest
  highest-priority victim, then the smallest sum (kube-scheduler's own tie-breaks);
- a member of a gputopo group only together with every active member of its group, so a group is
  never left partial; a member whose group has members outside this node's offer is never chosen;
- a node the pod fits on without any victim keeps its offer unchanged (kube-scheduler preempts for
  something other than GPUs there, CPU or memory, which this module cannot judge);
- a node where no choice lets the pod fit is dropped (`None`).

A victim whose GPUs gputopo does not know (a plain pod its node does not report by UID) is never
needed by an exact choice; when no choice of known victims works and such victims exist, the node
keeps its whole offer if the pod fits once every victim and every GPU no known pod holds are free.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations
from math import comb

from gputopo.engine.node.placement import Outcome, evaluate_node
from gputopo.engine.state.cliques import bits, k_cliques, mask_of, popcount
from gputopo.engine.state.scoring import DEFAULT_WEIGHTS, ScoreWeights
from gputopo.engine.state.snapshot import NodeState
from gputopo.model import NvlinkPolicy, PodRequest

__all__ = ["Choice", "Victim", "choose_victims"]

GroupKey = tuple[str, str]  # (namespace, group name)

# GPU sets enumerated per node before falling back to the greedy choice. C(8,4) = 70 and C(16,8) =
# 12,870 stay exact; a 72-GPU NVLink domain asked for 8 GPUs would be 1.1e10, answered greedily.
MAX_TARGET_SETS = 20_000


@dataclass(frozen=True)
class Victim:
    """One pod kube-scheduler offers to evict on the node."""

    uid: str
    gpus: frozenset[int] | None  # what it holds on the node; None when gputopo does not know
    priority: int = 0
    group: GroupKey | None = None


@dataclass(frozen=True)
class Choice:
    """The victims to evict on one node (in the order offered), the PDB violations to report for them,
    and the pod's outcome once they are gone."""

    victims: tuple[str, ...]
    pdb_violations: int
    outcome: Outcome
    unchanged: bool  # the offer as it came: kube-scheduler's own choice stands


@dataclass(frozen=True)
class _Unit:
    """Victims that go together: one pod, or every offered member of one group."""

    uids: tuple[str, ...]
    mask: int
    priorities: tuple[int, ...]


def _after(node: NodeState, freed: int) -> NodeState:
    """`node` with the GPUs in `freed` no longer in use. The key is cleared: this view is never memoised."""
    in_use = node.in_use_mask & ~freed
    return dataclasses.replace(node, in_use=frozenset(bits(in_use)), in_use_mask=in_use, key=0)


def _units(victims: Sequence[Victim], members: Mapping[GroupKey, Collection[str]]) -> list[_Unit]:
    """The victims that can be chosen, grouped; members of a group not wholly offered are left out."""
    offered = {v.uid for v in victims}
    out: list[_Unit] = []
    by_group: dict[GroupKey, list[Victim]] = {}
    for v in victims:
        if v.group is not None:
            by_group.setdefault(v.group, []).append(v)
        elif v.gpus:  # a pod that frees nothing gputopo knows of is never worth evicting for GPUs
            out.append(_Unit((v.uid,), mask_of(v.gpus), (v.priority,)))
    for key, vs in by_group.items():
        if not _whole(key, vs, members, offered):
            continue  # evicting these would leave members of the group running elsewhere
        group_mask = 0
        for v in vs:
            group_mask |= mask_of(v.gpus or ())
        if group_mask:
            out.append(_Unit(tuple(v.uid for v in vs), group_mask, tuple(v.priority for v in vs)))
    return out


def _whole(
    key: GroupKey, offered_members: Sequence[Victim], members: Mapping[GroupKey, Collection[str]], offered: set[str]
) -> bool:
    """Every active member of the group is among the offered victims."""
    return (set(members.get(key, ())) | {v.uid for v in offered_members}) <= offered


def _rank(units: Iterable[_Unit]) -> tuple[int, int, int, tuple[str, ...]]:
    """Fewest victims, then the lowest highest priority, then the lowest sum; uids make it total."""
    uids = tuple(sorted(u for unit in units for u in unit.uids))
    prios = [p for unit in units for p in unit.priorities]
    return (len(uids), max(prios, default=0), sum(prios), uids)


def _targets(node: NodeState, req: PodRequest, candidates: int) -> Iterator[int] | None:
    """Every GPU set the pod could end up on among `candidates`; None when there are too many to list."""
    k = req.gpus
    assert node.shape is not None
    n = popcount(candidates)
    if comb(n, k) > MAX_TARGET_SETS:
        return None
    if k > 1 and req.nvlink is NvlinkPolicy.REQUIRED:
        return k_cliques(node.shape.adj, candidates, k)
    return (mask_of(c) for c in combinations(bits(candidates), k))


def _exact(
    node: NodeState, req: PodRequest, units: list[_Unit], weights: ScoreWeights
) -> tuple[list[_Unit], Outcome] | None:
    """Every distinct set of units that frees some GPU set the pod could take, best first, verified
    with `evaluate_node` (which also checks memory, health and network) until one fits."""
    freeable = 0
    for u in units:
        freeable |= u.mask
    fixed = node.in_use_mask & ~freeable  # held by pods that stay
    targets = _targets(node, req, node.all_mask & ~node.failed_mask & ~fixed)
    if targets is None:
        return None
    options: dict[tuple[int, ...], list[_Unit]] = {}
    for t in targets:
        needed = tuple(i for i, u in enumerate(units) if u.mask & t & node.in_use_mask)
        if needed not in options:
            options[needed] = [units[i] for i in needed]
    for chosen in sorted(options.values(), key=_rank):
        freed = 0
        for u in chosen:
            freed |= u.mask
        outcome = evaluate_node(_after(node, freed), req, weights)
        if outcome.fits:
            return chosen, outcome
    return [], evaluate_node(node, req, weights)  # nothing fits: the caller sees the failure


def _greedy(node: NodeState, req: PodRequest, units: list[_Unit], weights: ScoreWeights) -> tuple[list[_Unit], Outcome]:
    """kube-scheduler's own method on GPUs: take every unit, then give back the most important ones
    that the pod can do without. Not always the fewest, but linear in the number of units."""
    chosen = sorted(units, key=lambda u: (max(u.priorities), sum(u.priorities), u.uids))
    freed = 0
    for u in chosen:
        freed |= u.mask
    outcome = evaluate_node(_after(node, freed), req, weights)
    if not outcome.fits:
        return [], outcome
    for u in reversed(list(chosen)):
        rest = [c for c in chosen if c is not u]
        mask = 0
        for c in rest:
            mask |= c.mask
        o = evaluate_node(_after(node, mask), req, weights)
        if o.fits:
            chosen, outcome = rest, o
    return chosen, outcome


def choose_victims(
    node: NodeState,
    req: PodRequest,
    victims: Sequence[Victim],
    *,
    pdb_violations: int = 0,
    group_members: Mapping[GroupKey, Collection[str]] | None = None,
    unattributed: frozenset[int] = frozenset(),
    weights: ScoreWeights = DEFAULT_WEIGHTS,
) -> Choice | None:
    """The victims to evict on `node` (as the preemptor sees it: its own GPUs free) so that `req`
    fits, or None when no choice among `victims` does.

    `pdb_violations` is kube-scheduler's count for the whole offer; it does not say which victims
    violate a PodDisruptionBudget, so a reduced choice reports at most that many (never more than
    it has victims): a node is never made to look better to kube-scheduler than it may be.
    `group_members` maps each group of a victim to the uids of its active members; `unattributed`
    are GPUs in use that no known pod holds (the fallback for unknown victims)."""
    if node.problem is not None or node.shape is None:
        return None
    offered = tuple(v.uid for v in victims)
    now = evaluate_node(node, req, weights)
    if now.fits:
        return Choice(offered, pdb_violations, now, unchanged=True)
    units = _units(victims, group_members or {})
    found = _exact(node, req, units, weights)
    if found is None:
        found = _greedy(node, req, units, weights)
    chosen, outcome = found
    if outcome.fits and chosen:
        keep = {u for unit in chosen for u in unit.uids}
        picked = tuple(u for u in offered if u in keep)
        if picked == offered:
            return Choice(offered, pdb_violations, outcome, unchanged=True)
        return Choice(picked, min(pdb_violations, len(picked)), outcome, unchanged=False)
    offered_set = set(offered)
    partial = any(v.group is not None and not _whole(v.group, [v], group_members or {}, offered_set) for v in victims)
    if any(v.gpus is None for v in victims) and not partial:
        freed = unattributed
        for v in victims:
            freed |= v.gpus or frozenset()
        outcome = evaluate_node(_after(node, mask_of(freed)), req, weights)
        if outcome.fits:
            return Choice(offered, pdb_violations, outcome, unchanged=True)
    return None
