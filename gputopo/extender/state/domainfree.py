"""Best fit above the node in the extender: free GPUs per fabric domain over every node the ledger knows
(not only one request's candidates) and each node's key in the engine's tie-break order
(`gputopo.engine.network.domains`: `DomainFree.tie_key`), taken once per ledger generation and shared by every
request of it.

Prioritize (`ahead.ranked`) breaks equal engine scores by these keys, and the binder's runner-up and
sentence read the same figures, so kube-scheduler's choice is the simulator's (`placement.rank` with the
same free GPUs per domain). Thousands of nodes change a few at a time: the nodes whose state is another
object since the last figures are found in one C-level pass, their free GPUs move their domains' sums,
and only the nodes under a domain whose sum moved get a new key. Other nodes, or a node under other
domains (its labels changed), start the figures afresh.
"""

from __future__ import annotations

import operator
import threading
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import compress

from gputopo.engine.network.domains import DomainFree, TieKeys, domain_of, free_gpus, narrow_first
from gputopo.engine.state.snapshot import NodeState
from gputopo.tiers import TierConfig


@dataclass(frozen=True)
class Fabric:
    """The figures of one generation: free GPUs per domain, and every known node's tie-break key."""

    generation: int
    free: DomainFree
    order: TieKeys


@dataclass
class _Base:
    """What the last figures were taken from: the nodes (parallel lists), each tier's domain of each node
    and the nodes under each domain, closest tier first."""

    states: Sequence[NodeState]
    frees: list[int]
    domains: list[list[str]]
    members: list[dict[str, list[int]]] = field(default_factory=list)


class FabricFigures:
    """The figures of the latest generation asked for, recomputed only when the generation moved (a
    change of a node's GPUs, its labels, its Lease, the pods or reservations). Replaced whole: a reader
    on another thread takes either the old figures or the new ones without waiting."""

    def __init__(self, tiers: TierConfig, generation: Callable[[], int], states: Callable[[], Sequence[NodeState]]):
        self._tiers, self._narrow = tiers, narrow_first(tiers)
        self._generation, self._states = generation, states
        self._last: Fabric | None = None
        self._base: _Base | None = None
        self._lock = threading.Lock()

    def now(self) -> Fabric:
        """The figures as of the current generation. The generation is read before the nodes: a change in
        between is counted in these figures and recomputed once more on the next call."""
        generation = self._generation()
        last = self._last
        if last is not None and last.generation == generation:
            return last
        states = self._states()  # read before this lock: it never waits for the ledger's
        with self._lock:  # one computation at a time: each starts from the last one's figures
            last = self._last
            if last is None or last.generation != generation:
                moved = self._moved(states)
                free, order = self._afresh(states) if moved is None else self._update(states, moved)
                last = self._last = Fabric(generation, free, order)
        return last

    def _moved(self, states: Sequence[NodeState]) -> list[int] | None:
        """The indices of the nodes whose state changed since the base, or None when the base does not
        hold (no figures yet, other nodes, a node under other domains)."""
        base, last = self._base, self._last
        if base is None or last is None or len(states) != len(base.states):
            return None
        moved = list(compress(range(len(states)), map(operator.is_not, states, base.states)))
        for i in moved:
            new, old = states[i], base.states[i]
            if new.name != old.name or new.location != old.location:
                return None
        return moved

    def _afresh(self, states: Sequence[NodeState]) -> tuple[DomainFree, TieKeys]:
        keys = list(map(operator.attrgetter("key"), states))
        # Nodes of a kind have the same free GPUs: count each kind once (the kind's key covers its problem).
        per_kind = {k: free_gpus(s) for k, s in dict(zip(keys, states, strict=True)).items()}
        frees = list(map(per_kind.__getitem__, keys))
        domains = [[domain_of(s, t) for s in states] for t in self._narrow]
        base = self._base = _Base(list(states), frees, domains)  # a copy: the caller's list may change
        sums: list[dict[str, int]] = []
        for of_tier in domains:
            totals: defaultdict[str, int] = defaultdict(int)
            members: defaultdict[str, list[int]] = defaultdict(list)
            for i, (d, f) in enumerate(zip(of_tier, frees, strict=True)):
                totals[d] += f
                members[d].append(i)
            sums.append(dict(totals))
            base.members.append(dict(members))
        names = list(map(operator.attrgetter("name"), states))
        columns = [map(totals.__getitem__, of_tier) for totals, of_tier in zip(sums, domains, strict=True)]
        order = TieKeys(zip(names, zip(*columns, names, strict=True), strict=True))
        return self._free(sums, dict(zip(names, frees, strict=True))), order

    def _update(self, states: Sequence[NodeState], moved: list[int]) -> tuple[DomainFree, TieKeys]:
        """The last figures moved by the nodes in `moved`: their free GPUs into their domains' sums, and a
        new key for every node under a domain whose sum moved."""
        base, last = self._base, self._last
        assert base is not None and last is not None
        sums = [dict(last.free.by_tier[t]) for t in self._narrow]
        by_node, order = dict(last.free.by_node), TieKeys(last.order)
        frees = list(base.frees)
        touched: set[int] = set()
        for i in moved:
            free = free_gpus(states[i])
            if free != frees[i]:
                for totals, of_tier, members in zip(sums, base.domains, base.members, strict=True):
                    totals[of_tier[i]] += free - frees[i]
                    touched.update(members[of_tier[i]])
                frees[i] = by_node[states[i].name] = free
        for i in touched:
            name = states[i].name
            order[name] = (*(totals[of_tier[i]] for totals, of_tier in zip(sums, base.domains, strict=True)), name)
        base.states, base.frees = list(states), frees
        return self._free(sums, by_node), order

    def _free(self, sums: list[dict[str, int]], by_node: dict[str, int]) -> DomainFree:
        return DomainFree(dict(zip(self._narrow, sums, strict=True)), by_node)
