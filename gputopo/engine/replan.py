"""Re-planning a group around the members already placed: pure functions from what is known of the
members, the node states and the tiers to one slot per member, or the reason there is none.

The extender calls `replan` when a member's filter finds no valid reservation; the simulator calls it
for a whole job (no member placed yet). Members already bound (or placed) keep their nodes and count
as pinned; the others are planned together with `plan_group` over the nodes given.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gputopo.engine.groupplan import Assignment, GroupFailure, GroupPlan, Member, group_waiting_message
from gputopo.engine.groups import plan_group
from gputopo.engine.scoring import DEFAULT_WEIGHTS, ScoreWeights
from gputopo.engine.snapshot import NodeState
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
    nodes: Sequence[NodeState],
    tiers: TierConfig = DEFAULT_TIERS,
    weights: ScoreWeights = DEFAULT_WEIGHTS,
) -> Replan | GroupWaiting | GroupFailure:
    """Plan the members of `group` not placed yet; `me` (the pod asking) is always planned afresh.

    `members` must hold `me` with its request. Fewer members than `size` wait; more fail."""
    if len(members) < size:
        return GroupWaiting(group, group_waiting_message(group, len(members), size))
    if len(members) > size:
        return GroupFailure(group, f"group {group}: {len(members)}/{size} pods exist, more than gputopo.io/group-size")
    lead = members[me].request
    assert lead is not None, "the asking member's request parsed"
    pinned = {n: m for n, m in sorted(members.items()) if n != me and m.node}
    todo: list[Member] = []
    for name, m in sorted(members.items()):
        if name in pinned:
            continue
        if m.request is None:
            why = f": {m.problem}" if m.problem else " has an invalid gputopo annotation"
            return GroupFailure(group, f"group {group}: member {name}{why}")
        todo.append(Member(name, m.request))
    # Pinned members' GPUs, on the nodes given, so that the new members line up with their rails.
    by_name = {n.name: n for n in nodes}
    alongside = [(by_name[m.node], tuple(sorted(m.gpus))) for m in pinned.values() if m.node in by_name]
    if lead.spread is Spread.NODE:
        taken = {m.node for m in pinned.values()}
        nodes = [n for n in nodes if n.name not in taken]
    slots: dict[str, Slot] = {}
    plan = None
    if todo:
        if pinned:
            # Stage numbers of a partial plan refer to the whole group; plan_group numbers its subset.
            todo = [Member(m.name, m.request.model_copy(update={"stage": None})) for m in todo]
        result = plan_group(group, todo, nodes, tiers, weights, alongside=alongside)
        if isinstance(result, GroupFailure):
            return result
        plan = result
        for a in result.assignments:
            stage: int | None = a.stage
            if pinned:
                asked = members[a.member].request
                stage = asked.stage if asked is not None and asked.stage is not None else a.stage
            slots[a.member] = Slot(a.member, a.node.name, frozenset(a.outcome.gpus), stage, False, a)
    for name, m in pinned.items():
        assert m.node is not None
        slots[name] = Slot(name, m.node, m.gpus, m.stage, True)
    return Replan(slots, plan)
