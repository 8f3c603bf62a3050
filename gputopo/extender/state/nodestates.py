"""Each node's engine state as pods see it: built from the node's GPUs in use, stale past its Lease deadline."""

from __future__ import annotations

import collections
import math
import operator
import threading
from collections.abc import Callable, Iterable, Mapping

from gputopo.engine.gang.imex import DRIVER_NODE_LABEL
from gputopo.engine.gang.labelindex import LabelIndex
from gputopo.engine.state.reasons import Reason
from gputopo.engine.state.snapshot import NodeState, node_state, taking
from gputopo.extender.state.records import NodeEntry
from gputopo.extender.state.reservations import ReservationBook, SlotKey
from gputopo.model import GpusInUse, agent_lease_name
from gputopo.tiers import TierConfig

STALE_DETAIL = "agent heartbeat (Lease {lease}) is older than staleAfterSeconds"
BUILT_PER_NODE = 4  # states kept per node by in-use set (one bind's claim, bound pod and release share one)
MOVES_KEPT = 4096  # recent changes of a node's kind, for `unchanged_since`
_KEY = operator.attrgetter("key")


class NodeStates:
    """The engine `NodeState` of every node (the ledger's node-state cache, `Ledger.node_states`), rebuilt
    only when that node, the pods placed on it or a reservation touching it change. The ledger records
    what changed (`assume`, `claim`, the reservation book, `changed`) and has the nodes rebuilt
    (`rebuild`). In-use GPUs of a node are

        the GPUs the agent's gputopo.io/gpus-in-use reports, per pod UID and `other`
      ∪ GPUs of non-terminated pods bound to the node whose gputopo.io/placement names it and that the
        node has not reported under their UID yet (assumed allocations; once reported, the actual GPUs
        replace them)
      ∪ GPUs of binds this process has in flight to the node
      ∪ GPUs reserved by group plans whose members are not bound yet.

    Readers take each node's state without the lock: a `NodeEntry.fresh` is replaced whole, never
    mutated, so a decision over thousands of nodes holds the lock only for the rare node that needs
    building (stale, or seen without a pod's own GPUs). Staleness is decided at request time against the
    injected clock from each node's deadline (Lease renewTime + staleAfterSeconds): each entry's current
    state and equivalence key are kept in name -> state and name -> key dicts, right for every time
    between the latest deadline already passed and the earliest one not passed yet, so a decision reads
    thousands of keys with C-level lookups and re-checks deadlines node by node only when the clock
    crosses one (`sweep`).
    """

    def __init__(self, *, tiers: TierConfig, clock: Callable[[], float], reservation_timeout_seconds: float) -> None:
        self.tiers = tiers
        self.clock = clock
        self.lock = threading.RLock()
        self.nodes: dict[str, NodeEntry] = {}
        self._assumed: dict[str, dict[str, frozenset[int]]] = {}  # node -> pod uid -> GPUs
        self._claims: dict[str, dict[str, frozenset[int]]] = {}  # node -> pod uid -> GPUs being bound
        self.channel_labels: dict[str, str] = {}  # node -> the ComputeDomain UID of its DRIVER_NODE_LABEL
        self.labels = LabelIndex()  # the nodes each nodeSelector selects (group members'), kept as labels change
        self.book = ReservationBook(reservation_timeout_seconds)
        # Bumps on every change that can alter a verdict (node states, leases, reservations). Cheap
        # "did anything change" for reusing a filter's outcomes in the prioritize that follows.
        self.generation = 0
        # The state (and its equivalence key) pods see of each cached node, right for every `now` with
        # _passed < now <= _earliest (see sweep); -inf/+inf as set here force a sweep on the first read.
        self._now: dict[str, NodeState] = {}
        self._now_keys: dict[str, int] = {}
        self._by_key: dict[int, set[str]] = {}  # the inverse of _now_keys: the nodes of each kind
        # (generation, node) of each change of a node's kind (or its removal), newest last
        self._moves: collections.deque[tuple[int, str]] = collections.deque(maxlen=MOVES_KEPT)
        self._earliest = -math.inf
        self._passed = math.inf

    def in_use(
        self, name: str, report: GpusInUse, without_pod: str = "", without_slot: SlotKey | None = None
    ) -> frozenset[int]:
        used = set(report.other)
        reported = report.pods
        for uid, gpus in reported.items():
            if uid != without_pod:
                used |= gpus
        for uid, gpus in self._assumed.get(name, {}).items():
            if uid != without_pod and uid not in reported:  # reported: the actual GPUs replaced these
                used |= gpus
        for uid, gpus in self._claims.get(name, {}).items():
            if uid != without_pod:
                used |= gpus
        for slot_key, gpus in self.book.on(name).items():
            if slot_key != without_slot:
                used |= gpus
        return frozenset(used)

    def build(self, e: NodeEntry, in_use: frozenset[int] | None = None) -> NodeState:
        used = self.in_use(e.name, e.report) if in_use is None else in_use
        # A bind rebuilds its node three times with the same GPUs in use (claim, the bound pod, unclaim)
        # and the pod's watch event a fourth: node_state is pure in (entry, in-use set), so the entry
        # keeps its last few states by in-use set, and a new set is derived from one of them (`taking`).
        built = e.built.get(used)
        if built is not None:
            return built
        base = next(iter(e.built.values()), None)  # the same facts with other GPUs in use
        if base is not None:
            built = taking(base, used)
        else:
            built = node_state(
                e.name,
                e.topology,
                labels=e.labels,
                in_use=used,
                problem=e.problem,
                problem_detail=e.detail,
                tiers=self.tiers,
            )
        if len(e.built) >= BUILT_PER_NODE:
            del e.built[next(iter(e.built))]
        e.built[used] = built
        return built

    def rebuild(self, names: Iterable[str | None]) -> None:
        for name in names:
            e = self.nodes.get(name) if name else None
            if e is not None:
                built = self.build(e)
                if built is e.fresh:
                    continue  # the same GPUs in use as before (a bound pod's watch event after our bind)
                e.stale = None
                e.fresh = built
                self.settle(e, self.clock())
                self.generation += 1

    def settle(self, e: NodeEntry, now: float) -> None:
        """Record the state pods see of `e` at `now` after its state or deadline changed (under the lock)."""
        if e.problem is None and now > e.deadline:
            self._set_now(e.name, self._stale(e))
            self._passed = max(self._passed, e.deadline)
        else:
            self._set_now(e.name, e.fresh)
            if e.problem is None:
                self._earliest = min(self._earliest, e.deadline)

    def _set_now(self, name: str, state: NodeState) -> None:
        old = self._now_keys.get(name)
        self._now[name] = state
        self._now_keys[name] = state.key
        if old != state.key:
            if old is not None:
                self._unkind(name, old)
            self._by_key.setdefault(state.key, set()).add(name)
            self._moves.append((self.generation, name))

    def label_channel(self, name: str, labels: Mapping[str, str]) -> None:
        """Keep the node's `DRIVER_NODE_LABEL` (gputopo.engine.gang.imex): which ComputeDomain NVIDIA's driver
        says its IMEX channel serves."""
        uid = labels.get(DRIVER_NODE_LABEL)
        if uid:
            self.channel_labels[name] = uid
        else:
            self.channel_labels.pop(name, None)

    def forget(self, name: str) -> None:
        self.channel_labels.pop(name, None)
        self._now.pop(name, None)
        old = self._now_keys.pop(name, None)
        if old is not None:
            self._unkind(name, old)
            self._moves.append((self.generation, name))

    # ------------------------------------------------------------------ what the owner records

    def changed(self) -> None:
        """A change that can alter a verdict happened (a node, a Lease, the pods): the generation moves."""
        self.generation += 1

    def assume(self, node: str, uid: str, gpus: frozenset[int]) -> None:
        """A pod bound to `node` with a placement the node has not reported yet (rebuilt by `rebuild`)."""
        self._assumed.setdefault(node, {})[uid] = gpus

    def unassume(self, node: str, uid: str) -> None:
        per = self._assumed.get(node)
        if per is not None:
            per.pop(uid, None)
            if not per:
                del self._assumed[node]

    def clear_assumed(self) -> None:
        self._assumed = {}

    def assumed(self, node: str, uid: str) -> frozenset[int] | None:
        return self._assumed.get(node, {}).get(uid)

    def claim(self, uid: str, node: str, gpus: frozenset[int]) -> None:
        """GPUs a bind in flight holds on `node`; the node is rebuilt."""
        with self.lock:
            self._claims.setdefault(node, {})[uid] = gpus
            self.rebuild([node])

    def unclaim(self, uid: str, node: str) -> None:
        with self.lock:
            per = self._claims.get(node)
            if per is not None and per.pop(uid, None) is not None:
                if not per:
                    del self._claims[node]
                self.rebuild([node])

    # ------------------------------------------------------------------ reading states

    def states_at(self, names: Iterable[str], now: float) -> list[NodeState]:
        """Each named node as pods see it at `now` (C-level lookups while every name is cached)."""
        self.current(now)
        try:
            return list(map(self._now.__getitem__, names))
        except KeyError:
            return [self.view(n, now) for n in names]

    def state_now(self, name: str) -> NodeState | None:
        """The node's state as of the last `current` (None when not cached)."""
        return self._now.get(name)

    def kinds_now(self) -> dict[int, set[str]]:
        """The nodes of each kind as of the last `current` (read under the lock: it changes with the nodes)."""
        return self._by_key

    def unchanged_since(self, generation: int, names: Iterable[str]) -> bool:
        """Whether no node in `names` changed kind since `generation` was read (so every verdict on them
        read then still holds; a change in the same generation counts as later). False when too many
        changes happened since to tell. `names` is read only when some node changed since."""
        now = self.clock()
        with self.lock:
            self.current(now)  # a Lease deadline passed since is a change too
            moved: set[str] = set()
            for gen, name in reversed(self._moves):
                if gen < generation:
                    break
                moved.add(name)
            else:
                if len(self._moves) >= MOVES_KEPT:
                    return False
        return not moved or moved.isdisjoint(names)

    def _unkind(self, name: str, key: int) -> None:
        names = self._by_key[key]
        names.discard(name)
        if not names:
            del self._by_key[key]

    def sweep(self, now: float) -> None:
        """Re-decide every node's current state for `now`; afterwards _passed < now <= _earliest."""
        with self.lock:
            earliest, passed = math.inf, -math.inf
            for e in self.nodes.values():
                if e.problem is None and now > e.deadline:
                    self._set_now(e.name, self._stale(e))
                    passed = max(passed, e.deadline)
                else:
                    self._set_now(e.name, e.fresh)
                    if e.problem is None:
                        earliest = min(earliest, e.deadline)
            self._earliest, self._passed = earliest, passed

    def current(self, now: float) -> None:
        """Make _now, _now_keys and _by_key right for `now` (a sweep only when the clock crossed a deadline)."""
        if not self._passed < now <= self._earliest:
            self.sweep(now)

    def kinds(self, names: list[str], now: float) -> tuple[list[int], list[NodeState] | None]:
        """Each node's equivalence key at `now`, by one C-level lookup per node (a plain name -> key
        dict: no node object is touched). When a name is not in the cache the states are built one by
        one (`resolve`) and returned too."""
        self.current(now)
        try:
            return list(map(self._now_keys.__getitem__, names)), None
        except KeyError:
            states = [self.view(n, now) for n in names]
            return list(map(_KEY, states)), states

    def _stale(self, e: NodeEntry) -> NodeState:
        if e.stale is None:
            e.stale = node_state(
                e.name,
                e.topology,
                labels=e.labels,
                in_use=e.fresh.in_use,
                problem=Reason.TOPOLOGY_STALE,
                problem_detail=STALE_DETAIL.format(lease=agent_lease_name(e.name)),
                tiers=self.tiers,
            )
        return e.stale

    def resolve(self, name: str, now: float) -> NodeState:
        """The node as a pod sees it right now (stale once its Lease deadline passed). A name not in the
        cache gets a state built on the spot: requests name any strings, none of them is kept."""
        e = self.nodes.get(name)
        if e is None:
            return node_state(name, None, problem=Reason.TOPOLOGY_MISSING, problem_detail="node not in the cache")
        if e.problem is None and now > e.deadline:
            with self.lock:
                return self._stale(e)
        return e.fresh

    def view(self, name: str, now: float) -> NodeState:
        e = self.nodes.get(name)
        if e is not None and (e.problem is not None or now <= e.deadline):
            return e.fresh  # the common case: no lock
        return self.resolve(name, now)
