"""End to end: native PodGroups (Kubernetes 1.37 Workload API, `GenericWorkload`) as gputopo groups,
with the real kube-scheduler's pod group cycle and its gang preemption.

This module runs a control plane of its own with `GenericWorkload=true` and
`--runtime-config=scheduling.k8s.io/v1beta1=true` (PodGroups carry a finalizer that only
kube-controller-manager's PodGroup controller clears, so every test uses a fresh namespace and
leaves it). On releases before 1.37 the API is not served in this form and the tests are skipped.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from conftest import StackNodes, serve
from gputopo.localcluster import (
    TEST_LABEL,
    ApiFeatures,
    ControlPlane,
    KubeClient,
    Lifetime,
    PodScheduling,
    find_binaries,
    pod_manifest,
)
from gputopo.localcluster.binaries import kubernetes_version
from gputopo.localcluster.kube import KubeApiError
from gputopo.localcluster.stack import GpuNode, SchedulerPods, Stack, StackTiming
from gputopo.model import GPUS_IN_USE_ANNOTATION, PLACEMENT_ANNOTATION, parse_gpus_in_use, parse_placement

pytestmark = pytest.mark.e2e

SCHEDULER = "gputopo-podgroups"
GATES = {"GenericWorkload": True}
RUNTIME = {"scheduling.k8s.io/v1beta1": True}
PRIORITIES = {"low": 10, "high": 1000}


@pytest.fixture(scope="module")
def control_plane() -> Iterator[ControlPlane]:
    """This module's own control plane (named as the session's, so that a failed test gets its logs)."""
    bin_dir = find_binaries()
    if bin_dir is None:
        pytest.fail("e2e: the upstream binaries are not built (see e2e/conftest.py)", pytrace=False)
    version = kubernetes_version(bin_dir)
    if version < (1, 37, 0):
        v = ".".join(map(str, version))
        pytest.skip(f"PodGroups are scheduling.k8s.io/v1beta1 from Kubernetes 1.37; the binaries are {v}")
    cp = ControlPlane(
        bin_dir,
        lifetime=Lifetime(keep=os.environ.get("GPUTOPO_E2E_KEEP") == "1"),
        features=ApiFeatures(feature_gates=GATES, runtime_config=RUNTIME),
    )
    cp.start()
    try:
        yield cp
    finally:
        cp.teardown()


@pytest.fixture(scope="module")
def kube(control_plane: ControlPlane) -> Iterator[KubeClient]:
    client = control_plane.client()
    client.apply(
        {
            "apiVersion": "scheduling.k8s.io/v1",
            "kind": "PriorityClass",
            "metadata": {"name": f"e2e-pg-{name}"},
            "value": value,
        }
        for name, value in PRIORITIES.items()
    )
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(scope="module")
def stack(control_plane: ControlPlane, kube: KubeClient) -> Iterator[Stack]:
    yield from serve(
        Stack(
            control_plane,
            kube,
            timing=StackTiming(stale_after_seconds=30, heartbeat_seconds=2, interval_seconds=1),
            scheduler=SchedulerPods(scheduler_name=SCHEDULER, extender_name="gputopo-extender-podgroups"),
        )
    )


@pytest.fixture
def namespace(kube: KubeClient, test_id: str) -> str:
    kube.create_namespace(test_id)
    return test_id


def podgroup(name: str, namespace: str, min_count: int, priority: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"schedulingPolicy": {"gang": {"minCount": min_count}}}
    if priority is not None:
        spec["priorityClassName"] = f"e2e-pg-{priority}"
    return {
        "apiVersion": "scheduling.k8s.io/v1beta1",
        "kind": "PodGroup",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


def gpu_pod(
    name: str,
    namespace: str,
    test_id: str,
    gpus: int,
    *,
    group: str | None = None,
    priority: str | None = None,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    pod = pod_manifest(
        name,
        namespace=namespace,
        gpus=gpus,
        annotations={"gputopo.io/nvlink": "required", **(annotations or {})},
        scheduling=PodScheduling(scheduler_name=SCHEDULER, node_selector={TEST_LABEL: test_id}),
    )
    if group is not None:
        pod["spec"]["schedulingGroup"] = {"podGroupName": group}
    if priority is not None:
        pod["spec"]["priorityClassName"] = f"e2e-pg-{priority}"
    return pod


def report_in_use(stack: Stack, node: str, gpus: list[int]) -> None:
    stack.set_in_use(node, gpus)
    stack.wait_node_annotation(
        node, GPUS_IN_USE_ANNOTATION, lambda v: set(parse_gpus_in_use(v) if v else []) == set(gpus)
    )


def bound_node(kube: KubeClient, namespace: str, pod: str) -> str:
    return str(kube.get_pod(namespace, pod)["spec"].get("nodeName") or "")


def gone(kube: KubeClient, namespace: str, pod: str) -> bool:
    try:
        kube.get_pod(namespace, pod)
    except KubeApiError as e:
        if e.status == 404:
            return True
        raise
    return False


def test_jobs_podgroup_on_one_free_nvlink_pair_binds_neither_member_then_both(
    stack: Stack, nodes: StackNodes, kube: KubeClient, namespace: str, test_id: str
) -> None:
    # The torn gang: two 2-GPU members of one PodGroup and one free NVLink pair. Before, both
    # passed filter on it, one bound, the other stayed pending while the PodGroup said Scheduled.
    (node,) = nodes.add(GpuNode("h100", "dgx-h100"))
    report_in_use(stack, node, [0, 1, 2, 3, 4, 5])
    kube.apply([podgroup("pair", namespace, 2)])
    members = [f"pair-{i}" for i in range(2)]
    for m in members:  # members of a PodGroup that take part of a node share one (docs/annotations.md, "Jobs")
        kube.create_pod(gpu_pod(m, namespace, test_id, 2, group="pair"))
    for m in members:
        kube.wait_pod_event(namespace, m, "FailedScheduling", timeout=60)
    assert [bound_node(kube, namespace, m) for m in members] == ["", ""]
    # A second free pair: the whole gang fits, and both members bind, on different GPUs.
    report_in_use(stack, node, [0, 1, 2, 3])
    assert set(kube.wait_pods_bound(namespace, members, timeout=120).values()) == {node}
    placed = [
        parse_placement(kube.get_pod(namespace, m)["metadata"]["annotations"][PLACEMENT_ANNOTATION]) for m in members
    ]
    assert not set(placed[0].gpus) & set(placed[1].gpus)
    assert {g for p in placed for g in p.gpus} == {4, 5, 6, 7}
    assert all(p.group == "podgroup/pair" for p in placed)


def test_jobs_high_priority_podgroup_preempts_low_priority_gpu_holders_and_binds(
    nodes: StackNodes, kube: KubeClient, namespace: str, test_id: str
) -> None:
    # Both nodes are full of low-priority 8-GPU pods; a high-priority gang of two 8-GPU members needs
    # both. Gang preemption (PodGroupPostFilter DefaultPreemption) never calls the preempt verb; its
    # dry run calls filter, which gputopo answers as if the lower-priority pods were gone.
    names = nodes.add(GpuNode("a", "dgx-h100"), GpuNode("b", "dgx-h100"))
    holders = [f"low-{i}" for i in range(2)]
    for h in holders:
        kube.create_pod(gpu_pod(h, namespace, test_id, 8, priority="low"))
    assert set(kube.wait_pods_bound(namespace, holders, timeout=120).values()) == set(names)
    kube.apply([podgroup("big", namespace, 2, priority="high")])
    members = [f"big-{i}" for i in range(2)]
    for m in members:
        kube.create_pod(gpu_pod(m, namespace, test_id, 8, group="big", priority="high"))
    # past kube-scheduler's 5-minute unschedulable flush: a preemptor can wait for it (kubernetes#141694)
    assert set(kube.wait_pods_bound(namespace, members, timeout=360).values()) == set(names)
    assert all(gone(kube, namespace, h) for h in holders)


def _placements(kube: KubeClient, namespace: str, members: list[str]) -> dict[str, tuple[str, tuple[int, ...]]]:
    out = {}
    for m in members:
        p = parse_placement(kube.get_pod(namespace, m)["metadata"]["annotations"][PLACEMENT_ANNOTATION])
        out[m] = (p.node, tuple(p.gpus))
    return out


def test_jobs_elastic_podgroup_grown_and_shrunk_plans_new_members_around_those_running(
    nodes: StackNodes, kube: KubeClient, namespace: str, test_id: str
) -> None:
    # minCount is mutable from 1.37 (elastic gangs). Three members, one more than minCount, bind together;
    # minCount raised from 2 to 4 and a 4th member: it binds beside them, and the running members keep
    # their nodes and GPUs throughout, as they do when minCount shrinks again.
    (node,) = nodes.add(GpuNode("h100", "dgx-h100"))
    kube.apply([podgroup("elastic", namespace, 2)])
    first = [f"elastic-{i}" for i in range(3)]
    for m in first:
        kube.create_pod(gpu_pod(m, namespace, test_id, 2, group="elastic"))
    assert set(kube.wait_pods_bound(namespace, first, timeout=120).values()) == {node}
    running = _placements(kube, namespace, first)
    kube.request(
        "PATCH",
        f"/apis/scheduling.k8s.io/v1beta1/namespaces/{namespace}/podgroups/elastic",
        {"spec": {"schedulingPolicy": {"gang": {"minCount": 4}}}},
        content_type="application/merge-patch+json",
    )
    kube.create_pod(gpu_pod("elastic-3", namespace, test_id, 2, group="elastic"))
    kube.wait_pods_bound(namespace, ["elastic-3"], timeout=120)
    kube.request(
        "PATCH",
        f"/apis/scheduling.k8s.io/v1beta1/namespaces/{namespace}/podgroups/elastic",
        {"spec": {"schedulingPolicy": {"gang": {"minCount": 1}}}},
        content_type="application/merge-patch+json",
    )
    assert _placements(kube, namespace, first) == running, "running members keep their nodes and GPUs"
    everyone = [*first, "elastic-3"]
    held = [g for _, gpus in _placements(kube, namespace, everyone).values() for g in gpus]
    assert sorted(held) == list(range(8)), "four 2-GPU members on one node's eight GPUs, none twice"
