"""`spread: none` groups honour the tiers (required, preferred, default packing) and fill as few nodes as
they fit, consecutive stages together."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gputopo.engine.gang.groups import plan_group
from gputopo.engine.gang.plan import GroupFailure, GroupPlan, Member
from gputopo.engine.state.snapshot import NodeState, node_state
from gputopo.model import parse_pod_request
from gputopo.sim import simulate
from gputopo.systems import build_system
from tests.sim.helpers import job

Layout = list[tuple[str, str, str, int]]  # (node, spine, leaf, GPUs in use from 0 upwards)


def nodes_of(layout: Layout, system: str = "dgx-h100") -> list[NodeState]:
    return [
        node_state(
            name,
            build_system(system, name),
            labels={"gputopo.io/network-spine": spine, "gputopo.io/network-leaf": leaf},
            in_use=frozenset(range(used)),
        )
        for name, spine, leaf, used in layout
    ]


def packed(n: int, gpus: int = 1, **ann: str) -> list[Member]:
    base = {"gputopo.io/group": "g", "gputopo.io/group-size": str(n), "gputopo.io/spread": "none"}
    base.update({f"gputopo.io/{k.replace('_', '-')}": v for k, v in ann.items()})
    return [Member(f"g-{i:02d}", parse_pod_request(base, gpus)) for i in range(n)]


def per_node(plan: GroupPlan | GroupFailure) -> dict[str, int]:
    assert isinstance(plan, GroupPlan), plan
    out: dict[str, int] = {}
    for a in plan.assignments:
        out[a.node.name] = out.get(a.node.name, 0) + 1
    return out


TWO_LEAVES_OF_FOUR: Layout = [("x", "s", "leaf-1", 0), ("y", "s", "leaf-2", 0)]


def test_required_leaf_group_that_no_leaf_holds_stays_unplaced() -> None:
    # The issue's example: two 4-GPU nodes on different leaves, five 1-GPU members, required-tier leaf.
    plan = plan_group("g", packed(5, required_tier="leaf"), nodes_of(TWO_LEAVES_OF_FOUR, "hgx-a100-4"))
    assert isinstance(plan, GroupFailure)
    assert plan.message == "group needs room for 5 members with 1 free GPUs under one leaf; best leaf holds 4"


def test_required_spine_group_may_span_leaves_of_that_spine() -> None:
    plan = plan_group("g", packed(5, required_tier="spine"), nodes_of(TWO_LEAVES_OF_FOUR, "hgx-a100-4"))
    assert per_node(plan) == {"x": 4, "y": 1}


@pytest.mark.parametrize(
    ("layout", "ann", "expected"),
    [
        # Default packing: one leaf over two nodes beats one node per leaf under the other spine.
        (
            [("a1", "sa", "l1", 4), ("a2", "sa", "l1", 4), ("b1", "sb", "l1", 5), ("b2", "sb", "l2", 5)],
            {},
            {"a1": 4, "a2": 2},
        ),
        # Fewest spines before fewest leaves: spine sb's two leaves hold it, spine sa's one leaf does not.
        (
            [("a1", "sa", "l1", 4), ("b1", "sb", "l1", 4), ("b2", "sb", "l2", 4)],
            {},
            {"b1": 4, "b2": 2},
        ),
        # Default packing keeps the group under one spine even across three of its leaves ...
        (
            [("a1", "sa", "l1", 5), ("a2", "sa", "l2", 5), ("a3", "sa", "l3", 6), ("b1", "sb", "l1", 1)],
            {},
            {"a1": 3, "a2": 3, "a3": 2},
        ),
        # ... and so does preferred-tier leaf when no leaf holds it: the smallest spine that does, split over
        # its fewest leaves (not the roomiest leaf, then one more under another spine).
        (
            [("a1", "sa", "l1", 5), ("a2", "sa", "l2", 5), ("a3", "sa", "l3", 6), ("b1", "sb", "l1", 1)],
            {"preferred_tier": "leaf"},
            {"a1": 3, "a2": 3, "a3": 2},
        ),
        # Required tier leaf with room in one leaf only: that leaf, even though it spans two nodes.
        (
            [("a1", "sa", "l1", 6), ("a2", "sa", "l1", 6), ("b1", "sb", "l1", 7)],
            {"required_tier": "leaf"},
            {"a1": 2, "a2": 2},
        ),
    ],
)
def test_spread_none_packs_under_fewest_switches(layout: Layout, ann: dict[str, str], expected: dict[str, int]) -> None:
    n = sum(expected.values())
    assert per_node(plan_group("g", packed(n, 1, **ann), nodes_of(layout))) == expected


def test_spread_none_takes_as_few_nodes_as_the_members_fit_on() -> None:
    # Placing each member on the best-scoring node alone would start on the fuller node (2 free) and
    # spill onto the empty one; five 1-GPU members fit on the empty node alone.
    layout: Layout = [("full", "s", "l", 6), ("empty", "s", "l", 0)]
    assert per_node(plan_group("g", packed(5), nodes_of(layout))) == {"empty": 5}


def test_of_nodes_that_each_hold_the_whole_group_the_best_scoring_one_is_taken() -> None:
    layout: Layout = [("roomy", "s", "l", 0), ("tight", "s", "l", 4)]
    assert per_node(plan_group("g", packed(4), nodes_of(layout))) == {"tight": 4}


def test_consecutive_stages_fill_one_node_before_the_next() -> None:
    layout: Layout = [("a", "s", "l", 5), ("b", "s", "l", 5), ("c", "s", "l", 5)]
    plan = plan_group("g", packed(8), nodes_of(layout))
    assert isinstance(plan, GroupPlan)
    nodes = [a.node.name for a in plan.assignments]
    assert nodes == sorted(nodes), "stage order follows node order: each node's stages are consecutive"
    assert per_node(plan) == {"a": 3, "b": 3, "c": 2}


def test_spread_none_without_room_fails_naming_how_many_fit() -> None:
    layout: Layout = [("a", "s", "l", 6), ("b", "s", "l", 7)]
    plan = plan_group("g", packed(4), nodes_of(layout))
    assert isinstance(plan, GroupFailure)
    assert plan.message == "group needs room for 4 members with 1 free GPUs; 3 fit"


SPINES = ("sa", "sb")
LEAVES = ("l1", "l2")


@st.composite
def clusters(draw: st.DrawFn) -> Layout:
    count = draw(st.integers(1, 6))
    return [
        (f"n{i}", draw(st.sampled_from(SPINES)), draw(st.sampled_from(LEAVES)), draw(st.integers(0, 8)))
        for i in range(count)
    ]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layout=clusters(),
    n=st.integers(1, 12),
    gpus=st.sampled_from([1, 2, 4]),
    required=st.sampled_from(["spine", "leaf"]),
    preferred=st.sampled_from([None, "spine", "leaf"]),
)
def test_spread_none_plan_never_breaks_required_tier(
    layout: Layout, n: int, gpus: int, required: str, preferred: str | None
) -> None:
    ann = {"required_tier": required} | ({"preferred_tier": preferred} if preferred else {})
    nodes = nodes_of(layout)
    plan = plan_group("g", packed(n, gpus, **ann), nodes)
    # Whether some switch of the required tier has room, counted independently: free GPUs per node.
    free = {name: 8 - used for name, _, _, used in layout}
    room: dict[str | None, int] = {}
    for node in nodes:
        sw = node.location.get(required)
        room[sw] = room.get(sw, 0) + free[node.name] // gpus
    if isinstance(plan, GroupFailure):
        assert max(room.values()) < n
        return
    assert len(plan.assignments) == n
    assert len({a.node.location.get(required) for a in plan.assignments}) == 1
    taken: dict[str, set[int]] = {}
    for a in plan.assignments:
        assert len(a.outcome.gpus) == gpus
        mine = set(a.outcome.gpus)
        assert mine.isdisjoint(taken.get(a.node.name, set())), "two members on the same GPU"
        assert mine.isdisjoint(range(8 - free[a.node.name])), "a member on a GPU in use"
        taken.setdefault(a.node.name, set()).update(mine)


def test_simulator_places_spread_none_groups_without_broken_requests() -> None:
    from tests.sim.helpers import node

    cluster = [
        node("x", "hgx-a100-4", leaf="leaf-1"),
        node("y", "hgx-a100-4", leaf="leaf-2"),
        node("z1", "dgx-h100", leaf="leaf-3"),
        node("z2", "dgx-h100", leaf="leaf-3"),
    ]
    jobs = [
        job("tight", 1, pods=5, spread="none", required_tier="leaf", nvlink="ignore"),
        job("wide", 2, pods=5, spread="none", required_tier="leaf"),
    ]
    result = simulate(cluster, jobs, "gputopo")
    assert result.summary.broken == {}
    where = {p.pod: p.node for p in result.placements}
    assert {where[f"tight-{i}"] for i in range(5)} == {"z1"}
    assert {where[f"wide-{i}"] for i in range(5)} == {"z1", "z2"}


def test_simulator_leaves_the_issue_example_unplaced() -> None:
    from tests.sim.helpers import node

    cluster = [node("x", "hgx-a100-4", leaf="leaf-1"), node("y", "hgx-a100-4", leaf="leaf-2")]
    result = simulate(cluster, [job("g", 1, pods=5, spread="none", required_tier="leaf")], "gputopo")
    assert not result.placements and len(result.unplaced) == 5
    assert result.summary.broken == {}
    assert "under one leaf; best leaf holds 4" in result.unplaced[0].reasons
