"""Pod objects, read by the one Pod reader (gputopo.model.pod.read_pod) on both sides: the extender's
`pod_info` and the agent's `parse_local_pod` accept the same Pods, read the same fields from them, and refuse
the same hostile ones with the same message naming the field (wrong types, huge annotation maps, integers
in another script's digits). One difference is by design and stated: the agent keys its view by UID, so a
Pod without one (a review's pod before it exists) is read by the extender and skipped by the agent."""

from __future__ import annotations

import copy
import tracemalloc
from typing import Any

import pytest

from gputopo.agent import pods as agent_pods
from gputopo.agent.pods import MalformedPodError, StaticLocalPods, parse_local_pod
from gputopo.extender.wire import WireError, pod_info
from gputopo.model import GPU_RESOURCE

NODE = "node-a"
EPOCH_2026 = 1767225600.0


def pod(**over: Any) -> dict[str, Any]:
    """A bound 2-GPU pod; `over` sets dotted paths (`metadata.uid=None` removes the field)."""
    obj: dict[str, Any] = {
        "metadata": {
            "name": "p",
            "namespace": "team",
            "uid": "uid-p",
            "annotations": {"note": "x"},
            "labels": {"app": "train"},
            "creationTimestamp": "2026-01-01T00:00:00Z",
        },
        "spec": {
            "nodeName": NODE,
            "schedulerName": "gputopo-scheduler",
            "containers": [{"name": "main", "resources": {"limits": {GPU_RESOURCE: "2"}}}],
        },
        "status": {"phase": "Running"},
    }
    for path, value in over.items():
        cur = obj
        *parents, leaf = path.split(".")
        for k in parents:
            cur = cur.setdefault(k, {})
        if value is None:
            cur.pop(leaf, None)
        else:
            cur[leaf] = value
    return obj


def limits(*counts: Any) -> list[dict[str, Any]]:
    return [{"name": f"c{i}", "resources": {"limits": {GPU_RESOURCE: n}}} for i, n in enumerate(counts)]


def extender_side(obj: Any) -> tuple[Any, ...] | str:
    """What the extender reads of the fields both sides use, or its error's message."""
    try:
        info = pod_info(obj)
    except WireError as e:
        return str(e)
    return (info.namespace, info.name, info.uid, info.phase, info.request.total, info.request.containers, info.created)


def agent_side(obj: Any) -> tuple[Any, ...] | str:
    """The same from the agent's LocalPod (its containers list keeps those with GPUs)."""
    try:
        local, _ = parse_local_pod(obj, NODE)
    except MalformedPodError as e:
        return str(e)
    return (
        local.namespace,
        local.name,
        local.uid,
        local.phase,
        local.gpus_requested,
        local.container_gpus,
        local.created,
    )


def _with_gpus_only(read: tuple[Any, ...] | str) -> tuple[Any, ...] | str:
    if isinstance(read, str):
        return read
    *head, containers, created = read
    return (*head, tuple((c, n) for c, n in containers if n > 0), created)


HUGE = {f"example.com/k{i}": "v" * 8 for i in range(50_000)}

READ = [
    pytest.param(pod(), ("team", "p", "uid-p", "Running", 2, (("main", 2),), EPOCH_2026), id="a bound pod"),
    pytest.param(
        pod(**{"metadata.namespace": None, "status": None, "metadata.creationTimestamp": None}),
        ("default", "p", "uid-p", "", 2, (("main", 2),), 0.0),
        id="no namespace, status or creation time: the defaults",
    ),
    pytest.param(
        pod(**{"spec.containers": limits("1", 0), "spec.initContainers": limits("4")}),
        ("team", "p", "uid-p", "Running", 4, (("c0", 1),), EPOCH_2026),
        id="an init container larger than the app containers",
    ),
    pytest.param(
        pod(**{"metadata.annotations": HUGE}),
        ("team", "p", "uid-p", "Running", 2, (("main", 2),), EPOCH_2026),
        id="50,000 annotations",
    ),
    pytest.param(
        pod(**{"metadata.deletionTimestamp": "2026-01-01T00:01:00Z", "status.phase": "Succeeded"}),
        ("team", "p", "uid-p", "Succeeded", 2, (("main", 2),), EPOCH_2026),
        id="being deleted, terminated",
    ),
]


@pytest.mark.parametrize(("obj", "expected"), READ)
def test_both_sides_read_the_same_fields(obj: dict[str, Any], expected: tuple[Any, ...]) -> None:
    assert _with_gpus_only(extender_side(obj)) == expected
    assert agent_side(obj) == expected


REFUSED = [
    pytest.param([pod()], "Pod must be a Pod object", id="a list, not an object"),
    pytest.param(pod(metadata=[1]), "Pod.metadata is missing", id="metadata a list"),
    pytest.param(pod(**{"metadata.name": 7}), "Pod.metadata.name is missing", id="name a number"),
    pytest.param(pod(**{"metadata.namespace": 7}), "Pod.metadata.namespace must be a string", id="namespace a number"),
    pytest.param(pod(**{"metadata.uid": ["u"]}), "Pod.metadata.uid must be a string", id="uid a list"),
    pytest.param(
        pod(**{"metadata.annotations": {**HUGE, "zz": 1}}),
        "Pod.metadata.annotations['zz'] must be a string, not int",
        id="50,000 annotations, the last one a number",
    ),
    pytest.param(
        pod(**{"metadata.labels": {"app": None}}), "Pod.metadata.labels['app'] must be a string", id="a label null"
    ),
    pytest.param(pod(**{"status.phase": 3}), "Pod.status.phase must be a string", id="phase a number"),
    pytest.param(pod(spec="x"), "Pod.spec must be an object", id="spec a string"),
    pytest.param(pod(status=["Running"]), "Pod.status must be an object", id="status a list"),
    pytest.param(pod(**{"spec.nodeName": 1}), "Pod.spec.nodeName must be a string", id="nodeName a number"),
    pytest.param(pod(**{"spec.containers": "x"}), "Pod.spec.containers must be a list", id="containers a string"),
    pytest.param(
        pod(**{"spec.containers": limits(True)}), "is not a Kubernetes quantity", id="a GPU count that is a boolean"
    ),
    pytest.param(
        pod(**{"spec.containers": limits("٣")}),
        "Pod.spec.containers[0].resources.limits.nvidia.com/gpu: '٣': not a Kubernetes quantity",
        id="a GPU count in Arabic-Indic digits",
    ),
    pytest.param(
        pod(**{"spec.containers": limits("３")}),
        "Pod.spec.containers[0].resources.limits.nvidia.com/gpu: '３'",
        id="a GPU count in full-width digits",
    ),
    pytest.param(pod(**{"spec.containers": limits("2²")}), "'2²': not a Kubernetes quantity", id="a superscript"),
    pytest.param(
        pod(**{"spec.containers": limits(10**30)}), "out of range", id="a GPU count past int64, as a JSON number"
    ),
    pytest.param(
        pod(**{"metadata.creationTimestamp": "٢٠٢٦-01-01T00:00:00Z"}),
        "Pod.metadata.creationTimestamp is not an RFC 3339 time",
        id="a creation time in Arabic-Indic digits",
    ),
    pytest.param(
        pod(**{"metadata.creationTimestamp": 1767225600}),
        "Pod.metadata.creationTimestamp is not an RFC 3339 time",
        id="a creation time as a number",
    ),
    pytest.param(
        pod(**{"spec.resourceClaims": {"gpus": "t"}}),
        "Pod.spec.resourceClaims must be a list of at most 32 claims",
        id="resourceClaims an object",
    ),
]


@pytest.mark.parametrize(("obj", "message"), REFUSED)
def test_both_sides_refuse_the_same_pod_naming_the_field(obj: Any, message: str) -> None:
    extender, agent = extender_side(obj), agent_side(obj)
    assert isinstance(extender, str) and message in extender
    assert agent == extender


def test_a_pod_without_a_uid_is_read_by_the_extender_and_skipped_by_the_agent() -> None:
    obj = pod(**{"metadata.uid": None})
    assert extender_side(obj) == ("team", "p", "", "Running", 2, (("main", 2),), EPOCH_2026)
    assert agent_side(obj) == "Pod.metadata.uid is missing"


def test_reading_leaves_the_object_as_it_was() -> None:
    obj = pod(**{"metadata.annotations": dict(list(HUGE.items())[:100])})
    before = copy.deepcopy(obj)
    pod_info(obj)
    parse_local_pod(obj, NODE)
    assert obj == before


def _placement_rewritten(i: int) -> list[dict[str, Any]]:
    """One bound pod whose gputopo.io/placement is rewritten with another 100 KB of garbage each time."""
    return [pod(**{"metadata.annotations": {"gputopo.io/placement": f"{i:08d}" + "x" * 100_000}})]


def _malformed_pods(i: int) -> list[dict[str, Any]]:
    """Twenty new pods each time, each refused by the reader (a GPU count that is no quantity)."""
    return [pod(**{"metadata.uid": f"uid-{i}-{j}", "spec.containers": limits("lots")}) for j in range(20)]


@pytest.mark.parametrize(
    ("objects", "most"),
    [
        pytest.param(_placement_rewritten, 8 * 1024 * 1024, id="placement-rewritten-1000-times-100-kb-each"),
        pytest.param(_malformed_pods, 2 * 1024 * 1024, id="20000-malformed-pods"),
    ],
)
def test_the_agent_keeps_no_memory_of_each_hostile_pod_it_has_logged(
    objects: Any, most: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The agent logs each unreadable pod or placement once; what it keeps to know that is bounded in count and
    # size, whatever a tenant writes (a placement is someone else's only while the chart's policy is on).
    monkeypatch.setattr(agent_pods.log, "disabled", True)  # the test's log capture would keep every line
    view = StaticLocalPods(NODE)
    for i in range(50):  # warm: the logger's and the reader's own caches
        view.set_objects(objects(i))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(50, 1000):
            view.set_objects(objects(i))
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < most  # of about 100 MB of placements, or 7 MB of 20,000 pods' names and problems
