"""The extender's decisions: filter, prioritize, bind and preempt over the cache, with the engine.

Everything here is synchronous and free of HTTP; the routers translate. Filter and prioritize read
only the cache (no I/O). Bind does I/O: a fresh read of the pods on the node, the placement
annotation, the Binding, the Event (docs/extender.md describes the double-booking story).
"""

from __future__ import annotations

import collections
import logging
import socket
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime

from extender.cache import ClusterCache, GroupKey, PodRecord, Reservation, Slot
from extender.kube import JSON, ApiError, ClusterSource
from extender.metrics import Metrics
from extender.wire import ExtenderPreemptionArgs, MetaVictims, PodInfo, pod_info
from gputopo.engine.explain import placement_sentence, why_lost
from gputopo.engine.groups import GroupFailure, Member, group_waiting_message, plan_group
from gputopo.engine.placement import NodeVerdict, Outcome, evaluate_node, fail_invalid
from gputopo.engine.reasons import Code, Reason, code_for, message
from gputopo.engine.scoring import to_extender_priority
from gputopo.engine.snapshot import NodeState, node_state
from gputopo.model import (
    PLACEMENT_ANNOTATION,
    AnnotationError,
    Placement,
    PodRequest,
    RunnerUp,
    is_gputopo_pod,
    parse_pod_request,
)

log = logging.getLogger("gputopo.extender")

COMPONENT = "gputopo-extender"
EVENT_REASON = "TopologyPlacement"
NODE_LABEL = "gputopo.io/placement-node"  # lets a bind find every pod annotated for a node in one query
NEUTRAL_SCORE = 5
MAX_LABEL_VALUE = 63


@dataclass
class Decision:
    """Per-node outcomes for one pod, plus the kind of decision (a bounded metrics label)."""

    kind: str  # pass_through | invalid | evaluated | group_waiting | group_failed | group_planned
    names: Sequence[str] = ()
    outcomes: list[Outcome] = field(default_factory=list)  # parallel to names
    priorities: list[int] | None = None  # overrides the outcome scores (group plans)
    request: PodRequest | None = None

    def reason_label(self) -> str:
        """The dominant failure reason when nothing fits ('' when something does)."""
        counts: collections.Counter[str] = collections.Counter()
        for o in self.outcomes:
            if o.code is Code.SUCCESS:
                return ""
            counts[o.reason.value if o.reason else "unknown"] += 1
        return counts.most_common(1)[0][0] if counts else ""


@dataclass(frozen=True)
class FilterAnswer:
    passed: list[str]
    failed: dict[str, str]
    unresolvable: dict[str, str]
    decision: Decision


def _outcome(reason: Reason, text: str = "") -> Outcome:
    return Outcome(code=code_for(reason), reason=reason, message=text or message(reason), detail=text)


_STUB = node_state("-", None)


class Extender:
    """One extender instance: a cache, optionally an API source (None in snapshot mode), metrics."""

    RECENT_PODS = 4096
    REUSE_SECONDS = 2.0  # a filter's outcomes answer the prioritize that follows within this window

    def __init__(self, cache: ClusterCache, source: ClusterSource | None, metrics: Metrics | None = None) -> None:
        self.cache = cache
        self.source = source
        self.metrics = metrics
        self._recent: collections.OrderedDict[str, PodInfo] = collections.OrderedDict()
        self._recent_lock = threading.Lock()
        self._node_locks: dict[str, threading.Lock] = collections.defaultdict(threading.Lock)
        self._group_locks: dict[GroupKey, threading.Lock] = collections.defaultdict(threading.Lock)
        self._locks_lock = threading.Lock()
        self.instance = socket.gethostname()
        self._last_outcomes: tuple[tuple[object, ...], float, list[str], list[Outcome]] | None = None
        # Events explain a bind that already happened: posted off the bind's critical path.
        self._events = ThreadPoolExecutor(max_workers=2, thread_name_prefix="gputopo-events")

    def flush_events(self, timeout: float = 10.0) -> None:
        """Wait until the events queued so far are posted (tests, shutdown)."""
        self._events.submit(lambda: None).result(timeout=timeout)

    # ------------------------------------------------------------------ decisions

    def _remember(self, info: PodInfo) -> None:
        with self._recent_lock:
            for key in (info.uid, info.ref):
                if key:
                    self._recent[key] = info
                    self._recent.move_to_end(key)
            while len(self._recent) > self.RECENT_PODS:
                self._recent.popitem(last=False)

    def decide(self, info: PodInfo, names: Sequence[str]) -> Decision:
        if not is_gputopo_pod(info.annotations):
            return Decision("pass_through")
        try:
            req = parse_pod_request(info.annotations, info.gpus, self.cache.tier_names)
        except AnnotationError as e:
            bad = fail_invalid([_STUB], str(e))[0].outcome
            return Decision("invalid", names, [bad] * len(names))
        self._remember(info)
        if req.is_group:
            return self._group_decision(info, req, names)
        # kube-scheduler calls prioritize right after filter for the same pod, with the nodes that
        # passed: answer it from the filter's outcomes while nothing in the cache has changed.
        key = (info.uid or info.ref, req, self.cache.generation)
        last = self._last_outcomes
        now = self.cache.clock()
        if last is not None and last[0] == key and 0 <= now - last[1] < self.REUSE_SECONDS:
            last_names, last_outcomes = last[2], last[3]
            if names == last_names:  # the same list: compared in C, no per-node Python work
                return Decision("evaluated", names, last_outcomes, request=req)
            by_name = dict(zip(last_names, last_outcomes, strict=True))
            try:
                return Decision("evaluated", names, [by_name[n] for n in names], request=req)
            except KeyError:
                pass  # a node the filter did not see: evaluate afresh
        outcomes = self.cache.evaluate(names, req, pod_uid=info.uid)
        self._last_outcomes = (key, now, list(names), outcomes)
        return Decision("evaluated", names, outcomes, request=req)

    def filter(self, info: PodInfo, names: Sequence[str]) -> FilterAnswer:
        d = self.decide(info, names)
        if d.kind == "pass_through":
            return FilterAnswer(list(names), {}, {}, d)
        passed: list[str] = []
        failed: dict[str, str] = {}
        unresolvable: dict[str, str] = {}
        success, unresolvable_code = Code.SUCCESS, Code.UNRESOLVABLE
        for name, o in zip(d.names, d.outcomes, strict=True):
            code = o.code
            if code is success:
                passed.append(name)
            elif code is unresolvable_code:
                unresolvable[name] = o.message
            else:
                failed[name] = o.message
        return FilterAnswer(passed, failed, unresolvable, d)

    def prioritize(self, info: PodInfo, names: Sequence[str]) -> tuple[list[tuple[str, int]], Decision]:
        d = self.decide(info, names)
        if d.kind == "pass_through":
            return [(n, NEUTRAL_SCORE) for n in names], d
        if d.priorities is not None:
            return list(zip(names, d.priorities, strict=True)), d
        # Outcomes are shared between equivalent nodes: quantise each distinct one once, then map
        # node by node with C-level iteration (thousands of nodes per call).
        success = Code.SUCCESS
        distinct = {id(o): o for o in d.outcomes}
        prio = {k: (to_extender_priority(o.score) if o.code is success else 0) for k, o in distinct.items()}
        return list(zip(d.names, map(prio.__getitem__, map(id, d.outcomes)), strict=True)), d

    # ------------------------------------------------------------------ groups

    def _group_lock(self, key: GroupKey) -> threading.Lock:
        with self._locks_lock:
            return self._group_locks[key]

    def _node_lock(self, node: str) -> threading.Lock:
        with self._locks_lock:
            return self._node_locks[node]

    def _group_decision(self, info: PodInfo, req: PodRequest, names: Sequence[str]) -> Decision:
        assert req.group is not None and req.group_size is not None
        key = (info.namespace, req.group)
        members: dict[str, PodRecord | None] = {r.name: r for r in self.cache.group_members(key)}
        members[info.name] = members.get(info.name)
        size = req.group_size
        if len(members) < size:
            text = group_waiting_message(req.group, len(members), size)
            o = _outcome(Reason.GROUP_WAITING, text)
            return Decision("group_waiting", names, [o] * len(names), request=req)
        if len(members) > size:
            text = f"group {req.group}: {len(members)}/{size} pods exist, more than gputopo.io/group-size"
            o = _outcome(Reason.GROUP_NO_PLAN, text)
            return Decision("group_failed", names, [o] * len(names), request=req)
        with self._group_lock(key):
            res = self.cache.reservations.get(key)
            if res is not None and res.members != frozenset(members):
                self.cache.release(key)  # the group changed (a member replaced): plan again
                res = None
            if res is not None:
                slot = res.slots.get(info.name)
                if slot is None or (not slot.pinned and self.cache.resolve(slot.node, self.cache.clock())[0].problem):
                    self.cache.release(key)  # the planned node went stale or away
                    res = None
            if res is None:
                planned = self._plan(key, info, req, members, names)
                if isinstance(planned, GroupFailure):
                    o = _outcome(Reason.GROUP_NO_PLAN, planned.message)
                    return Decision("group_failed", names, [o] * len(names), request=req)
                res = planned
            slot = res.slots[info.name]
        here = (
            slot.assignment.outcome
            if slot.assignment is not None
            else Outcome(code=Code.SUCCESS, gpus=tuple(sorted(slot.gpus)), score=1.0)
        )
        elsewhere = _outcome(Reason.GROUP_PLANNED_ELSEWHERE)
        outcomes = [here if n == slot.node else elsewhere for n in names]
        priorities = [10 if n == slot.node else 0 for n in names]
        return Decision("group_planned", names, outcomes, priorities, request=req)

    def _plan(
        self,
        key: GroupKey,
        info: PodInfo,
        req: PodRequest,
        members: dict[str, PodRecord | None],
        names: Sequence[str],
    ) -> Reservation | GroupFailure:
        """Plan the members not bound yet; bound (or annotated) members keep their nodes."""
        group = key[1]
        pinned: dict[str, PodRecord] = {}
        todo: list[Member] = []
        for name, rec in sorted(members.items()):
            if name != info.name and rec is not None and (rec.placed_node or rec.node_name):
                pinned[name] = rec
                continue
            r = req if name == info.name else (rec.request if rec is not None else None)
            if r is None:
                return GroupFailure(group, f"group {group}: member {name} has an invalid gputopo annotation")
            todo.append(Member(name, r))
        now = self.cache.clock()
        with self.cache.lock:
            self.cache.expire(now)
            taken = {rec.placed_node or rec.node_name for rec in pinned.values()}
            own = self.cache.pods.get(info.uid)
            own_node = own.placed_node if own is not None and not own.node_name else None
            states: list[NodeState] = []
            for n in names:
                if n in taken and req.spread.value == "node":
                    continue
                states.append(
                    self.cache.node_for(n, without_pod=info.uid) if n == own_node else self.cache.resolve(n, now)[0]
                )
        if pinned:
            # Stage numbers of a partial plan refer to the whole group; plan_group numbers its subset.
            todo = [Member(m.name, m.request.model_copy(update={"stage": None})) for m in todo]
        slots: dict[str, Slot] = {}
        plan = None
        if todo:
            result = plan_group(group, todo, states, self.cache.tiers, self.cache.weights)
            if isinstance(result, GroupFailure):
                return result
            plan = result
            for a in result.assignments:
                original = req if a.member == info.name else members[a.member]
                stage = a.stage
                if pinned:
                    stage_req = (
                        original if isinstance(original, PodRequest) else (original.request if original else None)
                    )
                    stage = stage_req.stage if stage_req is not None and stage_req.stage is not None else a.stage
                slots[a.member] = Slot(a.member, a.node.name, frozenset(a.outcome.gpus), stage, False, a)
        for name, rec in pinned.items():
            p = rec.placement
            node = rec.placed_node or rec.node_name
            slots[name] = Slot(name, node, frozenset(p.gpus) if p else frozenset(), p.stage if p else None, True)
        res = Reservation(key, now, slots, plan)
        self.cache.reserve(res)
        log.info(
            "group planned and reserved",
            extra={
                "group": f"{key[0]}/{key[1]}",
                "plan": {s.member: s.node for s in slots.values()},
                "pinned": sorted(pinned),
            },
        )
        return res

    # ------------------------------------------------------------------ bind

    def bind(self, namespace: str, name: str, uid: str, node: str) -> str:
        """Bind the pod; returns '' on success or the error text for the Error field."""
        with self._node_lock(node):  # one bind per node at a time in this process
            if self.source is None:
                return self._bind_snapshot(namespace, name, uid, node)
            return self._bind_api(self.source, namespace, name, uid, node)

    def _bind_snapshot(self, namespace: str, name: str, uid: str, node: str) -> str:
        info = self._recall(uid, f"{namespace}/{name}")
        if info is None or not is_gputopo_pod(info.annotations):
            return ""  # snapshot mode has no API to bind through; nothing to account for
        existing = self.cache.pods.get(info.uid or info.ref)
        if existing is not None and existing.node_name == node:
            return ""
        chosen = self._placement_for(info, node)
        if isinstance(chosen, str):
            return chosen
        placement, req = chosen
        obj: JSON = {
            "metadata": {
                "name": name,
                "namespace": namespace,
                "uid": info.uid or info.ref,
                "annotations": {**info.annotations, PLACEMENT_ANNOTATION: placement.to_annotation()},
            },
            "spec": {"nodeName": node, "containers": [{"resources": {"limits": {"nvidia.com/gpu": str(info.gpus)}}}]},
            "status": {"phase": "Pending"},
        }
        self.cache.upsert_pod(obj)
        if req.group:
            self.cache.pin((namespace, req.group), name)
        log.info(
            "bound (snapshot mode: recorded in memory only)",
            extra={"pod": info.ref, "node": node, "gpus": list(placement.gpus), "score": placement.score},
        )
        return ""

    def _choose(self, info: PodInfo, req: PodRequest, node: str) -> tuple[Placement | str, Outcome | None]:
        """Re-evaluate the pod on `node` against the cache now; the Placement to write, or an error."""
        slot_key: tuple[GroupKey, str] | None = None
        res: Reservation | None = None
        if req.group:
            gk = (info.namespace, req.group)
            res = self.cache.reservations.get(gk)
            slot_key = (gk, info.name)
        state = self.cache.node_for(node, without_pod=info.uid, without_slot=slot_key)
        outcome = evaluate_node(state, req, self.cache.weights)
        if not outcome.fits:
            return f"node {node} no longer fits pod {info.ref}: {outcome.message}", outcome
        score = to_extender_priority(outcome.score)
        runner = self._runner_up(node, req, info.uid)
        plan = res.plan if res is not None else None
        sentence = placement_sentence(node, outcome, runner, plan, info.name, self.cache.weights)
        stage = None
        if res is not None and info.name in res.slots:
            stage = res.slots[info.name].stage
        elif req.stage is not None:
            stage = req.stage
        placement = Placement(
            node=node,
            gpus=tuple(outcome.gpus),
            score=score,
            reason=sentence,
            runner_up=RunnerUp(
                node=runner.name,
                score=to_extender_priority(runner.outcome.score),
                why=why_lost(outcome, runner.outcome, self.cache.weights),
            )
            if runner is not None
            else None,
            group=req.group,
            stage=stage,
        )
        return placement, outcome

    def _runner_up(self, node: str, req: PodRequest, pod_uid: str) -> NodeVerdict | None:
        """The best other feasible node: `runner_up(node, rank(...))` over every cached node, in one pass
        (no verdict list, no sort of the whole cluster on every bind)."""
        best: NodeVerdict | None = None
        best_key: tuple[float, str] | None = None
        success = Code.SUCCESS
        for st, o in self.cache.evaluate_states(list(self.cache.nodes), req, pod_uid=pod_uid):
            if o.code is not success or st.name == node:
                continue
            key = (-o.score, st.name)
            if best_key is None or key < best_key:
                best, best_key = NodeVerdict(st, o), key
        return best

    def _conflict(self, source: ClusterSource, node: str, uid: str, gpus: frozenset[int]) -> str | None:
        """After writing our placement: another live pod claiming any of the same GPUs on the node?"""
        if len(node) > MAX_LABEL_VALUE:
            return None
        for obj in source.list_pods(label_selector=f"{NODE_LABEL}={node}"):
            rec = self.cache.upsert_pod(obj)
            if rec is None or rec.uid == uid or not rec.active or rec.placed_node != node or rec.placement is None:
                continue
            if gpus & frozenset(rec.placement.gpus):
                return rec.ref
        return None

    def _revert(self, source: ClusterSource, namespace: str, name: str) -> None:
        try:
            obj = source.patch_pod_metadata(
                namespace, name, annotations={PLACEMENT_ANNOTATION: None}, labels={NODE_LABEL: None}
            )
            self.cache.upsert_pod(obj)
        except ApiError as e:
            log.warning("could not remove placement annotation", extra={"pod": f"{namespace}/{name}", "error": str(e)})

    def _placement_for(self, info: PodInfo, node: str) -> tuple[Placement, PodRequest] | str:
        """The placement this pod gets on `node` now, or why it cannot have one."""
        try:
            req = parse_pod_request(info.annotations, info.gpus, self.cache.tier_names)
        except AnnotationError as e:
            return str(e)
        placement, _ = self._choose(info, req, node)
        return placement if isinstance(placement, str) else (placement, req)

    def _recall(self, uid: str, ref: str) -> PodInfo | None:
        """The pod as its filter call carried it moments ago (saves a GET per bind)."""
        with self._recent_lock:
            info = self._recent.get(uid) if uid else self._recent.get(ref)
        return info if info is not None and (not uid or info.uid == uid) else None

    def _bind_api(self, source: ClusterSource, namespace: str, name: str, uid: str, node: str) -> str:
        ref = f"{namespace}/{name}"
        info = self._recall(uid, ref)
        if info is None:
            try:
                pod = source.get_pod(namespace, name)
            except ApiError as e:
                return f"cannot read pod {ref}: {e}"
            info = pod_info(pod)
            if uid and info.uid and info.uid != uid:
                return f"pod {ref} has uid {info.uid}, the scheduler asked to bind uid {uid}"
            if info.node_name == node:
                self.cache.upsert_pod(pod)
                return ""  # already bound there: a retried bind succeeds
            if info.node_name:
                return f"pod {ref} is already bound to node {info.node_name}"
        # (a recalled pod that was bound meanwhile is caught by the Binding's 409 below)
        if not is_gputopo_pod(info.annotations):
            return self._post_binding(source, info, node)
        # Choose from the cache (it holds this process's claims at once); another replica's fresh
        # claim is caught by the conflict check after ours is written.
        chosen = self._placement_for(info, node)
        if isinstance(chosen, str):
            return chosen
        placement, req = chosen
        labels: dict[str, str | None] = {NODE_LABEL: node if len(node) <= MAX_LABEL_VALUE else None}
        try:
            patched = source.patch_pod_metadata(
                namespace, name, annotations={PLACEMENT_ANNOTATION: placement.to_annotation()}, labels=labels
            )
        except ApiError as e:
            return f"cannot write {PLACEMENT_ANNOTATION} on pod {ref}: {e}"
        self.cache.upsert_pod(patched)
        try:
            other = self._conflict(source, node, info.uid, frozenset(placement.gpus))
        except ApiError as e:
            other, verify_error = None, str(e)
            log.warning("could not verify the placement", extra={"pod": ref, "node": node, "error": verify_error})
        if other is not None:
            self._revert(source, namespace, name)
            return f"GPUs {list(placement.gpus)} on node {node} were just claimed by pod {other}; retry"
        err = self._post_binding(source, info, node)
        if err:
            self._revert(source, namespace, name)
            return err
        if req.group:
            self.cache.pin((namespace, req.group), name)
        self._events.submit(self._event, source, info, placement.reason)
        log.info(
            "bound",
            extra={
                "pod": ref,
                "node": node,
                "gpus": list(placement.gpus),
                "score": placement.score,
                "reason": placement.reason,
            },
        )
        return ""

    def _post_binding(self, source: ClusterSource, info: PodInfo, node: str) -> str:
        try:
            source.create_binding(info.namespace, info.name, info.uid, node)
        except ApiError as e:
            if e.status == 409:
                try:
                    if pod_info(source.get_pod(info.namespace, info.name)).node_name == node:
                        return ""  # someone (a retry of ours) already bound it there
                except ApiError:
                    pass
            return f"binding pod {info.ref} to node {node} failed: {e}"
        return ""

    def _event(self, source: ClusterSource, info: PodInfo, sentence: str) -> None:
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        event: JSON = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{info.name}.", "namespace": info.namespace},
            "involvedObject": {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": info.name,
                "namespace": info.namespace,
                "uid": info.uid,
            },
            "reason": EVENT_REASON,
            "message": sentence[:1024],
            "type": "Normal",
            "source": {"component": COMPONENT},
            "reportingComponent": COMPONENT,
            "reportingInstance": self.instance,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            source.create_event(info.namespace, event)
        except ApiError as e:  # the bind succeeded; a lost event is only logged
            log.warning("could not create the TopologyPlacement event", extra={"pod": info.ref, "error": str(e)})

    # ------------------------------------------------------------------ preempt

    def preempt(self, args: ExtenderPreemptionArgs) -> dict[str, MetaVictims]:
        """Keep a candidate node only if the pod could fit there once its victims are gone.

        Victims whose GPUs the cache knows (pods with a placement on that node) are subtracted from
        the node's in-use set. If some victim's GPUs are unknown (a plain pod), the node is kept
        unless the pod cannot fit even on an empty node (that verdict needs no knowledge of victims).
        Group members and plain pods get the candidates back unchanged."""
        candidates = args.meta_victims()
        info = pod_info(args.pod)
        if not is_gputopo_pod(info.annotations):
            return candidates
        try:
            req = parse_pod_request(info.annotations, info.gpus, self.cache.tier_names)
        except AnnotationError:
            return {}
        if req.is_group:
            return candidates
        out: dict[str, MetaVictims] = {}
        now = self.cache.clock()
        with self.cache.lock:
            for node, victims in candidates.items():
                state, _ = self.cache.resolve(node, now)
                if state.problem is not None:
                    continue  # stale or missing topology: no victim helps
                freed: set[int] = set()
                unknown = False
                for v in victims.pods:
                    rec = self.cache.pods.get(v.uid)
                    if rec is not None and rec.placed_node == node and rec.placement is not None:
                        freed |= set(rec.placement.gpus)
                    else:
                        unknown = True
                e = self.cache.nodes[node]
                in_use = self.cache.node_for(node, without_pod=info.uid).in_use - freed
                after = node_state(
                    node,
                    e.topology,
                    labels=e.labels,
                    in_use=in_use if not unknown else frozenset(),
                    tiers=self.cache.tiers,
                )
                if evaluate_node(after, req, self.cache.weights).fits:
                    out[node] = victims
        return out
