"""Free GPUs per fabric domain: the figure best fit above the node reads."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gputopo.engine.network.domains import FreeTracker, domain_free, domain_of, free_gpus
from gputopo.engine.state.snapshot import NodeState, node_state, with_in_use
from gputopo.systems import build_system


def node(name: str, leaf: str | None, spine: str | None, in_use: Sequence[int] = ()) -> NodeState:
    labels = {k: v for k, v in (("gputopo.io/network-leaf", leaf), ("gputopo.io/network-spine", spine)) if v}
    return node_state(name, build_system("dgx-h100", name), labels=labels, in_use=frozenset(in_use))


@pytest.mark.parametrize(
    ("nodes", "tier", "expected"),
    [
        pytest.param([node("a", "l1", "s1"), node("b", "l1", "s1", [0, 1])], "leaf", [14, 14], id="a leaf sums"),
        pytest.param([node("a", "l1", "s1"), node("b", "l2", "s1", range(8))], "spine", [8, 8], id="full node adds 0"),
        pytest.param([node("a", "l1", "s1"), node("b", "l2", "s1", [0])], "leaf", [8, 7], id="two leaves apart"),
        pytest.param([node("a", None, None, [3]), node("b", None, None)], "leaf", [7, 8], id="unlabelled: own domain"),
    ],
)
def test_free_gpus_are_summed_per_domain_of_each_tier(nodes: list[NodeState], tier: str, expected: list[int]) -> None:
    free = domain_free(nodes)
    assert [free.of(n, tier) for n in nodes] == expected
    assert free.by_node == {n.name: free_gpus(n) for n in nodes}
    assert sum(free.by_tier[tier].values()) == sum(free.by_node.values())
    assert {domain_of(n, tier) for n in nodes} == set(free.by_tier[tier])


def test_a_node_with_a_problem_counts_no_free_gpu() -> None:
    stale = node_state("x", None, labels={"gputopo.io/network-leaf": "l1"})
    assert free_gpus(stale) == 0
    assert domain_free([stale]).of(stale, "leaf") == 0


@given(st.lists(st.tuples(st.integers(0, 3), st.sets(st.integers(0, 7))), max_size=12))
def test_the_tracker_equals_a_recount_after_any_sequence_of_changes(changes: list[tuple[int, set[int]]]) -> None:
    nodes = [node(f"n{i}", f"l{i % 2}", "s1") for i in range(4)]
    tracker = FreeTracker(nodes)
    for i, gpus in changes:
        old, nodes[i] = nodes[i], with_in_use(nodes[i], frozenset(gpus))
        tracker.replace(old, nodes[i])
        recount = domain_free(nodes)
        assert tracker.figures.by_node == recount.by_node
        assert {t: dict(d) for t, d in tracker.figures.by_tier.items()} == {
            t: dict(d) for t, d in recount.by_tier.items()
        }
