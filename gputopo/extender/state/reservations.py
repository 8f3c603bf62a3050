"""Group reservations: the GPUs a group plan holds for members not bound yet, bounded in time and count.

A reservation is released when no member bound within the timeout (counted from the plan, and again
from each member's bind: a big gang that keeps binding keeps its hold, however long binding all of it
takes on a loaded control plane), or to make room
when `max_groups` reservations exist already (the oldest goes: filter calls can name any group, so the
book must not grow with them). Methods return the nodes whose reserved GPUs changed; the ledger
rebuilds those.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from gputopo.engine.gang.plan import GroupPlan
from gputopo.engine.gang.replan import Slot

log = logging.getLogger("gputopo.extender.state.reservations")

GroupKey = tuple[str, str]  # (namespace, group)
SlotKey = tuple[GroupKey, str]  # (group, member)


@dataclass
class Reservation:
    """A plan's slots; `slots` changes only through the book (`ReservationBook.pin`), which keeps `unpinned`."""

    key: GroupKey
    created: float
    slots: dict[str, Slot]
    plan: GroupPlan | None = None
    unpinned: int = field(init=False, compare=False)  # slots not bound yet: counted, not scanned, per bind
    # The version of the group's members (`PodTable.version`) at which they were found to be exactly the
    # slots' members: the group desk checks that once per version, not on every member's filter.
    members_checked: int = field(default=0, init=False, compare=False)
    progressed: float = field(default=0.0, init=False, compare=False)  # the plan, or a member's bind since
    # Planned before any member's filter named kube-scheduler's candidates (the group gate's lifter plans over every
    # node): the first member's filter checks its slot is among them (gputopo.extender.verbs.gangs).
    unchecked: bool = field(default=False, init=False, compare=False)

    def __post_init__(self) -> None:
        self.unpinned = sum(not s.pinned for s in self.slots.values())
        self.progressed = self.created

    def expires(self, timeout: float) -> float:
        return self.progressed + timeout

    @property
    def members(self) -> frozenset[str]:
        return frozenset(self.slots)

    @property
    def waiting(self) -> bool:
        return self.unpinned > 0


class ReservationBook:
    def __init__(self, timeout_seconds: float, max_groups: int = 1024) -> None:
        self.timeout = timeout_seconds
        self.max_groups = max_groups
        self.reservations: dict[GroupKey, Reservation] = {}
        self._by_node: dict[str, dict[SlotKey, frozenset[int]]] = {}
        self.next_expiry = math.inf
        # group -> the hold clock (`progressed`) of its reservation released to be planned again: the
        # next reservation of the group runs from it, so replacing a member (re-creating a leader) never
        # renews a hold; only a bind does. Bounded: the oldest goes first.
        self._carried: dict[GroupKey, float] = {}

    def on(self, node: str) -> Mapping[SlotKey, frozenset[int]]:
        """GPUs reserved on `node`, per (group, member)."""
        return self._by_node.get(node, {})

    def put(self, res: Reservation) -> set[str]:
        carried = self._carried.pop(res.key, None)
        if carried is not None:
            res.progressed = min(res.progressed, carried)
        touched = self.drop(res.key)
        while len(self.reservations) >= self.max_groups:
            oldest = min(self.reservations.values(), key=lambda r: r.created)
            log.warning("too many group reservations; released the oldest", extra={"group": "/".join(oldest.key)})
            touched |= self.drop(oldest.key)
        self.reservations[res.key] = res
        for slot in res.slots.values():
            if not slot.pinned:
                self._by_node.setdefault(slot.node, {})[(res.key, slot.member)] = slot.gpus
                touched.add(slot.node)
        self._schedule()
        return touched

    def drop(self, key: GroupKey, *, replan: bool = False) -> set[str]:
        """Release the group's reservation; `replan`: to plan the group again at once (a member replaced, a
        planned node gone), so the next reservation keeps this one's hold clock."""
        res = self.reservations.pop(key, None)
        touched: set[str] = set()
        if res is None:
            return touched
        if replan and res.waiting:
            self._carried.pop(key, None)
            while len(self._carried) >= self.max_groups:
                del self._carried[next(iter(self._carried))]
            self._carried[key] = res.progressed
        for slot in res.slots.values():
            if self._unreserve(slot.node, (key, slot.member)):
                touched.add(slot.node)
        self._schedule()
        return touched

    def pin(self, key: GroupKey, member: str, now: float | None = None) -> set[str]:
        """The member is bound: its placement carries its GPUs from now on, and the rest's hold runs from
        `now` again."""
        res = self.reservations.get(key)
        if res is None or member not in res.slots or res.slots[member].pinned:
            return set()
        self._carried.pop(key, None)  # a bind is progress: the group's next hold runs afresh
        slot = res.slots[member] = replace(res.slots[member], pinned=True)
        res.unpinned -= 1
        if now is not None:
            res.progressed = max(res.progressed, now)
        touched = {slot.node} if self._unreserve(slot.node, (key, member)) else set()
        if not res.waiting:
            self.reservations.pop(key, None)  # every member bound
        self._schedule()
        return touched

    def rename(self, key: GroupKey, names: Mapping[str, str]) -> Reservation | None:
        """Give slots held for pods not created yet their pods' names (`names`: slot -> pod) once the pods
        exist: the same nodes and GPUs, so no node's state changes. The reservation is replaced whole, so a
        reader without the lock sees the old one or the new one."""
        res = self.reservations.get(key)
        if res is None:
            return None
        slots: dict[str, Slot] = {}
        for name, slot in res.slots.items():
            new = names.get(name, name)
            if new != name:
                a = slot.assignment
                slot = replace(slot, member=new, assignment=None if a is None else replace(a, member=new))
                if self._unreserve(slot.node, (key, name)):
                    self._by_node.setdefault(slot.node, {})[(key, new)] = slot.gpus
            slots[new] = slot
        plan = res.plan
        if plan is not None:
            moved = tuple(replace(a, member=names[a.member]) if a.member in names else a for a in plan.assignments)
            plan = replace(plan, assignments=moved)
        self.reservations[key] = renamed = Reservation(key, res.created, slots, plan)
        renamed.progressed = res.progressed
        return renamed

    def held_on(self) -> Mapping[str, Mapping[SlotKey, frozenset[int]]]:
        """The nodes with GPUs held, and what each holds per (group, member)."""
        return self._by_node

    def held_by_namespace(self, *, promised: bool = False) -> dict[str, int]:
        """GPUs held for members not bound yet, per namespace; `promised`: only for pods not created yet
        (JobSet exclusive placement's followers, slots named 'job#index')."""
        out: dict[str, int] = {}
        for per in self._by_node.values():
            for ((namespace, _), member), gpus in per.items():
                if not promised or "#" in member:
                    out[namespace] = out.get(namespace, 0) + len(gpus)
        return out

    def due(self, now: float) -> list[GroupKey]:
        """Reservations no member of which bound within the timeout."""
        return [k for k, r in self.reservations.items() if r.expires(self.timeout) <= now and r.waiting]

    def _unreserve(self, node: str, key: SlotKey) -> bool:
        per = self._by_node.get(node)
        if per is None or per.pop(key, None) is None:
            return False
        if not per:
            del self._by_node[node]
        return True

    def _schedule(self) -> None:
        waiting = (r.expires(self.timeout) for r in self.reservations.values() if r.waiting)
        self.next_expiry = min(waiting, default=math.inf)
