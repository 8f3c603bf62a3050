"""End to end with NVLink clique blocks under DRA: the agent publishes every clique block as a device beside
its GPUs (`--dra-blocks`, sharing counters with them), the chart's block DeviceClasses carry the extended
resources `gputopo.io/gpu-clique<N>` (KEP-5004), and pods ask for a whole block three ways: the extended
resource, a claim by class, and the webhook's prioritized list (a block first, else single GPUs of one
clique). docs/install.md, "Clique blocks: what a pod can ask for" and "Your own claims".

The nodes are DGX-1V-shaped real kubelets on Kubernetes' fake CRI, as in e2e/test_dra.py (whose `DraNode`
this module reuses): quads 0-3 and 4-7 are its 4-GPU blocks; its aligned pairs are 0-1, 2-3, 4-5, 6-7 and
the cross-quad pairs 0-4 .. 3-7. GPUs are taken by "pin" pods whose one-device claims select single GPUs
by index (under the scheduler without the extender: gputopo refuses a CEL selector it cannot evaluate).
Partitionable devices and extended resources are on by default from 1.36: the block tests skip below it,
and on 1.34 and 1.35 the last test checks that the claims of single GPUs still land on cliques.
Needs root and the kubelet and fakecri binaries, as e2e/test_dra.py.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from test_dra import NS, SYSTEM, DraNode, _is_clique

from gputopo.agent.dra.cdi import VISIBLE_DEVICES_ENV, claim_spec_path
from gputopo.engine.dra.claims import claim_template
from gputopo.localcluster import TEST_LABEL, ControlPlane, KubeClient, PodScheduling, pod_manifest
from gputopo.localcluster.binaries import kubernetes_version
from gputopo.localcluster.kubelet import kubelet_unavailable
from gputopo.localcluster.stack import ChartRelease, SchedulerPods, Stack, StackTiming
from gputopo.model import PLACEMENT_ANNOTATION, PodRequest, parse_placement
from gputopo.model.dra import BLOCK_SIZES, COUNTER_SET, DEVICE_CLASS, DRIVER, block_class, block_gpus, block_resource
from gputopo.systems import build_system

pytestmark = pytest.mark.e2e

BLOCKS_SINCE = (1, 36)  # DRAPartitionableDevices and DRAExtendedResource beta and on


def _release(control_plane: ControlPlane) -> tuple[int, int, int]:
    return kubernetes_version(control_plane.bin_dir)


def _blocks_served(control_plane: ControlPlane) -> bool:
    return _release(control_plane)[:2] >= BLOCKS_SINCE


@pytest.fixture(scope="module")
def stack(control_plane: ControlPlane, kube: KubeClient) -> Iterator[Stack]:
    """The chart rendered for the control plane's own release, as helm would render it there: on 1.36 and
    later its block classes with their extended resources, and the extender's --dra-blocks."""
    reason = kubelet_unavailable(control_plane.bin_dir)
    if reason is not None:
        pytest.skip(reason)
    version = ".".join(map(str, _release(control_plane)))
    s = Stack(
        control_plane,
        kube,
        timing=StackTiming(stale_after_seconds=30, heartbeat_seconds=2, interval_seconds=1),
        scheduler=SchedulerPods(extender_name="gputopo-extender-dra-blocks"),
        chart=ChartRelease(dra=True, kube_version=version),
    )
    s.start()
    yield s
    control_plane.remove(s.scheduler_name)
    control_plane.remove(s.extender_name, grace=3)


@pytest.fixture
def blocks_node(stack: Stack, control_plane: ControlPlane, test_id: str) -> Iterator[DraNode]:
    """A DGX-1V whose agent publishes blocks, in best-fit order (the chart's flags on 1.36 and later)."""
    if not _blocks_served(control_plane):
        pytest.skip("clique blocks need partitionable devices and extended resources: on by default from 1.36")
    node = DraNode(stack, test_id, best_fit=True, blocks=True)
    try:
        yield node
    finally:
        node.close()


def _block_pod(node: DraNode, name: str, size: int) -> str:
    """A pod on `node` asking one block of `size` through its extended resource; no annotation."""
    full = f"{node.name}-{name}"
    m = pod_manifest(
        full,
        labels={TEST_LABEL: node.test_id},
        scheduling=PodScheduling(
            scheduler_name=node.stack.scheduler_name, node_selector={"kubernetes.io/hostname": node.name}
        ),
    )
    for kind in ("limits", "requests"):
        m["spec"]["containers"][0]["resources"][kind][block_resource(size)] = "1"
    node.kube.create_pod(m)
    node.pods.append(full)
    return full


def _results(node: DraNode, pod: str) -> list[dict[str, Any]]:
    return list(node.claim_of(pod)["status"]["allocation"]["devices"]["results"])


def _placed(node: DraNode, pod: str) -> tuple[int, ...]:
    annotations = node.kube.get_pod(NS, pod)["metadata"]["annotations"]
    return tuple(parse_placement(annotations[PLACEMENT_ANNOTATION]).gpus)


def _first_pair_is(stack: Stack, node: DraNode, name: str, timeout: float = 30.0) -> None:
    """Until the agent, having prepared the pins, lists block `name` first among the 2-GPU blocks."""
    deadline = time.monotonic() + timeout
    while True:
        pairs = [d["name"] for d in stack.devices(node.name) if len(block_gpus(d["name"]) or ()) == 2]
        if pairs[:1] == [name]:
            return
        assert time.monotonic() < deadline, f"2-GPU blocks not re-published with {name} first: {pairs}"
        time.sleep(0.3)


def test_blocks_each_size_has_its_class_and_extended_resource(stack: Stack, blocks_node: DraNode) -> None:
    classes = json.loads(stack.kube.kubectl("get", "deviceclasses", "-o", "json"))["items"]
    specs = {c["metadata"]["name"]: c["spec"] for c in classes}
    for size in BLOCK_SIZES:
        assert specs[block_class(size)].get("extendedResourceName") == block_resource(size)
    assert "extendedResourceName" not in specs[DEVICE_CLASS]
    names = {d["name"] for d in stack.devices(blocks_node.name)}
    assert {"block-0-1-2-3", "block-4-5-6-7", "block-0-1", "block-6-7", "block-0-4"} <= names


def test_blocks_a_4_gpu_block_by_extended_resource_lands_on_a_whole_clique(stack: Stack, blocks_node: DraNode) -> None:
    """GPU 1 taken: the pod asking `gputopo.io/gpu-clique4: 1` gets the whole quad 4-7 as one device, its
    placement names exactly those GPUs, and its container is given exactly their UUIDs."""
    n = blocks_node
    pin = n.pin("pin1", [1])
    assert n.running(pin) == (1,)
    quad = _block_pod(n, "tp4", 4)
    got = n.running(quad)
    assert got == (4, 5, 6, 7) and _is_clique(got)
    assert [r["device"] for r in _results(n, quad)] == ["block-4-5-6-7"]
    assert _placed(n, quad) == got
    event = stack.kube.wait_pod_event(NS, quad, "TopologyPlacement", timeout=60)
    assert "block-4-5-6-7" in event.message
    # What the runtime gives the container: the claim's CDI spec, the block's GPUs and no other.
    uid = n.claim_of(quad)["metadata"]["uid"]
    spec = json.loads(claim_spec_path(n.kubelet.cdi_dir, uid).read_text())
    (env,) = spec["devices"][0]["containerEdits"]["env"]
    uuids = {g.index: g.uuid for g in build_system(SYSTEM, n.name).gpus}
    assert env == f"{VISIBLE_DEVICES_ENV}=" + ",".join(uuids[i] for i in got)


def test_blocks_a_prioritized_list_claim_takes_the_whole_block(blocks_node: DraNode) -> None:
    """The webhook's template where blocks are on: the allocator takes the block subrequest, one device."""
    n = blocks_node
    t = claim_template(PodRequest(gpus=4), list_attributes=False, blocks=True)
    pod = n.pod("tp4-list", n.template(t.name, dict(t.devices)))
    assert n.running(pod) == (0, 1, 2, 3)
    assert [(r["request"], r["device"]) for r in _results(n, pod)] == [("gpus/block", "block-0-1-2-3")]


def test_blocks_a_pod_naming_its_own_block_template_lands_where_the_extender_chose(
    stack: Stack, blocks_node: DraNode
) -> None:
    """GPU 1 taken: a pod naming a template of its own for one `clique4.gpu.gputopo.io` device is a gputopo
    pod (docs/install.md, "Your own claims"): the extender filters and binds it, expecting the block the
    allocator gives, and its placement and Event name that block."""
    n = blocks_node
    pin = n.pin("pin1", [1])
    assert n.running(pin) == (1,)
    one = {"deviceClassName": block_class(4), "allocationMode": "ExactCount", "count": 1}
    pod = n.pod("own-quad", n.template("own-quad", {"requests": [{"name": "gpus", "exactly": one}]}))
    got = n.running(pod)
    assert got == (4, 5, 6, 7)
    assert [r["device"] for r in _results(n, pod)] == ["block-4-5-6-7"]
    stored = n.kube.get_pod(NS, pod)
    placement = parse_placement(stored["metadata"]["annotations"][PLACEMENT_ANNOTATION])
    assert (placement.node, placement.gpus) == (stored["spec"]["nodeName"], got)
    assert "block-4-5-6-7, the first free 4-GPU block" in placement.reason
    event = stack.kube.wait_pod_event(NS, pod, "TopologyPlacement", timeout=60)
    assert "block-4-5-6-7" in event.message


def test_blocks_a_pod_naming_a_pre_made_block_claim_lands_where_the_extender_chose(
    stack: Stack, blocks_node: DraNode
) -> None:
    """GPU 1 taken: a pod naming a pre-made claim (`resourceClaimName`) for one `clique4.gpu.gputopo.io`
    device is a gputopo pod (docs/install.md, "Your own claims"): the extender filters and binds it, and its
    placement names the block the allocator gave, on the node it chose."""
    n = blocks_node
    pin = n.pin("pin1", [1])
    assert n.running(pin) == (1,)
    claim = f"{n.name}-quad-claim"
    one = {"deviceClassName": block_class(4), "allocationMode": "ExactCount", "count": 1}
    devices = {"requests": [{"name": "gpus", "exactly": one}]}
    meta = {"name": claim, "namespace": NS, "labels": {TEST_LABEL: n.test_id}}
    n.kube.apply(
        [{"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": meta, "spec": {"devices": devices}}]
    )
    pod = f"{n.name}-pre-made"
    m = pod_manifest(
        pod,
        labels={TEST_LABEL: n.test_id},
        scheduling=PodScheduling(scheduler_name=stack.scheduler_name, node_selector={"kubernetes.io/hostname": n.name}),
    )
    m["spec"]["resourceClaims"] = [{"name": "gpus", "resourceClaimName": claim}]
    m["spec"]["containers"][0]["resources"]["claims"] = [{"name": "gpus"}]
    try:
        n.kube.create_pod(m)
        n.pods.append(pod)
        n.kube.wait_pod_condition(NS, pod, "Ready", status="True", timeout=90)
        held = json.loads(n.kube.kubectl("get", "resourceclaim", "-n", NS, claim, "-o", "json"))
        results = held["status"]["allocation"]["devices"]["results"]
        assert [(r["pool"], r["device"]) for r in results] == [(n.name, "block-4-5-6-7")]
        stored = n.kube.get_pod(NS, pod)
        placement = parse_placement(stored["metadata"]["annotations"][PLACEMENT_ANNOTATION])
        assert (placement.node, placement.gpus) == (stored["spec"]["nodeName"], (4, 5, 6, 7))
        assert "block-4-5-6-7, the first free 4-GPU block" in placement.reason
    finally:  # the pod goes with the node (DraNode.close); the claim, once no pod holds it
        n.kube.kubectl("delete", "resourceclaim", "-n", NS, claim, "--ignore-not-found", "--wait=false")


def test_blocks_a_2_gpu_block_beside_a_half_used_and_a_whole_quad_takes_the_half_used(
    stack: Stack, blocks_node: DraNode
) -> None:
    """GPUs 4 and 5 taken: a 2-GPU block goes to 6-7, leaving the quad 0-3 whole for a 4-GPU block, and
    the extender's placement names the block the allocator gave."""
    n = blocks_node
    pins = n.pin("pins", [4, 5])
    assert n.running(pins) == (4, 5)
    _first_pair_is(stack, n, "block-6-7")
    pair = _block_pod(n, "tp2", 2)
    assert n.running(pair) == (6, 7)
    assert _placed(n, pair) == (6, 7)
    quad = _block_pod(n, "tp4", 4)
    assert n.running(quad) == (0, 1, 2, 3)


def test_blocks_before_136_claims_of_single_gpus_still_land_on_cliques(
    stack: Stack, control_plane: ControlPlane, test_id: str
) -> None:
    """1.34 and 1.35: no block is published and the chart installs no block class; the claim the webhook
    gives a pod there (single GPUs sharing a clique partition) still gets an NVLink clique."""
    if _blocks_served(control_plane):
        pytest.skip("from 1.36 blocks are published: the tests above")
    items = json.loads(stack.kube.kubectl("get", "deviceclasses", "-o", "json"))["items"]
    assert not {block_class(s) for s in BLOCK_SIZES} & {c["metadata"]["name"] for c in items}
    n = DraNode(stack, test_id)
    try:
        pins = n.pin("pins", [0, 5])
        assert n.running(pins) == (0, 5)
        t = claim_template(PodRequest(gpus=2), list_attributes=False)
        pod = n.pod("tp2", n.template(t.name, dict(t.devices)), annotations={"gputopo.io/nvlink": "required"})
        got = n.running(pod)
        assert _is_clique(got) and not {0, 5} & set(got)
        assert all(r["device"].startswith("gpu-") for r in _results(n, pod))
        assert _placed(n, pod) == got
    finally:
        n.close()


def test_blocks_the_pool_shares_counters_and_a_gpu_of_a_taken_block_waits(stack: Stack, blocks_node: DraNode) -> None:
    """The pool as the API server stored it: one counters slice (a counter per GPU) and a device slice whose
    singles and blocks all consume counters. A claim by the 4-GPU class gets a quad, prepared as one block;
    a claim for one GPU of that quad then waits: the block's counters are spent."""
    n = blocks_node
    slices = {s["metadata"]["name"]: s["spec"] for s in stack.resource_slices(n.name)}
    (counters,) = slices[f"{n.name}-{DRIVER}-counters"]["sharedCounters"]
    assert counters["name"] == COUNTER_SET and len(counters["counters"]) == 8
    devices = {d["name"]: d for d in slices[f"{n.name}-{DRIVER}"]["devices"]}
    assert all(d.get("consumesCounters") for d in devices.values())
    assert {"block-0-1-2-3", "block-4-5-6-7", "block-0-4"} <= set(devices)
    by_class = {"requests": [{"name": "gpus", "exactly": {"deviceClassName": block_class(4), "count": 1}}]}
    quad = n.pod("quad", n.template("by-class-4", by_class))
    gpus = n.running(quad)
    (block,) = [r["device"] for r in _results(n, quad)]
    assert block_gpus(block) == gpus and gpus in ((0, 1, 2, 3), (4, 5, 6, 7))
    assert n.claim_of(quad)["metadata"]["uid"] in n.checkpoint()
    pin = n.pin("pin", [gpus[0]])
    assert "cannot allocate all claims" in n.unschedulable(pin)


def test_blocks_an_agent_told_to_publish_blocks_before_136_publishes_singles_only(
    stack: Stack, control_plane: ControlPlane, test_id: str
) -> None:
    """1.34 and 1.35 drop the counter fields on write: the agent sees that in the API server's answer and
    publishes its single GPUs alone, never a block that could be allocated beside its own GPUs."""
    if _blocks_served(control_plane):
        pytest.skip("from 1.36 the counters are kept: the tests above")
    n = DraNode(stack, test_id, blocks=True)
    try:
        (only,) = stack.resource_slices(n.name)
        assert not only["spec"].get("sharedCounters")
        assert all(d["name"].startswith("gpu-") for d in only["spec"]["devices"])
    finally:
        n.close()
