"""The extender's state: nodes, placed pods, in-flight binds and group reservations, over the engine
`NodeState` of every node that `NodeStates` (gputopo/extender/state/nodestates.py) keeps: what a node's GPUs in use are,
and when its state goes stale. Readers (`evaluate`, `states`) take each node's state without the lock.

Equivalent nodes share `NodeState.key`; outcomes are memoised by (PodRequest, key), so a decision over
5,000 nodes evaluates each distinct kind once.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import chain
from typing import TypedDict

from gputopo.engine.node.placement import Outcome, evaluate_node
from gputopo.engine.state.reasons import Code
from gputopo.engine.state.scoring import DEFAULT_WEIGHTS, ScoreWeights
from gputopo.engine.state.snapshot import NodeState
from gputopo.extender.state import mismatch
from gputopo.extender.state.domainfree import FabricFigures
from gputopo.extender.state.mismatch import Mismatch
from gputopo.extender.state.nodestates import NodeStates
from gputopo.extender.state.podindex import PodTable
from gputopo.extender.state.records import NodeEntry, NodeFacts, PodRecord
from gputopo.extender.state.reservations import GroupKey, Reservation, ReservationBook, SlotKey
from gputopo.extender.state.verdicts import Kinds, Verdicts
from gputopo.model import SCHEDULER_NAME, GpusInUse, PodRequest
from gputopo.tiers import DEFAULT_TIERS, TierConfig

log = logging.getLogger("gputopo.extender.state.ledger")


def _cached(states: NodeStates, name: str) -> NodeState:
    """A node the cache holds a current state of (read under its lock, from its kinds)."""
    state = states.state_now(name)
    assert state is not None
    return state


class LedgerOptions(TypedDict, total=False):
    tiers: TierConfig
    weights: ScoreWeights
    stale_after_seconds: float
    reservation_timeout_seconds: float
    clock: Callable[[], float]
    scheduler_name: str


class Ledger:
    """Nodes, placed pods, binds in flight and group reservations, and the per-request verdict memo, over its
    node-state cache (`node_states`, gputopo/extender/state/nodestates.py): every change here takes the cache's lock,
    records what it changed there (assumed GPUs, claims, reservations, the generation) and has the nodes it
    touched rebuilt by it."""

    MAX_REQUESTS_MEMOISED = 512

    def __init__(
        self,
        *,
        tiers: TierConfig = DEFAULT_TIERS,
        weights: ScoreWeights = DEFAULT_WEIGHTS,
        stale_after_seconds: float = 120.0,
        reservation_timeout_seconds: float = 120.0,
        clock: Callable[[], float] = time.time,
        scheduler_name: str = SCHEDULER_NAME,
    ) -> None:
        self.scheduler_name = scheduler_name  # only its pods are group members, and only theirs are inferred
        self.node_states = NodeStates(tiers=tiers, clock=clock, reservation_timeout_seconds=reservation_timeout_seconds)
        self.tiers, self.clock, self.tier_names = tiers, clock, tiers.names
        self.lock = self.node_states.lock  # one lock for the ledger and its cache
        self.weights, self.stale_after = weights, stale_after_seconds
        self.static = False  # --snapshot: no Leases, nothing goes stale
        self.where_version = 0  # moves when a node comes, goes, or changes labels or topology (its location)
        self.pods = PodTable(scheduler_name=scheduler_name)  # also each group's members, each controller's pods
        self.leases: dict[str, float] = {}  # node -> renew time
        self.mismatches: dict[str, Mismatch] = {}  # pod uid -> its current mismatch
        self._announced: set[str] = set()  # pod uids already handed to on_mismatch
        self.on_mismatch: Callable[[Mismatch], None] | None = None
        self._verdicts: OrderedDict[PodRequest, Verdicts] = OrderedDict()
        self.fabric = FabricFigures(tiers, lambda: self.node_states.generation, self.states)  # best fit by domain

    @property
    def reservations(self) -> Mapping[GroupKey, Reservation]:
        return self.book.reservations

    @property
    def nodes(self) -> dict[str, NodeEntry]:
        return self.node_states.nodes

    @property
    def book(self) -> ReservationBook:
        return self.node_states.book

    @property
    def generation(self) -> int:
        """Moves on every change that can alter a verdict (`NodeStates.generation`)."""
        return self.node_states.generation

    def resolve(self, name: str, now: float) -> NodeState:
        return self.node_states.resolve(name, now)

    def unchanged_since(self, generation: int, names: Iterable[str]) -> bool:
        return self.node_states.unchanged_since(generation, names)

    # ------------------------------------------------------------------ reading node states

    def states(self, names: Iterable[str] | None = None, now: float | None = None) -> list[NodeState]:
        now = self.clock() if now is None else now
        self.expire(now)
        return self.node_states.states_at(list(self.nodes) if names is None else names, now)

    def node_for(self, name: str, *, without_pod: str = "", without_slot: SlotKey | None = None) -> NodeState:
        """The node as the given pod (or group member) sees it: its own assumed/reserved GPUs are free."""
        ns = self.node_states
        with self.lock:
            st = ns.resolve(name, self.clock())
            e = ns.nodes.get(name)
            if e is None or st.problem is not None:
                return st
            return ns.build(e, ns.in_use(name, e.report, without_pod, without_slot))

    def evaluate(self, names: Sequence[str], req: PodRequest) -> list[Outcome]:
        """Outcome per requested node, in request order (unknown nodes: topology not reported)."""
        return self.evaluate_kinds(names, req)[0]

    def evaluate_kinds(self, names: Sequence[str], req: PodRequest) -> tuple[list[Outcome], Kinds | None]:
        """`evaluate`, and each node's kind with the verdict of every kind (None when nodes changed under
        every read): a caller sorting thousands of nodes by verdict looks at each kind once. A list of names
        is read as it is, not copied."""
        return self._evaluate(names if isinstance(names, list) else list(names), req)

    def evaluate_states(self, names: Iterable[str], req: PodRequest) -> list[tuple[NodeState, Outcome]]:
        """Each node's state with its outcome (read together, node by node: not for the hot path)."""
        now = self.clock()
        self.expire(now)
        memo = self._memo(req)
        out: list[tuple[NodeState, Outcome]] = []
        view, weights = self.node_states.view, self.weights
        for name in names:
            state = view(name, now)
            o = memo.get(state.key)
            if o is None:  # two threads may both compute one outcome: equal values, no harm
                o = memo[state.key] = evaluate_node(state, req, weights)
            out.append((state, o))
        return out

    def _memo(self, req: PodRequest) -> Verdicts:
        with self.lock:
            memo = self._verdicts.get(req)
            if memo is None:
                memo = self._verdicts[req] = Verdicts()
                if len(self._verdicts) > self.MAX_REQUESTS_MEMOISED:
                    self._verdicts.popitem(last=False)
            else:
                self._verdicts.move_to_end(req)
        return memo

    def _evaluate(self, names: list[str], req: PodRequest) -> tuple[list[Outcome], Kinds | None]:
        """Outcomes in request order. Thousands of nodes per call and a few distinct kinds: a node costs
        two C-level dict lookups (its key, the memoised outcome of that key), and only kinds the memo
        has not seen (a node whose GPUs just changed) are evaluated."""
        now = self.clock()
        self.expire(now)
        memo = self._memo(req)
        for _ in range(3):
            keys, states = self.node_states.kinds(names, now)
            try:
                return list(map(memo.__getitem__, keys)), Kinds(keys, memo)
            except KeyError:
                pass
            weights = self.weights
            where = dict(zip(keys, range(len(keys)), strict=True))  # a node of each kind (C-level)
            for key in set(keys).difference(memo):
                i = where[key]
                state = states[i] if states is not None else self.node_states.state_now(names[i])
                if state is None or state.key != key:
                    break  # the node changed since its key was read: read the keys again
                # two threads may both compute one outcome: equal values, no harm
                memo[key] = evaluate_node(state, req, weights)
            else:
                return list(map(memo.__getitem__, keys)), Kinds(keys, memo)
        return [o for _, o in self.evaluate_states(names, req)], None  # nodes changing under every read

    def runner_up(self, node: str, req: PodRequest) -> tuple[NodeState, Outcome] | None:
        """The best feasible node other than `node` over every cached node: the highest score, then the
        first in best fit above the node (`fabric`; what ranking the whole cluster would put first). Reads
        each kind of node once (the nodes of a kind share one verdict), not every node: a bind pays for a
        few hundred kinds at most, however many nodes there are."""
        order = self.fabric.now().order.__getitem__
        now = self.clock()
        self.expire(now)
        memo = self._memo(req)
        weights, success, ns = self.weights, Code.SUCCESS, self.node_states
        with self.lock:  # the kinds and their nodes read together; a kind not seen for `req` is evaluated here
            ns.current(now)
            feasible: dict[float, list[set[str]]] = {}
            for key, members in ns.kinds_now().items():
                o = memo.get(key)
                if o is None:
                    o = memo[key] = evaluate_node(_cached(ns, next(iter(members))), req, weights)
                if o.code is success:
                    feasible.setdefault(o.score, []).append(members)
            for score in sorted(feasible, reverse=True):
                pick = min(filter(node.__ne__, chain.from_iterable(feasible[score])), key=order, default=None)
                if pick is not None:
                    state = _cached(ns, pick)
                    return state, memo[state.key]
        return None

    # ------------------------------------------------------------------ nodes and leases

    def deadline(self, name: str) -> float:
        if self.static:
            return math.inf
        renew = self.leases.get(name)
        return -math.inf if renew is None else renew + self.stale_after

    def put_node(self, facts: NodeFacts) -> None:
        with self.lock:
            e = NodeEntry(**vars(facts), deadline=self.deadline(facts.name))
            prev = self.nodes.get(facts.name)
            if prev is None or prev.topology is not e.topology or prev.labels != e.labels:
                self.where_version += 1
            if (
                prev is not None
                and prev.topology is e.topology
                and prev.labels == e.labels
                and (prev.problem, prev.detail) == (e.problem, e.detail)
            ):
                # Same topology document (node_facts reuses it while the annotation text is unchanged):
                # a gpus-in-use update lands on a state built before, e.g. by the bind that caused it.
                e.built = prev.built
            ns = self.node_states
            e.fresh = ns.build(e)  # built before it is visible: readers take entries without the lock
            ns.settle(e, self.clock())
            ns.nodes[facts.name] = e
            ns.label_channel(facts.name, e.labels)
            ns.labels.put(facts.name, e.labels)
            ns.changed()
            for uid in e.report.pods:
                self._check_mismatch(uid)

    def put_static(self, st: NodeState) -> None:
        """A node of a static cluster file: never stale, nothing reported per pod."""
        facts = NodeFacts(
            st.name, dict(st.labels), st.topology, "", st.problem, st.problem_detail, GpusInUse(other=st.in_use)
        )
        self.static = True
        self.put_node(facts)

    def drop_nodes(self, names: Iterable[str]) -> None:
        with self.lock:
            for name in names:
                if self.nodes.pop(name, None) is not None:
                    self.where_version += 1
                    self.node_states.forget(name)
                    self.node_states.labels.drop([name])
                    self.node_states.changed()

    def put_lease(self, node: str, renew: float | None) -> bool:
        """Record an agent heartbeat (None: the Lease is gone or says nothing). True when it may change
        a verdict (the node was stale, or the Lease went away); renewing a fresh node's Lease is not."""
        with self.lock:
            entry = self.nodes.get(node)
            was_fresh = entry is not None and self.clock() <= entry.deadline
            if renew is None:
                self.leases.pop(node, None)
            else:
                self.leases[node] = renew
            if entry is not None:
                entry.deadline = self.deadline(node)
                self.node_states.settle(entry, self.clock())
            changed = renew is None or not was_fresh
            if changed:
                self.node_states.changed()
            return changed

    def replace_leases(self, leases: Mapping[str, float]) -> None:
        with self.lock:
            self.leases = dict(leases)
            for e in self.nodes.values():
                e.deadline = self.deadline(e.name)
            self.node_states.sweep(self.clock())
            self.node_states.changed()

    # ------------------------------------------------------------------ pods

    def put_pod(self, uid: str, rec: PodRecord | None) -> None:
        """Record a pod (None: deleted, or not a gputopo pod any more)."""
        with self.lock:
            old = self.pods.get(uid)  # replaced in place, not popped: a member bound stays the same member
            if old is not None:
                self._unindex(old)
                if rec is not None and rec.created is None and old.created is not None:  # built again, not read
                    rec = dataclasses.replace(rec, created=old.created)
            if rec is not None:
                self.pods[uid] = rec
                self._index(rec)
            elif old is not None:
                del self.pods[uid]
            self.node_states.rebuild({old.placed_node if old else None, rec.placed_node if rec else None})
            if rec is not None:
                self._check_mismatch(uid)
            else:
                self.mismatches.pop(uid, None)
                self._announced.discard(uid)

    def replace_pods(self, records: Mapping[str, PodRecord]) -> None:
        with self.lock:
            touched = {p.placed_node for p in self.pods.values()} | {p.placed_node for p in records.values()}
            before, self.pods = self.pods, PodTable(records, self.scheduler_name)
            self.pods.keep_versions(before)
            self.node_states.clear_assumed()
            for rec in self.pods.values():
                self._index(rec)
            self.node_states.rebuild(touched)
            for uid in set(self.mismatches) - set(records):
                del self.mismatches[uid]
            self._announced &= set(records)
            for uid in records:
                self._check_mismatch(uid)
            self.node_states.changed()

    def _index(self, rec: PodRecord) -> None:
        if not rec.active:
            return
        node = rec.placed_node
        if node and rec.placement is not None:
            self.node_states.assume(node, rec.uid, frozenset(rec.placement.gpus))
        key = self.pods.group_of(rec)  # another scheduler's pod is no member
        if node and key is not None:
            self.node_states.rebuild(self.book.pin(key, rec.name, self.clock()))

    def _unindex(self, rec: PodRecord) -> None:
        if rec.placed_node:
            self.node_states.unassume(rec.placed_node, rec.uid)

    def forget_reported(self, uid: str) -> None:
        """Drop what nodes report for `uid` (what-if views: the cluster as if the pod had never run)."""
        with self.lock:
            for e in self.nodes.values():
                if uid in e.report.pods:
                    e.report = GpusInUse(
                        pods={u: g for u, g in e.report.pods.items() if u != uid}, other=e.report.other
                    )
                    self.node_states.rebuild([e.name])

    def reported_gpus(self, node: str, uid: str) -> frozenset[int] | None:
        """The GPUs `node` reports under pod `uid`, or None when it reports none for it."""
        e = self.nodes.get(node)
        return None if e is None else e.report.pods.get(uid)

    def pod_gpus(self, node: str, uid: str) -> frozenset[int] | None:
        """The GPUs pod `uid` counts for on `node`: reported if the node reports it, else assumed from
        its placement; None when gputopo knows of none."""
        with self.lock:
            reported = self.reported_gpus(node, uid)
            return reported if reported is not None else self.node_states.assumed(node, uid)

    def _check_mismatch(self, uid: str) -> None:
        """Record (and announce once) a placed pod whose node reports other GPUs for it."""
        rec = self.pods.get(uid)
        found = mismatch.compare(rec, self.nodes.get(rec.placed_node or "") if rec is not None else None)
        if found is None:
            return  # nothing to compare yet; a recorded mismatch stays until the pod goes
        if found is False:
            self.mismatches.pop(uid, None)
            return
        assert isinstance(found, Mismatch)
        if self.mismatches.get(uid) == found:
            return
        self.mismatches[uid] = found
        if uid not in self._announced:
            self._announced.add(uid)
            log.warning(
                "pod got other GPUs than placed",
                extra={"pod": found.ref, "node": found.node, "gpus": list(found.actual), "placed": list(found.placed)},
            )
            if self.on_mismatch is not None:
                self.on_mismatch(found)

    # ------------------------------------------------------------------ binds in flight

    def claim(self, uid: str, node: str, gpus: frozenset[int]) -> None:
        """GPUs this process is binding a pod to right now: used for everyone else until `unclaim`."""
        self.node_states.claim(uid, node, gpus)

    def unclaim(self, uid: str, node: str) -> None:
        self.node_states.unclaim(uid, node)

    # ------------------------------------------------------------------ groups

    def group_members(self, key: GroupKey) -> list[PodRecord]:
        with self.lock:
            return self.pods.members(key)

    def reserve(self, res: Reservation) -> bool:
        """Hold the plan's GPUs; False (nothing held) when one of them was taken since it was planned."""
        with self.lock:
            for slot in res.slots.values():
                e = self.nodes.get(slot.node)
                if slot.pinned or e is None:
                    continue
                if slot.gpus & self.node_states.in_use(slot.node, e.report, without_slot=(res.key, slot.member)):
                    return False
            self.node_states.rebuild(self.book.put(res))
            return True

    def release(self, key: GroupKey, *, replan: bool = False) -> None:
        """Release the group's reservation; `replan` keeps its hold clock for the next one (`ReservationBook.drop`)."""
        with self.lock:
            self.node_states.rebuild(self.book.drop(key, replan=replan))

    def pin(self, key: GroupKey, member: str) -> None:
        with self.lock:
            self.node_states.rebuild(self.book.pin(key, member, self.clock()))

    def expire(self, now: float) -> list[GroupKey]:
        """Release reservations whose unbound members did not bind within the timeout."""
        if now < self.book.next_expiry:
            return []  # the common case: no lock
        with self.lock:
            gone = self.book.due(now)
            for k in gone:
                log.info("group reservation expired; released", extra={"group": f"{k[0]}/{k[1]}"})
                self.node_states.rebuild(self.book.drop(k))
            return gone
