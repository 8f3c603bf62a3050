"""Summary figures: clique share, group locality, stranded GPUs, communication time, exhaustive search."""

from __future__ import annotations

import pytest

from gputopo.engine.state.snapshot import shape_of
from gputopo.sim import prepare_pods, simulate
from gputopo.sim.comm import tp_seconds
from gputopo.sim.exhaustive import best_placement
from gputopo.systems import build_system
from gputopo.tiers import DEFAULT_TIERS
from tests.sim.helpers import job, node

MSG = 64 * 2**20


def test_clique_share_counts_pods_that_could_have_had_a_clique_on_the_empty_cluster() -> None:
    nodes = [node("h100", "dgx-h100", in_use=(0, 1, 2, 3, 4)), node("l40s", "l40s-4")]
    jobs = [job("tp2", 2), job("tp4", 4, nvlink="preferred"), job("serve", 4, nvlink="ignore")]
    s = simulate(nodes, jobs, "gputopo").summary
    assert s.multi_gpu_pods == 2  # the nvlink: ignore pod is left out
    assert (s.on_full_clique, s.multi_gpu_placed) == (1, 2)  # tp4 fell back to the PCIe-only node
    assert (s.on_full_clique_of_could, s.could_have_clique) == (1, 2)


def test_stranded_gpus_are_free_gpus_on_nodes_no_waiting_pod_fits() -> None:
    nodes = [node("h100", "dgx-h100", in_use=(0, 1, 2, 3, 4)), node("l40s", "l40s-4")]
    jobs = [job("tp8", 8)]
    s = simulate(nodes, jobs, "gputopo").summary
    assert (s.free_gpus, s.stranded_gpus, s.stranded_nodes) == (7, 7, 2)
    nothing_waits = simulate(nodes, [job("one", 1)], "gputopo").summary
    assert nothing_waits.stranded_gpus == 0


def test_stranded_gpus_exclude_nodes_where_some_waiting_pod_fits() -> None:
    # tp4b waits: the H100's 2 free GPUs are too few and the L40S node has no NVLink, so all 6 are stranded.
    nodes = [node("h100", "dgx-h100", in_use=(0, 1)), node("l40s", "l40s-4")]
    s = simulate(nodes, [job("tp4", 4), job("tp4b", 4)], "gputopo").summary
    assert (s.pods_placed, s.stranded_gpus, s.stranded_nodes) == (1, 6, 2)
    # A 3-node group cannot be placed on 2 nodes, but each of its 2-GPU members would fit either node.
    s = simulate(nodes, [job("tp4", 4), job("replicas", 2, pods=3, nvlink="ignore")], "gputopo").summary
    assert (s.pods_placed, s.stranded_gpus) == (1, 0)


def test_tp_allreduce_time_is_lower_on_nvswitch_than_over_pcie() -> None:
    h100 = shape_of(build_system("dgx-h100"))
    l40s = shape_of(build_system("l40s-4"))
    assert tp_seconds(h100, (0, 1, 2, 3), MSG) * 10 < tp_seconds(l40s, (0, 1, 2, 3), MSG)
    assert tp_seconds(h100, (0,), MSG) == 0.0


@pytest.mark.parametrize("policy", ["gputopo", "default", "random"])
def test_exhaustive_search_is_a_lower_bound_for_every_policy(policy: str) -> None:
    nodes = [
        node("dgx1v-a", "dgx-1v", leaf="l1", in_use=(0, 4)),
        node("dgx1v-b", "dgx-1v", leaf="l1", in_use=(0, 1, 2)),
        node("h100", "dgx-h100", leaf="l2", in_use=(0, 1, 2, 3)),
    ]
    jobs = [job("tp4", 4), job("tp2", 2), job("pp", 2, pods=2, network="infiniband")]
    s = simulate(nodes, jobs, policy, seed=1).summary
    assert s.exhaustive is not None and s.exhaustive.complete
    if s.exhaustive.ratio is not None:
        assert s.exhaustive.ratio >= 1.0 - 1e-9


def test_exhaustive_search_finds_the_nvswitch_node_for_a_tp4() -> None:
    nodes = [node("l40s", "l40s-4"), node("h100", "dgx-h100")]
    jobs = prepare_pods([job("tp4", 4, nvlink="preferred")])
    best = best_placement(nodes, jobs, DEFAULT_TIERS, MSG, MSG)
    assert best.complete and best.jobs_placed == 1
    assert best.seconds == pytest.approx(tp_seconds(shape_of(build_system("dgx-h100")), (0, 1, 2, 3), MSG))


def test_default_is_worse_than_the_best_placement_on_a_dgx1v_pair() -> None:
    nodes = [node("dgx1v-a", "dgx-1v", in_use=(0, 4)), node("dgx1v-b", "dgx-1v", in_use=(0, 1, 2))]
    jobs = [job("tp4", 4, nvlink="preferred")]
    topo = simulate(nodes, jobs, "gputopo").summary.exhaustive
    default = simulate(nodes, jobs, "default").summary.exhaustive
    assert topo is not None and default is not None
    assert topo.ratio == pytest.approx(1.0)
    assert default.ratio is not None and default.ratio > 1.5


def test_exhaustive_search_is_skipped_on_large_instances_with_a_note() -> None:
    nodes = [node(f"n{i}", "dgx-h100") for i in range(7)]
    s = simulate(nodes, [job("a", 1)], "gputopo").summary
    assert s.exhaustive is None
    assert "7 nodes" in s.exhaustive_note
