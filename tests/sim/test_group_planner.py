"""simulate's `group_planner`: a benchmark's other group placement in plan_group's place, for groups only."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from gputopo.engine.gang.groups import plan_group
from gputopo.engine.gang.plan import GroupFailure, GroupPlan, Member
from gputopo.engine.state.scoring import ScoreWeights
from gputopo.engine.state.snapshot import NodeState
from gputopo.sim import EngineSetup, Measures, simulate
from gputopo.tiers import TierConfig
from tests.sim.helpers import job, node

NODES = [node(f"n{i}", "dgx-h100", leaf=f"leaf-{i // 2}") for i in range(4)]
JOBS = [job("tp4", 4), job("pp", 8, pods=2, network="infiniband"), job("tp2", 2)]


def _last_node(
    group: str, members: Sequence[Member], nodes: Sequence[NodeState], tiers: TierConfig, weights: ScoreWeights
) -> GroupPlan | GroupFailure:
    """Plans over the last nodes only: the simulator must place where the planner says."""
    return plan_group(group, members, list(nodes)[-len(members) :], tiers, weights)


def _refuse(group: str, *_: object) -> GroupPlan | GroupFailure:
    return GroupFailure(group, f"group {group}: refused by the test planner")


def test_the_planner_plans_groups_and_single_pods_stay_the_engines() -> None:
    calls: list[str] = []

    def recording(
        group: str, members: Sequence[Member], nodes: Sequence[NodeState], tiers: TierConfig, weights: ScoreWeights
    ) -> GroupPlan | GroupFailure:
        calls.append(group)
        return plan_group(group, members, nodes, tiers, weights)

    plain = simulate(NODES, JOBS, "gputopo", measures=Measures(exhaustive=False))
    hooked = simulate(
        NODES, JOBS, "gputopo", engine=EngineSetup(group_planner=recording), measures=Measures(exhaustive=False)
    )
    assert calls == ["pp"]
    assert [(p.pod, p.node, p.gpus) for p in hooked.placements] == [(p.pod, p.node, p.gpus) for p in plain.placements]


@pytest.mark.parametrize(
    ("planner", "group_nodes", "unplaced"),
    [
        (_last_node, {"n2", "n3"}, []),
        (_refuse, set(), ["pp-0", "pp-1"]),
    ],
    ids=["places_where_the_planner_says", "a_refusal_leaves_the_group_waiting"],
)
def test_the_planners_verdict_is_what_the_simulator_places(
    planner: object, group_nodes: set[str], unplaced: list[str]
) -> None:
    engine = EngineSetup(group_planner=planner)  # type: ignore[arg-type]
    result = simulate(NODES, JOBS, "gputopo", engine=engine, measures=Measures(exhaustive=False))
    assert {p.node for p in result.placements if p.job == "pp"} == group_nodes
    assert [u.pod for u in result.unplaced] == unplaced
    for u in result.unplaced:
        assert "refused by the test planner" in u.reasons
    assert {p.pod for p in result.placements} >= {"tp4-0", "tp2-0"}
