"""gputopo's scheduling gate for gang members (docs/annotations.md, "While a gang is gated"): the two
decisions, pure (no I/O).

A member of a group whose pods arrive one by one (a JobSet's, an Indexed Job's, through their controllers)
would enter kube-scheduler's queue at once and be tried, and refused as "group incomplete", again and
again until the last member exists. With `spec.schedulingGates: [{name: gputopo.io/group-complete}]` the
pod waits outside the queue instead (Kubernetes' scheduling gates, GA since 1.30), and gputopo's extender
lifts the gate of every member once the group is whole.

- `admission_gate` decides, at the pod's creation (the webhook), whether the pod gets the gate: only a
  member of a group (by annotation or by a known controller's identity labels) under gputopo's scheduler,
  and never one another holder keeps back already (Kueue's gates, a native PodGroup's gang, or a JobSet
  with exclusive placement, whose followers JobSet creates only once their leader is scheduled: gating
  the leader would wait for members that cannot come).
- `lift` decides, for each gated pod the extender sees, whether its gate goes now and why. The gate goes
  when the group is whole (and, the extender's part, planned: `unplaced` keeps a whole group that no plan
  places now), at once when it has no reason (no group, another holder, a group that cannot be placed as
  it is), and after `release_after_s` in any case: a gate never outlives its reason, and a group that never
  completes, or is never placed, is told so on each member and then left to the scheduler.
- `gated_since` is when a gate was added: the pod's creation (the webhook gates at admission), so that an
  extender's restart never lengthens a hold.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final

GROUP_GATE: Final = "gputopo.io/group-complete"
KUEUE_ADMISSION_GATE: Final = "kueue.x-k8s.io/admission"
KUEUE_TOPOLOGY_GATE: Final = "kueue.x-k8s.io/topology"
# Gates of holders that already keep a pod back until its group is admitted or placed: gputopo adds none.
OTHER_HOLDERS: Final = frozenset({KUEUE_ADMISSION_GATE, KUEUE_TOPOLOGY_GATE})
# The API server caps a pod's gates only by the pod's size; they are read this far, and a pod with more gets
# no gate of gputopo's (its own might sit past the bound, and a name twice is refused).
MAX_GATES_READ: Final = 256

__all__ = [
    "GROUP_GATE",
    "KUEUE_ADMISSION_GATE",
    "KUEUE_TOPOLOGY_GATE",
    "MAX_GATES_READ",
    "OTHER_HOLDERS",
    "GatedMember",
    "Lift",
    "LiftReason",
    "admission_gate",
    "gate_names",
    "gate_patch",
    "gated_since",
    "lift",
    "remove_gate_patch",
    "unplaced",
    "unplaced_sentence",
    "waiting_sentence",
]


def gate_names(spec: Any) -> tuple[str, ...]:
    """The names of `spec.schedulingGates`, as far as they can be read (at most `MAX_GATES_READ`; a gate
    that is not an object with a string name is skipped: the API server validates them, a forged review
    may not)."""
    gates = spec.get("schedulingGates") if isinstance(spec, Mapping) else None
    if not isinstance(gates, list):
        return ()
    names = (g.get("name") for g in gates[:MAX_GATES_READ] if isinstance(g, Mapping))
    return tuple(n for n in names if isinstance(n, str))


def admission_gate(
    *,
    scheduler: str,
    ours: str,
    group: str | None,
    gates: Sequence[str],
    pod_group: str = "",
    exclusive: bool = False,
) -> str | None:
    """None when the pod being created gets gputopo's gate; else why not, in a few words.

    `scheduler`: its spec.schedulerName once admitted (after the webhook's own patch); `ours`: gputopo's;
    `group`: the group it is a member of (annotation or identity labels; None: none); `gates`: the gates
    it carries already; `pod_group`: spec.schedulingGroup.podGroupName; `exclusive`: a JobSet with
    exclusive placement."""
    if scheduler != ours:
        return f"scheduled by {scheduler or 'the default scheduler'}, not {ours}"
    if group is None:
        return "no group member"
    if GROUP_GATE in gates:
        return "gated already"  # a name twice is refused by the API server
    if len(gates) >= MAX_GATES_READ:
        return f"{MAX_GATES_READ} or more scheduling gates"

    held = sorted(OTHER_HOLDERS.intersection(gates))
    if held:
        return f"held by {held[0]}"
    if pod_group:
        return f"held by its PodGroup {pod_group} (kube-scheduler's gang)"
    if exclusive:
        return "a JobSet with exclusive placement creates its followers only once their leader is scheduled"
    return None


def gate_patch(has_gates: bool) -> list[dict[str, Any]]:
    """The JSONPatch (RFC 6902) that adds gputopo's gate: appended to the pod's gates, or the list made."""
    gate = {"name": GROUP_GATE}
    if has_gates:
        return [{"op": "add", "path": "/spec/schedulingGates/-", "value": gate}]
    return [{"op": "add", "path": "/spec/schedulingGates", "value": [gate]}]


def remove_gate_patch(gates: Sequence[str]) -> list[dict[str, Any]]:
    """The JSONPatch that removes gputopo's gate from a pod whose gates are `gates` (in order): a `test`
    first, so that a pod whose gates changed meanwhile is refused (422) and nothing else is removed."""
    i = list(gates).index(GROUP_GATE)
    path = f"/spec/schedulingGates/{i}"
    return [{"op": "test", "path": f"{path}/name", "value": GROUP_GATE}, {"op": "remove", "path": path}]


class LiftReason(StrEnum):
    COMPLETE = "complete"  # every member exists
    NO_GROUP = "no-group"  # not (or no longer) a member of a group gputopo schedules
    HELD_ELSEWHERE = "held-elsewhere"  # Kueue or a PodGroup holds it: one holder is enough
    CANNOT_PLACE = "cannot-place"  # the group can never be placed as it is; the scheduler will say why
    TIMEOUT = "timeout"  # still incomplete, or whole and still not placed, after the bound


@dataclass(frozen=True)
class GatedMember:
    """A pod that carries gputopo's gate, as the extender sees it.

    `group`: its group (None: none, or another scheduler's pod); `size`: the members the group needs (None:
    not known); `present`: the members that exist, this one counted; `held_by`: another holder's gate or
    PodGroup ("" when none); `exclusive`: a JobSet with exclusive placement; `problem`: why its group
    cannot be placed as it is ("" when it can); `since`: when it was gated (epoch seconds, `gated_since`)."""

    uid: str
    namespace: str
    name: str
    group: str | None
    size: int | None
    present: int
    since: float
    held_by: str = ""
    exclusive: bool = False
    problem: str = ""

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class Lift:
    """One gate to lift, and the sentence its pod's Event carries (empty: no Event, the group is whole)."""

    member: GatedMember
    reason: LiftReason
    message: str = ""


def waiting_sentence(m: GatedMember) -> str:
    """What `kubectl describe pod` shows while the member waits."""
    size = "an unknown number of" if m.size is None else str(m.size)
    return (
        f"gated by {GROUP_GATE} until group {m.group} is whole: {m.present} of {size} members exist; "
        "the gate is lifted for all members at once"
    )


def lift(m: GatedMember, now: float, release_after_s: float) -> Lift | None:
    """Whether `m`'s gate goes now (a `Lift`) or stays (None)."""
    if m.group is None:
        return Lift(m, LiftReason.NO_GROUP, f"{GROUP_GATE} lifted: the pod is no member of a group gputopo schedules")
    if m.held_by:
        return Lift(m, LiftReason.HELD_ELSEWHERE, f"{GROUP_GATE} lifted: {m.held_by} holds the pod already")
    if m.exclusive:
        return Lift(
            m,
            LiftReason.HELD_ELSEWHERE,
            f"{GROUP_GATE} lifted: JobSet exclusive placement creates the followers only once their leader is placed",
        )
    if m.problem:
        return Lift(m, LiftReason.CANNOT_PLACE, f"{GROUP_GATE} lifted: group {m.group} cannot be placed: {m.problem}")
    if m.size is not None and m.present >= m.size:
        return Lift(m, LiftReason.COMPLETE)
    waited = now - m.since
    if waited >= release_after_s:
        size = "?" if m.size is None else str(m.size)
        return Lift(
            m,
            LiftReason.TIMEOUT,
            f"{GROUP_GATE} lifted after {waited:.0f} s: group {m.group} has {m.present} of {size} members and "
            "may never be whole; the scheduler now reports what it waits for",
        )
    return None


def gated_since(created: float | None, first_seen: float) -> float:
    """When a pod's gate was added: its creationTimestamp (`created`, the API server's; the webhook gates at
    admission), so the bound runs from the gate and not from when this extender first saw it (`first_seen`).
    An absent creation time (None; an unreadable one makes the Pod a bad object), or one after `first_seen`
    (a clock ahead of ours), counts from `first_seen`: never later, so a hold is never lengthened."""
    if created is None or created != created or created > first_seen:  # None, NaN, or ahead of us
        return first_seen
    return created


def unplaced_sentence(m: GatedMember, failure: str) -> str:
    """What `kubectl describe pod` shows while a whole group cannot be placed (`failure`: the plan's
    sentence)."""
    return (
        f"gated by {GROUP_GATE}: group {m.group} is whole but cannot be placed now: {failure}; the gate is "
        "lifted for all members once a plan places them all"
    )


def unplaced(m: GatedMember, failure: str, now: float, release_after_s: float) -> Lift | None:
    """A whole group that no plan places now (`failure`: why): its gate stays, since its members would only
    be refused again and again in kube-scheduler's queue, until `release_after_s` (then a `TIMEOUT` lift
    whose Warning names the failure)."""
    waited = now - m.since
    if waited < release_after_s:
        return None
    return Lift(
        m,
        LiftReason.TIMEOUT,
        f"{GROUP_GATE} lifted after {waited:.0f} s: group {m.group} is whole but could not be placed: {failure}; "
        "the scheduler now reports what it waits for",
    )
