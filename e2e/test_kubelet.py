"""End to end with a real kubelet: placement → the kubelet's device manager → PodResources.

Each test starts an upstream kubelet (``RealKubelet``, with the fake CRI runtime of Kubernetes' own
kubelet tests, so pods become Running without anything executing) that registers a DGX-1V-shaped
node. The node's gputopo-agent has the fixture backend for that system and is the kubelet's device
plugin. What the kubelet actually allocated is read back from its PodResources socket, the same
way the agent reads it on a real node. Needs root (a private mount namespace per kubelet) and the
kubelet and fakecri binaries (``build_binaries.sh`` builds them); skipped otherwise.

DGX-1V's NVLink (hybrid cube mesh): the quads 0-3 and 4-7 are the only 4-GPU cliques; double links
join 0-3, 0-4, 1-2, 1-5, 2-3, 4-7, 5-6, 6-7.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from gputopo.agent.podresources.client import PodResourcesClient, PodResourcesError
from gputopo.engine.node.besteffort import best_effort
from gputopo.engine.node.placement import evaluate_node
from gputopo.engine.state.snapshot import node_state
from gputopo.localcluster import TEST_LABEL, ControlPlane, KubeClient, PodScheduling, pod_manifest
from gputopo.localcluster.kubelet import RealKubelet, kubelet_unavailable
from gputopo.localcluster.stack import KubeletAgent, SchedulerPods, Stack, StackTiming
from gputopo.model import (
    GPU_RESOURCE,
    GPUS_IN_USE_ANNOTATION,
    PLACEMENT_ANNOTATION,
    NvlinkPolicy,
    PodRequest,
    parse_gpus_in_use_report,
    parse_placement,
)
from gputopo.systems import build_system

pytestmark = pytest.mark.e2e

SYSTEM = "dgx-1v"
MISMATCH_REASON = "TopologyPlacementMismatch"


@pytest.fixture(scope="module")
def stack(control_plane: ControlPlane, kube: KubeClient) -> Iterator[Stack]:
    reason = kubelet_unavailable(control_plane.bin_dir)
    if reason is not None:
        pytest.skip(reason)
    # An extender of its own name: another module's may be stopped but still registered.
    s = Stack(
        control_plane,
        kube,
        timing=StackTiming(stale_after_seconds=30, heartbeat_seconds=2, interval_seconds=1),
        scheduler=SchedulerPods(extender_name="gputopo-extender-kubelet"),
    )
    s.install()
    s.start_extender()
    s.start_scheduler()
    yield s
    control_plane.remove(s.scheduler_name)
    control_plane.remove(s.extender_name, grace=3)


class KubeletNode:
    """This test's real-kubelet node: its name, kubelet, and GPU UUID → index map."""

    def __init__(self, stack: Stack, test_id: str) -> None:
        self.stack = stack
        self.test_id = test_id
        self.name = f"kl-dgx1v-{test_id[-6:]}"
        self.index = {g.uuid: g.index for g in build_system(SYSTEM, self.name).gpus}
        self._kubelet: RealKubelet | None = None

    @property
    def kubelet(self) -> RealKubelet:
        assert self._kubelet is not None, "call start() first"
        return self._kubelet

    def start(self, preferred_allocation: str = "placement") -> KubeletNode:
        self._kubelet = self.stack.add_kubelet_node(
            self.name,
            SYSTEM,
            labels={TEST_LABEL: self.test_id},
            agent=KubeletAgent(preferred_allocation=preferred_allocation),
        )
        self.stack.wait_published([self.name])
        return self

    def allocations(self) -> dict[str, tuple[int, ...]]:
        """The kubelet's PodResources `List`: pod name → GPU indices it holds."""
        client = PodResourcesClient(self.kubelet.podresources_socket)
        try:
            got = client.gpu_allocation()
        finally:
            client.close()
        return {name: tuple(sorted(self.index[d] for d in ids)) for (_, name), ids in got.by_pod.items()}

    def wait_allocations(self, pods: list[str], *, timeout: float = 60.0) -> dict[str, tuple[int, ...]]:
        """Until PodResources lists every one of `pods` (the socket may be restarting)."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            try:
                last = self.allocations()
            except PodResourcesError as e:
                last = e
            else:
                if all(p in last for p in pods):
                    return {p: last[p] for p in pods}
            time.sleep(0.3)
        raise AssertionError(f"PodResources never listed {pods}; last answer: {last}")

    def in_use(self) -> Any:
        ann = self.stack.kube.get_node(self.name)["metadata"].get("annotations", {})
        return parse_gpus_in_use_report(ann.get(GPUS_IN_USE_ANNOTATION, "[]"), len(self.index))

    def wait_in_use(self, gpus: set[int], *, timeout: float = 30.0) -> Any:
        """Until the agent publishes exactly `gpus` as in use."""
        deadline = time.monotonic() + timeout
        report = None
        while time.monotonic() < deadline:
            report = self.in_use()
            if set(report.all) == gpus:
                return report
            time.sleep(0.3)
        raise AssertionError(f"{GPUS_IN_USE_ANNOTATION} on {self.name} never became {sorted(gpus)}: {report}")

    def remove(self) -> None:
        if self._kubelet is not None:
            self.stack.remove_kubelet_node(self.name)


@pytest.fixture
def node(stack: Stack, test_id: str) -> Iterator[KubeletNode]:
    n = KubeletNode(stack, test_id)
    yield n
    n.remove()


def gputopo_pod(kube: KubeClient, ns: str, test_id: str, name: str, gpus: int, *, gated: bool = False) -> str:
    manifest = pod_manifest(
        name,
        namespace=ns,
        gpus=gpus,
        annotations={"gputopo.io/nvlink": "required"},
        scheduling=PodScheduling(scheduler_name="gputopo-scheduler", node_selector={TEST_LABEL: test_id}),
    )
    if gated:  # not scheduled until the gate is removed
        manifest["spec"]["schedulingGates"] = [{"name": "gputopo.io/test-hold"}]
    kube.create_pod(manifest)
    return name


def wait_running(kube: KubeClient, ns: str, pod: str, *, timeout: float = 60.0) -> dict[str, Any]:
    """Until the kubelet reports the pod Running; fails at once if the kubelet rejected it."""
    deadline = time.monotonic() + timeout
    status: dict[str, Any] = {}
    while time.monotonic() < deadline:
        status = kube.get_pod(ns, pod).get("status", {})
        if status.get("phase") == "Running":
            return status
        if status.get("phase") == "Failed":
            raise AssertionError(f"the kubelet rejected {pod}: {status.get('reason')}: {status.get('message')}")
        time.sleep(0.3)
    raise AssertionError(f"{pod} not Running after {timeout:.0f}s: {status}")


def placed_gpus(kube: KubeClient, ns: str, pod: str, node: str) -> tuple[int, ...]:
    assert kube.wait_pod_bound(ns, pod, timeout=60) == node
    p = parse_placement(kube.get_pod(ns, pod)["metadata"]["annotations"][PLACEMENT_ANNOTATION])
    assert p.node == node
    return tuple(sorted(p.gpus))


def gputopo_choice(in_use: set[int], gpus: int) -> tuple[int, ...]:
    """What the placement engine picks for an NVLink-required pod on a DGX-1V with `in_use` taken."""
    topo = build_system(SYSTEM, "any")
    out = evaluate_node(
        node_state("any", topo, in_use=frozenset(in_use)), PodRequest(gpus=gpus, nvlink=NvlinkPolicy.REQUIRED)
    )
    return tuple(sorted(out.gpus))


def test_real_kubelet_gives_a_tp4_pod_exactly_the_quad_of_its_placement(
    kube: KubeClient, node: KubeletNode, namespace: str, test_id: str
) -> None:
    node.start()
    pod = gputopo_pod(kube, namespace, test_id, "tp4", 4)
    quad = placed_gpus(kube, namespace, pod, node.name)
    assert quad in ((0, 1, 2, 3), (4, 5, 6, 7))
    wait_running(kube, namespace, pod)
    assert node.wait_allocations([pod]) == {pod: quad}
    report = node.wait_in_use(set(quad))
    uid = kube.get_pod(namespace, pod)["metadata"]["uid"]
    assert dict(report.pods) == {uid: frozenset(quad)}


def test_real_kubelet_gives_two_same_size_pods_admitted_back_to_back_each_its_own_placement(
    kube: KubeClient, node: KubeletNode, namespace: str, test_id: str
) -> None:
    node.start()
    # NVIDIA's best effort would give the first pair 2,3; gputopo keeps the quad 4-7 whole and the
    # rest in NVLink pairs: 0,3 then 1,2. Only the placements explain what the kubelet hands out.
    assert best_effort(build_system(SYSTEM, "any"), list(range(8)), [], 2) == (2, 3)
    pods = [gputopo_pod(kube, namespace, test_id, f"tp2-{i}", 2) for i in range(2)]
    placed = {p: placed_gpus(kube, namespace, p, node.name) for p in pods}
    assert sorted(placed.values()) == [(0, 3), (1, 2)]
    for p in pods:
        wait_running(kube, namespace, p)
    assert node.wait_allocations(pods) == placed
    node.wait_in_use({0, 1, 2, 3})


def test_real_kubelet_reaching_the_younger_pod_first_gives_each_pod_its_own_placement(
    kube: KubeClient, node: KubeletNode, namespace: str, test_id: str
) -> None:
    # The older pod is bound after the younger one, both while the kubelet is stopped: it then admits
    # the younger first, with both pending in the agent's view. Only the kubelet's own pod list says
    # which one it is admitting; "the oldest pending pod" would hand the younger the older's pair.
    node.start()
    older = gputopo_pod(kube, namespace, test_id, "older", 2, gated=True)
    younger = gputopo_pod(kube, namespace, test_id, "younger", 2)
    with node.kubelet.paused():
        placed = {younger: placed_gpus(kube, namespace, younger, node.name)}
        kube.patch_pod(namespace, older, {"spec": {"schedulingGates": None}})
        placed[older] = placed_gpus(kube, namespace, older, node.name)
    assert placed[older] != placed[younger]
    for p in (younger, older):
        wait_running(kube, namespace, p)
    assert node.wait_allocations([younger, older]) == placed


def test_real_kubelet_allocation_unlike_the_placement_gives_a_mismatch_event_and_actual_accounting(
    kube: KubeClient, node: KubeletNode, namespace: str, test_id: str
) -> None:
    # The plugin answers as NVIDIA's would (best effort, ignoring placements): the kubelet's
    # choice is then not gputopo's, deterministically, since the plugin breaks ties by GPU index.
    node.start(preferred_allocation="besteffort")
    topo = build_system(SYSTEM, "any")
    # 1. A pod bound straight to the node (no scheduler, no gputopo) takes two GPUs: 2,3.
    outside = pod_manifest("outside", namespace=namespace, gpus=2)
    outside["spec"]["nodeName"] = node.name
    kube.create_pod(outside)
    wait_running(kube, namespace, "outside")
    assert node.wait_allocations(["outside"]) == {"outside": (2, 3)}
    node.wait_in_use({2, 3})
    # 2. gputopo places a TP-2 pod on 0,4 (leaving the quad's rest 5-7 usable); best effort over
    #    the free GPUs gives 6,7 instead.
    placed, besteffort = gputopo_choice({2, 3}, 2), best_effort(topo, [0, 1, 4, 5, 6, 7], [], 2)
    assert (placed, besteffort) == ((0, 4), (6, 7))
    pod = gputopo_pod(kube, namespace, test_id, "tp2", 2)
    assert placed_gpus(kube, namespace, pod, node.name) == placed
    wait_running(kube, namespace, pod)
    assert node.wait_allocations([pod]) == {pod: besteffort}
    # 3. The agent reports the truth per pod, and the extender says so on the pod.
    report = node.wait_in_use({2, 3, 6, 7})
    uid = kube.get_pod(namespace, pod)["metadata"]["uid"]
    assert report.pods.get(uid) == frozenset(besteffort)
    event = kube.wait_pod_event(namespace, pod, MISMATCH_REASON, timeout=30)
    assert event.type == "Warning"
    assert "GPUs 6-7" in event.message and "0,4" in event.message, event.message
    # 4. The extender counts the actual GPUs as used: the next TP-2 goes to the still free 0,4
    #    (had it believed the placement, 6,7 would look free and 0,4 taken).
    assert gputopo_choice({2, 3, 6, 7}, 2) == (0, 4) and gputopo_choice({0, 2, 3, 4}, 2) == (6, 7)
    nxt = gputopo_pod(kube, namespace, test_id, "tp2-next", 2)
    assert placed_gpus(kube, namespace, nxt, node.name) == (0, 4)


def test_real_kubelet_restart_keeps_running_pods_gpus_and_the_plugin_registers_again(
    kube: KubeClient, node: KubeletNode, namespace: str, test_id: str
) -> None:
    node.start()
    first = gputopo_pod(kube, namespace, test_id, "tp4-a", 4)
    quad = placed_gpus(kube, namespace, first, node.name)
    wait_running(kube, namespace, first)
    before = node.wait_allocations([first])
    assert before == {first: quad}
    connections = node.kubelet.plugin_connections(GPU_RESOURCE)
    node.kubelet.restart()
    # The kubelet restores allocations from its checkpoint; devices count again only once the
    # plugin has registered with the new kubelet.
    assert node.wait_allocations([first]) == before
    deadline = time.monotonic() + 60
    while node.kubelet.plugin_connections(GPU_RESOURCE) <= connections:
        assert time.monotonic() < deadline, "the device plugin did not register with the restarted kubelet"
        time.sleep(0.3)
    node.kubelet.wait_allocatable(GPU_RESOURCE, 8)
    assert kube.get_pod(namespace, first)["status"]["phase"] == "Running"
    second = gputopo_pod(kube, namespace, test_id, "tp4-b", 4)
    other = placed_gpus(kube, namespace, second, node.name)
    assert set(other) == set(range(8)) - set(quad)
    wait_running(kube, namespace, second)
    assert node.wait_allocations([first, second]) == {first: quad, second: other}


def test_real_kubelet_node_agent_restart_loses_no_allocation_nor_annotation(
    kube: KubeClient, stack: Stack, node: KubeletNode, namespace: str, test_id: str
) -> None:
    node.start()
    first = gputopo_pod(kube, namespace, test_id, "tp2-a", 2)
    pair = placed_gpus(kube, namespace, first, node.name)
    wait_running(kube, namespace, first)
    before = node.wait_allocations([first])
    report = node.wait_in_use(set(pair))
    annotations = {
        k: v for k, v in kube.get_node(node.name)["metadata"]["annotations"].items() if k.startswith("gputopo.io/")
    }
    connections = node.kubelet.plugin_connections(GPU_RESOURCE)
    restarted = time.time()
    stack.cp.restart(stack.agent_component(node.name))
    stack.wait_heartbeat(node.name, after=restarted)
    deadline = time.monotonic() + 60
    while node.kubelet.plugin_connections(GPU_RESOURCE) <= connections:
        assert time.monotonic() < deadline, "the restarted agent's device plugin did not register"
        time.sleep(0.3)
    assert node.allocations() == before
    assert node.in_use() == report
    after = {
        k: v for k, v in kube.get_node(node.name)["metadata"]["annotations"].items() if k.startswith("gputopo.io/")
    }
    assert after == annotations
    second = gputopo_pod(kube, namespace, test_id, "tp2-b", 2)
    assert placed_gpus(kube, namespace, second, node.name) == gputopo_choice(set(pair), 2)
    wait_running(kube, namespace, second)
    assert node.wait_allocations([first, second])[second] == gputopo_choice(set(pair), 2)
