"""The node's ResourceSlice: the v1 wire shape per system (DGX-1V partitions, NVSwitch, PCIe-only, a failed
GPU), and the publisher's writes: once at start, none in steady state, one per real change, a deleted slice
created again, strays removed, a field the server drops costing one write."""

from __future__ import annotations

from typing import Any, cast

import pytest

from gputopo.agent.confirmedwrite import PublishResult
from gputopo.agent.dra.slices import (
    KubeSliceApi,
    SlicePublisher,
    SliceShape,
    comparable,
    desired_spec,
    slice_name,
    wire_attribute,
)
from gputopo.engine.dra.devices import DRIVER
from gputopo.kube import Kube, KubeError
from gputopo.model import Health, NodeTopology
from tests.agent.dp_harness import NODE, topology, with_gpu
from tests.agent.dra_harness import FakeSlices


def _attr(spec: dict[str, Any], name: str) -> list[Any]:
    return [next(iter(d["attributes"][name].values())) for d in spec["devices"]]


@pytest.mark.parametrize(
    ("value", "wire"),
    [
        pytest.param(True, {"bool": True}, id="bool-before-int"),
        pytest.param(3, {"int": 3}, id="int"),
        pytest.param("0-3", {"string": "0-3"}, id="string"),
        pytest.param("x" * 80, {"string": "x" * 64}, id="string-cut-to-64"),
        pytest.param(("0-3", "0,4"), {"strings": ["0-3", "0,4"]}, id="list-KEP-5491"),
    ],
)
def test_wire_attribute_is_one_v1_value(value: Any, wire: dict[str, Any]) -> None:
    assert wire_attribute(value) == wire


@pytest.mark.parametrize(
    ("system", "partition0", "partition1", "cliques0"),
    [
        pytest.param(
            "dgx-1v",
            ["0-3"] * 4 + ["4-7"] * 4,
            ["0,4", "1,5", "2,6", "3,7"] * 2,
            ["0-3", "0,4"],
            id="dgx-1v-quads-then-cross-pairs",
        ),
        pytest.param("dgx-h100", ["0-7"] * 8, ["0-7"] * 8, ["0-7"], id="nvswitch-one-clique"),
        pytest.param("l40s-4", ["0", "1", "2", "3"], ["0", "1", "2", "3"], ["0"], id="pcie-only-singletons"),
    ],
)
def test_slice_carries_the_clique_encodings(
    system: str, partition0: list[str], partition1: list[str], cliques0: list[str]
) -> None:
    topo = topology(system)
    scalar = desired_spec(NODE, topo, SliceShape(list_attributes=False, device_taints=False))
    assert scalar["driver"] == DRIVER and scalar["nodeName"] == NODE
    assert scalar["pool"] == {"name": NODE, "resourceSliceCount": 1}
    assert [d["name"] for d in scalar["devices"]] == [f"gpu-{g.index}" for g in topo.gpus]
    assert _attr(scalar, "nvlinkPartition0") == partition0
    assert _attr(scalar, "nvlinkPartition1") == partition1
    assert _attr(scalar, "uuid") == [g.uuid for g in topo.gpus]
    assert all("nvlinkCliques" not in d["attributes"] for d in scalar["devices"])
    assert [d["capacity"] for d in scalar["devices"]] == [{"memory": {"value": f"{g.memory_mib}Mi"}} for g in topo.gpus]
    listed = desired_spec(NODE, topo, SliceShape(list_attributes=True, device_taints=False))
    assert listed["devices"][0]["attributes"]["nvlinkCliques"] == {"strings": cliques0}


def test_standard_attributes_are_qualified() -> None:
    topo = topology()
    spec = desired_spec(
        NODE, topo, SliceShape(list_attributes=False, device_taints=False), pcie_roots={0: "pci0000:00"}
    )
    attrs = spec["devices"][0]["attributes"]
    assert attrs["resource.kubernetes.io/pciBusID"] == {"string": topo.gpus[0].pci_bus_id.lower()}
    assert attrs["resource.kubernetes.io/pcieRoot"] == {"string": "pci0000:00"}
    assert attrs["resource.kubernetes.io/numaNode"] == {"int": topo.gpus[0].numa_node}
    assert "resource.kubernetes.io/pcieRoot" not in spec["devices"][1]["attributes"]


@pytest.mark.parametrize(
    ("taints", "names", "tainted"),
    [
        pytest.param(False, [f"gpu-{i}" for i in range(8) if i != 3], [], id="no-taints-left-out"),
        pytest.param(True, [f"gpu-{i}" for i in range(8)], ["gpu-3"], id="taints-NoSchedule"),
    ],
)
def test_a_failed_gpu_is_tainted_or_left_out(taints: bool, names: list[str], tainted: list[str]) -> None:
    topo = with_gpu(topology(), 3, health=Health.FAILED)
    spec = desired_spec(NODE, topo, SliceShape(list_attributes=False, device_taints=taints))
    assert [d["name"] for d in spec["devices"]] == names
    assert [d["name"] for d in spec["devices"] if "taints" in d] == tainted
    for d in spec["devices"]:
        if "taints" in d:
            assert d["taints"] == [{"key": f"{DRIVER}/health", "value": "failed", "effect": "NoSchedule"}]
    # A failed GPU is in no clique: GPU 2's quad lost it.
    assert _attr(spec, "nvlinkPartition0")[2] == "0-2"


def test_comparable_reads_quantities_and_server_fields_as_values() -> None:
    ours = {
        "pool": {"name": "n", "resourceSliceCount": 1},
        "devices": [
            {
                "name": "a",
                "capacity": {"memory": {"value": "81920Mi"}},
                "taints": [{"key": "k", "effect": "NoSchedule"}],
            }
        ],
    }
    theirs = {
        "pool": {"name": "n", "resourceSliceCount": 1, "generation": 7},
        "devices": [
            {
                "name": "a",
                "capacity": {"memory": {"value": "80Gi"}},
                "taints": [{"key": "k", "effect": "NoSchedule", "timeAdded": "t"}],
            }
        ],
    }
    assert comparable(ours) == comparable(theirs)


def _publisher(api: FakeSlices, clock: list[float], **kw: Any) -> SlicePublisher:
    return SlicePublisher(
        api,
        NODE,
        SliceShape(list_attributes=kw.pop("list_attributes", False), device_taints=kw.pop("device_taints", False)),
        sleep=lambda _s: True,
        monotonic=lambda: clock[0],
        reverify_s=60.0,
        **kw,
    )


def test_steady_state_makes_zero_writes_and_no_reads_between_reverifies() -> None:
    api, clock = FakeSlices(), [0.0]
    pub = _publisher(api, clock)
    topo = topology("hgx-a100-4")  # 81920 MiB: the server writes it back as 80Gi
    assert pub.publish(topo) is PublishResult.CHANGED
    stored = api.slices[slice_name(NODE)]
    assert stored["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": "node-uid-1", "controller": True}
    ]
    assert stored["spec"]["pool"]["generation"] == 1
    assert stored["spec"]["devices"][0]["capacity"]["memory"]["value"] == "80Gi"
    reads = api.reads
    for step in range(1, 200):
        clock[0] = step * 10.0  # a discovery cycle every 10 s for half an hour
        assert pub.publish(topo) is PublishResult.UNCHANGED
    assert api.writes == 1
    assert api.reads - reads == 199 * 10 // 60  # one read per reverify period, no more


def test_a_change_is_one_write_with_the_next_generation() -> None:
    api, clock = FakeSlices(), [0.0]
    pub = _publisher(api, clock)
    pub.publish(topology())
    assert pub.publish(with_gpu(topology(), 5, health=Health.FAILED)) is PublishResult.CHANGED
    assert pub.publish(with_gpu(topology(), 5, health=Health.FAILED)) is PublishResult.UNCHANGED
    stored = api.slices[slice_name(NODE)]
    assert api.writes == 2 and stored["spec"]["pool"]["generation"] == 2
    assert "gpu-5" not in [d["name"] for d in stored["spec"]["devices"]]


def test_a_deleted_slice_is_created_again_once_reverified() -> None:
    api, clock = FakeSlices(), [0.0]
    pub = _publisher(api, clock)
    pub.publish(topology())
    api.slices.clear()
    clock[0] = 10.0
    assert pub.publish(topology()) is PublishResult.UNCHANGED  # not read yet
    pub.reverify()
    assert pub.publish(topology()) is PublishResult.CHANGED
    assert slice_name(NODE) in api.slices and api.writes == 2


def test_an_edited_slice_is_repaired_and_a_foreign_owner_replaced() -> None:
    api, clock = FakeSlices(), [0.0]
    pub = _publisher(api, clock)
    pub.publish(topology())
    api.slices[slice_name(NODE)]["spec"]["devices"].pop()
    clock[0] = 61.0
    assert pub.publish(topology()) is PublishResult.CHANGED
    api.slices[slice_name(NODE)]["metadata"]["ownerReferences"] = []
    clock[0] = 122.0
    assert pub.publish(topology()) is PublishResult.CHANGED
    assert len(api.slices[slice_name(NODE)]["spec"]["devices"]) == 8 and api.writes == 3


def test_a_field_the_server_drops_costs_one_write_not_one_per_cycle() -> None:
    api, clock = FakeSlices(strip_taints=True), [0.0]
    pub = _publisher(api, clock, device_taints=True)
    topo: NodeTopology = with_gpu(topology(), 3, health=Health.FAILED)
    pub.publish(topo)
    for step in range(1, 30):
        clock[0] = step * 61.0  # every publish reads
        assert pub.publish(topo) is PublishResult.UNCHANGED
    assert api.writes == 1


def test_stray_slices_of_this_node_and_driver_are_removed_once() -> None:
    api, clock = FakeSlices(), [0.0]
    other = {"metadata": {"name": "old-name"}, "spec": {"nodeName": NODE, "driver": DRIVER, "devices": []}}
    foreign = {"metadata": {"name": "nvidia"}, "spec": {"nodeName": NODE, "driver": "gpu.nvidia.com", "devices": []}}
    api.slices.update({"old-name": other, "nvidia": foreign})
    pub = _publisher(api, clock)
    pub.publish(topology())
    assert sorted(api.slices) == sorted([slice_name(NODE), "nvidia"])


def test_an_api_failure_is_an_error_result_and_the_next_publish_retries() -> None:
    api, clock = FakeSlices(), [0.0]
    pub = _publisher(api, clock)
    api.node_uids.clear()  # the node read fails (KeyError stands in for any failure)
    assert pub.publish(topology()) is PublishResult.ERROR
    api.node_uids[NODE] = "node-uid-1"
    assert pub.publish(topology()) is PublishResult.CHANGED


class _RecordingKube:
    """The Kube calls KubeSliceApi makes, recorded; a 404 for a slice that is not there."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def get(self, path: str) -> dict[str, Any]:
        self.calls.append(("GET", path))
        if path.startswith("/api/v1/nodes/"):
            return {"metadata": {"uid": "u-1"}}
        raise KubeError(404, "not found", "NotFound")

    def list_items(self, path: str, *, field_selector: str = "") -> tuple[list[dict[str, Any]], str]:
        self.calls.append(("LIST", path, field_selector))
        return [{"metadata": {"name": "s1"}}], "1"

    def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(("POST", path))
        return body

    def request(self, method: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.calls.append((method, path))
        return body

    def delete(self, path: str) -> dict[str, Any]:
        self.calls.append(("DELETE", path))
        raise KubeError(404, "gone", "NotFound")


def test_kube_slice_api_speaks_resource_k8s_io_v1() -> None:
    kube = _RecordingKube()
    api = KubeSliceApi(cast(Kube, kube))
    assert api.node_uid("n1") == "u-1"
    assert api.get_slice("n1-gpu.gputopo.io") is None
    assert api.list_slice_names("n1", DRIVER) == ["s1"]
    api.create_slice({"metadata": {"name": "x"}})
    api.replace_slice("x", {"metadata": {"name": "x"}})
    api.delete_slice("x")  # already gone is fine
    base = "/apis/resource.k8s.io/v1/resourceslices"
    assert kube.calls == [
        ("GET", "/api/v1/nodes/n1"),
        ("GET", f"{base}/n1-gpu.gputopo.io"),
        ("LIST", base, f"spec.nodeName=n1,spec.driver={DRIVER}"),
        ("POST", base),
        ("PUT", f"{base}/x"),
        ("DELETE", f"{base}/x"),
    ]
