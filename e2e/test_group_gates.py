"""Gang members wait outside kube-scheduler's queue until their group is whole (docs/annotations.md, "While a
gang is gated"): the extender's webhook (``--group-gate``) gives each member the ``gputopo.io/group-complete``
scheduling gate at creation, the extender lifts it for every member once the group is whole, through the
chart's RBAC and its gate ValidatingAdmissionPolicy, and a group that never completes is told so and released.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import workloads as wl

from conftest import StackNodes, serve
from gputopo.localcluster import TEST_LABEL, ControlPlane, KubeApiError, KubeClient, PodScheduling, pod_manifest
from gputopo.localcluster.promstats import http_get
from gputopo.localcluster.stack import ChartRelease, GpuNode, SchedulerPods, Stack, StackTiming
from gputopo.model import PLACEMENT_ANNOTATION, parse_placement
from gputopo.model.gates import GROUP_GATE

pytestmark = pytest.mark.e2e

SCHEDULER = "gputopo-scheduler"
RELEASE_S = 15


@pytest.fixture(scope="module")
def stack(control_plane: ControlPlane, kube: KubeClient) -> Iterator[Stack]:
    values = {"webhook": {"groupGate": {"enabled": True, "releaseSeconds": RELEASE_S}}}
    yield from serve(
        Stack(
            control_plane,
            kube,
            timing=StackTiming(stale_after_seconds=60),
            scheduler=SchedulerPods(webhook=True),
            chart=ChartRelease(values=values),
        )
    )


@pytest.fixture
def gated(stack: Stack, kube: KubeClient, namespace: str, test_id: str) -> Iterator[str]:
    """The test's namespace, its pod CREATEs sent to the extender's webhook (active once a probe comes back
    mutated: a new configuration takes a moment to reach the admission chain)."""
    name = f"gputopo-e2e-{test_id}"[:63]
    stack.route_pods_to_webhook(name, namespace)
    try:
        yield namespace
    finally:
        kube.request("DELETE", f"/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/{name}")


def member(name: str, namespace: str, test_id: str, *, size: int, stage: int) -> dict[str, Any]:
    """A group member as a user writes it: annotations only, no scheduler (the webhook sets it)."""
    ann = {"gputopo.io/group": "g", "gputopo.io/group-size": str(size), "gputopo.io/stage": str(stage)}
    return pod_manifest(
        name,
        namespace=namespace,
        gpus=8,
        annotations=ann,
        scheduling=PodScheduling(node_selector={TEST_LABEL: test_id}),
    )


def gates(kube: KubeClient, namespace: str, name: str) -> list[str]:
    return [g["name"] for g in kube.get_pod(namespace, name)["spec"].get("schedulingGates") or []]


def lifted(stack: Stack, reason: str) -> float:
    status, text = http_get(stack.pods[0].metrics_url)
    assert status == 200
    want = f'gputopo_extender_group_gates_lifted_total{{reason="{reason}"}} '
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(want))


def test_group_gates_members_wait_gated_until_whole_then_bind_in_rank_order(
    kube: KubeClient, nodes: StackNodes, gated: str, test_id: str
) -> None:
    added = nodes.add(*[GpuNode(f"gg-{i}", "dgx-h100") for i in range(3)])
    kube.create_pods([member(f"m-{i}", gated, test_id, size=3, stage=i) for i in (2, 0)])
    for name in ("m-0", "m-2"):
        assert gates(kube, gated, name) == [GROUP_GATE]
        event = kube.wait_pod_event(gated, name, "GroupGated", contains="of 3 members exist", timeout=30)
        assert f"gated by {GROUP_GATE} until group g is whole" in event.message
        assert not [e for e in kube.pod_events(gated, name) if e.reason == "FailedScheduling"]
    kube.create_pod(member("m-1", gated, test_id, size=3, stage=1))
    bound = kube.wait_pods_bound(gated, ["m-0", "m-1", "m-2"], timeout=60)
    assert set(bound.values()) <= set(added)
    for i in range(3):
        assert gates(kube, gated, f"m-{i}") == []
        p = parse_placement(kube.get_pod(gated, f"m-{i}")["metadata"]["annotations"][PLACEMENT_ANNOTATION])
        assert (p.group, p.stage, p.node) == ("g", i, bound[f"m-{i}"])


def test_group_gates_a_group_that_never_completes_is_told_and_released(
    kube: KubeClient, nodes: StackNodes, gated: str, test_id: str
) -> None:
    nodes.add(GpuNode("gr-0", "dgx-h100"))
    kube.create_pods([member(f"m-{i}", gated, test_id, size=3, stage=i) for i in range(2)])
    for name in ("m-0", "m-1"):
        event = kube.wait_pod_event(
            gated, name, "GroupGateLifted", contains="has 2 of 3 members", timeout=RELEASE_S + 30
        )
        assert event.type == "Warning" and "may never be whole" in event.message
        assert gates(kube, gated, name) == []
        # Now in kube-scheduler's queue, where the group waits as it would without the gate.
        kube.wait_pod_event(gated, name, "FailedScheduling", contains="2/3 pods exist", timeout=60)


def test_group_gates_jobset_members_are_gated_then_bind_as_one_group_in_rank_order(
    stack: Stack, controllers: Callable[..., None], kube: KubeClient, nodes: StackNodes, gated: str, test_id: str
) -> None:
    controllers("jobset")
    added = nodes.add(*[GpuNode(f"gj-{i}", "dgx-h100") for i in range(4)])
    before = lifted(stack, "complete")
    scheduling = PodScheduling(scheduler_name=SCHEDULER, node_selector={TEST_LABEL: test_id})
    js = wl.two_job_jobset("pretrain", gated, pod_manifest("t", gpus=8, scheduling=scheduling)["spec"])
    kube.request("POST", f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{gated}/jobsets", js)
    pods = wl.wait_pods(kube, gated, f"{wl.JOBSET_NAME}=pretrain", 4, timeout=90)
    names = [p["metadata"]["name"] for p in pods]
    bound = kube.wait_pods_bound(gated, names, timeout=120)
    ranks: dict[int, str] = {}
    for name in names:
        pod = kube.get_pod(gated, name)
        assert not pod["spec"].get("schedulingGates"), name
        p = parse_placement(pod["metadata"]["annotations"][PLACEMENT_ANNOTATION])
        assert p.group == "jobset/pretrain" and p.stage is not None and p.node == bound[name]
        ranks[p.stage] = p.node
    assert sorted(ranks) == [0, 1, 2, 3] and set(ranks.values()) == set(added)
    assert lifted(stack, "complete") >= before + 4  # every member was gated and its gate lifted


def test_group_gates_the_scheduler_may_lift_its_gate_and_change_nothing_else(
    stack: Stack, kube: KubeClient, gated: str, test_id: str
) -> None:
    pod = member("held", gated, test_id, size=4096, stage=0)
    pod["spec"]["schedulingGates"] = [{"name": "example.com/mine"}]
    kube.create_pod(pod)
    assert gates(kube, gated, "held") == ["example.com/mine", GROUP_GATE]
    path = f"/api/v1/namespaces/{gated}/pods/held"
    json_patch = "application/json-patch+json"
    with KubeClient(stack.pods[0].kubeconfig) as as_scheduler:
        # Lifting its gate is allowed, so the same patch with anything else is refused for that else.
        ours = [{"op": "remove", "path": "/spec/schedulingGates/1"}]
        label = [*ours, {"op": "add", "path": "/metadata/labels", "value": {"forged": "yes"}}]
        with pytest.raises(KubeApiError) as refused:
            as_scheduler.request("PATCH", path, label, content_type=json_patch)
        assert "may not change metadata.labels" in str(refused.value)
        theirs = [{"op": "remove", "path": "/spec/schedulingGates/0"}]
        with pytest.raises(KubeApiError) as refused:
            as_scheduler.request("PATCH", path, theirs, content_type=json_patch)
        assert f"may only remove the {GROUP_GATE} scheduling gate" in str(refused.value)
        try:
            as_scheduler.request("PATCH", path, ours, content_type=json_patch)
        except KubeApiError as e:  # the extender's own sweep may have lifted it first (size 4096: not yet)
            assert e.status == 422, e
    assert gates(kube, gated, "held") == ["example.com/mine"]
