"""With --filter-best-only (the chart's default) a lone GPU pod's filter passes only the node prioritize would
rank first, so kube-scheduler skips its score plugins and the prioritize call; what fails, what is no
gputopo pod's and a gang member's planned node are answered as before, and the placement is the same."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gputopo.extender.settings import Settings
from gputopo.model import PLACEMENT_ANNOTATION, parse_placement
from tests.extender.harness import JSON, Env, gputopo_pod, node_obj, pod_obj

NODES = ["gpu-1", "gpu-2", "gpu-3", "gpu-4"]


def _cluster(env: Env) -> None:
    env.add_nodes(
        node_obj("gpu-1", leaf="leaf-a", spine="s1"),
        node_obj("gpu-2", leaf="leaf-a", spine="s1", in_use=[0, 1, 2, 3]),  # half full: the tighter fit
        node_obj("gpu-3", leaf="leaf-b", spine="s1"),
        node_obj("gpu-4", leaf="leaf-b", spine="s1", in_use=list(range(8))),
    )


def _top(env: Env, pod: JSON, names: list[str]) -> str:
    """The node prioritize ranks first, with every fitting node passed."""
    env.extender.best_only = False
    passed = env.passed(pod, names)
    scores = env.prioritize(pod, passed)
    env.extender.best_only = True
    return max(passed, key=lambda n: (scores[n], n))


@pytest.mark.parametrize(
    ("pod", "expect"),
    [
        pytest.param(lambda: gputopo_pod("small", 4), "top", id="a-lone-pod-passes-only-its-best-node"),
        pytest.param(lambda: gputopo_pod("whole", 8), "top", id="equal-nodes-pass-the-one-prioritize-ranks-first"),
        pytest.param(lambda: gputopo_pod("huge", 16), "none", id="a-pod-nothing-fits-is-told-why-as-before"),
        pytest.param(lambda: pod_obj("plain", 0), "all", id="a-pod-not-gputopo-s-passes-every-node"),
    ],
)
def test_the_filter_passes_the_best_node_only(env: Env, pod: Callable[[], JSON], expect: str) -> None:
    _cluster(env)
    asked = pod()
    if expect == "top":
        best = _top(env, asked, NODES)
        assert env.passed(asked, NODES) == [best]
    elif expect == "none":
        env.extender.best_only = True
        assert env.reasons(asked, NODES)  # the reasons kube-scheduler shows and preempts by
    else:
        env.extender.best_only = True
        assert env.passed(asked, NODES) == NODES


def test_off_every_fitting_node_passes(env: Env) -> None:
    _cluster(env)
    env.extender.best_only = False
    assert env.passed(gputopo_pod("small", 4), NODES) == ["gpu-1", "gpu-2", "gpu-3"]


def test_the_placement_and_its_sentence_are_the_ones_prioritize_would_have_made(env: Env) -> None:
    _cluster(env)
    pod = gputopo_pod("small", 4)
    best = _top(env, pod, NODES)
    env.add_pods(pod)
    (node,) = env.passed(pod, NODES)
    assert node == best == "gpu-2"  # the half-full node: packed
    assert env.bind(pod, node) == ""
    stored = env.source.get("pods", "default", "small")
    assert stored is not None
    placement = parse_placement(stored["metadata"]["annotations"][PLACEMENT_ANNOTATION])
    assert placement.node == "gpu-2" and placement.reason


def test_a_gang_member_still_passes_its_planned_node(env: Env) -> None:
    _cluster(env)
    env.extender.best_only = True
    members = [gputopo_pod(f"m-{i}", 8, group="g", group_size="2", stage=str(i)) for i in range(2)]
    env.add_pods(*members)
    planned = {env.passed(m, NODES)[0] for m in members}
    assert planned == {"gpu-1", "gpu-3"}


def test_the_setting_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUTOPO_FILTER_BEST_ONLY", "true")
    assert Settings().filter_best_only is True
    monkeypatch.setenv("GPUTOPO_FILTER_BEST_ONLY", "maybe")
    with pytest.raises(ValueError, match="filter_best_only"):
        Settings()
