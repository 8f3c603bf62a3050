"""End to end on NVL72-style racks: real etcd, kube-apiserver and kube-scheduler, the real gputopo-extender,
and one real gputopo-agent per simulated GB200 tray publishing its GPUs' NVLink fabric (the clique of its
rack and each GPU's fabric state and health mask), as on real trays.

Two racks of 18 trays (4 GPUs each) are made once for the module: starting 36 agents is the slow part.
Tray 5 of rack ra reports a degraded NVLink fabric from the start (healthMask 0xa9: degraded bandwidth on
every GPU), so every test sees it. Each test deletes its pods and puts back any label it changed.
"""

from __future__ import annotations

import secrets
import time
import uuid
from collections import Counter
from collections.abc import Iterator

import pytest

from conftest import serve
from gputopo.localcluster import TEST_LABEL, ControlPlane, KubeClient, PodScheduling, pod_manifest
from gputopo.localcluster.kube import KubeApiError
from gputopo.localcluster.stack import GpuNode, Stack, StackTiming
from gputopo.model import HEALTHY_MASK, PLACEMENT_ANNOTATION, FabricInfo, GpuFabric, NodeTopology, parse_placement
from gputopo.systems import build_system

pytestmark = pytest.mark.e2e

TRAYS = 18
RACKS = ("ra", "rb")
CAP_LABEL = "gputopo.io/nvlink-domain-cap"
DEGRADED = ("ra", 5)


def tray_topology(name: str, rack: str, mask: int = HEALTHY_MASK) -> NodeTopology:
    """A GB200 tray of `rack`'s NVLink domain (its fabric clique) whose GPUs report `mask`."""
    topo = build_system("gb200-tray", name)
    fabric = GpuFabric(state="completed", health_mask=mask)
    gpus = tuple(g.model_copy(update={"fabric": fabric}) for g in topo.gpus)
    clique = f"{uuid.uuid5(uuid.NAMESPACE_DNS, 'e2e.gputopo.io')}.{RACKS.index(rack) + 1}"
    return topo.model_copy(update={"gpus": gpus, "fabric": FabricInfo(clique=clique)})


@pytest.fixture(scope="module")
def stack(control_plane: ControlPlane, kube: KubeClient) -> Iterator[Stack]:
    yield from serve(Stack(control_plane, kube, timing=StackTiming(heartbeat_seconds=2, interval_seconds=1)))


@pytest.fixture(scope="module")
def racks(stack: Stack) -> Iterator[dict[str, list[str]]]:
    """Two racks of trays, each rack one NVLink domain, labelled for this module's pods."""
    label = f"rack-{secrets.token_hex(3)}"
    trays = {r: [f"{r}-tray-{i:02d}-{label[-6:]}" for i in range(1, TRAYS + 1)] for r in RACKS}
    nodes = [
        GpuNode(
            name,
            topology=tray_topology(name, r, 0xA9 if (r, i) == DEGRADED else HEALTHY_MASK),
            labels={"gputopo.io/network-leaf": f"leaf-{r}"},
        )
        for r in RACKS
        for i, name in enumerate(trays[r], start=1)
    ]
    stack.add_nodes(nodes, extra_labels={TEST_LABEL: label})
    stack.wait_published([n.name for n in nodes], timeout=180)
    trays["label"] = [label]
    yield trays
    for n in nodes:
        stack.cp.remove(stack.agent_component(n.name), grace=2)
        try:
            stack.kube.delete_node(n.name)
        except KubeApiError as e:
            if e.status != 404:
                raise


class Gang:
    """A group of 4-GPU pods under gputopo with `gputopo.io/tp-size`, deleted when the test ends."""

    def __init__(self, kube: KubeClient, namespace: str, label: str) -> None:
        self.kube, self.namespace, self.label = kube, namespace, label
        self.pods: list[str] = []

    def create(self, name: str, size: int, tp: int) -> list[str]:
        ann = {"gputopo.io/group": name, "gputopo.io/group-size": str(size), "gputopo.io/tp-size": str(tp)}
        pods = []
        for i in range(size):
            pod = f"{name}-{i}"
            self.kube.create_pod(
                pod_manifest(
                    pod,
                    namespace=self.namespace,
                    gpus=4,
                    annotations={**ann, "gputopo.io/stage": str(i)},
                    scheduling=PodScheduling(
                        scheduler_name="gputopo-scheduler", node_selector={TEST_LABEL: self.label}
                    ),
                )
            )
            pods.append(pod)
        self.pods += pods
        return pods

    def delete(self) -> None:
        for pod in self.pods:
            self.kube.delete_pod(self.namespace, pod)
        deadline = time.monotonic() + 60
        while self.kube.list_pods(self.namespace) and time.monotonic() < deadline:
            time.sleep(0.5)


@pytest.fixture
def gang(kube: KubeClient, namespace: str, racks: dict[str, list[str]]) -> Iterator[Gang]:
    g = Gang(kube, namespace, racks["label"][0])
    yield g
    g.delete()


def rack_of(node: str) -> str:
    return node.split("-", 1)[0]


def test_rack_tp16_group_lands_in_one_nvlink_domain_and_says_so(kube: KubeClient, namespace: str, gang: Gang) -> None:
    pods = gang.create("tp16", 4, 16)
    bound = kube.wait_pods_bound(namespace, pods, timeout=90)
    # Both racks are as free: the one without a degraded tray comes first.
    assert {rack_of(n) for n in bound.values()} == {"rb"}, bound
    assert len(set(bound.values())) == 4
    reason = parse_placement(kube.get_pod(namespace, "tp16-2")["metadata"]["annotations"][PLACEMENT_ANNOTATION]).reason
    assert "TP group 0/1 (16 GPUs, ranks 0-3) in NVLink domain" in reason
    assert "TP all-reduce" in reason and "in one domain vs" in reason
    assert "TP group 0/1" in kube.describe_pod(namespace, "tp16-2")


def test_rack_32_tray_gang_splits_16_16_on_two_racks_with_a_cap_of_16(
    kube: KubeClient, namespace: str, gang: Gang, racks: dict[str, list[str]]
) -> None:
    trays = [t for r in RACKS for t in racks[r]]
    for t in trays:
        kube.patch_node(t, {"metadata": {"labels": {CAP_LABEL: "16"}}})
    try:
        pods = gang.create("llm", 32, 16)
        bound = kube.wait_pods_bound(namespace, pods, timeout=180)
        assert Counter(rack_of(n) for n in bound.values()) == Counter({"ra": 16, "rb": 16})
        for group in range(8):  # TP group g (stages 4g..4g+3) lies in one rack
            assert len({rack_of(bound[f"llm-{i}"]) for i in range(4 * group, 4 * group + 4)}) == 1
        placed = parse_placement(kube.get_pod(namespace, "llm-20")["metadata"]["annotations"][PLACEMENT_ANNOTATION])
        assert "4+4 TP groups over 2 domains (cap 16 trays)" in placed.reason
        tp = placed.tp  # the annotation's structured form of the same clause
        assert tp is not None and (tp.group, tp.groups, tp.gpus, tp.cap_trays) == (5, 8, 16, 16), tp
        assert [s.tp_groups for s in tp.split] == [4, 4] and len({s.domain for s in tp.split}) == 2
        assert tp.domain == tp.split[1].domain and tp.fill == (16, 16) and tp.fill_straddles == 0
        gang.delete()
        # Beyond the cap: 9 TP groups would need the spares, so the gang waits and names the cap.
        waiting = gang.create("big", 36, 16)
        event = kube.wait_pod_event(namespace, waiting[-1], "FailedScheduling", contains="cap of 16 trays", timeout=90)
        assert "needs 9 TP groups of 16 GPUs" in event.message
    finally:
        for t in trays:
            kube.patch_node(t, {"metadata": {"labels": {CAP_LABEL: None}}})


def test_rack_degraded_tray_is_avoided_and_named(
    kube: KubeClient, namespace: str, gang: Gang, racks: dict[str, list[str]]
) -> None:
    bad = racks[DEGRADED[0]][DEGRADED[1] - 1]
    # Rack rb partly taken first, so only rack ra can hold 16 trays: its 17 healthy ones, never `bad`.
    kube.wait_pods_bound(namespace, gang.create("rb-part", 4, 16), timeout=90)
    pods = gang.create("tp64", 16, 64)
    placed = kube.wait_pods_bound(namespace, pods, timeout=120)
    assert {rack_of(n) for n in placed.values()} == {"ra"}
    assert bad not in placed.values()
    reason = parse_placement(kube.get_pod(namespace, "tp64-0")["metadata"]["annotations"][PLACEMENT_ANNOTATION])
    assert "1 tray of these domains left out for their NVLink fabric" in reason.reason
    # A third TP-64 gang: ra has one healthy tray left, rb 14: it waits, naming the degraded tray.
    waiting = gang.create("more", 16, 64)
    event = kube.wait_pod_event(namespace, waiting[-1], "FailedScheduling", contains="left out for their", timeout=90)
    assert f"{bad}: degraded, GPU 0: healthMask 0xa9: degraded bandwidth" in event.message
