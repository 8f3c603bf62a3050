"""Holds are owned and bounded, on the real JobSet controller: with JobSets served before the extender starts
(so it watches them), JobSet exclusive placement holds a Job's followers within the room the namespace's
ResourceQuota on GPUs leaves, and past it holds nothing, its leaders told the quota (docs/annotations.md,
"JobSet exclusive placement"). The extender reads JobSets and ResourceQuotas with the chart's RBAC.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import workloads as wl

from conftest import StackNodes, serve
from gputopo.localcluster import TEST_LABEL, ControlPlane, KubeClient, PodScheduling, pod_manifest
from gputopo.localcluster.jobcontrollers import JobControllers
from gputopo.localcluster.stack import GpuNode, Stack, StackTiming
from gputopo.model import LABEL_NETWORK_LEAF, LABEL_NETWORK_SPINE

pytestmark = pytest.mark.e2e

SCHEDULER = "gputopo-scheduler"
GPU_QUOTA = "requests.nvidia.com/gpu"


@pytest.fixture(scope="module")
def stack(control_plane: ControlPlane, kube: KubeClient, job_controllers: JobControllers) -> Iterator[Stack]:
    job_controllers.ensure("jobset")  # JobSet's API served before the extender first lists JobSets
    yield from serve(Stack(control_plane, kube, timing=StackTiming(stale_after_seconds=60)))


def _exclusive_jobset(name: str, namespace: str, test_id: str) -> dict[str, Any]:
    """Two Jobs of two 8-GPU pods, each Job in a leaf of its own: the followers are held for 16 GPUs."""
    scheduling = PodScheduling(scheduler_name=SCHEDULER, node_selector={TEST_LABEL: test_id})
    spec = pod_manifest("t", gpus=8, scheduling=scheduling)["spec"]
    return wl.two_job_jobset(name, namespace, spec, annotations={wl.EXCLUSIVE_TOPOLOGY: LABEL_NETWORK_LEAF})


def _quota(kube: KubeClient, namespace: str, hard: int) -> None:
    """A ResourceQuota on GPUs, counted: the local cluster runs no quota controller, so its first count (none
    used) is written here; the API server's quota admission then counts each pod it admits, as anywhere."""
    path = f"/api/v1/namespaces/{namespace}/resourcequotas"
    kube.request("POST", path, {"metadata": {"name": "gpus"}, "spec": {"hard": {GPU_QUOTA: str(hard)}}})
    status = {"status": {"hard": {GPU_QUOTA: str(hard)}, "used": {GPU_QUOTA: "0"}}}
    kube.request("PATCH", f"{path}/gpus/status", status, content_type="application/merge-patch+json")


def _nodes(nodes: StackNodes) -> list[str]:
    fabric = [{LABEL_NETWORK_SPINE: "spine-a", LABEL_NETWORK_LEAF: f"leaf-{i % 2}"} for i in range(4)]
    return nodes.add(*[GpuNode(f"hb-{i}", "dgx-h100", labels=fabric[i]) for i in range(4)])


def test_hold_bounds_a_quota_with_room_for_the_followers_lets_the_jobset_bind(
    kube: KubeClient, nodes: StackNodes, namespace: str, test_id: str
) -> None:
    node, *_ = _nodes(nodes)
    _quota(kube, namespace, 32)  # the 4 pods' 32 GPUs: the leaders' 16 used, the followers' 16 free
    kube.request(
        "POST",
        f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{namespace}/jobsets",
        _exclusive_jobset("roomy", namespace, test_id),
    )
    # JobSet admits the followers once the leaders are scheduled: nudged until all four exist, then bound.
    selector = f"{wl.JOBSET_NAME}=roomy"
    made = wl.after_nudges(kube, node, lambda w: wl.wait_pods(kube, namespace, selector, 4, timeout=w), timeout=120)
    for pod in made:
        wl.bound_after_nudges(kube, namespace, pod["metadata"]["name"], node, timeout=120)


def test_hold_bounds_past_the_quotas_room_nothing_is_held_and_the_leaders_are_told_the_quota(
    kube: KubeClient, nodes: StackNodes, namespace: str, test_id: str
) -> None:
    node, *_ = _nodes(nodes)
    _quota(kube, namespace, 24)  # the leaders' 16 used leave 8: too few for the followers' 16
    kube.request(
        "POST",
        f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{namespace}/jobsets",
        _exclusive_jobset("tight", namespace, test_id),
    )
    leaders = wl.wait_pods(kube, namespace, f"{wl.JOBSET_NAME}=tight", 2, timeout=120)
    told = f"ResourceQuota gpus: {GPU_QUOTA} hard 24, used 16, free 8"
    for pod in leaders:
        wl.event_after_nudges(kube, namespace, pod["metadata"]["name"], node, told)
    assert all(not kube.get_pod(namespace, p["metadata"]["name"])["spec"].get("nodeName") for p in leaders)
