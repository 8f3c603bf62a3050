"""End to end with clique blocks (`--dra-blocks`): on Kubernetes 1.36 and later (DRAPartitionableDevices
beta and on) a DGX-1V-shaped kubelet node's agent publishes its pool as a counters slice and a device
slice whose singles and blocks consume their GPUs' counters; a claim for one 4-GPU block (the chart's
DeviceClass with a `blockSize` selector) is allocated a whole quad and prepared with its four GPUs, and
a pin claim on one of those GPUs then waits. Before 1.36 the API server drops the counters and the agent
publishes its single GPUs only. Needs root and the kubelet and fakecri binaries; skipped otherwise."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from gputopo.localcluster import TEST_LABEL, ControlPlane, KubeClient, PodScheduling, pod_manifest
from gputopo.localcluster.kubelet import kubelet_unavailable
from gputopo.localcluster.stack import ChartRelease, KubeletAgent, SchedulerPods, Stack, StackTiming
from gputopo.model.dra import COUNTER_SET, DEVICE_CLASS, DRIVER, device_gpus

pytestmark = pytest.mark.e2e

SYSTEM = "dgx-1v"
NS = "default"


@pytest.fixture(scope="module")
def stack(control_plane: ControlPlane, kube: KubeClient) -> Iterator[Stack]:
    reason = kubelet_unavailable(control_plane.bin_dir)
    if reason is not None:
        pytest.skip(reason)
    s = Stack(
        control_plane,
        kube,
        timing=StackTiming(stale_after_seconds=30, heartbeat_seconds=2, interval_seconds=1),
        scheduler=SchedulerPods(extender_name="gputopo-extender-dra-blocks"),
        chart=ChartRelease(dra=True),
    )
    s.start()
    yield s
    control_plane.remove(s.scheduler_name)
    control_plane.remove(s.extender_name, grace=3)


def _minor(kube: KubeClient) -> int:
    version = json.loads(kube.kubectl("version", "-o", "json"))["serverVersion"]
    return int(str(version["minor"]).rstrip("+"))


def _template(kube: KubeClient, name: str, expression: str) -> str:
    request = {
        "name": "gpus",
        "exactly": {"deviceClassName": DEVICE_CLASS, "count": 1, "selectors": [{"cel": {"expression": expression}}]},
    }
    body = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"spec": {"devices": {"requests": [request]}}},
    }
    kube.apply([body])
    return name


def _pod(stack: Stack, node: str, test_id: str, name: str, template: str) -> str:
    m = pod_manifest(
        name,
        labels={TEST_LABEL: test_id},
        scheduling=PodScheduling(scheduler_name=stack.scheduler_name, node_selector={"kubernetes.io/hostname": node}),
    )
    m["spec"]["resourceClaims"] = [{"name": "gpus", "resourceClaimTemplateName": template}]
    m["spec"]["containers"][0]["resources"]["claims"] = [{"name": "gpus"}]
    stack.kube.create_pod(m)
    return name


def _allocated(kube: KubeClient, pod: str) -> list[str]:
    statuses = kube.get_pod(NS, pod).get("status", {}).get("resourceClaimStatuses") or []
    claim = json.loads(kube.kubectl("get", "resourceclaim", "-n", NS, statuses[0]["resourceClaimName"], "-o", "json"))
    return [r["device"] for r in claim["status"]["allocation"]["devices"]["results"] if r["driver"] == DRIVER]


def test_dra_blocks_pool_carries_counters_and_a_block_claim_gets_a_whole_quad(
    stack: Stack, kube: KubeClient, test_id: str
) -> None:
    node = f"dra-blocks-{test_id[-6:]}".lower()
    stack.add_kubelet_node(
        node,
        SYSTEM,
        labels={TEST_LABEL: test_id},
        agent=KubeletAgent(dra=True, dra_best_fit_order=True, dra_blocks=True),
    )
    pods: list[str] = []
    try:
        slices = {s["metadata"]["name"]: s["spec"] for s in stack.resource_slices(node)}
        if _minor(kube) < 36:
            assert list(slices) == [f"{node}-{DRIVER}"], "counters dropped: the singles only"
            assert all(d["name"].startswith("gpu-") for d in slices[f"{node}-{DRIVER}"]["devices"])
            return
        counters = slices[f"{node}-{DRIVER}-counters"]["sharedCounters"]
        assert [c["name"] for c in counters] == [COUNTER_SET] and len(counters[0]["counters"]) == 8
        devices = {d["name"]: d for d in slices[f"{node}-{DRIVER}"]["devices"]}
        assert all(d.get("consumesCounters") for d in devices.values())
        assert {"block-0-1-2-3", "block-4-5-6-7", "block-0-4"} <= set(devices)
        quad = _template(kube, "block-4", f'device.attributes["{DRIVER}"].blockSize == 4')
        pods.append(_pod(stack, node, test_id, f"{node}-quad", quad))
        kube.wait_pod_condition(NS, pods[-1], "Ready", status="True", timeout=90)
        (block,) = _allocated(kube, pods[-1])
        gpus = device_gpus(block)
        assert gpus in ((0, 1, 2, 3), (4, 5, 6, 7))
        checkpoint = stack.kubelets[node].dra_plugins_dir / DRIVER / "checkpoint.json"
        assert block in checkpoint.read_text()
        assert gpus is not None
        # A block has no `index`: the blockSize test first, so the selector never looks one up on a block.
        single = f'device.attributes["{DRIVER}"].blockSize == 1'
        pin = _template(kube, f"pin-{gpus[0]}", f'{single} && device.attributes["{DRIVER}"].index == {gpus[0]}')
        pods.append(_pod(stack, node, test_id, f"{node}-pin", pin))
        kube.wait_pod_condition(NS, pods[-1], "PodScheduled", status="False", reason="Unschedulable")
    finally:
        for pod in pods:
            kube.delete_pod(NS, pod)
        stack.remove_kubelet_node(node)
