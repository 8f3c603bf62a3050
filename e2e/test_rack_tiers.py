"""End to end, tier sets per hardware shape (docs/configuration.md, "Tier sets per hardware shape"): the chart's
`tierSets` reach the real gputopo-extender, H100 nodes and GB200 trays (one real gputopo-agent each) in one
cluster are each read by their own labels, and a gang lands within one shape; nodes labelled by topograph 1.0
alone are read by the default tiers.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from conftest import StackNodes, serve
from gputopo.localcluster import TEST_LABEL, ControlPlane, KubeClient, PodScheduling, pod_manifest
from gputopo.localcluster.stack import ChartRelease, GpuNode, Stack, StackTiming

pytestmark = pytest.mark.e2e

PRODUCT = "nvidia.com/gpu.product"
H100, GB200 = "NVIDIA-H100-80GB-HBM3", "NVIDIA-GB200"
IB_SPINE, IB_LEAF = "ib.example.com/spine", "ib.example.com/leaf"
TG_TIER1, TG_TIER2 = "fabric.topograph.run/tier-1", "fabric.topograph.run/tier-2"
TG_DOMAIN = "accelerator.topograph.run/domain"


def tiers(spine: str, leaf: str, domain: str) -> list[dict[str, object]]:
    return [
        {"name": "spine", "labels": [spine], "oversubscription": 2},
        {"name": "leaf", "labels": [leaf]},
        {"name": "nvlink-domain", "labels": [domain]},
    ]


TIER_SETS = [
    {"name": "h100", "match": {PRODUCT: H100}, "tiers": tiers(IB_SPINE, IB_LEAF, "nvidia.com/gpu.clique")},
    {"name": "gb200", "match": {PRODUCT: GB200}, "tiers": tiers(TG_TIER2, TG_TIER1, TG_DOMAIN)},
]


@pytest.fixture(scope="module")
def stack(control_plane: ControlPlane, kube: KubeClient) -> Iterator[Stack]:
    yield from serve(
        Stack(
            control_plane,
            kube,
            timing=StackTiming(heartbeat_seconds=2, interval_seconds=1),
            chart=ChartRelease(values={"tierSets": TIER_SETS}),
        )
    )


def gang(kube: KubeClient, namespace: str, test_id: str, name: str, size: int, gpus: int, **ann: str) -> list[str]:
    """`size` pods of `gpus` GPUs each, one group; `ann` more gputopo.io/ annotations (required_tier=...)."""
    base = {"gputopo.io/group": name, "gputopo.io/group-size": str(size)}
    base |= {f"gputopo.io/{k.replace('_', '-')}": v for k, v in ann.items()}
    pods = [f"{name}-{i}" for i in range(size)]
    for i, pod in enumerate(pods):
        kube.create_pod(
            pod_manifest(
                pod,
                namespace=namespace,
                gpus=gpus,
                annotations={**base, "gputopo.io/stage": str(i)},
                scheduling=PodScheduling(scheduler_name="gputopo-scheduler", node_selector={TEST_LABEL: test_id}),
            )
        )
    return pods


def test_rack_mixed_cluster_two_tier_sets(kube: KubeClient, nodes: StackNodes, namespace: str, test_id: str) -> None:
    # H100 nodes also carry topograph keys of another fabric: the h100 set reads only its InfiniBand keys.
    h100 = {PRODUCT: H100, IB_SPINE: "ib-spine"}
    gb200 = {PRODUCT: GB200, TG_TIER2: "tg-spine", TG_DOMAIN: "nvl72-a", "nvidia.com/gpu.clique": "nvl72-a"}
    added = nodes.add(
        GpuNode("h0", "dgx-h100", labels={**h100, IB_LEAF: "ib-leaf-1", TG_TIER1: "tg-leaf-x"}),
        GpuNode("h1", "dgx-h100", labels={**h100, IB_LEAF: "ib-leaf-2", TG_TIER1: "tg-leaf-x"}),
        GpuNode("h2", "dgx-h100", labels={**h100, IB_LEAF: "ib-leaf-2", TG_TIER1: "tg-leaf-y"}),
        GpuNode("t0", "gb200-tray", labels={**gb200, TG_TIER1: "tg-leaf-1"}),
        GpuNode("t1", "gb200-tray", labels={**gb200, TG_TIER1: "tg-leaf-2"}),
        GpuNode("t2", "gb200-tray", labels={**gb200, TG_TIER1: "tg-leaf-2"}),
    )
    shape = {n: kube.get_node(n)["metadata"]["labels"][PRODUCT] for n in added}
    name = {n.rsplit("-", 1)[0]: n for n in added}

    # 8-GPU members fit only the H100 nodes, and pack under the one InfiniBand leaf that holds both.
    big = gang(kube, namespace, test_id, "big", 2, 8)
    bound = kube.wait_pods_bound(namespace, big, timeout=90)
    assert set(bound.values()) == {name["h1"], name["h2"]}, bound

    # 4-GPU members fit both shapes: one H100 node is left, so the GB200 trays under one topograph leaf.
    small = gang(kube, namespace, test_id, "small", 2, 4)
    bound = kube.wait_pods_bound(namespace, small, timeout=90)
    assert set(bound.values()) == {name["t1"], name["t2"]}, bound
    assert {shape[n] for n in bound.values()} == {GB200}

    # One H100 node and one tray are left: two members would fit only across the shapes, so none is placed.
    split = gang(kube, namespace, test_id, "split", 2, 4)
    # The last member is first tried with the whole group there (the first may be told only to wait).
    event = kube.wait_pod_event(namespace, split[-1], "FailedScheduling", contains="hardware shape", timeout=60)
    assert "group " in event.message and "in tier set gb200" in event.message and "in tier set h100" in event.message
    assert not any(kube.get_pod(namespace, p)["spec"].get("nodeName") for p in split)


def test_rack_topograph_labels_only(kube: KubeClient, nodes: StackNodes, namespace: str, test_id: str) -> None:
    # No product label: these nodes match no set and are read by the default tiers, topograph 1.0's keys.
    spine = {TG_TIER2: "tg-spine"}
    added = nodes.add(
        GpuNode("a0", "dgx-h100", labels={**spine, TG_TIER1: "sw-a"}),
        GpuNode("b0", "dgx-h100", labels={**spine, TG_TIER1: "sw-b"}),
        GpuNode("b1", "dgx-h100", labels={**spine, TG_TIER1: "sw-b"}),
        GpuNode("b2", "dgx-h100", labels={**spine, TG_TIER1: "sw-b"}),
        GpuNode("d0", "gb200-tray", labels={**spine, TG_TIER1: "sw-c", TG_DOMAIN: "dom-1"}),
        GpuNode("d1", "gb200-tray", labels={**spine, TG_TIER1: "sw-c", TG_DOMAIN: "dom-2"}),
        GpuNode("d2", "gb200-tray", labels={**spine, TG_TIER1: "sw-c", TG_DOMAIN: "dom-2"}),
        GpuNode("d3", "gb200-tray", labels={**spine, TG_TIER1: "sw-c", TG_DOMAIN: "dom-2"}),
    )
    name = {n.rsplit("-", 1)[0]: n for n in added}

    leaf = gang(kube, namespace, test_id, "leaf", 3, 8, required_tier="leaf")
    bound = kube.wait_pods_bound(namespace, leaf, timeout=90)
    assert set(bound.values()) == {name["b0"], name["b1"], name["b2"]}, bound

    domain = gang(kube, namespace, test_id, "domain", 3, 4, required_tier="nvlink-domain")
    bound = kube.wait_pods_bound(namespace, domain, timeout=90)
    assert set(bound.values()) == {name["d1"], name["d2"], name["d3"]}, bound
