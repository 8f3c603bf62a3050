"""A group member's filter: its slot in the group's reservation, planning one when none holds.

The members come from the ledger, the plan from the engine (`gputopo.engine.replan`, pure), and the
reservation goes back to the ledger, which refuses it if a planned GPU was taken meanwhile (planning
runs without the ledger's lock). Planning is serialised per group by a fixed table of locks.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from extender.ledger import Ledger
from extender.locks import StripedLocks
from extender.objects import PodRecord
from extender.reservations import Reservation
from extender.wire import PodInfo
from gputopo.engine.groups import GroupFailure
from gputopo.engine.replan import GroupWaiting, MemberView, Replan, Slot, replan
from gputopo.model import PodRequest

log = logging.getLogger("gputopo.extender.groups")

PLAN_ATTEMPTS = 3


def member_view(rec: PodRecord) -> MemberView:
    node = rec.placed_node or rec.node_name or None
    placed = rec.placement if rec.placed_node else None
    return MemberView(
        rec.name,
        rec.request,
        node=node,
        gpus=frozenset(placed.gpus) if placed is not None else frozenset(),
        stage=placed.stage if placed is not None else None,
        problem=rec.problem,
    )


def _rank_clash(group: str, records: Sequence[PodRecord], members: dict[str, MemberView]) -> GroupFailure | None:
    """Two members of an inferred group with one rank: a controller's labels are never guessed at, so
    every member is told which label repeats (plan_group would only say the stage does)."""
    labels = sorted({r.inferred.rank_label for r in records if r.inferred is not None and r.inferred.rank_label})
    if not labels:
        return None
    by_rank: dict[int, list[str]] = {}
    for m in members.values():
        if m.request is not None and m.request.stage is not None:
            by_rank.setdefault(m.request.stage, []).append(m.name)
    dup = sorted((r, sorted(names)) for r, names in by_rank.items() if len(names) > 1)
    if not dup:
        return None
    rank, names = dup[0]
    return GroupFailure(
        group,
        f"group {group}: rank {rank} ({' / '.join(labels)}) is claimed by more than one pod: {', '.join(names[:4])}",
    )


class GroupDesk:
    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.locks = StripedLocks()

    def slot_for(self, info: PodInfo, req: PodRequest, names: Sequence[str]) -> Slot | GroupWaiting | GroupFailure:
        assert req.group is not None and req.group_size is not None
        ledger = self.ledger
        key = (info.namespace, req.group)
        records = ledger.group_members(key)
        members = {r.name: member_view(r) for r in records}
        members[info.name] = MemberView(info.name, req)  # the asking pod is always planned afresh
        clash = _rank_clash(req.group, records, members)
        if clash is not None:
            return clash
        if len(members) != req.group_size:
            counted = replan(req.group, req.group_size, info.name, members, ())
            assert not isinstance(counted, Replan)
            return counted
        with self.locks(key):
            res = ledger.reservations.get(key)
            if res is not None and res.members != frozenset(members):
                ledger.release(key)  # the group changed (a member replaced): plan again
                res = None
            if res is not None:
                slot = res.slots.get(info.name)
                if slot is None or (not slot.pinned and ledger.resolve(slot.node, ledger.clock()).problem):
                    ledger.release(key)  # the planned node went stale or away
                    res = None
            if res is None:
                planned = self._plan(key, info, req, members, names)
                if not isinstance(planned, Reservation):
                    return planned
                res = planned
            return res.slots[info.name]

    def _plan(
        self,
        key: tuple[str, str],
        info: PodInfo,
        req: PodRequest,
        members: dict[str, MemberView],
        names: Sequence[str],
    ) -> Reservation | GroupWaiting | GroupFailure:
        group = key[1]
        assert req.group_size is not None
        for _ in range(PLAN_ATTEMPTS):
            now = self.ledger.clock()
            states = self.ledger.states(names, now)
            out = replan(group, req.group_size, info.name, members, states, self.ledger.tiers, self.ledger.weights)
            if not isinstance(out, Replan):
                return out
            res = Reservation(key, now, dict(out.slots), out.plan)
            if self.ledger.reserve(res):
                log.info(
                    "group planned and reserved",
                    extra={
                        "group": f"{key[0]}/{key[1]}",
                        "plan": {s.member: s.node for s in res.slots.values()},
                        "pinned": sorted(s.member for s in res.slots.values() if s.pinned),
                    },
                )
                return res
        return GroupFailure(group, f"group {group}: the planned GPUs kept changing while planning; retrying")
