"""Lifting gputopo's scheduling gate (`gputopo.io/group-complete`, gputopo.model.gates) from gang members.

The webhook gates a group member at its creation (docs/annotations.md, "While a gang is gated"); this
loop, in the extender (the sidecar of the one leader kube-scheduler), lifts the gate of every member of a
group once the group is whole, with one JSON patch per pod (a `test` of the gate's name, then its
`remove`: a pod whose gates changed meanwhile is refused and read again). `GateLifter.sweep()` reads the
gated pods the ledger indexes (`PodTable.gated`), decides each with `gputopo.model.gates.lift`, and:

- tells each gated member once why it waits (a `GroupGated` Event, `kubectl describe pod`), once it has
  waited `tell_after_s`;
- lifts a whole group's gates together, the group's ranks in order, before any other lift;
- lifts at once a gate without a reason (no group, another holder, a group that cannot be placed) and,
  after `release_after_s`, a group that is still not whole, each with a `GroupGateLifted` Warning Event;
- writes at most `max_writes` patches a sweep (every `interval_s`), `WRITERS` at once: a flood of gated pods
  is lifted at that pace, never faster.

The time a pod is first seen gated is this process's: after a restart a gate may be held up to one more
`release_after_s`. Another scheduler's pod carries gputopo's gate only because its author wrote it (the
webhook gates only gputopo's): it is left alone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from gputopo.extender.state.ledger import Ledger
from gputopo.extender.state.records import PodRecord
from gputopo.extender.verbs.events import EventPoster
from gputopo.extender.watch.source import ClusterSource
from gputopo.kube import KubeError
from gputopo.model.gates import (
    GROUP_GATE,
    OTHER_HOLDERS,
    GatedMember,
    Lift,
    LiftReason,
    lift,
    remove_gate_patch,
    waiting_sentence,
)

log = logging.getLogger("gputopo.extender.verbs.groupgates")

GATED_REASON = "GroupGated"
LIFTED_REASON = "GroupGateLifted"
DEFAULT_RELEASE_AFTER_S = 900.0
DEFAULT_MAX_WRITES = 1000
# Patches in flight at once: a gang of 1,024 is lifted in about the time of 1,024 / 8 round trips.
WRITERS = 8
# A member is told why it waits once it has waited this long: a gang whose members all come within it costs
# no Event at all, only its lifts.
DEFAULT_TELL_AFTER_S = 5.0
# A lift written is not written again until the watch shows the pod (or this long has passed).
_RESEND_AFTER_S = 30.0


@dataclass(frozen=True)
class Gated:
    member: GatedMember
    gates: tuple[str, ...]
    stage: int


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
    return Gated(member, rec.gates, stage)


@dataclass(frozen=True, kw_only=True)
class SweepPace:
    """When and how fast the sweep lifts (module doc): a sweep every `interval_s`, at most `max_writes`
    patches each; a member told why it waits after `tell_after_s`; a group still not whole lifted after
    `release_after_s`."""

    release_after_s: float = DEFAULT_RELEASE_AFTER_S
    interval_s: float = 0.25
    max_writes: int = DEFAULT_MAX_WRITES
    tell_after_s: float = DEFAULT_TELL_AFTER_S


SWEEP_PACE = SweepPace()


class GateLifter:
    """The sweep over the gated pods; `run(stop)` sweeps every `pace.interval_s` until `stop` is set."""

    def __init__(
        self,
        ledger: Ledger,
        source: Callable[[], ClusterSource | None],
        events: EventPoster,
        *,
        pace: SweepPace = SWEEP_PACE,
        clock: Callable[[], float] = time.time,
        on_lift: Callable[[str], None] | None = None,
    ) -> None:
        self.ledger = ledger
        self.source = source
        self.events = events
        self.release_after_s = pace.release_after_s
        self.interval_s = pace.interval_s
        self.max_writes = pace.max_writes
        self.clock = clock
        self.since: dict[str, float] = {}  # uid -> when first seen gated
        self.told: set[str] = set()  # uids told why they wait
        self.written: dict[str, float] = {}  # uid -> when its lift was written
        self.on_lift = on_lift  # a lift written, by its reason (the metric)
        self.tell_after_s = pace.tell_after_s
        self._pool = ThreadPoolExecutor(max_workers=WRITERS, thread_name_prefix="gputopo-gate-lift")

    def gated(self) -> list[Gated]:
        now = self.clock()
        with self.ledger.lock:
            pods = self.ledger.pods
            # Another scheduler's pod carries the gate only because its author wrote it: theirs to lift.
            uids = sorted(u for u in pods.gated if pods[u].scheduler_name == self.ledger.scheduler_name)
            out = [gated_member(self.ledger, pods[u], self.since.setdefault(u, now)) for u in uids]
        for uid in set(self.since) - set(uids):  # lifted (by anyone) or gone
            self.since.pop(uid, None)
            self.told.discard(uid)
            self.written.pop(uid, None)
        return out

    def sweep(self) -> list[Lift]:
        """One pass: the lifts written (or tried) and the Events queued. Never raises for the API's sake."""
        source = self.source()
        if source is None:
            return []
        now = self.clock()
        lifts: list[tuple[Lift, Gated]] = []
        waiting: list[Gated] = []
        for g in self.gated():
            if now - self.written.get(g.member.uid, -_RESEND_AFTER_S) < _RESEND_AFTER_S:
                continue  # written; the watch has not shown it yet
            decided = lift(g.member, now, self.release_after_s)
            if decided is None:
                waiting.append(g)
            else:
                lifts.append((decided, g))
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
        for g in waiting:
            if g.member.uid not in self.told and now - g.member.since >= self.tell_after_s:
                self.told.add(g.member.uid)
                m = g.member
                self.events.pod_event(
                    m.namespace, m.name, m.uid, GATED_REASON, "Normal", waiting_sentence(m), "group-gated"
                )
        return done

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
