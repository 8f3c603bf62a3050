"""Lifting gputopo's scheduling gate (`gputopo.io/group-complete`, gputopo.model.gates) from gang members.

The webhook gates a group member at its creation (docs/annotations.md, "While a gang is gated"); this
loop, in the extender beside the leader kube-scheduler, lifts the gate of every member of a group once the
group is whole and planned, with one JSON patch per pod (a `test` of the gate's name, then its `remove`: a
pod whose gates changed meanwhile is refused and read again). `GateLifter.sweep()` reads the gated pods the
ledger indexes (`PodTable.gated`), decides each with `gputopo.model.gates.lift`, and:

- plans each whole group (`plan_with`: the group desk's plan over every node the ledger holds, kept as the
  group's reservation, so the members' filters then find their slots planned, at no second cost), at most
  `max_plans` groups a sweep, the longest waiting first (by when each was last planned or, never planned,
  when its oldest member was gated: neither new groups nor a group flipping whole and back jump the queue);
  a failed plan is the desk's to keep
  (`FailedPlans`), so a group no change could help costs nothing until the nodes change;
- lifts a planned group's gates together, the group's ranks in order, before any other lift;
- keeps the gates of a whole group no plan places now (its members would only be refused again in
  kube-scheduler's queue) and tells each member why, the plan's sentence (a `GroupGated` Event), until
  `release_after_s`, when they are lifted with a `GroupGateLifted` Warning;
- tells each gated member once why it waits (a `GroupGated` Event, `kubectl describe pod`), once it has
  waited `tell_after_s`;
- lifts at once a gate without a reason (no group, another holder, a group that cannot be placed as it
  is) and, after `release_after_s`, a group that is still not whole, each with a `GroupGateLifted` Warning;
- writes at most `max_writes` patches a sweep (every `interval_s`), `WRITERS` at once: a flood of gated pods
  is lifted at that pace, never faster.

The bound runs from the pod's creationTimestamp (the gate's own time, `gputopo.model.gates.gated_since`), so a
restart never lengthens a hold. Only while this replica's kube-scheduler leads (`leading`, the leader
Lease: gputopo.extender.state.leadership) does a sweep write or tell anything: a standby's writes would be
refused and its Events doubled. Another scheduler's pod carries gputopo's gate only because its author wrote
it (the webhook gates only gputopo's): it is left alone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from gputopo.engine.gang.plan import GroupFailure
from gputopo.engine.gang.replan import GroupWaiting
from gputopo.extender.state.ledger import Ledger
from gputopo.extender.state.records import PodRecord
from gputopo.extender.state.reservations import GroupKey
from gputopo.extender.verbs.events import EventPoster
from gputopo.extender.verbs.gangs import GroupDesk
from gputopo.extender.watch.source import ClusterSource
from gputopo.kube import KubeError
from gputopo.model.gates import (
    GROUP_GATE,
    OTHER_HOLDERS,
    GatedMember,
    Lift,
    LiftReason,
    gated_since,
    lift,
    remove_gate_patch,
    unplaced,
    unplaced_sentence,
    waiting_sentence,
)

log = logging.getLogger("gputopo.extender.verbs.groupgates")

GATED_REASON = "GroupGated"
LIFTED_REASON = "GroupGateLifted"
DEFAULT_RELEASE_AFTER_S = 900.0
DEFAULT_MAX_WRITES = 1000
# Whole groups planned a sweep: a plan over every node is the costliest thing a sweep does, and it shares the
# process (and its interpreter lock) with the filters. Four every 0.25 s: a tenant's flood of unplaceable
# gangs is planned in turn, each at most once a sweep, and a plan the nodes have not changed under is reused.
DEFAULT_MAX_PLANS = 4
# Patches in flight at once: a gang of 1,024 is lifted in about the time of 1,024 / 8 round trips.
WRITERS = 8
# A member is told why it waits once it has waited this long: a gang whose members all come within it costs
# no Event at all, only its lifts.
DEFAULT_TELL_AFTER_S = 5.0
# A lift written is not written again until the watch shows the pod (or this long has passed).
_RESEND_AFTER_S = 30.0

# A whole group's plan, asked with one member's record: None when it places every member (the group's
# reservation then holds their slots), else why not (the plan's sentence).
GroupPlanner = Callable[[PodRecord], str | None]


@dataclass(frozen=True)
class Gated:
    member: GatedMember
    gates: tuple[str, ...]
    stage: int
    rec: PodRecord


def gated_member(ledger: Ledger, rec: PodRecord, since: float) -> Gated:
    """What `lift` reads of one gated pod (call under the ledger's lock)."""
    key = ledger.pods.group_of(rec)
    req = rec.request
    size = req.group_size if req is not None else None
    held = next((g for g in rec.gates if g in OTHER_HOLDERS), "")
    if not held and (rec.pod_group or (req is not None and req.group_size_at_least)):
        held = f"the PodGroup {rec.pod_group or '?'} (kube-scheduler's gang)"
    waiting = rec.inferred is not None and bool(rec.inferred.waiting)
    problem = rec.problem if req is None and not waiting else ""
    member = GatedMember(
        uid=rec.uid,
        namespace=rec.namespace,
        name=rec.name,
        group=key[1] if key is not None else None,
        size=size,
        present=len(ledger.pods.tally(key).names) if key is not None else 0,
        since=since,
        held_by=held,
        exclusive=rec.inferred is not None and rec.inferred.exclusive is not None,
        problem=problem,
    )
    stage = req.stage if req is not None and req.stage is not None else 1 << 30
    return Gated(member, rec.gates, stage, rec)


def plan_with(desk: GroupDesk) -> GroupPlanner:
    """The group desk's plan of a member's whole group over every node the ledger holds (kube-scheduler's
    candidates are not known before a member reaches its queue), reserved as a member's filter reserves it.
    The reservation it makes is `unchecked`: the first member's filter, which names the nodes kube-scheduler's
    own filters pass, plans the group again over those if its slot is not among them."""

    def plan(rec: PodRecord) -> str | None:
        req = rec.request
        if req is None or not req.is_group:
            return rec.problem or "no group request"
        info = rec.info_again()  # as re-inference rebuilds a pod
        ledger, key = desk.ledger, (rec.namespace, req.group or "")
        with ledger.lock:
            names = list(ledger.nodes)
        before = ledger.reservations.get(key)
        was_unchecked = before is not None and before.unchecked  # this call's own look must not count as a filter's
        out = desk.slot_for(info, req, names)
        if isinstance(out, GroupFailure | GroupWaiting):
            return out.message
        res = ledger.reservations.get(key)
        if res is not None and (res is not before or was_unchecked):  # the first member's filter checks its node
            res.unchecked = True
        return None

    return plan


@dataclass(frozen=True, kw_only=True)
class SweepPace:
    """When and how fast the sweep lifts (module doc): a sweep every `interval_s`, at most `max_writes`
    patches and `max_plans` group plans each; a member told why it waits after `tell_after_s`; a group
    still not whole, or not placed, lifted after `release_after_s`."""

    release_after_s: float = DEFAULT_RELEASE_AFTER_S
    interval_s: float = 0.25
    max_writes: int = DEFAULT_MAX_WRITES
    tell_after_s: float = DEFAULT_TELL_AFTER_S
    max_plans: int = DEFAULT_MAX_PLANS


SWEEP_PACE = SweepPace()


def _leads_alone() -> bool:
    return True


@dataclass(frozen=True, kw_only=True)
class LiftChecks:
    """What a lift asks of the rest of the extender: a whole group's plan (None: lifted unplanned) and whether
    this replica's kube-scheduler leads (without leader election, it does)."""

    plan: GroupPlanner | None = None
    leading: Callable[[], bool] = _leads_alone


class GateLifter:
    """The sweep over the gated pods; `run(stop)` sweeps every `pace.interval_s` until `stop` is set.

    `checks.plan`: a whole group's plan (`plan_with`; None: a whole group is lifted unplanned);
    `checks.leading`: whether this replica's kube-scheduler leads (gputopo.extender.state.leadership; a
    standby sweeps nothing)."""

    def __init__(
        self,
        ledger: Ledger,
        source: Callable[[], ClusterSource | None],
        events: EventPoster,
        *,
        pace: SweepPace = SWEEP_PACE,
        clock: Callable[[], float] = time.time,
        on_lift: Callable[[str], None] | None = None,
        checks: LiftChecks = LiftChecks(),
    ) -> None:
        self.ledger = ledger
        self.source = source
        self.events = events
        self.release_after_s = pace.release_after_s
        self.interval_s = pace.interval_s
        self.max_writes = pace.max_writes
        self.clock = clock
        self.since: dict[str, float] = {}  # uid -> when first seen gated
        self._read: dict[str, tuple[PodRecord, int, Gated]] = {}  # uid -> (record, its group's version, reading)
        self.told: dict[str, set[str]] = {}  # uid -> what it was told: "waiting" for members, "unplaced"
        self.written: dict[str, float] = {}  # uid -> when its lift was written
        self.on_lift = on_lift  # a lift written, by its reason (the metric)
        self.tell_after_s = pace.tell_after_s
        self.plan = checks.plan
        self.max_plans = pace.max_plans
        self.plans = 0  # plans asked for, all sweeps together (tests read it)
        self.planned: dict[GroupKey, float] = {}  # whole groups still gated -> when last planned
        self.leading = checks.leading
        self._pool = ThreadPoolExecutor(max_workers=WRITERS, thread_name_prefix="gputopo-gate-lift")

    def gated(self) -> list[Gated]:
        """The gated pods of this scheduler, in UID order. A pod whose record and group's members are as the
        last sweep read them keeps that reading: a flood of gated pods costs the lock (which the filters
        wait on) a look-up each, and a full read only for what changed."""
        now = self.clock()
        found: dict[str, Gated] = {}
        with self.ledger.lock:
            pods = self.ledger.pods
            for u in pods.gated:
                rec = pods[u]
                if rec.scheduler_name != self.ledger.scheduler_name:
                    continue  # another scheduler's pod carries the gate only because its author wrote it
                key = pods.group_of(rec)
                version = pods.tally(key).version if key is not None else 0
                kept = self._read.get(u)
                # The same record object between relists; after a relist an equal one (compared, not read again).
                if kept is None or kept[1] != version or (kept[0] is not rec and kept[0] != rec):
                    since = gated_since(rec.created, self.since.setdefault(u, now))
                    kept = self._read[u] = (rec, version, gated_member(self.ledger, rec, since))
                found[u] = kept[2]
        for uid in set(self._read) - set(found):  # lifted (by anyone) or gone
            for kept_by_uid in (self.since, self.told, self.written, self._read):
                kept_by_uid.pop(uid, None)
        return [found[u] for u in sorted(found)]

    def sweep(self) -> list[Lift]:
        """One pass: the lifts written (or tried) and the Events queued. Never raises for the API's sake."""
        source = self.source()
        if source is None or not self.leading():
            return []
        now = self.clock()
        lifts: list[tuple[Lift, Gated]] = []
        waiting: list[tuple[Gated, str]] = []  # (member, what it is told: "" while its group is not whole)
        whole: dict[GroupKey, list[tuple[Lift, Gated]]] = {}
        gated = self.gated()
        # A group's turn to plan is kept while any member is gated, not only while it is whole: a group that
        # leaves and comes back whole (a tenant flipping its size each sweep) never jumps the queue.
        groups = {(g.member.namespace, g.member.group) for g in gated}
        for key in set(self.planned) - groups:
            del self.planned[key]
        for g in gated:
            if now - self.written.get(g.member.uid, -_RESEND_AFTER_S) < _RESEND_AFTER_S:
                continue  # written; the watch has not shown it yet
            decided = lift(g.member, now, self.release_after_s)
            if decided is None:
                waiting.append((g, ""))
            elif decided.reason is LiftReason.COMPLETE and self.plan is not None:
                whole.setdefault((g.member.namespace, g.member.group or ""), []).append((decided, g))
            else:
                lifts.append((decided, g))
        self._plan_whole(whole, now, lifts, waiting)
        # A whole group first, in rank order: its members enter kube-scheduler's queue together.
        lifts.sort(
            key=lambda x: (
                x[0].reason is not LiftReason.COMPLETE,
                x[1].member.namespace,
                x[0].member.group or "",
                x[1].stage,
            )
        )
        batch = lifts[: self.max_writes]
        wrote = self._pool.map(lambda x: self._write(source, x[0], x[1].gates), batch)  # submitted in order
        done = [decided for (decided, _), ok in zip(batch, wrote, strict=True) if ok]
        for g, failure in waiting:
            self._tell(g.member, failure, now)
        return done

    def _plan_whole(
        self,
        whole: dict[GroupKey, list[tuple[Lift, Gated]]],
        now: float,
        lifts: list[tuple[Lift, Gated]],
        waiting: list[tuple[Gated, str]],
    ) -> None:
        """Plan the whole groups, the longest waiting first, at most `max_plans`: a planned group's lifts go
        to `lifts`; an unplaced one's members wait, told why, until the bound; one not planned this sweep
        waits (past the bound it is released unplanned: its members' filters plan)."""

        def turn(key: GroupKey) -> tuple[float, bool, GroupKey]:
            # Never planned: when its oldest member was gated, so that new groups (a tenant's flood of them
            # each sweep) queue behind every group that has waited longer, planned or not (and at one time,
            # a group never planned goes first).
            planned = self.planned.get(key)
            if planned is None:
                return min(g.member.since for _, g in whole[key]), False, key
            return planned, True, key

        order = sorted(whole, key=turn)
        for i, key in enumerate(order):
            members = sorted(whole[key], key=lambda x: x[1].stage)
            if i < self.max_plans:
                self.plans += 1
                self.planned[key] = now
                failure = self._planned(members[0][1].rec)
            else:
                failure = "not planned yet: other groups were planned first"
            if failure is None:
                lifts.extend(members)
                continue
            for _, g in members:
                released = unplaced(g.member, failure, now, self.release_after_s)
                if released is not None:
                    lifts.append((released, g))
                elif i < self.max_plans:
                    waiting.append((g, failure))

    def _planned(self, rec: PodRecord) -> str | None:
        assert self.plan is not None
        try:
            return self.plan(rec)
        except Exception:  # a bug in one group's plan must not stop every other group's lift
            log.exception("could not plan a gated group", extra={"pod": rec.ref, "group": rec.group})
            return "the extender could not plan it (see its log)"

    def _tell(self, m: GatedMember, failure: str, now: float) -> None:
        """Tell `m` once why it waits (members missing, or `failure`: why its whole group is not placed)."""
        what = "unplaced" if failure else "waiting"
        told = self.told.setdefault(m.uid, set())
        if what in told or now - m.since < self.tell_after_s:
            return
        told.add(what)
        text = unplaced_sentence(m, failure) if failure else waiting_sentence(m)
        self.events.pod_event(m.namespace, m.name, m.uid, GATED_REASON, "Normal", text, "group-gated")

    def _write(self, source: ClusterSource, decided: Lift, gates: tuple[str, ...]) -> bool:
        m = decided.member
        try:
            source.patch_pod(m.namespace, m.name, remove_gate_patch(gates))
        except KubeError as e:
            if e.status in (404, 409, 422):  # gone, or its gates changed: the watch brings the pod again
                log.debug("gate not lifted", extra={"pod": m.ref, "error": str(e)})
            else:
                log.warning("could not lift the gate", extra={"pod": m.ref, "gate": GROUP_GATE, "error": str(e)})
            return False
        self.written[m.uid] = self.clock()
        if self.on_lift is not None:
            self.on_lift(str(decided.reason))
        if decided.message:
            self.events.pod_event(
                m.namespace,
                m.name,
                m.uid,
                LIFTED_REASON,
                "Warning" if decided.reason is LiftReason.TIMEOUT else "Normal",
                decided.message,
                "group-gate-lifted",
            )
        log.info("gate lifted", extra={"pod": m.ref, "group": m.group, "reason": str(decided.reason)})
        return True

    def run(self, stop: threading.Event) -> None:
        try:
            while not stop.wait(self.interval_s):
                try:
                    self.sweep()
                except Exception:  # the loop outlives a bug in one sweep; the next one reads afresh
                    log.exception("gate sweep failed")
        finally:
            self.close()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
