"""`Follower`: the engine's decision in the state real placements left, and the verdict on each pod."""

from __future__ import annotations

import pytest

from gputopo.clusterfile import JobSpec, cluster_states, load_cluster, load_jobs
from gputopo.engine.state.snapshot import NodeState
from gputopo.sim import Measures, prepare_pods, simulate
from gputopo.sim.fidelity import Follower, RealPlacement, follow_engine
from tests.paths import REPO
from tests.sim.helpers import IB, job, node

EXAMPLES = REPO / "examples"


def _dgx1v_pair() -> list[NodeState]:
    # The case: GPU 1 of one DGX-1V in use, the other empty.
    return [node("frag", "dgx-1v", in_use=(1,)), node("empty", "dgx-1v")]


def _one(nodes: list[NodeState], spec: JobSpec, real: dict[str, RealPlacement | None]) -> list[tuple[bool, str]]:
    f = Follower(nodes)
    (pods,) = prepare_pods([spec])
    return [(v.agrees, v.engine_node or "") for v in f.observe(f.decide(pods), real)]


@pytest.mark.parametrize(
    ("real", "agrees"),
    [
        (RealPlacement("frag", (4, 5, 6, 7)), True),  # the engine's choice: the empty node stays whole
        (RealPlacement("empty", (0, 1, 2, 3)), False),  # what LeastAllocated alone picks
        (None, False),  # the engine places it
    ],
)
def test_tp4_over_dgx1v_pair_agrees_only_on_the_fragmented_node(real: RealPlacement | None, agrees: bool) -> None:
    assert _one(_dgx1v_pair(), job("tp4", 4), {"tp4-0": real}) == [(agrees, "frag")]


@pytest.mark.parametrize("where", ["h-a", "h-b"])
def test_a_node_the_engine_scores_equal_to_its_choice_agrees(where: str) -> None:
    nodes = [node("h-a", "dgx-h100"), node("h-b", "dgx-h100")]
    f = Follower(nodes)
    (pods,) = prepare_pods([job("tp8", 8)])
    (v,) = f.observe(f.decide(pods), {"tp8-0": RealPlacement(where, tuple(range(8)))})
    assert v.agrees and v.same_gpus is True and v.engine_node == "h-a"


def test_a_pod_neither_places_agrees_and_one_placed_where_it_does_not_fit_differs() -> None:
    nodes = [node("q", "dgx-1v", in_use=(1, 5))]  # no free quad
    assert _one(nodes, job("tp4", 4), {"tp4-0": None}) == [(True, "")]
    (v,) = Follower(nodes).observe(
        Follower(nodes).decide(prepare_pods([job("tp4", 4)])[0]), {"tp4-0": RealPlacement("q", (0, 2, 3, 4))}
    )
    assert not v.agrees and "places nothing" in v.note


def test_the_next_decision_sees_the_real_placement_not_the_engines() -> None:
    f = Follower(_dgx1v_pair())
    (a,), (b,) = prepare_pods([job("tp4", 4), job("tp4b", 4)])
    first = f.decide([a])
    f.observe(first, {a.name: RealPlacement("empty", (0, 1, 2, 3))})  # against the engine's choice
    second = f.decide([b])
    # the empty node's other quad and the fragmented node's 4-7 are what is left; the fragmented one keeps
    # nothing whole either way, so the engine now weighs them on the state that really is
    assert set(second.scores) == {"frag", "empty"}
    assert f.state["empty"].in_use == frozenset({0, 1, 2, 3})


def _leaf_nodes() -> list[NodeState]:
    return [
        node("a1", "dgx-h100", leaf="leaf-1"),
        node("a2", "dgx-h100", leaf="leaf-1"),
        node("b1", "dgx-h100", leaf="leaf-2"),
        node("b2", "dgx-h100", leaf="leaf-2", in_use=(0,)),
    ]


@pytest.mark.parametrize(
    ("where", "agrees"),
    [
        ({"pp-0": "a1", "pp-1": "a2"}, True),  # the plan
        ({"pp-0": "a2", "pp-1": "a1"}, True),  # stages swapped between equal nodes: as good
        ({"pp-0": "b1", "pp-1": "a1"}, False),  # across leaves, each off the plan: not as good
    ],
)
def test_group_members_agree_on_the_plan_or_an_equally_good_group(where: dict[str, str], agrees: bool) -> None:
    spec = job("pp", 8, 2, preferred_tier="leaf", network=IB["gputopo.io/network"])
    real: dict[str, RealPlacement | None] = {p: RealPlacement(n, tuple(range(8))) for p, n in where.items()}
    assert [a for a, _ in _one(_leaf_nodes(), spec, real)] == [agrees, agrees]


def test_across_leaves_only_the_member_on_its_planned_node_agrees() -> None:
    spec = job("pp", 8, 2, preferred_tier="leaf", network=IB["gputopo.io/network"])
    real: dict[str, RealPlacement | None] = {
        "pp-0": RealPlacement("a1", tuple(range(8))),
        "pp-1": RealPlacement("b1", tuple(range(8))),
    }
    assert _one(_leaf_nodes(), spec, real) == [(True, "a1"), (False, "a2")]


def test_a_group_placed_in_part_differs_for_every_member() -> None:
    spec = job("pp", 8, 2)
    got = _one(_leaf_nodes(), spec, {"pp-0": RealPlacement("a1", tuple(range(8))), "pp-1": None})
    assert [a for a, _ in got] == [False, False]


@pytest.mark.parametrize(("real", "agrees"), [(RealPlacement("b2", (1,)), True), (None, False)])
def test_a_plain_pod_agrees_wherever_it_has_room(real: RealPlacement | None, agrees: bool) -> None:
    assert _one(_leaf_nodes(), job("nb", 1, plain=True), {"nb-0": real})[0][0] is agrees


def test_plain_gpus_are_the_device_plugins_besteffort_choice() -> None:
    f = Follower([node("v", "dgx-1v", in_use=(0, 1, 2))])
    assert f.plain_gpus("v", 4) == (4, 5, 6, 7)


def test_a_placement_on_a_node_the_cluster_lacks_is_refused_by_name() -> None:
    f = Follower(_dgx1v_pair())
    (pods,) = prepare_pods([job("tp2", 2)])
    with pytest.raises(ValueError, match="'ghost'"):
        f.observe(f.decide(pods), {"tp2-0": RealPlacement("ghost", (0, 1))})


def test_following_the_simulators_own_placements_agrees_on_every_pod_and_gives_its_figures() -> None:
    nodes = cluster_states(load_cluster(EXAMPLES / "cluster.yaml"))
    jobs = load_jobs(EXAMPLES / "jobs.yaml").jobs
    sim = simulate(nodes, jobs, "gputopo", measures=Measures(exhaustive=False))
    where = {p.pod: RealPlacement(p.node, p.gpus, p.score, p.reason) for p in sim.placements}
    f = Follower(nodes)
    for pods in prepare_pods(jobs):
        f.observe(f.decide(pods), {p.name: where.get(p.name) for p in pods})
    assert f.agreed == len(f.verdicts) == sum(j.pods for j in jobs)
    assert f.summary() == sim.summary


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_engine_with_random_ties_agrees_with_itself_and_keeps_the_simulators_figures_on_examples(
    seed: int,
) -> None:
    nodes = cluster_states(load_cluster(EXAMPLES / "cluster.yaml"))
    jobs = load_jobs(EXAMPLES / "jobs.yaml").jobs
    f = follow_engine(nodes, jobs, seed)
    assert f.agreed == len(f.verdicts) == 12
    sim = simulate(nodes, jobs, "gputopo", measures=Measures(exhaustive=False)).summary
    s = f.summary()
    assert (s.pods_placed, s.on_full_clique, s.groups_within, s.stranded_gpus) == (
        sim.pods_placed,
        sim.on_full_clique,
        sim.groups_within,
        sim.stranded_gpus,
    )


def test_random_ties_spread_single_pods_over_equal_nodes() -> None:
    nodes = [node(f"h{i}", "dgx-h100", leaf=f"leaf-{i % 2}") for i in range(8)]
    jobs = [job(f"tp8-{i}", 8) for i in range(4)]
    used = {frozenset(p.node for p in follow_engine(nodes, jobs, seed).placements) for seed in range(6)}
    assert len(used) > 1  # the simulator itself always fills leaf-0 (the fullest with room), leaving leaf-1 whole
    assert {p.node for p in simulate(nodes, jobs, "gputopo", measures=Measures(exhaustive=False)).placements} == {
        "h0",
        "h2",
        "h4",
        "h6",
    }
