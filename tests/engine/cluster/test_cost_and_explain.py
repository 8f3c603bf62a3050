"""The communication cost model and the one-sentence explanations."""

from __future__ import annotations

import pytest

from gputopo.engine.cluster.explain import gpu_ranges, placement_sentence, runner_up, stage_clause
from gputopo.engine.gang.groups import plan_group
from gputopo.engine.gang.plan import GroupPlan, Member
from gputopo.engine.network.cost import (
    REFERENCE_BUSBW_GBPS,
    intra_node_bandwidth,
    nic_gbps,
    pp_transfer_seconds,
    tiers_crossed,
    tp_allreduce_seconds,
)
from gputopo.engine.node.placement import evaluate_pod, rank
from gputopo.engine.state.snapshot import shape_of
from gputopo.model import parse_pod_request
from gputopo.systems import build_system
from tests.engine.gang.test_groups import TWO_SPINES, cluster
from tests.engine.node.test_placement import node


@pytest.mark.parametrize(
    ("system", "gpus", "via", "low", "high"),
    [
        pytest.param("dgx-h100", (0, 1, 2, 3, 4, 5, 6, 7), "nvswitch", 360, 380, id="h100-nvswitch-370GBps"),
        pytest.param("dgx-1v", (0, 1, 2, 3), "nvlink", 70, 90, id="dgx1v-quad-4-links-each"),
        # Not a clique: the model conservatively takes the PCIe/SYS hop as the bottleneck.
        pytest.param("dgx-1v", (0, 1, 2, 3, 4, 5, 6, 7), "pcie", 19, 21, id="dgx1v-all-eight-is-not-a-clique"),
        pytest.param("a100-pcie-bridged", (0, 1), "nvlink", 200, 260, id="bridged-pair-near-measured-208"),
        pytest.param("l40s-4", (0, 1), "pcie", 24, 26, id="pcie-same-numa"),
        pytest.param("l40s-4", (0, 2), "pcie", 19, 21, id="pcie-across-sockets"),
    ],
)
def test_intra_node_bandwidth_tracks_measured_anchors(
    system: str, gpus: tuple[int, ...], via: str, low: float, high: float
) -> None:
    s = shape_of(build_system(system))
    bw = intra_node_bandwidth(s.links, s.nvswitch, s.gbps_per_link, s.numa, gpus)
    assert bw.via == via
    assert low <= bw.gbps <= high


def test_nvswitch_allreduce_is_an_order_of_magnitude_faster_than_pcie() -> None:
    h = shape_of(build_system("dgx-h100"))
    p = shape_of(build_system("rtx4090-8"))
    t_nv = tp_allreduce_seconds(1e9, 8, intra_node_bandwidth(h.links, h.nvswitch, h.gbps_per_link, h.numa, range(8)))
    t_pcie = tp_allreduce_seconds(1e9, 8, intra_node_bandwidth(p.links, p.nvswitch, p.gbps_per_link, p.numa, range(8)))
    assert 10 < t_pcie / t_nv < 25
    assert pytest.approx(369.0) == REFERENCE_BUSBW_GBPS


@pytest.mark.parametrize(("rate", "expected"), [(400, 47.0), (200, 23.5), (100, 11.75)])
def test_nic_bandwidth_is_94_percent_of_line_rate(rate: float, expected: float) -> None:
    assert nic_gbps(rate) == pytest.approx(expected)


def test_crossing_more_tiers_costs_more() -> None:
    a = {"spine": "s1", "leaf": "s1/l1"}
    same_leaf = {"spine": "s1", "leaf": "s1/l1"}
    same_spine = {"spine": "s1", "leaf": "s1/l2"}
    other = {"spine": "s2", "leaf": "s2/l1"}
    net = ("spine", "leaf")
    crossed = [tiers_crossed(a, b, net) for b in (same_leaf, same_spine, other)]
    assert crossed == [1, 2, 3]
    times = [pp_transfer_seconds(256e6, 400, c) for c in crossed]
    assert times == sorted(times) and times[0] < times[-1]


@pytest.mark.parametrize(
    ("gpus", "text"), [((0, 1, 2, 3), "0-3"), ((0, 1, 2, 3, 6), "0-3,6"), ((5,), "5"), ((1, 3), "1,3")]
)
def test_gpu_ranges(gpus: tuple[int, ...], text: str) -> None:
    assert gpu_ranges(gpus) == text


def test_sentence_names_clique_link_count_and_runner_up() -> None:
    nodes = [node("dgx-h100", "gpu-07", in_use=(4, 5, 6, 7)), node("dgx-1v", "gpu-09", in_use=(0,))]
    ranked = rank(evaluate_pod(nodes, parse_pod_request({}, 4)))
    win = ranked[0]
    text = placement_sentence(win.name, win.outcome, runner_up(win.name, ranked))
    assert text.startswith("GPUs 0-3 on gpu-07 form a full NVLink clique (NV18 via NVSwitch)")
    assert "runner-up gpu-09 has weaker GPU links (NV1 vs NV18)" in text


def test_sentence_for_preferred_fallback_says_no_clique() -> None:
    ranked = rank(evaluate_pod([node("l40s-4", "pcie-1")], parse_pod_request({"gputopo.io/nvlink": "preferred"}, 2)))
    text = placement_sentence(ranked[0].name, ranked[0].outcome, None)
    assert "no full NVLink clique was free" in text


def test_runner_up_that_would_split_a_clique_says_so() -> None:
    nodes = [node("dgx-h100", "gpu-07", in_use=(4, 5, 6, 7)), node("dgx-h100", "gpu-09")]
    ranked = rank(evaluate_pod(nodes, parse_pod_request({}, 4)))
    assert ranked[0].name == "gpu-07"
    assert "runner-up gpu-09 would split its free 8-GPU clique" in placement_sentence(
        "gpu-07", ranked[0].outcome, ranked[1]
    )


def test_runner_up_that_is_merely_emptier_says_so() -> None:
    nodes = [node("dgx-1v", "a", in_use=(0, 1)), node("dgx-1v", "b", in_use=(0,))]
    ranked = rank(evaluate_pod(nodes, parse_pod_request({}, 2)))
    assert "runner-up b is emptier, so it stays whole for larger jobs" in placement_sentence(
        "a", ranked[0].outcome, ranked[1]
    )


def test_stage_clause_names_the_shared_leaf_and_the_stages() -> None:
    ms = [
        Member(f"pp-{i}", parse_pod_request({"gputopo.io/group": "pp", "gputopo.io/group-size": "5"}, 8))
        for i in range(5)
    ]
    plan = plan_group("pp", ms, cluster(TWO_SPINES))
    assert isinstance(plan, GroupPlan)
    third = plan.assignments[2]
    assert stage_clause(plan, third) == "stage 2/5 shares leaf leaf-2 with stages 3-4"
    assert stage_clause(plan, plan.assignments[0]) == "stage 0/5 shares leaf leaf-1 with stage 1"


@pytest.mark.parametrize(
    ("system", "k", "words"),
    [("l40s-4", 4, "(PCIe only)"), ("a100-pcie-bridged", 4, "(PCIe between some pairs)")],
)
def test_best_connected_fallback_says_whether_any_nvlink_is_used(system: str, k: int, words: str) -> None:
    ranked = rank(evaluate_pod([node(system, "x")], parse_pod_request({"gputopo.io/nvlink": "preferred"}, k)))
    assert words in placement_sentence("x", ranked[0].outcome, None)
