"""Best fit above the node on the wire: among nodes of equal engine score, prioritize ranks first the node
whose domains hold the fewest free GPUs over every node the extender knows, exactly as the simulator's
`rank` does (docs/extender.md, "How a node is chosen"); the figures follow binds and dropped nodes."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gputopo.engine.network.domains import TieKeys, domain_free, narrow_first, tie_keys
from gputopo.engine.node.placement import evaluate_pod, rank
from gputopo.engine.state.scoring import MAX_EXTENDER_SCORE, wire_scores
from gputopo.engine.state.snapshot import NodeState, node_state, taking
from gputopo.extender.settings import Settings
from gputopo.extender.state.domainfree import FabricFigures
from gputopo.model import PLACEMENT_ANNOTATION, parse_placement, parse_pod_request
from gputopo.systems import build_system
from gputopo.tiers import DEFAULT_TIERS
from tests.extender.fake import FakeSource
from tests.extender.harness import JSON, NS, Env, FakeClock, gputopo_pod, make_env, node_obj

FULL = list(range(8))


def _two_leaves() -> list[JSON]:
    """leaf-1: four empty nodes (32 free GPUs); leaf-3: one empty node and three full ones (8 free). The
    name alone would pick leaf-1's a0."""
    return [
        *(node_obj(f"a{i}", leaf="leaf-1", spine="s") for i in range(4)),
        node_obj("z0", leaf="leaf-3", spine="s"),
        *(node_obj(f"z{i}", leaf="leaf-3", spine="s", in_use=FULL) for i in (1, 2, 3)),
    ]


@pytest.mark.parametrize(
    ("order", "expected"),
    [
        (None, [10, 9, 8]),  # by name
        ({"a": (2, "a"), "b": (1, "b"), "c": (0, "c")}, [8, 9, 10]),  # by key
        ({"c": (0, "c")}, [9, 8, 10]),  # unknown names after every known one, by name
    ],
    ids=["no order: the name", "keys", "unknown names last"],
)
def test_wire_scores_break_equal_scores_by_the_order_given(
    order: dict[str, tuple[int | str, ...]] | None, expected: list[int]
) -> None:
    names = ["a", "b", "c"]
    assert wire_scores(names, [0, 0, 0], {0: 0.5}, None if order is None else TieKeys(order)) == expected


@pytest.mark.parametrize("filter_first", [True, False], ids=["prepared after filter", "prioritize alone"])
def test_prioritize_gives_the_top_score_to_the_fullest_leaf_with_room(env: Env, filter_first: bool) -> None:
    env.add_nodes(*_two_leaves())
    names = [f"a{i}" for i in range(4)] + [f"z{i}" for i in range(4)]
    pod = gputopo_pod("one", 1, nvlink="required")
    if filter_first:
        env.filter(pod, names)
    scores = env.prioritize(pod, names)
    assert max(scores, key=scores.__getitem__) == "z0"
    assert scores["z0"] > max(scores[f"a{i}"] for i in range(4))


def test_the_bound_pods_sentence_says_packing_chose_its_node(env: Env) -> None:
    env.add_nodes(*_two_leaves())
    pod = gputopo_pod("one", 1, nvlink="required")
    env.add_pods(pod)
    assert env.bind(pod, "z0") == ""
    stored = env.source.get("pods", "default", "one")
    assert stored is not None
    placement = parse_placement(stored["metadata"]["annotations"][PLACEMENT_ANNOTATION])
    words = "leaf leaf-3 is the fullest with room (8 free GPUs): keeps leaf leaf-1's 32 free GPUs whole"
    assert words in placement.reason
    assert placement.runner_up is not None and placement.runner_up.node == "a0"
    assert placement.runner_up.why == f"scored the same; {words}"


def _same_as_the_engine(env: Env) -> None:
    states = env.ledger.states()
    free = domain_free(states, env.ledger.tiers)
    figures = env.ledger.fabric.now()
    assert figures.free.by_tier == free.by_tier and figures.free.by_node == free.by_node
    assert figures.order == tie_keys(states, free, narrow_first(env.ledger.tiers))


def test_the_figures_follow_binds_dropped_nodes_and_new_labels(env: Env) -> None:
    env.add_nodes(*_two_leaves())
    _same_as_the_engine(env)
    for i, node in enumerate(["a0", "a1", "z0"]):
        pod = gputopo_pod(f"p{i}", 2, nvlink="required")
        env.add_pods(pod)
        assert env.bind(pod, node) == ""
        _same_as_the_engine(env)
    env.ledger.drop_nodes(["a3"])
    _same_as_the_engine(env)
    env.add_nodes(node_obj("a2", leaf="leaf-9", spine="t"))  # relabelled
    _same_as_the_engine(env)


@contextmanager
def _cluster() -> Iterator[Env]:
    with make_env(FakeSource(NS), FakeClock(), Settings(namespace=NS, stale_after_seconds=120)) as e:
        yield e


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    nodes=st.lists(
        st.tuples(st.integers(0, 3), st.sets(st.integers(0, 7), max_size=8), st.booleans()), min_size=1, max_size=10
    ),
    gpus=st.sampled_from([1, 2, 4, 8]),
)
def test_the_wire_carries_the_simulators_order(nodes: list[tuple[int, set[int], bool]], gpus: int) -> None:
    """Random leaves (some nodes unlabelled) and GPUs in use: the wire's order is `rank` over the same
    nodes with free GPUs per domain, so `gputopo simulate` decides what kube-scheduler does."""
    names = [f"n{i}" for i in range(len(nodes))]
    objs = [
        node_obj(name, in_use=sorted(used), leaf=f"leaf-{leaf}" if labelled else None, spine="s" if labelled else None)
        for name, (leaf, used, labelled) in zip(names, nodes, strict=True)
    ]
    with _cluster() as env:
        env.add_nodes(*objs)
        wire = env.prioritize(gputopo_pod("p", gpus, nvlink="required"), names)
        states = env.ledger.states()
    req = parse_pod_request({"gputopo.io/nvlink": "required"}, gpus)
    ranked = rank(evaluate_pod(states, req), domain_free(states))
    expected = {v.name: max(0, MAX_EXTENDER_SCORE - i) for i, v in enumerate(ranked)}
    lowest = min(expected.get(n, 0) for n in names)
    assert wire == {n: expected.get(n, 0) - lowest for n in names}


def _h100(name: str, leaf: int | None, used: int) -> NodeState:
    labels = (
        {"gputopo.io/network-leaf": f"l{leaf}", "gputopo.io/network-spine": f"s{leaf % 2}"} if leaf is not None else {}
    )
    return node_state(name, build_system("dgx-h100", name), labels=labels, in_use=frozenset(range(used)))


@settings(max_examples=60, deadline=None)
@given(
    start=st.lists(st.tuples(st.none() | st.integers(0, 3), st.integers(0, 8)), min_size=1, max_size=8),
    steps=st.lists(
        st.tuples(st.sampled_from(["take", "relabel", "rename", "drop", "add"]), st.integers(0, 7), st.integers(0, 8)),
        max_size=12,
    ),
)
def test_the_figures_kept_from_generation_to_generation_equal_the_engines(
    start: list[tuple[int | None, int]], steps: list[tuple[str, int, int]]
) -> None:
    """Whatever changes between generations (GPUs taken, labels, nodes renamed, dropped or added), the figures the
    extender keeps are those `domain_free` and `tie_keys` compute afresh over the same nodes."""
    nodes = [_h100(f"n{i}", leaf, used) for i, (leaf, used) in enumerate(start)]
    generation = [0]
    figures = FabricFigures(DEFAULT_TIERS, lambda: generation[0], lambda: nodes)
    for what, i, value in [("none", 0, 0), *steps]:
        at = i % len(nodes)
        if what == "take":
            nodes[at] = taking(nodes[at], frozenset(range(value)))
        elif what == "relabel":
            nodes[at] = _h100(nodes[at].name, value % 4, len(nodes[at].in_use))
        elif what == "rename":  # another node in its place: as many nodes as before, names unique as a cluster's
            nodes[at] = taking(_h100(f"r{generation[0]}-{at}", None, 0), nodes[at].in_use)
        elif what == "drop" and len(nodes) > 1:
            del nodes[at]
        elif what == "add":
            nodes.append(_h100(f"m{generation[0]}", value % 4 if value else None, value))
        generation[0] += 1
        got, free = figures.now(), domain_free(nodes)
        assert (got.free.by_tier, got.free.by_node) == (free.by_tier, free.by_node)
        assert got.order == tie_keys(nodes, free, narrow_first())
