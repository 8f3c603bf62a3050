"""Bind: placement annotation first, then the Binding, then the TopologyPlacement event; idempotent."""

from __future__ import annotations

import json

import pytest

from extender.kube import ApiError
from extender.service import NODE_LABEL
from extender.testing import Env, gputopo_pod, node_obj, pod_obj
from gputopo.model import PLACEMENT_ANNOTATION, parse_placement


@pytest.fixture
def cluster(env: Env) -> Env:
    env.add_nodes(
        node_obj("gpu-07", leaf="ib-leaf-3", spine="s1"),
        node_obj("gpu-09", in_use=[0, 2, 4, 6], leaf="ib-leaf-3", spine="s1"),
        node_obj("pcie", "l40s-4"),
    )
    return env


def test_bind_writes_placement_then_binding_then_event(cluster: Env) -> None:
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
    assert stored["metadata"]["labels"][NODE_LABEL] == "gpu-07"
    assert stored["spec"]["nodeName"] == "gpu-07"

    calls = [c for c in cluster.source.calls if not c.startswith(("list", "watch"))]
    assert calls.index("patch pod default/train-0") < calls.index("bind default/train-0 gpu-07")
    assert calls.index("bind default/train-0 gpu-07") < calls.index("event default")
    assert cluster.source.bindings == [("default", "train-0", "uid-default-train-0", "gpu-07")]

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
    assert cluster.source.bindings == [] and cluster.source.patches == []


def test_bind_backs_off_when_another_replica_already_claimed_the_gpus(cluster: Env) -> None:
    """Another replica's placement is not in our cache yet: our claim is written, the check after it
    finds the overlap, ours is retracted and nothing is bound (kube-scheduler retries the pod)."""
    pod = gputopo_pod("mine", 8)
    cluster.add_pods(pod)
    theirs = pod_obj(
        "theirs",
        4,
        {
            "gputopo.io/nvlink": "required",
            PLACEMENT_ANNOTATION: json.dumps(
                {"node": "gpu-07", "gpus": [0, 1, 2, 3], "score": 9, "reason": "other replica"}
            ),
        },
    )
    theirs["metadata"]["labels"] = {NODE_LABEL: "gpu-07"}
    cluster.source.put("pods", theirs)  # no resync: the watch has not delivered it
    err = cluster.bind(pod, "gpu-07")
    assert "were just claimed by pod default/theirs; retry" in err
    assert cluster.source.bindings == []
    mine = cluster.source.get_pod("default", "mine")
    assert PLACEMENT_ANNOTATION not in mine["metadata"].get("annotations", {}), "our claim was retracted"
    cluster.resync()  # once the watch delivers theirs, the retry sees the GPUs taken
    assert "fewer than 8 free GPUs" in cluster.bind(pod, "gpu-07")


def test_bind_backs_off_when_a_concurrent_placement_claims_the_same_gpus(
    cluster: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Write-then-verify: a claim that lands between our read and our write makes us retract ours."""
    pod = gputopo_pod("mine", 8)
    cluster.add_pods(pod)
    original = cluster.source.patch_pod_metadata

    def racing_patch(namespace: str, name: str, **kw: object) -> dict[str, object]:
        result = original(namespace, name, **kw)  # type: ignore[arg-type]
        if name == "mine" and kw["annotations"].get(PLACEMENT_ANNOTATION):  # type: ignore[attr-defined]
            other = pod_obj(
                "racer",
                1,
                {
                    "gputopo.io/nvlink": "ignore",
                    PLACEMENT_ANNOTATION: json.dumps(
                        {"node": "gpu-07", "gpus": [5], "score": 9, "reason": "other replica"}
                    ),
                },
            )
            other["metadata"]["labels"] = {NODE_LABEL: "gpu-07"}
            cluster.source.put("pods", other)
        return result

    monkeypatch.setattr(cluster.source, "patch_pod_metadata", racing_patch)
    err = cluster.bind(pod, "gpu-07")
    assert "just claimed by pod default/racer" in err
    assert cluster.source.bindings == []
    stored = cluster.source.get("pods", "default", "mine")
    assert stored is not None and PLACEMENT_ANNOTATION not in stored["metadata"]["annotations"]


def test_a_failed_binding_retracts_the_placement(cluster: Env) -> None:
    pod = gputopo_pod("train-0", 4)
    cluster.add_pods(pod)
    cluster.source.fail_binding = ApiError(403, "pods/binding is forbidden", "Forbidden")
    err = cluster.bind(pod, "gpu-07")
    assert "binding pod default/train-0 to node gpu-07 failed" in err and "forbidden" in err
    stored = cluster.source.get("pods", "default", "train-0")
    assert stored is not None and PLACEMENT_ANNOTATION not in stored["metadata"]["annotations"]
    assert cluster.cache.node_for("gpu-07").in_use == frozenset()


def test_a_plain_pod_is_bound_without_annotation_or_event(cluster: Env) -> None:
    pod = pod_obj("plain", 1)
    cluster.add_pods(pod)
    assert cluster.bind(pod, "pcie") == ""
    assert cluster.source.bindings == [("default", "plain", "uid-default-plain", "pcie")]
    assert cluster.source.patches == [] and cluster.source.events == []


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
        raise ApiError(403, "events is forbidden", "Forbidden")

    monkeypatch.setattr(cluster.source, "create_event", no_events)
    assert cluster.bind(pod, "gpu-07") == ""
    assert cluster.source.bindings
