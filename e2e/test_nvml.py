"""End to end through the real NVML binding: the agent (`--backend nvml`, no fixture) reads a DGX-1V
through nvidia-ml-py from the NVML mock library built here, on a simulated node and on a node run by a
real kubelet whose device plugin the agent is.

A TP-4 pod lands on one NVLink quad; a link inside the other quad is then broken in the library's
profile under the running agent (or, on the simulated node, peer-to-peer over NVLink dies while the
links stay Active); the agent publishes it within a poll, the next TP-4 pod is refused with the
sentence that names the link or the GPU pair, and once repaired the pod lands on that quad. A fatal
Xid on a GPU of the free quad fails that GPU, named by the Xid, and the next TP-4 pod is refused.
DGX-1V's only 4-GPU NVLink cliques are the quads 0-3 and 4-7.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterator

import pytest
from workloads import bound_after_nudges

from conftest import StackNodes
from gputopo.localcluster import TEST_LABEL, ControlPlane, KubeClient, PodScheduling, pod_manifest
from gputopo.localcluster.kubelet import kubelet_unavailable
from gputopo.localcluster.nvmlmock import Profile, profile_for_system
from gputopo.localcluster.stack import GpuNode, KubeletAgent, SchedulerPods, Stack, StackTiming
from gputopo.model import PLACEMENT_ANNOTATION, TOPOLOGY_ANNOTATION, NodeTopology, parse_placement, parse_topology
from gputopo.systems import build_system

pytestmark = pytest.mark.e2e

SYSTEM = "dgx-1v"
QUADS = ((0, 1, 2, 3), (4, 5, 6, 7))


@pytest.fixture(scope="module")
def stack(control_plane: ControlPlane, kube: KubeClient) -> Iterator[Stack]:
    # An extender of its own name: another module's may be stopped but still registered.
    s = Stack(
        control_plane,
        kube,
        timing=StackTiming(stale_after_seconds=30, heartbeat_seconds=1, interval_seconds=1),
        scheduler=SchedulerPods(extender_name="gputopo-extender-nvml"),
    )
    s.start()
    yield s
    s.stop()


def tp4(kube: KubeClient, ns: str, test_id: str, name: str) -> str:
    kube.create_pod(
        pod_manifest(
            name,
            namespace=ns,
            gpus=4,
            annotations={"gputopo.io/nvlink": "required"},
            scheduling=PodScheduling(scheduler_name="gputopo-scheduler", node_selector={TEST_LABEL: test_id}),
        )
    )
    return name


def placed(kube: KubeClient, ns: str, pod: str, node: str, timeout: float = 60) -> tuple[int, ...]:
    assert kube.wait_pod_bound(ns, pod, timeout=timeout) == node
    p = parse_placement(kube.get_pod(ns, pod)["metadata"]["annotations"][PLACEMENT_ANNOTATION])
    return tuple(sorted(p.gpus))


def published(kube: KubeClient, node: str) -> NodeTopology:
    return parse_topology(kube.get_node(node)["metadata"]["annotations"][TOPOLOGY_ANNOTATION])


def wait_published(
    kube: KubeClient, node: str, check: str, ok: Callable[[NodeTopology], bool], timeout: float = 30
) -> NodeTopology:
    """Until the node's published topology passes `ok` (a callable on it); `check` says what for."""
    deadline = time.monotonic() + timeout
    topo = published(kube, node)
    while time.monotonic() < deadline:
        topo = published(kube, node)
        if ok(topo):
            return topo
        time.sleep(0.3)
    raise AssertionError(f"{node} never published {check}: {topo.degraded_links}, {[g.reasons for g in topo.gpus]}")


def explain(stack: Stack, ns: str, pod: str) -> str:
    done = subprocess.run(
        [stack._exe("gputopo"), "explain", "-n", ns, pod, f"--kubeconfig={stack.cp.kubeconfig}",
         f"--stale-after-seconds={stack.stale_after_seconds}"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def link_inside(profile: Profile, quad: tuple[int, ...]) -> tuple[int, int]:
    """(GPU, link) of an NVLink between two GPUs of `quad`, as the library's profile wires it."""
    buses = [g.bus for g in profile.gpus]
    for gpu in quad:
        for index, lk in enumerate(profile.gpus[gpu].links or []):
            if lk.remote_bus in buses and buses.index(lk.remote_bus) in quad:
                return gpu, index
    raise AssertionError(f"no link inside {quad}")


def link_down(profile: Profile, quad: tuple[int, ...]) -> list[str]:
    """Break an NVLink inside `quad`; the words the extender's sentence must contain."""
    gpu, link = link_inside(profile, quad)
    links = profile.gpus[gpu].links
    assert links is not None
    links[link].active = False
    return [
        f"no 4-GPU NVLink clique without degraded GPUs: GPU {gpu} link {link} down (link not active)",
        f"GPU {gpu} degraded: NVLink link {link} down",
    ]


def p2p_lost(profile: Profile, quad: tuple[int, ...]) -> list[str]:
    """Peer-to-peer over NVLink dead between two GPUs of `quad` while every link stays Active."""
    a, b = quad[1], quad[2]
    profile.gpus[a].p2p[b] = profile.gpus[b].p2p[a] = 5  # NVML_P2P_STATUS_NOT_SUPPORTED
    return [
        f"GPU {a} degraded: NVLink peer-to-peer to GPU {b} not working although its links are Active "
        "(NVML P2P status: not supported)"
    ]


def break_and_repair(
    stack: Stack,
    kube: KubeClient,
    node: str,
    ns: str,
    test_id: str,
    fault: Callable[[Profile, tuple[int, ...]], list[str]] = link_down,
) -> None:
    """The scenario every node kind shares; returns with the second pod on the repaired quad."""
    want = build_system(SYSTEM, node)
    got = published(kube, node)
    assert got.gpus == want.gpus and got.nvlink == want.nvlink  # read through NVML, not a fixture

    first = tp4(kube, ns, test_id, "tp4-first")
    quad = placed(kube, ns, first, node)
    assert quad in QUADS
    other = QUADS[1 - QUADS.index(quad)]

    healthy = profile_for_system(SYSTEM, node)
    broken = profile_for_system(SYSTEM, node)
    words = fault(broken, other)
    stack.set_nvml_profile(node, broken)
    wait_published(kube, node, "the fault", lambda t: t.gpus != want.gpus)

    second = tp4(kube, ns, test_id, "tp4-second")
    event = kube.wait_pod_event(ns, second, "FailedScheduling", contains="NVLink degraded", timeout=60)
    assert "0/1 nodes are available: 1 NVLink degraded." in event.message
    assert "NVLink degraded" in kube.describe_pod(ns, second)
    # The whole sentence, as `gputopo explain` prints the extender's verdict for the node.
    why = explain(stack, ns, second)
    for phrase in words:
        assert phrase in why

    # Repaired under the running agent: published within a poll, and the waiting pod takes the quad.
    stack.set_nvml_profile(node, healthy)
    wait_published(kube, node, "the repair", lambda t: t.gpus == want.gpus and not t.degraded_links)
    assert bound_after_nudges(kube, ns, second, node, timeout=90) == node
    assert placed(kube, ns, second, node) == other


@pytest.mark.parametrize(
    "fault",
    [
        pytest.param(link_down, id="nvml link down: named by GPU and link"),
        pytest.param(p2p_lost, id="nvml P2P over NVLink lost with links Active: named by both GPUs"),
    ],
)
def test_nvml_simulated_node_a_fault_under_the_running_agent_steers_the_next_tp4_and_says_why(
    fault: Callable[[Profile, tuple[int, ...]], list[str]],
    stack: Stack,
    kube: KubeClient,
    nodes: StackNodes,
    namespace: str,
    test_id: str,
) -> None:
    (node,) = nodes.add(GpuNode("nvml-dgx1v", SYSTEM, nvml=True))
    break_and_repair(stack, kube, node, namespace, test_id, fault)


def test_nvml_kubelet_node_device_plugin_on_the_real_binding_avoids_a_broken_link_and_says_why(
    stack: Stack, control_plane: ControlPlane, kube: KubeClient, namespace: str, test_id: str
) -> None:
    reason = kubelet_unavailable(control_plane.bin_dir)
    if reason is not None:
        pytest.skip(reason)
    node = f"kl-nvml-{test_id[-6:]}"
    stack.add_kubelet_node(node, SYSTEM, labels={TEST_LABEL: test_id}, agent=KubeletAgent(nvml=True))
    try:
        stack.wait_published([node])
        break_and_repair(stack, kube, node, namespace, test_id)
        for pod in ("tp4-first", "tp4-second"):  # the kubelet admitted both through the agent's device plugin
            deadline = time.monotonic() + 60
            while kube.get_pod(namespace, pod).get("status", {}).get("phase") != "Running":
                assert time.monotonic() < deadline, f"{pod} never Running: {kube.get_pod(namespace, pod)['status']}"
                time.sleep(0.3)
    finally:
        stack.remove_kubelet_node(node)


def test_nvml_simulated_node_a_fatal_xid_under_the_running_agent_fails_the_gpu_and_the_next_tp4_avoids_its_quad(
    stack: Stack, kube: KubeClient, nodes: StackNodes, namespace: str, test_id: str
) -> None:
    (node,) = nodes.add(GpuNode("nvml-xid-dgx1v", SYSTEM, nvml=True))
    want = build_system(SYSTEM, node)
    got = published(kube, node)
    assert got.gpus == want.gpus and got.nvlink == want.nvlink  # the agent runs, registered for Xids

    first = tp4(kube, namespace, test_id, "tp4-first")
    quad = placed(kube, namespace, first, node)
    other = QUADS[1 - QUADS.index(quad)]

    # Xid 79 on a GPU of the free quad, as the driver reports it: the GPU fails, the quad is no clique.
    profile = profile_for_system(SYSTEM, node)
    profile.xids.append((other[2], 79))
    stack.set_nvml_profile(node, profile)
    topo = wait_published(kube, node, "the Xid", lambda t: t.gpus[other[2]].reasons != ())
    assert topo.gpus[other[2]].reasons == (
        "Xid 79: GPU has fallen off the bus (1 Xids seen; reset the GPU, then restart the agent)",
    )
    assert topo.gpus[other[2]].health.value == "failed"
    assert [g for g in topo.gpus if g.index != other[2]] == [g for g in want.gpus if g.index != other[2]]

    second = tp4(kube, namespace, test_id, "tp4-second")
    # The failed GPU is no one's to take: four in use and three healthy left, no quad.
    event = kube.wait_pod_event(namespace, second, "FailedScheduling", contains="fewer than 4 free GPUs", timeout=60)
    assert "0/1 nodes are available: 1 fewer than 4 free GPUs." in event.message
    assert not kube.get_pod(namespace, second)["spec"].get("nodeName")
