"""The engine's order of nodes reaches kube-scheduler: prioritize ranks a request's fitting nodes as the
engine ranks them (score, then name), so the engine's choice always gets strictly the highest extender
score (docs/extender.md, "Scores on the wire")."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gputopo.console import inspect
from gputopo.engine.node.placement import evaluate_pod, rank
from gputopo.engine.state.scoring import MAX_EXTENDER_SCORE, first_ranked, wire_scores
from gputopo.engine.state.snapshot import node_state
from gputopo.extender.settings import Settings
from gputopo.model import parse_pod_request
from gputopo.systems import SYSTEMS, build_system
from tests.extender.fake import FakeSource
from tests.extender.harness import NS, Env, FakeClock, gputopo_pod, make_env, node_obj, pod_obj


def _engine_order(names: list[str], kinds: list[int], scores: dict[int, float]) -> list[int]:
    """The reference: fitting nodes sorted as placement.rank sorts them, the i-th getting 10 - i."""
    fitting = sorted((-scores[k], n) for n, k in zip(names, kinds, strict=True) if k in scores)
    top = {n: max(0, MAX_EXTENDER_SCORE - i) for i, (_, n) in enumerate(fitting)}
    return [top.get(n, 0) for n in names]


@pytest.mark.parametrize(
    ("names", "kinds", "scores", "expected"),
    [
        ([], [], {}, []),
        (["a"], [0], {0: 0.5}, [10]),
        (["a", "b"], [0, 1], {0: 0.71, 1: 0.74}, [9, 10]),  # one grade apart would both be 7
        (["b", "a", "c"], [0, 0, 1], {0: 0.9, 1: 0.3}, [9, 10, 8]),  # equal scores: the first name first
        (["a", "b"], [0, 1], {1: 0.1}, [0, 10]),  # a node that does not fit gets 0, below any that fits
        ([f"n{i:02d}" for i in range(12)], [0] * 12, {0: 1.0}, [10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 0]),
        (["a", "b"], [0, 1], {0: float("nan"), 1: 0.2}, [0, 10]),  # NaN is no level
    ],
    ids=["none", "one", "close scores", "ties by name", "not fitting", "past the tenth", "NaN"],
)
def test_wire_scores_rank_nodes_in_the_engines_order(
    names: list[str], kinds: list[int], scores: dict[int, float], expected: list[int]
) -> None:
    assert wire_scores(names, kinds, scores) == expected


@given(
    st.lists(st.tuples(st.integers(0, 5), st.booleans()), max_size=40),
    st.lists(st.floats(0, 1), min_size=6, max_size=6),
)
def test_wire_scores_equal_the_engines_rank_order(nodes: list[tuple[int, bool]], levels: list[float]) -> None:
    names = [f"node-{i}" for i in range(len(nodes))]
    kinds = [k for k, _ in nodes]
    scores = {k: levels[k] for k, fits in nodes if fits}
    assert wire_scores(names, kinds, scores) == _engine_order(names, kinds, scores)


@given(
    st.lists(st.tuples(st.integers(0, 5), st.booleans()), max_size=40),
    st.lists(st.floats(0, 1) | st.just(float("nan")), min_size=6, max_size=6),
    st.booleans(),
)
def test_the_one_node_filter_passes_the_node_wire_scores_rank_first(
    nodes: list[tuple[int, bool]], levels: list[float], by_fit: bool
) -> None:
    names = [f"node-{i}" for i in range(len(nodes))]
    kinds = [k for k, _ in nodes]
    scores = {k: levels[k] for k, fits in nodes if fits}
    order = {n: (-(i % 3), n) for i, n in enumerate(names)} if by_fit else None
    wire = wire_scores(names, kinds, scores, order)
    want = wire.index(MAX_EXTENDER_SCORE) if MAX_EXTENDER_SCORE in wire else None
    assert first_ranked(names, kinds, scores, order) == want


def test_tp4_prefers_the_fragmented_dgx1v_node_on_the_wire(env: Env) -> None:
    """The case kube-scheduler decided at random: both nodes grade 7, but the engine keeps the empty one
    whole for an 8-GPU job, so it must lose on the wire by a whole step."""
    env.add_nodes(node_obj("v-frag", "dgx-1v", in_use=[1]), node_obj("v-empty", "dgx-1v"))
    scores = env.prioritize(gputopo_pod("tp4", 4, nvlink="required"), ["v-frag", "v-empty"])
    assert scores["v-frag"] > scores["v-empty"]


@contextmanager
def _cluster() -> Iterator[Env]:
    source = FakeSource(NS)
    clock = FakeClock()
    with make_env(source, clock, Settings(namespace=NS, stale_after_seconds=120)) as e:
        yield e


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    system=st.sampled_from(sorted(SYSTEMS)),
    in_use=st.lists(st.sets(st.integers(0, 7), max_size=7), min_size=2, max_size=6),
    gpus=st.sampled_from([1, 2, 3, 4, 8]),
    nvlink=st.sampled_from(["required", "preferred", "ignore"]),
)
def test_prioritize_keeps_the_engines_order_strictly(
    system: str, in_use: list[set[int]], gpus: int, nvlink: str
) -> None:
    """On every named system and random in-use sets, the wire carries the engine's own order (score,
    then name): its first choice gets strictly the top score, whatever kube-scheduler adds."""
    n = len(build_system(system, "probe").gpus)
    names = [f"n{i}" for i in range(len(in_use))]
    used = [sorted(g for g in s if g < n) for s in in_use]
    ann = {"gputopo.io/nvlink": nvlink}
    with _cluster() as env:
        env.add_nodes(*(node_obj(name, system, in_use=u) for name, u in zip(names, used, strict=True)))
        wire = env.prioritize(gputopo_pod("p", gpus, nvlink=nvlink), names)
    req = parse_pod_request(ann, gpus)
    pairs = zip(names, used, strict=True)
    states = [node_state(name, build_system(system, name), in_use=frozenset(u)) for name, u in pairs]
    ranked = rank(evaluate_pod(states, req))
    # Exactly the engine's order: its i-th node gets 10 - i (the tenth 1), every other node 0; the answer
    # then lowers all by the lowest (which changes no difference between nodes).
    expected = {v.name: max(0, MAX_EXTENDER_SCORE - i) for i, v in enumerate(ranked)}
    lowest = min(expected.get(n, 0) for n in names)
    assert wire == {n: expected.get(n, 0) - lowest for n in names}


def test_explain_prints_each_nodes_engine_score_next_to_its_wire_score(
    env: Env, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    env.add_nodes(node_obj("v-frag", "dgx-1v", in_use=[1]), node_obj("v-empty", "dgx-1v"))
    env.source.put("pods", pod_obj("tp4", 4, {"gputopo.io/nvlink": "required"}))
    env.resync()
    monkeypatch.setattr(inspect, "_source", lambda _args: env.source)
    args = argparse.Namespace(pod="tp4", namespace="default", stale_after_seconds=1e12, gputopo_namespace=NS)
    assert inspect.run(args) == 0
    table = capsys.readouterr().out.split("NODE", 1)[1]
    header, first, second = table.splitlines()[:3]
    assert header.split()[:5] == ["VERDICT", "SCORE", "WIRE", "GPUS", "WHY"]
    # Best first: the engine's 0.7279 beats 0.7140 (both grade 7), and the wire says so by a whole step.
    assert first.split()[:5] == ["v-frag", "fits", "0.7279", "10", "4-7"]
    assert second.split()[:5] == ["v-empty", "fits", "0.7140", "9", "0-3"]
