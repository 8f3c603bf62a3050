"""The extender's cluster cache: one immutable engine `NodeState` per node, rebuilt only when that node,
the pods placed on it or a group reservation touching it change.

Request handlers never do I/O: they read this cache under its lock. Staleness is decided at request
time against the injected clock from a per-node deadline (Lease renewTime + staleAfterSeconds), so a
node whose agent stopped heartbeating goes stale without any event. In-use GPUs of a node are

    the agent's gputopo.io/gpus-in-use
  ∪ GPUs of non-terminated pods whose gputopo.io/placement names the node (assumed allocations:
    written at bind, so a restarted extender or a second replica sees them)
  ∪ GPUs reserved by group plans whose members are not bound yet (released after a timeout).

Equivalent nodes share `NodeState.key` (a small interned int); per-request outcomes are memoised by
(PodRequest, key), so a decision over 5,000 nodes evaluates each distinct kind once.
"""

from __future__ import annotations

import gc
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from extender.kube import JSON, Kind
from extender.wire import WireError, pod_info
from gputopo.engine.groups import Assignment, GroupPlan
from gputopo.engine.placement import Outcome, evaluate_node
from gputopo.engine.reasons import Reason
from gputopo.engine.scoring import DEFAULT_WEIGHTS, ScoreWeights
from gputopo.engine.snapshot import NodeState, node_state
from gputopo.model import (
    ANN_GROUP,
    ANN_GROUP_SIZE,
    GPUS_IN_USE_ANNOTATION,
    PLACEMENT_ANNOTATION,
    PREFIX,
    TOPOLOGY_ANNOTATION,
    AnnotationError,
    NodeTopology,
    Placement,
    PodRequest,
    parse_gpus_in_use,
    parse_placement,
    parse_pod_request,
    parse_topology,
)
from gputopo.tiers import DEFAULT_TIERS, TierConfig

log = logging.getLogger("gputopo.extender.cache")

LEASE_PREFIX = "gputopo-agent-"
STALE_DETAIL = "agent heartbeat (Lease {lease}) is older than staleAfterSeconds"
GroupKey = tuple[str, str]  # (namespace, group)


def parse_time(text: str) -> float | None:
    """RFC 3339 (Lease renewTime: 2026-01-01T00:00:00.000000Z) to epoch seconds."""
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except (ValueError, AttributeError):
        return None


@dataclass(frozen=True)
class PodRecord:
    """A pod that carries gputopo annotations, as far as placement is concerned."""

    uid: str
    namespace: str
    name: str
    node_name: str
    phase: str
    gpus: int
    group: str | None
    group_size: str | None
    request: PodRequest | None
    placement: Placement | None

    @property
    def active(self) -> bool:
        return self.phase not in ("Succeeded", "Failed")

    @property
    def placed_node(self) -> str | None:
        """The node whose GPUs this pod holds: its placement, unless it was bound elsewhere."""
        if self.placement is None or (self.node_name and self.node_name != self.placement.node):
            return None
        return self.placement.node

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"


def pod_record(obj: Mapping[str, Any], tiers: tuple[str, ...]) -> PodRecord | None:
    """None when the pod has no gputopo annotation (the cache does not track plain pods)."""
    try:
        info = pod_info(obj)
    except WireError:
        return None
    ann = {k: v for k, v in info.annotations.items() if k.startswith(PREFIX)}
    if not ann:
        return None
    placement = None
    if PLACEMENT_ANNOTATION in ann:
        try:
            placement = parse_placement(ann[PLACEMENT_ANNOTATION])
        except AnnotationError as e:
            log.warning("ignoring unreadable placement annotation", extra={"pod": info.ref, "error": str(e)})
    try:
        request: PodRequest | None = parse_pod_request(ann, info.gpus, tiers)
    except AnnotationError:
        request = None
    return PodRecord(
        uid=info.uid or info.ref,
        namespace=info.namespace,
        name=info.name,
        node_name=info.node_name,
        phase=info.phase,
        gpus=info.gpus,
        group=ann.get(ANN_GROUP, "").strip() or None,
        group_size=ann.get(ANN_GROUP_SIZE),
        request=request,
        placement=placement,
    )


@dataclass
class NodeEntry:
    name: str
    labels: dict[str, str]
    topology: NodeTopology | None
    topology_text: str
    problem: Reason | None
    detail: str
    agent_in_use: frozenset[int]
    deadline: float  # epoch seconds after which the topology is stale
    fresh: NodeState
    kid: int
    stale: NodeState | None = None
    stale_kid: int = -1


@dataclass
class Slot:
    """One group member's place in a reservation."""

    member: str
    node: str
    gpus: frozenset[int]
    stage: int | None
    pinned: bool  # bound (or annotated) already: its GPUs count through its placement annotation
    assignment: Assignment | None = None


@dataclass
class Reservation:
    key: GroupKey
    created: float
    slots: dict[str, Slot]
    plan: GroupPlan | None = None

    @property
    def members(self) -> frozenset[str]:
        return frozenset(self.slots)


@dataclass
class _VerdictTable:
    outcomes: dict[int, Outcome] = field(default_factory=dict)


def _freeze() -> None:
    """Move everything alive now out of the cyclic GC's reach: thousands of long-lived node states and
    topology documents otherwise make every full collection cost tens of milliseconds mid-request.
    Frozen objects are still freed by reference counting when the cache drops them."""
    gc.collect()
    gc.freeze()


class ClusterCache:
    """Thread-safe cache fed by the informers (`replace`/`apply`) or loaded statically (`load_static`)."""

    MAX_REQUESTS_MEMOISED = 512

    def __init__(
        self,
        *,
        tiers: TierConfig = DEFAULT_TIERS,
        weights: ScoreWeights = DEFAULT_WEIGHTS,
        stale_after_seconds: float = 120.0,
        reservation_timeout_seconds: float = 120.0,
        clock: Callable[[], float] = time.time,
        lease_namespace: str = "gputopo-system",
    ) -> None:
        self.tiers = tiers
        self.tier_names = tiers.names
        self.weights = weights
        self.stale_after = stale_after_seconds
        self.reservation_timeout = reservation_timeout_seconds
        self.clock = clock
        self.lease_namespace = lease_namespace
        self.lock = threading.RLock()
        self.static = False
        self.nodes: dict[str, NodeEntry] = {}
        self.pods: dict[str, PodRecord] = {}
        self.leases: dict[str, float] = {}  # node -> renew time
        self._assumed: dict[str, dict[str, frozenset[int]]] = {}  # node -> pod uid -> GPUs
        self._groups: dict[GroupKey, set[str]] = {}
        self.reservations: dict[GroupKey, Reservation] = {}
        self._reserved: dict[str, dict[tuple[GroupKey, str], frozenset[int]]] = {}  # node -> (group, member) -> GPUs
        self._next_expiry = math.inf
        self._unknown: dict[str, tuple[NodeState, int]] = {}
        self._verdicts: OrderedDict[PodRequest, _VerdictTable] = OrderedDict()
        self.synced: set[Kind] = set()
        self.last_heard = 0.0
        # Bumps on every change that can alter a verdict (node states, leases, reservations); a pod
        # event bumps it only when it changes a node's GPUs in use. Cheap "did anything change".
        self.generation = 0

    # ------------------------------------------------------------------ readiness

    @property
    def ready(self) -> bool:
        return self.static or self.synced >= {"nodes", "pods", "leases"}

    def age_seconds(self) -> float:
        if self.static:
            return 0.0
        return max(0.0, self.clock() - self.last_heard) if self.last_heard else math.inf

    def heard_from_api(self) -> None:
        self.last_heard = self.clock()

    # ------------------------------------------------------------------ node states

    def _in_use(self, name: str, agent: frozenset[int]) -> frozenset[int]:
        used = set(agent)
        for gpus in self._assumed.get(name, {}).values():
            used |= gpus
        for gpus in self._reserved.get(name, {}).values():
            used |= gpus
        return frozenset(used)

    def _build(self, e: NodeEntry, in_use: frozenset[int] | None = None) -> NodeState:
        return node_state(
            e.name,
            e.topology,
            labels=e.labels,
            in_use=self._in_use(e.name, e.agent_in_use) if in_use is None else in_use,
            problem=e.problem,
            problem_detail=e.detail,
            tiers=self.tiers,
        )

    def _rebuild(self, name: str) -> None:
        e = self.nodes.get(name)
        if e is None:
            return
        e.fresh = self._build(e)
        e.kid = e.fresh.key
        e.stale = None
        self.generation += 1

    def _stale(self, e: NodeEntry) -> tuple[NodeState, int]:
        if e.stale is None:
            e.stale = node_state(
                e.name,
                e.topology,
                labels=e.labels,
                in_use=e.fresh.in_use,
                problem=Reason.TOPOLOGY_STALE,
                problem_detail=STALE_DETAIL.format(lease=LEASE_PREFIX + e.name),
                tiers=self.tiers,
            )
            e.stale_kid = e.stale.key
        return e.stale, e.stale_kid

    def resolve(self, name: str, now: float) -> tuple[NodeState, int]:
        """The node as a pod sees it right now (stale once its Lease deadline passed)."""
        e = self.nodes.get(name)
        if e is None:
            hit = self._unknown.get(name)
            if hit is None:
                if len(self._unknown) > 10_000:
                    self._unknown.clear()
                st = node_state(name, None, problem=Reason.TOPOLOGY_MISSING, problem_detail="node not in the cache")
                hit = self._unknown[name] = (st, st.key)
            return hit
        if e.problem is None and now > e.deadline:
            return self._stale(e)
        return e.fresh, e.kid

    def states(self, names: Iterable[str] | None = None, now: float | None = None) -> list[NodeState]:
        now = self.clock() if now is None else now
        with self.lock:
            self.expire(now)
            return [self.resolve(n, now)[0] for n in (self.nodes if names is None else names)]

    def node_for(
        self, name: str, *, without_pod: str = "", without_slot: tuple[GroupKey, str] | None = None
    ) -> NodeState:
        """The node as the given pod (or group member) sees it: its own assumed/reserved GPUs are free."""
        now = self.clock()
        with self.lock:
            st, _ = self.resolve(name, now)
            e = self.nodes.get(name)
            if e is None or st.problem is not None:
                return st
            used = set(e.agent_in_use)
            for uid, gpus in self._assumed.get(name, {}).items():
                if uid != without_pod:
                    used |= gpus
            for slot_key, gpus in self._reserved.get(name, {}).items():
                if slot_key != without_slot:
                    used |= gpus
            return self._build(e, frozenset(used))

    def evaluate(self, names: Iterable[str], req: PodRequest, *, pod_uid: str = "") -> list[Outcome]:
        """Outcome per requested node, in request order (unknown nodes: topology not reported).

        A pod that already holds assumed GPUs (an earlier bind that did not complete) sees its own GPUs
        as free on that node."""
        return self._evaluate(names, req, pod_uid, None)

    def evaluate_states(
        self, names: Iterable[str], req: PodRequest, *, pod_uid: str = ""
    ) -> list[tuple[NodeState, Outcome]]:
        states: list[NodeState] = []
        outcomes = self._evaluate(names, req, pod_uid, states)
        return list(zip(states, outcomes, strict=True))

    def _evaluate(
        self, names: Iterable[str], req: PodRequest, pod_uid: str, states: list[NodeState] | None
    ) -> list[Outcome]:
        now = self.clock()
        with self.lock:
            self.expire(now)
            table = self._verdicts.get(req)
            if table is None:
                table = self._verdicts[req] = _VerdictTable()
                if len(self._verdicts) > self.MAX_REQUESTS_MEMOISED:
                    self._verdicts.popitem(last=False)
            else:
                self._verdicts.move_to_end(req)
            memo = table.outcomes
            own = self.pods.get(pod_uid) if pod_uid else None
            own_node = own.placed_node if own is not None and not own.node_name else None
            out: list[Outcome] = []
            append = out.append
            nodes = self.nodes
            weights = self.weights
            for name in names:
                e = nodes.get(name)
                if e is not None and (e.problem is not None or now <= e.deadline) and name != own_node:
                    state, kid = e.fresh, e.kid  # the common case, inlined
                else:
                    state, kid = self.resolve(name, now)
                    if name == own_node and state.problem is None:
                        state = self.node_for(name, without_pod=pod_uid)
                        kid = state.key
                o = memo.get(kid)
                if o is None:
                    o = memo[kid] = evaluate_node(state, req, weights)
                append(o)
                if states is not None:
                    states.append(state)
            return out

    # ------------------------------------------------------------------ static clusters (--snapshot)

    def load_static(self, states: Iterable[NodeState]) -> None:
        with self.lock:
            self.static = True
            for st in states:
                e = NodeEntry(
                    name=st.name,
                    labels=dict(st.labels),
                    topology=st.topology,
                    topology_text="",
                    problem=st.problem,
                    detail=st.problem_detail,
                    agent_in_use=st.in_use,
                    deadline=math.inf,
                    fresh=st,
                    kid=st.key,
                )
                self.nodes[st.name] = e
                self._rebuild(st.name)
        _freeze()

    # ------------------------------------------------------------------ informer handler

    def replace(self, kind: Kind, items: list[JSON]) -> None:
        with self.lock:
            if kind == "nodes":
                names = set()
                for obj in items:
                    names.add(self._upsert_node(obj))
                for gone in set(self.nodes) - names:
                    del self.nodes[gone]
            elif kind == "pods":
                fresh: dict[str, PodRecord] = {}
                for obj in items:
                    rec = pod_record(obj, self.tier_names)
                    if rec is not None:
                        fresh[rec.uid] = rec
                touched = {p.placed_node for p in self.pods.values()} | {p.placed_node for p in fresh.values()}
                self.pods = fresh
                self._reindex_pods()
                for node in touched:
                    if node:
                        self._rebuild(node)
            else:
                self.leases.clear()
                for obj in items:
                    self._upsert_lease(obj, rebuild=False)
                for e in self.nodes.values():
                    e.deadline = self._deadline(e.name)
            self.synced.add(kind)
            self.generation += 1
        _freeze()

    def apply(self, kind: Kind, event_type: str, obj: JSON) -> None:
        with self.lock:
            if kind == "nodes":
                if event_type == "DELETED":
                    self.nodes.pop(str((obj.get("metadata") or {}).get("name")), None)
                else:
                    self._upsert_node(obj)
            elif kind == "pods":
                # upsert_pod bumps the generation itself, only when a node's GPUs in use changed: a new
                # pending pod (most pod events) cannot change any verdict.
                self.upsert_pod(obj, deleted=event_type == "DELETED")
                return
            else:
                if not self._upsert_lease(obj, deleted=event_type == "DELETED"):
                    return  # a fresh node's heartbeat: no verdict can change, keep the generation
            self.generation += 1

    # nodes

    def _deadline(self, name: str) -> float:
        if self.static:
            return math.inf
        renew = self.leases.get(name)
        return -math.inf if renew is None else renew + self.stale_after

    def _upsert_node(self, obj: JSON) -> str:
        meta = obj.get("metadata") or {}
        name = str(meta.get("name"))
        labels = {str(k): str(v) for k, v in (meta.get("labels") or {}).items()}
        ann = meta.get("annotations") or {}
        text = ann.get(TOPOLOGY_ANNOTATION)
        prev = self.nodes.get(name)
        topology: NodeTopology | None = None
        problem: Reason | None = None
        detail = ""
        if text is None:
            problem, detail = Reason.TOPOLOGY_MISSING, f"node has no {TOPOLOGY_ANNOTATION} annotation"
        elif prev is not None and prev.topology_text == text and prev.topology is not None:
            topology = prev.topology  # unchanged annotation: skip re-validating the document
        else:
            try:
                topology = parse_topology(text)
            except AnnotationError as e:
                problem, detail = Reason.TOPOLOGY_INVALID, str(e)
        in_use: frozenset[int] = frozenset()
        raw_in_use = ann.get(GPUS_IN_USE_ANNOTATION)
        if topology is not None and problem is None and raw_in_use:
            try:
                in_use = parse_gpus_in_use(raw_in_use, len(topology.gpus))
            except AnnotationError as e:
                problem, detail = Reason.TOPOLOGY_INVALID, f"{GPUS_IN_USE_ANNOTATION}: {e}"
        entry = NodeEntry(
            name=name,
            labels=labels,
            topology=topology,
            topology_text=text or "",
            problem=problem,
            detail=detail,
            agent_in_use=in_use,
            deadline=self._deadline(name),
            fresh=node_state(name, None),
            kid=-1,
        )
        self.nodes[name] = entry
        self._rebuild(name)
        return name

    # leases

    def _upsert_lease(self, obj: JSON, *, deleted: bool = False, rebuild: bool = True) -> bool:
        """Record an agent heartbeat. True when it may change a verdict (the node was stale, or the
        Lease went away); a renewal of a fresh node's Lease is not a change."""
        meta = obj.get("metadata") or {}
        name = str(meta.get("name") or "")
        if not name.startswith(LEASE_PREFIX) or meta.get("namespace", self.lease_namespace) != self.lease_namespace:
            return False
        node = name[len(LEASE_PREFIX) :]
        entry = self.nodes.get(node)
        was_fresh = entry is not None and self.clock() <= entry.deadline
        spec = obj.get("spec") or {}
        renew = parse_time(str(spec.get("renewTime") or spec.get("acquireTime") or ""))
        if deleted or renew is None:
            self.leases.pop(node, None)
        else:
            self.leases[node] = renew
        if rebuild and node in self.nodes:
            self.nodes[node].deadline = self._deadline(node)
        return deleted or renew is None or not was_fresh

    # pods

    def _reindex_pods(self) -> None:
        self._assumed = {}
        self._groups = {}
        for rec in self.pods.values():
            self._index(rec)

    def _index(self, rec: PodRecord) -> None:
        if not rec.active:
            return
        node = rec.placed_node
        if node and rec.placement is not None:
            self._assumed.setdefault(node, {})[rec.uid] = frozenset(rec.placement.gpus)
        if rec.group:
            self._groups.setdefault((rec.namespace, rec.group), set()).add(rec.uid)
            res = self.reservations.get((rec.namespace, rec.group))
            if res is not None and node and rec.name in res.slots and not res.slots[rec.name].pinned:
                self._pin(res, rec.name)

    def _unindex(self, rec: PodRecord) -> None:
        node = rec.placed_node
        if node:
            per = self._assumed.get(node)
            if per is not None:
                per.pop(rec.uid, None)
        if rec.group:
            members = self._groups.get((rec.namespace, rec.group))
            if members is not None:
                members.discard(rec.uid)

    def upsert_pod(self, obj: JSON, *, deleted: bool = False) -> PodRecord | None:
        """Apply a pod object (from a watch, or an API answer the extender just got)."""
        with self.lock:
            rec = pod_record(obj, self.tier_names)
            meta = obj.get("metadata") or {}
            uid = str(meta.get("uid") or f"{meta.get('namespace') or 'default'}/{meta.get('name')}")
            old = self.pods.pop(uid, None)
            touched = set()
            if old is not None:
                self._unindex(old)
                touched.add(old.placed_node)
            if rec is not None and not deleted:
                self.pods[uid] = rec
                self._index(rec)
                touched.add(rec.placed_node)
            for node in touched:
                if node:
                    self._rebuild(node)  # bumps the generation
            return None if deleted else rec

    def group_members(self, key: GroupKey) -> list[PodRecord]:
        with self.lock:
            return [self.pods[u] for u in self._groups.get(key, ()) if u in self.pods and self.pods[u].active]

    # ------------------------------------------------------------------ group reservations

    def reserve(self, res: Reservation) -> None:
        with self.lock:
            self.release(res.key)
            self.reservations[res.key] = res
            for slot in res.slots.values():
                if not slot.pinned:
                    self._reserved.setdefault(slot.node, {})[(res.key, slot.member)] = slot.gpus
                    self._rebuild(slot.node)
            self._schedule_expiry()

    def release(self, key: GroupKey) -> None:
        with self.lock:
            res = self.reservations.pop(key, None)
            if res is None:
                return
            for slot in res.slots.values():
                per = self._reserved.get(slot.node)
                if per is not None and per.pop((key, slot.member), None) is not None:
                    self._rebuild(slot.node)
            self._schedule_expiry()

    def _pin(self, res: Reservation, member: str) -> None:
        slot = res.slots[member]
        slot.pinned = True
        per = self._reserved.get(slot.node)
        if per is not None and per.pop((res.key, member), None) is not None:
            self._rebuild(slot.node)
        if all(s.pinned for s in res.slots.values()):
            self.reservations.pop(res.key, None)  # every member bound: placements carry the GPUs now
        self._schedule_expiry()

    def pin(self, key: GroupKey, member: str) -> None:
        with self.lock:
            res = self.reservations.get(key)
            if res is not None and member in res.slots and not res.slots[member].pinned:
                self._pin(res, member)

    def _schedule_expiry(self) -> None:
        self._next_expiry = min(
            (
                r.created + self.reservation_timeout
                for r in self.reservations.values()
                if any(not s.pinned for s in r.slots.values())
            ),
            default=math.inf,
        )

    def expire(self, now: float) -> list[GroupKey]:
        """Release reservations whose unbound members did not bind within the timeout."""
        if now < self._next_expiry:
            return []
        with self.lock:
            gone = [
                k
                for k, r in self.reservations.items()
                if r.created + self.reservation_timeout <= now and any(not s.pinned for s in r.slots.values())
            ]
            for k in gone:
                log.info("group reservation expired; released", extra={"group": f"{k[0]}/{k[1]}"})
                self.release(k)
            self._schedule_expiry()
            return gone
