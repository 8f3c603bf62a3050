"""Best fit above the node for lone pods: among nodes of equal engine score, the one whose domains (NVLink
domain, leaf, spine, closest first) hold the fewest free GPUs wins, then the name; a better node score
always wins first (docs/extender.md, "How a node is chosen")."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gputopo.engine.network.domains import domain_free, narrow_first, tie_keys
from gputopo.engine.node.placement import evaluate_pod, rank
from gputopo.engine.state.snapshot import NodeState, node_state, taking
from gputopo.model import parse_pod_request
from gputopo.sim import Measures, simulate
from gputopo.systems import build_system
from tests.sim.helpers import job

FULL = tuple(range(8))


def gpu_node(
    name: str, leaf: str | None = None, spine: str | None = None, in_use: Sequence[int] = (), clique: str | None = None
) -> NodeState:
    labels = {
        k: v
        for k, v in (
            ("gputopo.io/network-leaf", leaf),
            ("gputopo.io/network-spine", spine),
            ("nvidia.com/gpu.clique", clique),
        )
        if v
    }
    return node_state(name, build_system("dgx-h100", name), labels=labels, in_use=frozenset(in_use))


def first_choice(nodes: Sequence[NodeState], gpus: int = 1) -> str:
    req = parse_pod_request({"gputopo.io/nvlink": "required"}, gpus)
    return rank(evaluate_pod(nodes, req), domain_free(nodes))[0].name


# Each cluster: the node best fit must choose. Names are chosen so that the name alone would choose
# otherwise (an emptier domain sorts first).
CLUSTERS = {
    "fullest leaf with room": (
        [gpu_node(f"a{i}", "leaf-1", "s") for i in range(4)]
        + [gpu_node("z0", "leaf-3", "s"), *(gpu_node(f"z{i}", "leaf-3", "s", FULL) for i in (1, 2, 3))],
        "z0",
    ),
    "fullest spine when the leaves hold as much": (
        [
            gpu_node("a0", "leaf-1", "spine-1"),
            gpu_node("a1", "leaf-2", "spine-1"),
            gpu_node("z0", "leaf-3", "spine-2"),
            gpu_node("z1", "leaf-4", "spine-2", FULL),
        ],
        "z0",
    ),
    "fullest labelled NVLink domain": (
        [
            gpu_node("a0", "leaf-1", "s", clique="nvl-1"),
            gpu_node("a1", "leaf-1", "s", clique="nvl-1"),
            gpu_node("z0", "leaf-1", "s", clique="nvl-2"),
            gpu_node("z1", "leaf-1", "s", FULL, clique="nvl-2"),
        ],
        "z0",
    ),
    "unlabelled nodes: the name": ([gpu_node("b"), gpu_node("a"), gpu_node("c")], "a"),
    "an unlabelled node is a domain of its own": (
        [gpu_node("a0", "leaf-1", "s"), gpu_node("a1", "leaf-1", "s"), gpu_node("z0")],
        "z0",
    ),
    "one leaf: the name": ([gpu_node("b", "leaf-1", "s"), gpu_node("a", "leaf-1", "s")], "a"),
    "a better node score wins over packing": (
        # a0 has GPUs in use (fuller node, higher score) though its leaf is the emptier one
        [
            gpu_node("a0", "leaf-1", "s", (0, 1, 2, 3)),
            *(gpu_node(f"a{i}", "leaf-1", "s") for i in (1, 2, 3)),
            gpu_node("z0", "leaf-3", "s"),
            *(gpu_node(f"z{i}", "leaf-3", "s", FULL) for i in (1, 2, 3)),
        ],
        "a0",
    ),
}


@pytest.mark.parametrize(("nodes", "chosen"), CLUSTERS.values(), ids=CLUSTERS.keys())
def test_a_lone_pod_goes_to_the_fullest_domain_with_room(nodes: list[NodeState], chosen: str) -> None:
    assert first_choice(nodes) == chosen
    placed = simulate(nodes, [job("one", 1)], "gputopo", measures=Measures(exhaustive=False)).placements
    assert [p.node for p in placed] == [chosen]


def _renamed(nodes: Sequence[NodeState], rename: dict[str, str]) -> list[NodeState]:
    return [node_state(rename[n.name], n.topology, labels=dict(n.labels), in_use=frozenset(n.in_use)) for n in nodes]


@pytest.mark.parametrize(
    "case", ["fullest leaf with room", "fullest spine when the leaves hold as much", "fullest labelled NVLink domain"]
)
def test_reversing_the_node_names_chooses_the_same_domain(case: str) -> None:
    nodes, _ = CLUSTERS[case]
    names = sorted(n.name for n in nodes)
    rename = dict(zip(names, [f"n{i:02d}" for i in reversed(range(len(names)))], strict=True))
    chosen = {n.name: n for n in nodes}[first_choice(nodes)]
    flipped = _renamed(nodes, rename)
    again = {n.name: n for n in flipped}[first_choice(flipped)]
    assert dict(again.location) == dict(chosen.location)


@pytest.mark.parametrize(
    ("nodes", "words"),
    [
        (
            CLUSTERS["fullest leaf with room"][0],
            "leaf leaf-3 is the fullest with room (8 free GPUs): keeps leaf leaf-1's 32 free GPUs whole",
        ),
        (
            CLUSTERS["an unlabelled node is a domain of its own"][0],
            "node z0 is the fullest with room (8 free GPUs): keeps leaf leaf-1's 16",
        ),
        (CLUSTERS["one leaf: the name"][0], "scored the same; the first name wins"),
    ],
    ids=["packing decided", "unlabelled node", "the name decided"],
)
def test_the_sentence_says_when_packing_decided(nodes: list[NodeState], words: str) -> None:
    (placed,) = simulate(nodes, [job("one", 1)], "gputopo", measures=Measures(exhaustive=False)).placements
    assert words in placed.reason


def test_a_better_score_is_not_explained_by_packing() -> None:
    (placed,) = simulate(CLUSTERS["a better node score wins over packing"][0], [job("one", 1)], "gputopo").placements
    assert "fullest with room" not in placed.reason


def _place(nodes: list[NodeState], k: int, fill: bool) -> list[NodeState]:
    """One lone pod on the engine's first choice: by best fit above the node, or by the name alone."""
    req = parse_pod_request({"gputopo.io/nvlink": "required"}, k)
    ranked = rank(evaluate_pod(nodes, req), domain_free(nodes) if fill else None)
    if not ranked:
        return nodes
    best = ranked[0]
    return [taking(n, n.in_use | frozenset(best.outcome.gpus)) if n.name == best.name else n for n in nodes]


def _largest_free(nodes: Sequence[NodeState], tier: str) -> int:
    return max(domain_free(nodes).by_tier[tier].values())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.sampled_from([1, 2, 4, 8]), min_size=1, max_size=24),
    leaves=st.integers(2, 4),
    per_leaf=st.integers(1, 4),
)
def test_best_fit_never_leaves_a_smaller_largest_free_domain_than_the_name(
    sizes: list[int], leaves: int, per_leaf: int
) -> None:
    """Along a random sequence of lone pods, each placement by best fit leaves the largest free leaf and
    spine no smaller than the name's choice from the same cluster would. (Greedy, step by step: over a
    whole sequence the name can be luckier, e.g. 8, 1, 8 GPUs on two leaves of two nodes.)"""
    # Node names interleave the leaves, as a cluster's names often do: the name alone scatters pods.
    nodes = [gpu_node(f"n{j:02d}-{i}", f"leaf-{i}", f"spine-{i % 2}") for j in range(per_leaf) for i in range(leaves)]
    for k in sizes:
        by_fill, by_name = _place(nodes, k, True), _place(nodes, k, False)
        for tier in ("leaf", "spine"):
            assert _largest_free(by_fill, tier) >= _largest_free(by_name, tier)
        nodes = by_fill


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2), st.integers(0, 8)), min_size=1, max_size=12))
def test_tie_keys_follow_the_tie_key(spec: list[tuple[int, int, int]]) -> None:
    nodes = [gpu_node(f"n{i}", f"l{leaf}", f"s{leaf % 2}", range(used)) for i, (leaf, _, used) in enumerate(spec)]
    free, narrow = domain_free(nodes), narrow_first()
    order = tie_keys(nodes, free, narrow)
    assert sorted(order, key=order.__getitem__) == [
        n.name for n in sorted(nodes, key=lambda n: free.tie_key(n, narrow))
    ]
    assert order["unknown"] > max(order.values())
