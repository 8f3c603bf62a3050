"""The one door into the verbs (`gputopo.extender.verbs.door.Door`): what it routes, where each verb runs, and the two
hooks
the verbs server calls for the prioritize-ahead memory, driven in process as the server drives them."""

from __future__ import annotations

from collections.abc import Callable

import orjson
import pytest

from tests.extender.harness import JSON, Env, args, gputopo_pod, node_obj, pod_obj

NODES = ["dgx-0", "dgx-1", "a100-0"]


@pytest.fixture
def cluster(env: Env) -> Env:
    env.add_nodes(node_obj("dgx-0"), node_obj("dgx-1", in_use=[0, 1, 2, 3]), node_obj("a100-0", "dgx-a100"))
    return env


@pytest.mark.parametrize(
    ("method", "path", "routed"),
    [
        (b"POST", "/filter", "filter"),
        (b"POST", "/prioritize", "prioritize"),
        (b"POST", "/bind", "bind"),
        (b"POST", "/preempt", "preempt"),
        (b"GET", "/healthz", "healthz"),
        (b"HEAD", "/readyz", "readyz"),
        (b"GET", "/filter", 405),
        (b"HEAD", "/bind", 405),
        (b"POST", "/healthz", 405),
        (b"POST", "/mutate", 404),
        (b"GET", "/metrics", 404),
        (b"POST", "filter", 404),
        (b"POST", "/", 404),
    ],
)
def test_route_names_the_verb_or_answers_404_and_405_in_json(
    env: Env, method: bytes, path: str, routed: str | int
) -> None:
    got = env.door.route(method, path)
    if isinstance(routed, str):
        assert got == routed
    else:
        assert isinstance(got, tuple) and got[0] == routed
        assert path in orjson.loads(got[1])["Error"]


def test_only_the_posted_verbs_read_a_body_and_run_on_workers(env: Env) -> None:
    door = env.door
    assert [v for v in ("filter", "prioritize", "bind", "preempt", "healthz", "readyz") if door.reads_body(v)] == [
        "filter",
        "prioritize",
        "bind",
        "preempt",
    ]
    assert door.pool_for("healthz") is None and door.pool_for("readyz") is None  # on the loop
    decide, binds = door.pool_for("filter"), door.pool_for("bind")
    assert decide is not None and binds is not None and decide is not binds  # a filter never queues behind binds
    assert door.pool_for("prioritize") is decide and door.pool_for("preempt") is decide


def test_health_answers_and_an_unknown_verb(cluster: Env) -> None:
    assert cluster.call("healthz").json() == {"status": "ok"}
    assert cluster.call("readyz").json() == {"status": "ready", "nodes": 3}
    unknown = cluster.call("mutate", {})
    assert unknown.status == 404 and "/mutate" in unknown.json()["Error"]


def _filter_then_after(env: Env, pod: JSON) -> list[str]:
    """A filter as the server runs it: answered, then the door's `after` hook once it is written."""
    passed: list[str] = env.filter(pod, NODES)["NodeNames"]
    env.door.after("filter")
    return passed


def test_the_prioritize_computed_ahead_is_what_prioritize_computes_afresh(cluster: Env) -> None:
    pod = gputopo_pod("p", 4)
    passed = _filter_then_after(cluster, pod)
    body = orjson.dumps(args(pod, passed))
    ready = cluster.door.ready("prioritize", body)
    assert ready is not None
    assert ready == cluster.door.answer("prioritize", body)
    assert cluster.door.ready("prioritize", body) is None  # handed out once


Change = Callable[[Env, JSON, list[str]], bytes]  # what happens before prioritize: its body


def _another_pod(_env: Env, _pod: JSON, passed: list[str]) -> bytes:
    return orjson.dumps(args(gputopo_pod("other", 4), passed))


def _other_nodes(_env: Env, pod: JSON, passed: list[str]) -> bytes:
    return orjson.dumps(args(pod, passed[:1]))


def _unreadable(_env: Env, _pod: JSON, _passed: list[str]) -> bytes:
    return b"{not json"


def _a_passed_node_changed(env: Env, pod: JSON, passed: list[str]) -> bytes:
    env.add_nodes(node_obj("dgx-0", in_use=[4, 5, 6, 7]))  # its agent reports other GPUs in use
    return orjson.dumps(args(pod, passed))


@pytest.mark.parametrize(
    "change",
    [_another_pod, _other_nodes, _unreadable, _a_passed_node_changed],
    ids=["another pod", "other nodes", "unreadable", "a passed node changed"],
)
def test_the_prioritize_computed_ahead_is_not_used_for_another_request_or_a_changed_node(
    cluster: Env, change: Change
) -> None:
    pod = gputopo_pod("p", 4)
    passed = _filter_then_after(cluster, pod)
    assert "dgx-0" in passed and len(passed) > 1
    body = change(cluster, pod, passed)
    assert cluster.door.ready("prioritize", body) is None


def test_a_plain_pod_leaves_nothing_ahead(cluster: Env) -> None:
    pod = pod_obj("plain", 1)
    passed = _filter_then_after(cluster, pod)
    assert passed == NODES
    assert cluster.door.ready("prioritize", orjson.dumps(args(pod, passed))) is None
