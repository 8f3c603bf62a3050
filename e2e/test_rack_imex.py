"""End to end, ComputeDomains on NVL72 racks (docs/devices.md, "ComputeDomains on NVL72 racks"):
the pods of one ComputeDomain, each claiming its IMEX channel through the ComputeDomain's ResourceClaimTemplate,
land in one NVLink domain even where best fit alone would take another rack's free tray.

There is no NVIDIA DRA driver here (nor GPUs): the test makes what it would. The DeviceClass
`compute-domain-default-channel.nvidia.com`, the channel ResourceClaimTemplate its controller makes per
ComputeDomain, and per tray a ResourceSlice of driver `compute-domain.nvidia.com` with its one device
`channel-0` (spec.nodeName = the tray), standing in for NVIDIA's kubelet plugin on hardware we lack, so that
kube-scheduler's DRA plugin allocates the claims as it would there. The trays (GB200, one real gputopo-agent
each) have no kubelet: pods are only bound. Needs resource.k8s.io/v1 (Kubernetes 1.34 and later).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from conftest import StackNodes, serve
from gputopo.engine.gang.imex import DRIVER_NODE_LABEL
from gputopo.extender.watch.computedomains import CHANNEL_DEVICE_CLASS, CHANNEL_DRIVER
from gputopo.localcluster import TEST_LABEL, ControlPlane, KubeClient, PodScheduling, pod_manifest
from gputopo.localcluster.stack import GpuNode, Stack, StackTiming

pytestmark = pytest.mark.e2e

CLIQUE = "nvidia.com/gpu.clique"
TRAY = "e2e.gputopo.io/tray"


# The ComputeDomain CRD's spec as NVIDIA's driver declares it (resource.nvidia.com/v1beta1): the fields gputopo
# reads, typed as there; the status is the driver's and is left open.
_NAME = {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}
_CHANNEL = {
    "type": "object",
    "required": ["resourceClaimTemplate"],
    "properties": {
        "allocationMode": {"type": "string", "enum": ["All", "Single"], "default": "Single"},
        "resourceClaimTemplate": _NAME,
    },
}
CRD_NAME = "computedomains.resource.nvidia.com"
COMPUTE_DOMAIN_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": CRD_NAME},
    "spec": {
        "group": "resource.nvidia.com",
        "scope": "Namespaced",
        "names": {"kind": "ComputeDomain", "listKind": "ComputeDomainList", "plural": "computedomains"},
        "versions": [
            {
                "name": "v1beta1",
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {
                                "type": "object",
                                "required": ["channel", "numNodes"],
                                "properties": {"numNodes": {"type": "integer", "minimum": 0}, "channel": _CHANNEL},
                            },
                            "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                        },
                    }
                },
            }
        ],
    },
}


@pytest.fixture(scope="module")
def stack(control_plane: ControlPlane, kube: KubeClient) -> Iterator[Stack]:
    kube.apply(
        [
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "DeviceClass",
                "metadata": {"name": CHANNEL_DEVICE_CLASS},
                "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{CHANNEL_DRIVER}"'}}]},
            },
            COMPUTE_DOMAIN_CRD,
        ]
    )
    kube.wait_crds_established([CRD_NAME])  # served before the extender first lists it
    yield from serve(Stack(control_plane, kube, timing=StackTiming(heartbeat_seconds=2, interval_seconds=1)))


def channel_slices(kube: KubeClient, trays: list[str]) -> None:
    """Each tray's `channel-0`, as NVIDIA's kubelet plugin publishes it."""
    kube.apply(
        [
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceSlice",
                "metadata": {"name": f"{tray}-channels"},
                "spec": {
                    "driver": CHANNEL_DRIVER,
                    "nodeName": tray,
                    "pool": {"name": tray, "generation": 1, "resourceSliceCount": 1},
                    "devices": [{"name": "channel-0", "attributes": {"type": {"string": "channel"}}}],
                },
            }
            for tray in trays
        ]
    )


def add_trays(kube: KubeClient, nodes: StackNodes, test_id: str, racks: dict[str, str]) -> dict[str, str]:
    """GB200 trays (short name -> rack), each labelled with its rack's clique and its own tray label, with
    their channel slices; short name -> node name."""
    suffix = test_id[-6:]
    trays = nodes.add(
        *(
            GpuNode(t, "gb200-tray", labels={CLIQUE: f"rack-{r}-{suffix}", TRAY: f"{t}-{suffix}"})
            for t, r in racks.items()
        )
    )
    channel_slices(kube, trays)
    return dict(zip(racks, trays, strict=True))


def channel_template(kube: KubeClient, namespace: str, name: str, uid: str = "") -> str:
    """The ResourceClaimTemplate NVIDIA's ComputeDomain controller makes for a ComputeDomain (labelled with
    the ComputeDomain's UID, as the controller does, when `uid` is given)."""
    request = {"name": "channel", "exactly": {"deviceClassName": CHANNEL_DEVICE_CLASS}}
    labels = {DRIVER_NODE_LABEL: uid} if uid else {}
    kube.apply(
        [
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaimTemplate",
                "metadata": {"name": name, "namespace": namespace, "labels": labels},
                "spec": {"spec": {"devices": {"requests": [request]}}},
            }
        ]
    )
    return name


def compute_domain(kube: KubeClient, namespace: str, name: str, template: str, num_nodes: int = 1) -> str:
    """A ComputeDomain object (what NVIDIA's controller makes the channel template from); its UID, which the
    API server gives it and its controller puts on the template and on the nodes whose channel serves it."""
    kube.apply(
        [
            {
                "apiVersion": "resource.nvidia.com/v1beta1",
                "kind": "ComputeDomain",
                "metadata": {"name": name, "namespace": namespace},
                "spec": {"numNodes": num_nodes, "channel": {"resourceClaimTemplate": {"name": template}}},
            }
        ]
    )
    got = kube.request("GET", f"/apis/resource.nvidia.com/v1beta1/namespaces/{namespace}/computedomains/{name}")
    uid: str = got["metadata"]["uid"]
    return uid


def pod(kube: KubeClient, namespace: str, name: str, gpus: int, selector: dict[str, str], cd: str | None) -> str:
    manifest = pod_manifest(
        name,
        namespace=namespace,
        gpus=gpus,
        annotations={"gputopo.io/nvlink": "required"},
        scheduling=PodScheduling(scheduler_name="gputopo-scheduler", node_selector=selector),
    )
    if cd is not None:
        manifest["spec"]["resourceClaims"] = [{"name": "imex", "resourceClaimTemplateName": cd}]
        manifest["spec"]["containers"][0]["resources"]["claims"] = [{"name": "imex"}]
    kube.create_pod(manifest)
    return name


def gang(kube: KubeClient, namespace: str, group: str, size: int, cd: str, selector: dict[str, str]) -> list[str]:
    """A gang of `size` whole-tray members, each claiming ComputeDomain `cd`'s channel; their names."""
    members = []
    for i in range(size):
        manifest = pod_manifest(
            f"{group}-{i}",
            namespace=namespace,
            gpus=4,
            annotations={"gputopo.io/group": group, "gputopo.io/group-size": str(size), "gputopo.io/stage": str(i)},
            scheduling=PodScheduling(scheduler_name="gputopo-scheduler", node_selector=selector),
        )
        manifest["spec"]["resourceClaims"] = [{"name": "imex", "resourceClaimTemplateName": cd}]
        manifest["spec"]["containers"][0]["resources"]["claims"] = [{"name": "imex"}]
        kube.create_pod(manifest)
        members.append(f"{group}-{i}")
    return members


def test_rack_compute_domain_pods_one_domain(kube: KubeClient, nodes: StackNodes, namespace: str, test_id: str) -> None:
    name = add_trays(kube, nodes, test_id, {"a0": "a", "a1": "a", "a2": "a", "b0": "b", "b1": "b"})
    cd = channel_template(kube, namespace, "train-channel")
    mine = {TEST_LABEL: test_id}

    # The ComputeDomain's first pod on a0 (its selector), a plain pod filling b0: rack b is now the fuller
    # rack with room, where best fit alone would put the next whole-tray pod.
    pod(kube, namespace, "train-0", 4, {**mine, TRAY: f"a0-{test_id[-6:]}"}, cd)
    pod(kube, namespace, "other", 4, {**mine, TRAY: f"b0-{test_id[-6:]}"}, None)
    assert kube.wait_pods_bound(namespace, ["train-0", "other"], timeout=60) == {
        "train-0": name["a0"],
        "other": name["b0"],
    }
    pod(kube, namespace, "plain", 4, mine, None)
    assert kube.wait_pod_bound(namespace, "plain", timeout=60) == name["b1"]  # best fit, as without CDs
    kube.delete_pod(namespace, "plain")
    deadline = time.monotonic() + 30
    while any(p["metadata"]["name"] == "plain" for p in kube.list_pods(namespace)):  # b1 free again
        assert time.monotonic() < deadline, "pod plain not deleted"
        time.sleep(0.2)

    later = [pod(kube, namespace, f"train-{i}", 4, mine, cd) for i in (1, 2)]
    bound = kube.wait_pods_bound(namespace, later, timeout=60)
    assert sorted(bound.values()) == [name["a1"], name["a2"]]  # the ComputeDomain's rack, not b1


def test_rack_compute_domain_keeps_its_free_tray_whole_for_its_next_pod(
    kube: KubeClient, nodes: StackNodes, namespace: str, test_id: str
) -> None:
    name = add_trays(kube, nodes, test_id, {"a0": "a", "a1": "a", "b0": "b", "b1": "b"})
    cd = channel_template(kube, namespace, "serve-channel")
    mine = {TEST_LABEL: test_id}

    # Rack a is the fuller rack with room once the ComputeDomain's first pod holds a0: best fit alone would
    # put a one-GPU pod on a1 and leave the ComputeDomain no whole tray in its rack.
    pod(kube, namespace, "serve-0", 4, {**mine, TRAY: f"a0-{test_id[-6:]}"}, cd)
    assert kube.wait_pod_bound(namespace, "serve-0", timeout=60) == name["a0"]
    pod(kube, namespace, "small", 1, mine, None)
    assert kube.wait_pod_bound(namespace, "small", timeout=60) in (name["b0"], name["b1"])
    pod(kube, namespace, "serve-1", 4, mine, cd)
    assert kube.wait_pod_bound(namespace, "serve-1", timeout=60) == name["a1"]


def test_rack_compute_domain_gang_is_planned_in_one_domain_whole(
    kube: KubeClient, nodes: StackNodes, namespace: str, test_id: str
) -> None:
    """A gang whose members claim one ComputeDomain's channel: the whole gang in one NVLink domain, the
    rack that holds all four (b), never split over the two racks (gputopo.engine.gang.rack, one domain)."""
    name = add_trays(kube, nodes, test_id, {"a0": "a", "a1": "a", "b0": "b", "b1": "b", "b2": "b", "b3": "b"})
    cd = channel_template(kube, namespace, "gang-channel")
    mine = {TEST_LABEL: test_id}
    members = gang(kube, namespace, "gang", 4, cd, mine)
    bound = kube.wait_pods_bound(namespace, members, timeout=90)
    assert sorted(bound.values()) == sorted(name[t] for t in ("b0", "b1", "b2", "b3"))


def test_rack_compute_domain_gang_joins_the_domain_its_compute_domains_pods_run_in(
    kube: KubeClient, nodes: StackNodes, namespace: str, test_id: str
) -> None:
    """A gang of a ComputeDomain whose first pod (no member of the gang) runs on rack b: the gang goes to rack b
    though rack a, the fuller rack with room, is where best fit alone would plan it."""
    racks = {"a0": "a", "a1": "a", "a2": "a", "b0": "b", "b1": "b", "b2": "b", "b3": "b"}
    name = add_trays(kube, nodes, test_id, racks)
    cd, mine, suffix = channel_template(kube, namespace, "shared-channel"), {TEST_LABEL: test_id}, test_id[-6:]
    pod(kube, namespace, "solo", 4, {**mine, TRAY: f"b0-{suffix}"}, cd)
    pod(kube, namespace, "fill", 4, {**mine, TRAY: f"a0-{suffix}"}, None)
    assert kube.wait_pods_bound(namespace, ["solo", "fill"], timeout=60) == {"solo": name["b0"], "fill": name["a0"]}
    members = gang(kube, namespace, "pair", 2, cd, mine)
    bound = set(kube.wait_pods_bound(namespace, members, timeout=90).values())
    assert len(bound) == 2 and bound <= {name["b1"], name["b2"], name["b3"]}


def test_rack_compute_domain_driver_label_keeps_its_next_pod_in_its_domain(
    kube: KubeClient, nodes: StackNodes, namespace: str, test_id: str
) -> None:
    """A tray NVIDIA's kubelet plugin labelled with a ComputeDomain's UID, as it does while a pod of that
    ComputeDomain that gputopo does not track runs there (here the label alone): the ComputeDomain's next pod
    joins that tray's NVLink domain, though best fit alone would take the fuller rack's free tray."""
    name = add_trays(kube, nodes, test_id, {"a0": "a", "a1": "a", "b0": "b", "b1": "b", "b2": "b"})
    mine, suffix = {TEST_LABEL: test_id}, test_id[-6:]
    uid = compute_domain(kube, namespace, "train", "train-channel")  # where served, the UID's owner names it
    cd = channel_template(kube, namespace, "train-channel", uid=uid)
    kube.patch_node(name["b0"], {"metadata": {"labels": {DRIVER_NODE_LABEL: uid}}})
    pod(kube, namespace, "fill", 4, {**mine, TRAY: f"a0-{suffix}"}, None)  # rack a: the fuller rack with room
    assert kube.wait_pod_bound(namespace, "fill", timeout=60) == name["a0"]
    pod(kube, namespace, "train-1", 4, mine, cd)
    assert kube.wait_pod_bound(namespace, "train-1", timeout=60) in (name["b0"], name["b1"], name["b2"])


def test_rack_compute_domain_a_template_in_another_namespace_cannot_claim_its_uid(
    kube: KubeClient, nodes: StackNodes, namespace: str, test_id: str
) -> None:
    """Another tenant's channel template carrying the victim's ComputeDomain UID (on the victim's Node labels
    for anyone to read), made after the victim's: the victim's tray still serves the victim's ComputeDomain
    (its ComputeDomain object names the UID), so its next pod joins that tray's NVLink domain, that tray
    included, where the later claim used to send it to the fuller rack."""
    name = add_trays(kube, nodes, test_id, {"a0": "a", "a1": "a", "b0": "b", "b1": "b", "b2": "b"})
    mine, suffix = {TEST_LABEL: test_id}, test_id[-6:]
    uid = compute_domain(kube, namespace, "train", "train-channel")
    cd = channel_template(kube, namespace, "train-channel", uid=uid)
    kube.patch_node(name["b0"], {"metadata": {"labels": {DRIVER_NODE_LABEL: uid}}})
    tenant = f"{namespace[:56]}-tenant"
    kube.create_namespace(tenant)
    channel_template(kube, tenant, "claims-their-uid", uid=uid)  # the later claim: it used to win
    pod(kube, namespace, "fill", 4, {**mine, TRAY: f"a0-{suffix}"}, None)  # rack a: the fuller rack with room
    assert kube.wait_pod_bound(namespace, "fill", timeout=60) == name["a0"]
    pod(kube, namespace, "train-1", 4, mine, cd)
    assert kube.wait_pod_bound(namespace, "train-1", timeout=60) in (name["b0"], name["b1"], name["b2"])


def test_rack_compute_domain_first_pod_goes_where_its_num_nodes_fit(
    kube: KubeClient, nodes: StackNodes, namespace: str, test_id: str
) -> None:
    """A ComputeDomain with numNodes 2: its first pod goes to rack b, where two trays are free, though best fit
    alone would take rack a's one free tray (the fuller rack), where its second pod could never join it."""
    name = add_trays(kube, nodes, test_id, {"a0": "a", "a1": "a", "b0": "b", "b1": "b", "b2": "b"})
    mine, suffix, cd = {TEST_LABEL: test_id}, test_id[-6:], "pair-channel"
    # The ComputeDomain first, as NVIDIA's controller makes its template from it: the extender has read it
    # (one watch, in order) long before the pods below reach it.
    compute_domain = {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "ComputeDomain",
        "metadata": {"name": "pair", "namespace": namespace},
        "spec": {"numNodes": 2, "channel": {"resourceClaimTemplate": {"name": cd}}},
    }
    kube.apply([compute_domain])
    channel_template(kube, namespace, cd)
    pod(kube, namespace, "fill", 4, {**mine, TRAY: f"a0-{suffix}"}, None)
    assert kube.wait_pod_bound(namespace, "fill", timeout=60) == name["a0"]
    pod(kube, namespace, "pair-0", 4, mine, cd)
    assert kube.wait_pod_bound(namespace, "pair-0", timeout=60) in (name["b0"], name["b1"], name["b2"])
    pod(kube, namespace, "pair-1", 4, mine, cd)
    assert kube.wait_pod_bound(namespace, "pair-1", timeout=60) in (name["b0"], name["b1"], name["b2"])
