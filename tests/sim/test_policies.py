"""The three policies on small crafted clusters: where they differ, and why."""

from __future__ import annotations

import pytest

from gputopo.engine.node.besteffort import best_effort
from gputopo.engine.state.cliques import bits
from gputopo.engine.state.snapshot import NodeState
from gputopo.sim import Measures, simulate
from gputopo.systems import build_system
from tests.sim.helpers import job, node

DGX1V_QUADS = ({0, 1, 2, 3}, {4, 5, 6, 7})


def _two_dgx1v() -> list[NodeState]:
    # a: 6 free GPUs but no free quad; b: 5 free GPUs and the quad 4-7 free.
    return [node("dgx1v-a", "dgx-1v", in_use=(0, 4)), node("dgx1v-b", "dgx-1v", in_use=(0, 1, 2))]


def test_default_splits_a_tp4_across_dgx1v_quads_where_gputopo_keeps_it_in_one() -> None:
    nodes = _two_dgx1v()
    jobs = [job("tp4", 4)]
    topo = simulate(nodes, jobs, "gputopo").placements[0]
    default = simulate(nodes, jobs, "default").placements[0]
    assert (topo.node, set(topo.gpus)) == ("dgx1v-b", {4, 5, 6, 7})
    assert default.node == "dgx1v-a"  # LeastAllocated: most GPUs left free
    assert set(default.gpus) not in DGX1V_QUADS
    assert "not one NVLink clique" in default.reason
    assert "blind to the pod's annotations" in default.reason  # nvlink: required is the default


def test_default_scatters_pipeline_stages_across_leaves_where_gputopo_packs_one_leaf() -> None:
    nodes = [
        node("a1", "dgx-h100", leaf="leaf-1"),
        node("a2", "dgx-h100", leaf="leaf-1", in_use=(0, 1, 2, 3)),
        node("b1", "dgx-h100", leaf="leaf-2", in_use=(0,)),
        node("b2", "dgx-h100", leaf="leaf-2", in_use=(0, 1, 2, 3)),
    ]
    jobs = [job("pp", 4, pods=2, network="infiniband", required_tier="spine", preferred_tier="leaf")]
    topo = simulate(nodes, jobs, "gputopo")
    default = simulate(nodes, jobs, "default")
    assert topo.summary.groups_within == {"spine": 1, "leaf": 1}
    assert default.summary.groups_within == {"spine": 1, "leaf": 0}
    assert {p.node for p in default.placements} == {"a1", "b1"}
    assert topo.summary.pp_transfer_seconds < default.summary.pp_transfer_seconds


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_random_policy_is_deterministic_for_a_seed(seed: int) -> None:
    nodes = [node(f"n{i}", "dgx-h100") for i in range(4)]
    jobs = [job("a", 2), job("b", 3), job("c", 1), job("pp", 2, pods=3)]
    first = simulate(nodes, jobs, "random", seed=seed, measures=Measures(exhaustive=False))
    again = simulate(nodes, jobs, "random", seed=seed, measures=Measures(exhaustive=False))
    assert first.placements == again.placements


def test_random_policy_depends_on_the_seed() -> None:
    nodes = [node(f"n{i}", "dgx-h100") for i in range(8)]
    jobs = [job(f"j{i}", 2) for i in range(6)]
    outcomes = {tuple((p.node, p.gpus) for p in simulate(nodes, jobs, "random", seed=s).placements) for s in range(5)}
    assert len(outcomes) > 1


def test_default_breaks_least_allocated_ties_with_the_seed() -> None:
    nodes = [node(f"n{i}", "dgx-h100") for i in range(6)]
    chosen = {simulate(nodes, [job("a", 8)], "default", seed=s).placements[0].node for s in range(12)}
    assert len(chosen) > 1
    assert (
        simulate(nodes, [job("a", 8)], "default", seed=3).placements
        == simulate(nodes, [job("a", 8)], "default", seed=3).placements
    )


@pytest.mark.parametrize(
    ("fixture", "free", "k", "expected"),
    [
        ("dgx-1v", 0xFF, 4, {0, 1, 2, 3}),  # a full quad has the most NVLink links
        ("dgx-1v", 0xFE, 4, {4, 5, 6, 7}),
        # An NV2 pair on one socket, behind one PCIe switch (both PIX to mlx5_0); the pairing of all
        # eight GPUs around it ({0,4} {1,5} {2,3} {6,7}) scores highest.
        ("dgx-1v", 0xFF, 2, {2, 3}),
        ("a100-pcie-bridged", 0xFF, 2, {0, 1}),  # a bridged pair
        ("l40s-4", 0b1111, 2, {0, 1}),  # same socket beats cross socket
    ],
)
def test_device_plugin_best_effort_maximises_pairwise_link_score(
    fixture: str, free: int, k: int, expected: set[int]
) -> None:
    assert set(best_effort(build_system(fixture), bits(free), (), k)) == expected


def test_gputopo_places_groups_all_or_nothing_while_default_places_them_in_part() -> None:
    nodes = [node("a", "dgx-h100", leaf="l1"), node("b", "dgx-h100", leaf="l1"), node("c", "l40s-4")]
    jobs = [job("pp", 8, pods=3)]
    topo = simulate(nodes, jobs, "gputopo")
    default = simulate(nodes, jobs, "default")
    assert not topo.placements and len(topo.unplaced) == 3
    assert topo.unplaced[0].reasons.startswith("0/3 nodes are available: 3 group needs 3 nodes")
    assert len(default.placements) == 2 and default.summary.groups_partial == 1
    assert default.unplaced[0].reasons == "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."


def test_gputopo_honours_min_gpu_memory_that_default_cannot_see() -> None:
    nodes = [node("h100", "dgx-h100"), node("h200", "hgx-h200", in_use=(0,))]
    jobs = [job("big", 4, min_gpu_memory="100Gi")]
    assert simulate(nodes, jobs, "gputopo").placements[0].node == "h200"
    default = simulate(nodes, jobs, "default")
    assert default.placements[0].node == "h100"  # the emptier node
    assert default.summary.broken == {"min-gpu-memory": 1}
    assert "the pod asked for 100Gi" in default.placements[0].reason


def test_unknown_policy_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        simulate([node("a", "dgx-h100")], [job("a", 1)], "best")


def test_random_can_undercut_the_best_placement_only_by_breaking_requests() -> None:
    nodes = [node(f"n{i}", "dgx-h100") for i in range(3)]
    jobs = [job("pp", 2, pods=3)]
    undercut = 0
    for seed in range(6):
        s = simulate(nodes, jobs, "random", seed=seed).summary
        assert s.exhaustive is not None and s.exhaustive.ratio is not None
        assert s.exhaustive.ratio <= 1
        if s.exhaustive.ratio < 1:
            undercut += 1
            assert "spread" in s.broken and "broke requests" in s.exhaustive_note
        else:
            assert "broke requests" not in s.exhaustive_note
    # The claim needs a case that exercises it: several seeds do undercut by stacking stages on one node.
    assert undercut >= 2


def test_plain_pods_are_placed_as_kube_scheduler_would_even_under_gputopo() -> None:
    nodes = [node("a", "dgx-h100"), node("b", "l40s-4")]
    jobs = [job("notebook", 1, plain=True)]
    gputopo = simulate(nodes, jobs, "gputopo")
    default = simulate(nodes, jobs, "default")
    assert [(p.node, p.gpus) for p in gputopo.placements] == [(p.node, p.gpus) for p in default.placements]
    assert "kube-scheduler (LeastAllocated)" in gputopo.placements[0].reason
