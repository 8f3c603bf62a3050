"""Group plans: all or nothing, one member per node, tiers honoured, stages ordered along the fabric."""

from __future__ import annotations

import pytest

from gputopo.engine.gang.groups import plan_group
from gputopo.engine.gang.plan import GroupFailure, GroupPlan, Member
from gputopo.engine.state.snapshot import NodeState, node_state
from gputopo.model import parse_pod_request
from gputopo.systems import build_system


def cluster(layout: dict[str, list[tuple[str, str]]], system: str = "dgx-h100") -> list[NodeState]:
    """layout: spine -> [(node, leaf)]."""
    out = []
    for spine, nodes in layout.items():
        for name, leaf in nodes:
            labels = {"gputopo.io/network-spine": spine, "gputopo.io/network-leaf": leaf}
            out.append(node_state(name, build_system(system, name), labels=labels))
    return out


def members(n: int, gpus: int = 8, **ann: str) -> list[Member]:
    base = {"gputopo.io/group": "pp", "gputopo.io/group-size": str(n)}
    base.update({f"gputopo.io/{k.replace('_', '-')}": v for k, v in ann.items()})
    return [Member(f"pp-{i}", parse_pod_request({**base, "gputopo.io/stage": str(i)}, gpus)) for i in range(n)]


TWO_SPINES = {
    "spine-a": [("a1", "leaf-1"), ("a2", "leaf-1"), ("a3", "leaf-2"), ("a4", "leaf-2"), ("a5", "leaf-2")],
    "spine-b": [("b1", "leaf-1"), ("b2", "leaf-1"), ("b3", "leaf-1"), ("b4", "leaf-1")],
}


def planned(result: GroupPlan | GroupFailure) -> list[str]:
    assert isinstance(result, GroupPlan), result
    return [a.node.name for a in result.assignments]


def test_group_fits_in_one_leaf_when_a_leaf_has_room() -> None:
    plan = plan_group("pp", members(4), cluster(TWO_SPINES))
    assert planned(plan) == ["b1", "b2", "b3", "b4"]
    assert isinstance(plan, GroupPlan) and plan.switches_used == {"spine": 1, "leaf": 1}


def test_leaf_names_that_repeat_under_different_spines_are_different_switches() -> None:
    plan = plan_group("pp", members(3), cluster(TWO_SPINES))
    assert isinstance(plan, GroupPlan) and plan.switches_used["leaf"] == 1


def test_required_tier_keeps_all_members_under_one_spine() -> None:
    nodes = cluster({"spine-a": [("a1", "l1"), ("a2", "l2")], "spine-b": [("b1", "l1"), ("b2", "l2")]})
    result = plan_group("pp", members(3, required_tier="spine"), nodes)
    assert isinstance(result, GroupFailure)
    assert result.message == "group needs 3 nodes with a free 8-GPU NVLink clique under one spine; best spine has 2"


def test_without_required_tier_a_group_may_span_spines_but_uses_as_few_as_possible() -> None:
    nodes = cluster({"spine-a": [("a1", "l1"), ("a2", "l2")], "spine-b": [("b1", "l1")]})
    plan = plan_group("pp", members(3), nodes)
    assert sorted(planned(plan)) == ["a1", "a2", "b1"]
    assert isinstance(plan, GroupPlan) and plan.switches_used == {"spine": 2, "leaf": 3}


def test_preferred_tier_packs_into_fewest_leaves() -> None:
    plan = plan_group("pp", members(5, required_tier="spine", preferred_tier="leaf"), cluster(TWO_SPINES))
    assert sorted(planned(plan)) == ["a1", "a2", "a3", "a4", "a5"]
    assert isinstance(plan, GroupPlan) and plan.switches_used["leaf"] == 2


def test_stages_are_ordered_along_the_fabric() -> None:
    plan = plan_group("pp", members(5), cluster(TWO_SPINES))
    nodes = planned(plan)
    # leaf-1 pair first, then leaf-2 triple: consecutive stages share a leaf wherever possible
    assert nodes == ["a1", "a2", "a3", "a4", "a5"]


def test_network_requirement_excludes_roce_nodes() -> None:
    ib = cluster({"s": [("ib1", "l1")]})
    roce = [node_state(f"r{i}", build_system("a100-pcie-bridged", f"r{i}")) for i in range(3)]
    result = plan_group("pp", members(2, 2, network="infiniband"), ib + roce)
    assert isinstance(result, GroupFailure)
    assert "an active InfiniBand NIC and a free 2-GPU NVLink clique" in result.message


def test_group_is_all_or_nothing() -> None:
    result = plan_group("pp", members(10), cluster(TWO_SPINES))
    assert isinstance(result, GroupFailure)
    assert result.message == "group needs 10 nodes with a free 8-GPU NVLink clique; 9 have it"


def test_spread_none_lets_members_share_a_node_and_accounts_for_taken_gpus() -> None:
    nodes = cluster({"s": [("n1", "l1"), ("n2", "l1")]})
    plan = plan_group("pp", members(3, 4, spread="none"), nodes)
    assert isinstance(plan, GroupPlan)
    placed = [(a.node.name, a.outcome.gpus) for a in plan.assignments]
    assert placed[0][0] == placed[1][0], "the second member joins the first on its node"
    assert set(placed[0][1]).isdisjoint(placed[1][1])


def test_explicit_stages_are_kept_and_missing_ones_filled() -> None:
    base = {"gputopo.io/group": "pp", "gputopo.io/group-size": "3"}
    ms = [
        Member("x", parse_pod_request({**base, "gputopo.io/stage": "2"}, 8)),
        Member("y", parse_pod_request(base, 8)),
        Member("z", parse_pod_request({**base, "gputopo.io/stage": "0"}, 8)),
    ]
    plan = plan_group("pp", ms, cluster(TWO_SPINES))
    assert isinstance(plan, GroupPlan)
    assert [(a.member, a.stage) for a in plan.assignments] == [("z", 0), ("y", 1), ("x", 2)]


def test_duplicate_stage_is_a_clear_failure() -> None:
    base = {"gputopo.io/group": "pp", "gputopo.io/group-size": "2", "gputopo.io/stage": "1"}
    ms = [Member("x", parse_pod_request(base, 8)), Member("y", parse_pod_request(base, 8))]
    result = plan_group("pp", ms, cluster(TWO_SPINES))
    assert isinstance(result, GroupFailure) and "stage 1 is claimed by more than one pod" in result.message


@pytest.mark.parametrize("size", [2, 4, 8])
def test_multi_node_nvlink_domain_can_be_required(size: int) -> None:
    trays = [node_state(f"t{i}", build_system("gb200-tray", f"t{i}")) for i in range(4)]
    other = [
        node_state(f"o{i}", build_system("gb200-tray", f"o{i}").model_copy(update={"fabric": None})) for i in range(8)
    ]
    result = plan_group("pp", members(size, 4, required_tier="nvlink-domain"), trays + other)
    if size <= 4:
        assert set(planned(result)) <= {"t0", "t1", "t2", "t3"}
    else:
        assert (
            isinstance(result, GroupFailure) and "under one nvlink-domain; best nvlink-domain has 4" in result.message
        )
