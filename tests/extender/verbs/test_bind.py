"""Bind: one Binding that carries the placement annotation, then the TopologyPlacement event; idempotent;
only bound pods (or binds in flight) hold GPUs."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest

from gputopo.extender.app import create_listeners
from gputopo.extender.settings import Settings
from gputopo.kube import KubeError
from gputopo.model import PLACEMENT_ANNOTATION, parse_placement
from tests.extender.fake import FakeSource
from tests.extender.harness import JSON, NS, Env, FakeClock, gputopo_pod, node_obj, pod_obj


@pytest.fixture
def cluster(env: Env) -> Env:
    env.add_nodes(
        node_obj("gpu-07", leaf="ib-leaf-3", spine="s1"),
        node_obj("gpu-09", in_use=[0, 2, 4, 6], leaf="ib-leaf-3", spine="s1"),
        node_obj("pcie", "l40s-4"),
    )
    return env


def test_bind_is_one_binding_carrying_the_placement_then_the_event(cluster: Env) -> None:
    pod = gputopo_pod("train-0", 4)
    cluster.add_pods(pod)
    assert cluster.bind(pod, "gpu-07") == ""

    stored = cluster.source.get("pods", "default", "train-0")
    assert stored is not None
    placement = parse_placement(stored["metadata"]["annotations"][PLACEMENT_ANNOTATION])
    assert placement.node == "gpu-07"
    assert len(placement.gpus) == 4
    assert 0 <= placement.score <= 10
    assert placement.reason.startswith("GPUs ")
    assert "gpu-07 form a full NVLink clique (NV18 via NVSwitch)" in placement.reason
    assert placement.runner_up is not None and placement.runner_up.node == "gpu-09"
    assert placement.runner_up.why
    # The predicted all-reduce of the chosen GPUs and the runner-up's travel with the placement.
    assert placement.estimate is not None and placement.estimate.message_bytes == 1 << 30
    assert placement.estimate.all_reduce_ms is not None and placement.estimate.all_reduce_ms > 0
    assert placement.estimate.runner_up_all_reduce_ms is not None
    assert f"est. 1 GiB all-reduce {placement.estimate.all_reduce_ms:.1f} ms" in placement.reason
    assert "labels" not in stored["metadata"], "no claim label any more"
    assert stored["spec"]["nodeName"] == "gpu-07"

    calls = [c for c in cluster.source.calls if not c.startswith(("list", "watch"))]
    assert calls == ["get pod default/train-0", "bind default/train-0 gpu-07", "event default"]
    assert cluster.source.bindings == [("default", "train-0", "uid-default-train-0", "gpu-07")]
    assert cluster.source.binding_annotations == [{PLACEMENT_ANNOTATION: placement.to_annotation()}]

    (event,) = cluster.source.events
    assert event["reason"] == "TopologyPlacement"
    assert event["type"] == "Normal"
    assert event["message"] == placement.reason
    assert event["involvedObject"] == {
        "apiVersion": "v1",
        "kind": "Pod",
        "name": "train-0",
        "namespace": "default",
        "uid": "uid-default-train-0",
    }
    assert event["source"] == {"component": "gputopo-extender"}
    assert event["reportingComponent"] == "gputopo-extender"


def test_bound_gpus_count_as_used_for_the_next_pod_at_once(cluster: Env) -> None:
    first, second = gputopo_pod("a", 8), gputopo_pod("b", 8)
    cluster.add_pods(first, second)
    assert cluster.bind(first, "gpu-07") == ""
    out = cluster.filter(second, ["gpu-07"])
    assert out["FailedNodes"] == {"gpu-07": "fewer than 8 free GPUs"}


def test_binding_an_already_bound_pod_to_the_same_node_succeeds(cluster: Env) -> None:
    pod = gputopo_pod("train-0", 4)
    cluster.add_pods(pod)
    assert cluster.bind(pod, "gpu-07") == ""
    assert cluster.bind(pod, "gpu-07") == ""
    assert len(cluster.source.bindings) == 1
    assert len(cluster.source.events) == 1


def test_binding_a_pod_bound_elsewhere_is_an_error(cluster: Env) -> None:
    pod = gputopo_pod("train-0", 4)
    cluster.add_pods(pod)
    assert cluster.bind(pod, "gpu-07") == ""
    assert "already bound to node gpu-07" in cluster.bind(pod, "gpu-09")


def test_bind_refuses_a_node_that_no_longer_fits_and_writes_nothing(cluster: Env) -> None:
    pod = gputopo_pod("big", 8)
    cluster.add_pods(pod)
    err = cluster.bind(pod, "gpu-09")
    assert "no longer fits" in err and "fewer than 8 free GPUs" in err
    assert cluster.source.bindings == []
    assert not any(c.startswith("bind") for c in cluster.source.calls)


def user_placed(name: str, node: str, gpus: list[int], *, bound_to: str | None = None) -> JSON:
    """A pod whose gputopo.io/placement someone wrote by hand (any pod author can)."""
    ann = {
        "gputopo.io/nvlink": "ignore",
        PLACEMENT_ANNOTATION: json.dumps({"node": node, "gpus": gpus, "score": 9, "reason": "hand-written"}),
    }
    return pod_obj(name, len(gpus), ann, node=bound_to)


@pytest.mark.parametrize(
    ("bound_to", "held"),
    [
        pytest.param(None, frozenset(), id="unbound: reserves nothing"),
        pytest.param("gpu-09", frozenset(), id="bound to another node: nothing on the named one"),
        pytest.param("gpu-07", frozenset(range(8)), id="bound to the named node: honoured"),
    ],
)
def test_a_placement_holds_gpus_only_on_the_node_the_pod_is_bound_to(
    cluster: Env, bound_to: str | None, held: frozenset[int]
) -> None:
    """Two unbound pods carrying hand-written placements once blocked two 8-GPU nodes."""
    cluster.add_pods(user_placed("squatter", "gpu-07", list(range(8)), bound_to=bound_to))
    assert cluster.ledger.node_for("gpu-07").in_use == held
    fits = cluster.filter(gputopo_pod("real", 8), ["gpu-07"])["NodeNames"] == ["gpu-07"]
    assert fits is (bound_to != "gpu-07")


def test_gpus_of_a_bind_in_flight_are_taken_for_everyone_else(cluster: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between choosing the GPUs and the Binding's answer, a filter or a bind for another pod sees them."""
    mine, other = gputopo_pod("mine", 8), gputopo_pod("other", 8)
    cluster.add_pods(mine, other)
    seen: list[JSON] = []
    binds: list[str] = []
    original = cluster.source.create_binding
    extender = cluster.extender

    def observing(namespace: str, name: str, uid: str, node: str, **kw: Any) -> None:
        if name == "mine":
            seen.append(cluster.filter(other, ["gpu-07"]))
            binds.append(extender.bind("default", "other", "uid-default-other", "gpu-07"))
        original(namespace, name, uid, node, **kw)

    monkeypatch.setattr(cluster.source, "create_binding", observing)
    assert cluster.bind(mine, "gpu-07") == ""
    (during,) = seen
    assert during["FailedNodes"] == {"gpu-07": "fewer than 8 free GPUs"}
    assert binds == ["node gpu-07 no longer fits pod default/other: fewer than 8 free GPUs"]
    assert cluster.source.bindings == [("default", "mine", "uid-default-mine", "gpu-07")]
    assert cluster.ledger.node_for("gpu-07").in_use == frozenset(range(8))  # now through the bound pod


def test_a_failed_binding_writes_no_placement_and_holds_no_gpus(cluster: Env) -> None:
    pod = gputopo_pod("train-0", 4)
    cluster.add_pods(pod)
    cluster.source.fail_binding = KubeError(403, "pods/binding is forbidden", "Forbidden")
    err = cluster.bind(pod, "gpu-07")
    assert "binding pod default/train-0 to node gpu-07 failed" in err and "forbidden" in err
    stored = cluster.source.get("pods", "default", "train-0")
    assert stored is not None and PLACEMENT_ANNOTATION not in stored["metadata"]["annotations"]
    assert cluster.ledger.node_for("gpu-07").in_use == frozenset()


def test_a_plain_pod_is_bound_without_annotation_or_event(cluster: Env) -> None:
    pod = pod_obj("plain", 1)
    cluster.add_pods(pod)
    assert cluster.bind(pod, "pcie") == ""
    assert cluster.source.bindings == [("default", "plain", "uid-default-plain", "pcie")]
    assert cluster.source.binding_annotations == [{}] and cluster.source.events == []


@pytest.mark.parametrize(
    ("setup", "needle"),
    [
        ("missing", 'pods "ghost" not found'),
        ("api-down", "connection refused"),
        ("uid-mismatch", "the scheduler asked to bind uid"),
    ],
    ids=["pod deleted meanwhile", "API server unreachable", "pod recreated with a new uid"],
)
def test_bind_errors_are_returned_in_the_error_field(cluster: Env, setup: str, needle: str) -> None:
    pod = gputopo_pod("ghost", 4)
    if setup != "missing":
        cluster.add_pods(gputopo_pod("ghost", 4))
    if setup == "api-down":
        cluster.source.down = True
    if setup == "uid-mismatch":
        pod["metadata"]["uid"] = "some-older-uid"
    assert needle in cluster.bind(pod, "gpu-07")


def test_event_failure_does_not_fail_the_bind(cluster: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    pod = gputopo_pod("train-0", 4)
    cluster.add_pods(pod)

    def no_events(*_: object) -> None:
        raise KubeError(403, "events is forbidden", "Forbidden")

    monkeypatch.setattr(cluster.source, "create_event", no_events)
    assert cluster.bind(pod, "gpu-07") == ""
    assert cluster.source.bindings


def test_shutdown_posts_queued_events_then_stops_their_threads() -> None:
    source = FakeSource(NS)
    settings = Settings(namespace=NS, stale_after_seconds=120, reservation_timeout_seconds=120)
    listeners = create_listeners(settings, cluster=source, clock=FakeClock(), watch=False)
    release = threading.Event()
    posted = source.create_event

    def slow_create_event(namespace: str, event: JSON) -> None:
        release.wait(10)  # hold the first Event until shutdown has begun
        posted(namespace, event)

    source.create_event = slow_create_event  # type: ignore[method-assign]
    with listeners.running():
        env = Env(source, FakeClock(), listeners, settings)
        env.add_nodes(node_obj("gpu-07"))
        env.resync()
        pod = gputopo_pod("train-0", 4)
        env.add_pods(pod)
        meta = pod["metadata"]
        bind = {"PodName": meta["name"], "PodNamespace": meta["namespace"], "PodUID": meta["uid"], "Node": "gpu-07"}
        assert env.call("bind", bind).json() == {"Error": ""}
        assert source.events == []  # still queued behind the held post
        release.set()
    # Leaving the app: the queued Event was posted, and the posting threads are gone.
    assert [e["reason"] for e in source.events] == ["TopologyPlacement"]
    extender = listeners.extender
    extender.events.placed(NS, "late", "uid-late", "after shutdown")
    assert [e["reason"] for e in source.events] == ["TopologyPlacement"]
