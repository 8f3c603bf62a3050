"""Group members that ask for no GPUs (a JobSet's driver, an LWS leader): each takes its stage and counts
in the group's size, but no GPU and no node of its own; it goes beside its nearest GPU-holding stage."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gputopo.engine.cluster.explain import Seat, placement_sentence, stage_clause
from gputopo.engine.gang.assigned import Candidates
from gputopo.engine.gang.beside import beside, nearest_stage
from gputopo.engine.gang.groups import plan_group
from gputopo.engine.gang.plan import GroupFailure, GroupPlan, Member, Placed, PlacedBefore
from gputopo.engine.gang.replan import MemberView, Replan, replan
from gputopo.engine.state.snapshot import NodeState, node_state
from gputopo.model import parse_pod_request
from tests.engine.gang.test_groups import TWO_SPINES, cluster

FOUR = {"spine-a": [("n1", "leaf-1"), ("n2", "leaf-1"), ("n3", "leaf-2"), ("n4", "leaf-2")]}


def group(gpus: list[int], spread: str = "node", name: str = "pp") -> list[Member]:
    """One member per entry (its GPU count), stage = its index."""
    base = {"gputopo.io/group": name, "gputopo.io/group-size": str(len(gpus)), "gputopo.io/spread": spread}
    return [
        Member(f"{name}-{i}", parse_pod_request({**base, "gputopo.io/stage": str(i)}, g)) for i, g in enumerate(gpus)
    ]


def plan(result: GroupPlan | GroupFailure) -> GroupPlan:
    assert isinstance(result, GroupPlan), result
    return result


@pytest.mark.parametrize(
    ("gpus", "cpu_stage", "neighbour"),
    [
        ([0, 8, 8, 8, 8], 0, 1),  # driver first: beside rank 1
        ([8, 8, 8, 8, 0], 4, 3),  # driver last: beside the rank before it
        ([8, 8, 0, 8, 8], 2, 1),  # in the middle, as near to 1 as to 3: the lower rank
        ([8, 0, 0, 8, 8, 8], 2, 3),  # two without GPUs: each beside its own nearest GPU holder
    ],
)
@pytest.mark.parametrize("spread", ["node", "none"])
def test_a_member_without_gpus_sits_on_its_nearest_gpu_stages_node(
    gpus: list[int], cpu_stage: int, neighbour: int, spread: str
) -> None:
    p = plan(plan_group("pp", group(gpus, spread), cluster(FOUR)))
    by_stage = {a.stage: a for a in p.assignments}
    assert [a.stage for a in p.assignments] == list(range(len(gpus)))  # every rank keeps its stage
    assert p.size == len(gpus)
    cpu = by_stage[cpu_stage]
    assert cpu.outcome.gpus == () and cpu.outcome.fits
    assert cpu.node.name == by_stage[neighbour].node.name
    # The GPU members still have a node each (spread node) on the 4 nodes there are: the member
    # without GPUs used up none of them.
    holders = [a for a in p.assignments if a.outcome.gpus]
    assert len(holders) == 4 and all(len(a.outcome.gpus) == 8 for a in holders)
    assert len({a.node.name for a in holders}) == 4


def test_members_without_gpus_never_change_the_gpu_members_plan() -> None:
    nodes = cluster(TWO_SPINES)
    alone = plan(plan_group("pp", group([8, 8, 8, 8, 8]), nodes))
    with_driver = plan(plan_group("pp", group([0, 8, 8, 8, 8, 8]), nodes))
    assert [(a.node.name, a.outcome.gpus) for a in alone.assignments] == [
        (a.node.name, a.outcome.gpus) for a in with_driver.assignments if a.outcome.gpus
    ]
    assert alone.switches_used == with_driver.switches_used


@pytest.mark.parametrize(
    ("spread", "nodes_used"),
    [("none", 1), ("node", 3)],  # a group of such members alone is planned as before: packed, or spread
)
def test_a_group_of_members_without_gpus_alone_is_planned_whole(spread: str, nodes_used: int) -> None:
    p = plan(plan_group("cpu", group([0, 0, 0], spread, "cpu"), cluster(FOUR)))
    assert [a.outcome.gpus for a in p.assignments] == [(), (), ()]
    assert len({a.node.name for a in p.assignments}) == nodes_used
    assert p.size == 3


@pytest.mark.parametrize(
    ("stage", "holders", "expected"),
    [(0, [1, 2], 1), (4, [1, 2], 2), (2, [1, 3], 1), (2, [3, 1], 1), (5, [], None), (3, [3], 3)],
)
def test_nearest_stage_takes_the_lower_of_two_as_near(stage: int, holders: list[int], expected: int | None) -> None:
    assert nearest_stage(stage, holders) == expected


def _node(name: str, leaf: str | None, spine: str | None = "s") -> NodeState:
    labels = {k: v for k, v in (("gputopo.io/network-spine", spine), ("gputopo.io/network-leaf", leaf)) if v}
    return node_state(name, None, labels=labels)


@pytest.mark.parametrize(
    ("home", "expected"),
    [
        (_node("h", "leaf-1"), ["a", "b"]),  # the narrowest switch: the leaf
        (_node("h", None), ["a", "b", "c", "d"]),  # no leaf known: the spine
        (_node("h", None, None), []),  # under no known switch: no other node is beside it
        (_node("h", "leaf-1", "t"), []),  # leaf ids name their spine: leaf-1 under t is another switch
    ],
)
def test_nodes_beside_are_those_under_the_same_narrowest_switch(home: NodeState, expected: list[str]) -> None:
    others = [_node("a", "leaf-1"), _node("b", "leaf-1"), _node("c", "leaf-2"), _node("d", None), home]
    assert [n.name for n in beside(home, others)] == expected


def test_a_member_whose_neighbours_node_went_bad_takes_another_node_under_its_leaf() -> None:
    nodes = cluster(FOUR)
    broken = node_state("n1", None, labels=dict(nodes[0].labels))  # stale: its topology is gone
    driver, _, last = group([0, 8, 8])
    # Stage 1 was placed on n1 before; stage 0 asks for no GPUs, and n1 cannot take it now.
    p = plan(
        plan_group("pp", [driver, last], nodes[1:], before=PlacedBefore(placed=[Placed(1, broken, tuple(range(8)))]))
    )
    a = p.for_member(driver.name)
    assert a is not None and a.node.name == "n2"  # under leaf-1 with n1
    assert p.size == 3


def test_a_bound_driver_keeps_its_rank_and_the_sentence_agrees_with_the_slot() -> None:
    """The driver was bound (by kube-scheduler alone, so without a placement) before the workers were
    planned: every worker's stage in the sentence is its rank, of the whole group."""
    members = group([0, 8, 8, 8])
    views = {m.name: MemberView(m.name, m.request) for m in members}
    views["pp-0"] = MemberView("pp-0", members[0].request, node="n3")
    out = replan("pp", 4, "pp-1", views, Candidates(cluster(FOUR)))
    assert isinstance(out, Replan) and out.plan is not None
    for name in ("pp-1", "pp-2", "pp-3"):
        slot = out.slots[name]
        assert slot.assignment is not None and slot.stage == int(name[-1])
        clause = stage_clause(out.plan, slot.assignment)
        assert clause.startswith(f"stage {slot.stage}/4 ")
    assert out.slots["pp-0"].stage is None and out.slots["pp-0"].pinned  # its placement says none


def test_a_driver_bound_beside_its_planned_node_is_described_where_it_is() -> None:
    nodes = cluster(FOUR)
    p = plan(plan_group("pp", group([0, 8, 8, 8, 8]), nodes))
    a = p.for_member("pp-0")
    assert a is not None
    other = next(n for n in beside(a.node, nodes))
    text = placement_sentence(other.name, a.outcome, None, Seat(p, "pp-0", at=other))
    assert text.startswith(f"{other.name} has room (the pod asks for no GPUs); stage 0/5 shares leaf")
    assert "rails" not in text and "all-reduce" not in text


@settings(max_examples=40, deadline=None)
@given(
    workers=st.lists(st.sampled_from([1, 2, 4, 8]), min_size=1, max_size=5),
    cpu=st.sets(st.integers(0, 6), min_size=1, max_size=3),
    spread=st.sampled_from(["node", "none"]),
)
def test_any_mix_places_every_member_without_gpus_beside_its_nearest_gpu_stage(
    workers: list[int], cpu: set[int], spread: str
) -> None:
    gpus = list(workers)
    for s in sorted(cpu):
        gpus.insert(min(s, len(gpus)), 0)
    result = plan_group("pp", group(gpus, spread), cluster(TWO_SPINES))
    p = plan(result)
    by_stage = {a.stage: a for a in p.assignments}
    held = [s for s, g in enumerate(gpus) if g]
    assert sorted(by_stage) == list(range(len(gpus)))
    for s, g in enumerate(gpus):
        assert len(by_stage[s].outcome.gpus) == g
        if not g:
            near = min(held, key=lambda h: (abs(h - s), h))
            assert by_stage[s].node.name == by_stage[near].node.name
    if spread == "node":
        assert len({by_stage[s].node.name for s in held}) == len(held)
