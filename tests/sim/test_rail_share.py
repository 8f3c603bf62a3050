"""The simulator's share of rail-aligned groups, among groups with members on part of a node."""

from __future__ import annotations

import pytest

from gputopo.engine.state.snapshot import NodeState
from gputopo.sim.core import simulate
from gputopo.sim.output import render_text, to_json
from tests.sim.helpers import IB, job, node


def two_nodes() -> list[NodeState]:
    return [node("a", "dgx-h100", in_use=(0, 1)), node("b", "dgx-h100", in_use=(4, 5))]


@pytest.mark.parametrize(
    ("gpus", "groups", "aligned", "share"),
    [
        (4, 1, 1, 1.0),  # two quads: lined up on rails 2-3,6-7
        (2, 1, 1, 1.0),
        # Six of eight: the free GPUs are the only choice on each node, rails 2-7 and 0-3,6-7.
        (6, 1, 0, 0.0),
    ],
    ids=["quads", "pairs", "six-of-eight"],
)
def test_gputopo_lines_up_partial_members_where_it_can_and_counts_them(
    gpus: int, groups: int, aligned: int, share: float
) -> None:
    result = simulate(two_nodes(), [job("pp", gpus, pods=2, network=IB["gputopo.io/network"])])
    summary = to_json(result)["summary"]
    assert isinstance(summary, dict)
    assert (summary["groupsOnPartNodes"], summary["groupsRailAligned"]) == (groups, aligned)
    assert summary["groupsRailAlignedShare"] == share
    row = next(line for line in render_text(result).splitlines() if "rail-aligned groups" in line)
    assert (
        row.split("rail-aligned groups")[1]
        .strip()
        .startswith(f"{aligned} of {groups} ({100 * share:.0f}%) of those with members on part of a node")
    )


def test_groups_on_whole_nodes_are_not_counted() -> None:
    result = simulate([node("a", "dgx-h100"), node("b", "dgx-h100")], [job("pp", 8, pods=2)])
    assert (result.summary.rail_groups, result.summary.rail_aligned) == (0, 0)
    assert to_json(result)["summary"]["groupsRailAlignedShare"] is None  # type: ignore[index]
    assert "rail-aligned" not in render_text(result)


def test_a_group_that_cannot_align_is_counted_as_not_aligned() -> None:
    nodes = [node("a", "dgx-h100", in_use=(0, 1, 2, 3)), node("b", "dgx-h100", in_use=(4, 5, 6, 7))]
    result = simulate(nodes, [job("pp", 4, pods=2)])
    assert (result.summary.rail_groups, result.summary.rail_aligned) == (1, 0)
    assert "rail-aligned groups" in render_text(result) and "0 of 1 (0%) of those" in render_text(result)
