"""Re-planning a group around the members already placed: pure functions from what is known of the
members, the node states and the tiers to one slot per member, or the reason there is none.

The extender calls `replan` when a member's filter finds no valid reservation; the simulator calls it
for a whole job (no member placed yet). Members already bound (or placed) keep their nodes and count
as pinned; the others are planned together with `plan_group` over the nodes given.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gputopo.engine.gang.assigned import Candidates, Held, Selector, plan_held
from gputopo.engine.gang.groups import plan_group
from gputopo.engine.gang.plan import (
    Assignment,
    GroupFailure,
    GroupPlan,
    Member,
    Placed,
    PlacedBefore,
    group_waiting_message,
)
from gputopo.engine.state.scoring import DEFAULT_WEIGHTS, ScoreWeights
from gputopo.model import PodRequest, Spread
from gputopo.tiers import DEFAULT_TIERS, TierConfig


@dataclass(frozen=True)
class MemberView:
    """One member as far as planning is concerned: its request (None: its annotations do not parse)
    and, once bound or placed, its node, GPUs and stage."""

    name: str
    request: PodRequest | None
    node: str | None = None
    gpus: frozenset[int] = frozenset()
    stage: int | None = None
    problem: str = ""  # why `request` is None (the annotation or label at fault), when known
    selector: Selector = ()  # its spec.nodeSelector: planned only onto nodes it selects (gputopo.engine.gang.assigned)
    gated: str = ""  # a scheduling gate that holds it until its selector is written (Kueue's topology gate)


@dataclass(frozen=True)
class Slot:
    """One member's place in a plan. `pinned`: bound already, its GPUs count through its placement."""

    member: str
    node: str
    gpus: frozenset[int]
    stage: int | None
    pinned: bool
    assignment: Assignment | None = None


@dataclass(frozen=True)
class Replan:
    slots: Mapping[str, Slot]
    plan: GroupPlan | None  # None when every member was pinned already


@dataclass(frozen=True)
class GroupWaiting:
    group: str
    message: str


def replan(
    group: str,
    size: int,
    me: str,
    members: Mapping[str, MemberView],
    where: Candidates,
    tiers: TierConfig = DEFAULT_TIERS,
    weights: ScoreWeights = DEFAULT_WEIGHTS,
) -> Replan | GroupWaiting | GroupFailure:
    """Plan the members of `group` not placed yet; `me` (the pod asking) is always planned afresh.

    `members` must hold `me` with its request. Fewer members than `size` wait; more fail. `where`: the
    asking pod's candidates, and the nodes beyond them that other members' selectors name."""
    miscounted = counted(group, len(members), size)
    if miscounted is not None:
        return miscounted
    lead = members[me].request
    assert lead is not None, "the asking member's request parsed"
    ordered = sorted(members.items())
    pinned = {n: m for n, m in ordered if n != me and m.node}
    todo: list[Member] = []
    for name, m in ordered:
        if name in pinned:
            continue
        if m.request is None:
            why = f": {m.problem}" if m.problem else " has an invalid gputopo annotation"
            return GroupFailure(group, f"group {group}: member {name}{why}")
        if m.gated:
            return GroupWaiting(group, f"group {group}: waiting for member {name}'s node assignment ({m.gated})")
        todo.append(Member(name, m.request))
    if todo and any(members[m.name].selector for m in todo):  # its own spread rule: before `nodes` narrows
        held = [Held(m, members[m.name].selector) for m in todo]
        return _replan_held(group, members[me].selector, held, pinned, where, tiers, weights)
    # Pinned members, on the nodes given: their stages are taken, the new members line up with their rails.
    nodes = where.nodes
    by_name = {n.name: n for n in nodes}
    placed = [Placed(_stage(m), by_name.get(m.node or ""), tuple(sorted(m.gpus))) for m in pinned.values()]
    if lead.spread is Spread.NODE:  # a member without GPUs is no node's one member
        taken = {m.node for m in pinned.values() if m.request is None or m.request.gpus}
        nodes = [n for n in nodes if n.name not in taken]
    slots: dict[str, Slot] = {}
    plan = None
    if todo:
        result = plan_group(group, todo, nodes, tiers, weights, before=PlacedBefore(placed=placed))
        if isinstance(result, GroupFailure):
            return result
        plan = result
        for a in result.assignments:  # stages of the whole group: the placed members' are taken
            slots[a.member] = Slot(a.member, a.node.name, frozenset(a.outcome.gpus), a.stage, False, a)
    for name, m in pinned.items():
        assert m.node is not None
        slots[name] = Slot(name, m.node, m.gpus, m.stage, True)
    return Replan(slots, plan)


def counted(group: str, present: int, size: int) -> GroupWaiting | GroupFailure | None:
    """Fewer members than `size` wait; more fail; None when they are as many."""
    if present < size:
        return GroupWaiting(group, group_waiting_message(group, present, size))
    if present > size:
        return GroupFailure(group, f"group {group}: {present}/{size} pods exist, more than gputopo.io/group-size")
    return None


def _stage(m: MemberView) -> int | None:
    """A pinned member's stage: its request's (the controller's rank, the annotation), else its placement's."""
    return m.request.stage if m.request is not None and m.request.stage is not None else m.stage


def _replan_held(
    group: str,
    mine: Selector,
    held: Sequence[Held],
    pinned: Mapping[str, MemberView],
    where: Candidates,
    tiers: TierConfig,
    weights: ScoreWeights,
) -> Replan | GroupFailure:
    """`replan` for a group some of whose members carry a nodeSelector (gputopo.engine.gang.assigned):
    `held`, the members to plan; `mine`, the asking pod's selector."""
    by_name = {n.name: n for n in (*where.nodes, *where.extra)}
    placed = [Placed(_stage(m), by_name.get(m.node or ""), tuple(sorted(m.gpus))) for m in pinned.values()]
    plan = plan_held(group, held, where, tiers, weights, placed=placed, mine=mine)
    if isinstance(plan, GroupFailure):
        return plan
    slots = {
        a.member: Slot(a.member, a.node.name, frozenset(a.outcome.gpus), a.stage, False, a) for a in plan.assignments
    }
    for name, m in pinned.items():
        assert m.node is not None
        slots[name] = Slot(name, m.node, m.gpus, m.stage, True)
    return Replan(slots, plan)
