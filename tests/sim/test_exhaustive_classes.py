"""The exhaustive search counts interchangeable GPUs by class: the same answers as the search that
permuted every symmetry (tests/sim/exhaustive_reference.py), and large nodes within seconds."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gputopo.clusterfile import JobSpec
from gputopo.engine.state.snapshot import NodeState, node_state, shape_of
from gputopo.model import NodeTopology
from gputopo.sim import prepare_pods
from gputopo.sim.comm import pp_seconds, tp_seconds
from gputopo.sim.exhaustive import best_placement
from gputopo.sim.symmetry import node_kind
from gputopo.systems import SYSTEMS, VARIANTS, build_system
from gputopo.tiers import DEFAULT_TIERS
from tests.sim import exhaustive_reference as reference
from tests.sim.helpers import job, node
from tests.sim.large_nodes import bridged_pairs, nvswitch, pcie, topology

MSG = 64 * 2**20


def _both(nodes: Sequence[NodeState], jobs: Sequence[JobSpec]) -> tuple[object, object]:
    pods = prepare_pods(jobs)
    new = best_placement(nodes, pods, DEFAULT_TIERS, MSG, MSG)
    old = reference.best_placement(nodes, pods, DEFAULT_TIERS, MSG, MSG)
    assert new.complete and old.complete
    return (new.jobs_placed, pytest.approx(new.seconds, rel=1e-9, abs=1e-15)), (old.jobs_placed, old.seconds)


# Mixes that touch every kind of option: lone pods of each NVLink policy, a spread group (tried per
# class) and a group whose stages may share a node (tried set by set), on nodes partly in use.
_MIXES = {
    "lone pods": [job("tp2", 2), job("tp4", 4, nvlink="preferred"), job("one", 1), job("any3", 3, nvlink="ignore")],
    "spread group": [job("pp", 2, pods=2, spread="node"), job("tp2", 2, nvlink="preferred")],
    "shared-node group": [job("pp", 2, pods=2, nvlink="preferred"), job("one", 1, plain=True)],
    "wide pods": [job("tp8", 8, nvlink="preferred"), job("tp4", 4, nvlink="ignore"), job("tp3", 3)],
}


@pytest.mark.parametrize("system", sorted([*SYSTEMS, *VARIANTS]))
@pytest.mark.parametrize("mix", sorted(_MIXES))
def test_same_best_placement_as_the_permuting_search_on_every_named_system(system: str, mix: str) -> None:
    nodes = [node("a", system, leaf="l1", in_use=(1,)), node("b", system, leaf="l2", in_use=(0, 3))]
    new, old = _both(nodes, _MIXES[mix])
    assert new == old


@st.composite
def _instances(draw: st.DrawFn) -> tuple[list[NodeState], list[JobSpec]]:
    n = draw(st.integers(2, 6))
    links = [[0] * n for _ in range(n)]
    for a in range(n):
        for b in range(a):
            links[a][b] = links[b][a] = draw(st.sampled_from([0, 0, 1, 2]))
    numa = [draw(st.integers(0, 1)) for _ in range(n)]
    failed, degraded, small = (draw(st.integers(0, 2**n - 1)) & draw(st.integers(0, 2**n - 1)) for _ in range(3))
    topo = topology(links, numa, failed=failed, degraded=degraded, small=small)
    nodes = [
        node_state(
            f"n{i}",
            topo,
            labels={"gputopo.io/network-leaf": f"l{i % 2}"},
            in_use=frozenset(draw(st.sets(st.integers(0, n - 1), max_size=2))),
        )
        for i in range(draw(st.integers(1, 3)))
    ]
    specs = []
    for j in range(draw(st.integers(1, 3))):
        ann = {"gputopo.io/nvlink": draw(st.sampled_from(["required", "preferred", "ignore"]))}
        pods = draw(st.integers(1, 2))
        if pods > 1 and draw(st.booleans()):
            ann["gputopo.io/spread"] = "node"
        if draw(st.booleans()):
            ann["gputopo.io/min-gpu-memory"] = "60Gi"
        specs.append(JobSpec(name=f"j{j}", pods=pods, gpus_per_pod=draw(st.integers(1, 3)), annotations=ann))
    return nodes, specs


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_instances())
def test_same_best_placement_as_the_permuting_search_on_random_nodes(
    instance: tuple[list[NodeState], list[JobSpec]],
) -> None:
    nodes, specs = instance
    new, old = _both(nodes, specs)
    assert new == old


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_canonical_states_match_exactly_when_a_symmetry_maps_one_mask_onto_the_other(data: st.DataObject) -> None:
    n = data.draw(st.integers(1, 7))
    links = [[0] * n for _ in range(n)]
    for a in range(n):
        for b in range(a):
            links[a][b] = links[b][a] = data.draw(st.sampled_from([0, 1, 1, 2]))
    attrs = tuple(data.draw(st.sampled_from([(0, False), (0, False), (1, False), (0, True)])) for _ in range(n))
    signature = (tuple(tuple(r) for r in links), attrs)
    kind = node_kind(*signature)
    masks = data.draw(st.lists(st.integers(0, 2**n - 1), min_size=2, max_size=6))
    for a in masks:
        for b in masks:
            same_orbit = reference._canonical(signature, a) == reference._canonical(signature, b)
            assert (kind.canonical(a) == kind.canonical(b)) == same_orbit, (links, attrs, a, b)


def test_node_kinds_count_gpus_by_class_instead_of_permuting_them() -> None:
    def kind_of(topo: NodeTopology) -> tuple[int, int, int]:
        state = node_state("x", topo)
        assert state.shape is not None
        attrs = tuple((g.numa_node, False, False, g.memory_mib) for g in topo.gpus)
        k = node_kind(state.shape.links, attrs)
        return len(k.class_masks), len(k.blocks), len(k.perms)

    assert kind_of(pcie(16)) == (1, 1, 1)  # 16! permutations before
    assert kind_of(nvswitch(64)) == (2, 2, 1)  # one class per NUMA node
    # 32 bridged pairs: 32 classes of twins, which swap as wholes: one block.
    assert kind_of(bridged_pairs(64)) == (32, 1, 1)
    # The DGX-1's hybrid cube mesh has no twins: its few symmetries are enumerated, as before.
    assert kind_of(build_system("dgx-1v"))[0] == 8


def test_a_16_gpu_pcie_node_and_64_gpu_nodes_are_searched_in_full() -> None:
    # The old search never finished the first (16! permutations); times are in docs/benchmarks.md.
    pcie16 = node_state("pcie16", pcie(16))
    jobs = [job("one", 1, plain=True), job("tp4", 4, nvlink="ignore"), job("tp8", 8, nvlink="ignore"), job("tp3", 3)]
    best = best_placement([pcie16], prepare_pods(jobs), DEFAULT_TIERS, MSG, MSG)
    pcie_shape = shape_of(pcie(16))
    expected = sum(tp_seconds(pcie_shape, tuple(range(k)), MSG) for k in (4, 8))
    assert (best.complete, best.jobs_placed) == (True, 3)  # tp3 asks for NVLink, which the node lacks
    assert best.seconds == pytest.approx(expected)

    big = [node_state(f"nv{i}", nvswitch(64), labels={"gputopo.io/network-leaf": "l1"}) for i in range(2)]
    jobs = [job("tp8", 8), job("pp", 32, pods=2, spread="node"), job("tp16", 16), job("one", 1)]
    pods = prepare_pods(jobs)
    best = best_placement(big, pods, DEFAULT_TIERS, MSG, MSG)
    nv = shape_of(nvswitch(64))
    stages = pp_seconds(big[0], (0,), big[1], (0,), pods[1][0].request.network, MSG, DEFAULT_TIERS)
    expected = sum(tp_seconds(nv, tuple(range(k)), MSG) for k in (8, 32, 32, 16)) + stages
    assert (best.complete, best.jobs_placed) == (True, 4) and best.seconds == pytest.approx(expected)

    bridged = node_state("bridged", bridged_pairs(64))
    jobs = [job(f"tp2-{i}", 2) for i in range(6)] + [job("tp3", 3)]
    best = best_placement([bridged], prepare_pods(jobs), DEFAULT_TIERS, MSG, MSG)
    pair = tp_seconds(shape_of(bridged_pairs(64)), (0, 1), MSG)
    assert (best.complete, best.jobs_placed) == (True, 6) and best.seconds == pytest.approx(6 * pair)


def test_the_budget_bounds_the_work_and_says_when_it_ran_out() -> None:
    nodes = [node("a", "dgx-1v"), node("b", "dgx-1v", in_use=(2,))]
    jobs = prepare_pods([job("pp", 2, pods=2, nvlink="preferred"), job("tp4", 4), job("one", 1)])
    full = best_placement(nodes, jobs, DEFAULT_TIERS, MSG, MSG)
    assert full.complete and full.jobs_placed == 3
    # Building the node kind is charged first; past the limit only the step under way finishes (a
    # canonical form of a DGX-1 costs 24 steps).
    kinds_only = best_placement(nodes, jobs, DEFAULT_TIERS, MSG, MSG, budget=1)
    assert not kinds_only.complete and kinds_only.states == 0
    for budget in (kinds_only.steps, full.steps // 2, full.steps - 1):
        cut = best_placement(nodes, jobs, DEFAULT_TIERS, MSG, MSG, budget=budget)
        assert not cut.complete
        assert budget < cut.steps <= budget + 100
        assert cut.jobs_placed < full.jobs_placed or cut.seconds >= full.seconds - 1e-15  # never beats the optimum
