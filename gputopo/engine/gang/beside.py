"""Group members that ask for no GPUs (a JobSet's driver, a LeaderWorkerSet's leader): each takes its
stage of the group plan (its rank counts, the group's size counts it) but neither a GPU nor a node of
its own. It goes on the node of its nearest GPU-holding stage, the lower stage on a tie: a driver of
rank 0 beside rank 1. CPU, memory and taints are kube-scheduler's own filters' to judge, not the
engine's, so any node under the same narrowest switch as that node may take it as well (`beside`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

from gputopo.engine.gang.plan import Assignment, GroupFailure, GroupPlan, Member, switches_of
from gputopo.engine.node.placement import evaluate_node
from gputopo.engine.state.scoring import DEFAULT_WEIGHTS, ScoreWeights
from gputopo.engine.state.snapshot import NodeState
from gputopo.tiers import DEFAULT_TIERS, TierConfig


def nearest_stage(stage: int, holders: Iterable[int]) -> int | None:
    """The stage among `holders` nearest to `stage`, the lower one of two as near; None when none."""
    return min(holders, key=lambda s: (abs(s - stage), s), default=None)


def beside(node: NodeState, nodes: Iterable[NodeState], tiers: TierConfig = DEFAULT_TIERS) -> list[NodeState]:
    """The other nodes of `nodes` under `node`'s narrowest network switch, in their order; none when
    `node` hangs under no known switch. (Switch ids name their wider switches, so equal ids are one.)"""
    for tier in reversed(tiers.network_tiers()):
        switch = node.location.get(tier)
        if switch is not None:
            return [n for n in nodes if n.location.get(tier) == switch and n.name != node.name]
    return []


def place_beside(
    plan: GroupPlan,
    members: Sequence[tuple[int, Member]],
    nodes: Sequence[NodeState],
    tiers: TierConfig = DEFAULT_TIERS,
    weights: ScoreWeights = DEFAULT_WEIGHTS,
) -> GroupPlan | GroupFailure:
    """`plan` (of the members with GPUs) with each of `members` (stage, member: no GPUs) beside its
    nearest GPU-holding stage, planned or placed before: on that stage's node, else (the engine refuses
    it there) on the first node of `nodes` under the same narrowest switch that takes it."""
    holders = {a.stage: a.node for a in plan.assignments if a.outcome.gpus}
    holders.update({p.stage: p.node for p in plan.placed if p.stage is not None and p.node is not None and p.gpus})
    out = list(plan.assignments)
    for stage, member in members:
        near = nearest_stage(stage, holders)
        if near is None:
            return GroupFailure(plan.group, f"group {plan.group}: no member with GPUs for {member.name} to sit beside")
        home = holders[near]
        for node in (home, *beside(home, nodes, tiers)):
            outcome = evaluate_node(node, member.request, weights)
            if outcome.fits:
                out.append(Assignment(member.name, stage, node, outcome))
                break
        else:
            return GroupFailure(
                plan.group, f"group {plan.group}: no node beside stage {near} ({home.name}) takes {member.name}"
            )
    out.sort(key=lambda a: a.stage)
    return replace(plan, assignments=tuple(out), switches_used=switches_of(out, tiers))
