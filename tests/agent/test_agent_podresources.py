"""PodResources client against a real gRPC server on a unix socket (a stand-in kubelet)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from gputopo.agent.backends import InUseError, InUseFile, NoneInUse, PodResourcesInUse
from gputopo.agent.main import make_in_use
from gputopo.agent.podresources import api_pb2
from gputopo.agent.podresources.client import (
    GpuAllocation,
    PodResourcesClient,
    PodResourcesError,
    indices_in_use,
    per_pod_in_use,
    strip_replica,
)
from gputopo.agent.settings import AgentSettings
from gputopo.model import GpusInUse
from gputopo.systems import build_system
from tests.agent.dp_harness import PodResourcesKubelet as Kubelet
from tests.agent.dp_harness import serve_podresources

TOPO = build_system("dgx-h100", "node-a")
UUIDS = [g.uuid for g in TOPO.gpus]


def devices(resource: str, *ids: str) -> Any:
    return api_pb2.ContainerDevices(resource_name=resource, device_ids=list(ids))


def pod(name: str, *containers: list[Any]) -> Any:
    return api_pb2.PodResources(
        name=name,
        namespace="default",
        containers=[api_pb2.ContainerResources(name=f"c{i}", devices=d) for i, d in enumerate(containers)],
    )


@pytest.fixture
def socket_path(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "kubelet.sock"
    if len(str(path)) < 100:  # unix socket paths are limited to 107 bytes
        yield path
        return
    short = Path(tempfile.mkdtemp(prefix="gputopo-pr-"))
    try:
        yield short / "kubelet.sock"
    finally:
        shutil.rmtree(short, ignore_errors=True)


@pytest.fixture
def kubelet(socket_path: Path) -> Iterator[Kubelet]:
    with serve_podresources(socket_path) as servicer:
        yield servicer


@pytest.fixture
def client(socket_path: Path) -> Iterator[PodResourcesClient]:
    c = PodResourcesClient(socket_path, timeout_s=5.0)
    try:
        yield c
    finally:
        c.close()


@pytest.mark.parametrize(
    ("resource", "expected"),
    [("nvidia.com/gpu", {0}), ("example.com/gpu", {3})],
    ids=["default-resource", "custom-resource-name"],
)
def test_gpus_are_counted_under_the_served_resource_name_only(
    kubelet: Kubelet, socket_path: Path, resource: str, expected: set[int]
) -> None:
    kubelet.pods = [pod("a", [devices("nvidia.com/gpu", UUIDS[0])]), pod("b", [devices("example.com/gpu", UUIDS[3])])]
    c = PodResourcesClient(socket_path, timeout_s=5.0, resource=resource)
    try:
        found, unknown = indices_in_use(c.gpu_allocation(), {u: i for i, u in enumerate(UUIDS)})
    finally:
        c.close()
    assert (set(found), unknown) == (expected, ())


def test_list_and_allocatable_with_replicas_stripped(kubelet: Kubelet, client: PodResourcesClient) -> None:
    kubelet.pods = [
        pod("trainer", [devices("nvidia.com/gpu", f"{UUIDS[0]}::0", f"{UUIDS[0]}::1", UUIDS[5])]),
        pod("sidecar", [devices("rdma/hca_shared", "mlx5_0")], [devices("nvidia.com/gpu", f"{UUIDS[7]}::3")]),
        pod("cpu-only", []),
    ]
    kubelet.allocatable = [devices("nvidia.com/gpu", *UUIDS), devices("rdma/hca_shared", "mlx5_0")]
    alloc = client.gpu_allocation()
    assert alloc == GpuAllocation(
        in_use=frozenset({UUIDS[0], UUIDS[5], UUIDS[7]}),
        allocatable=frozenset(UUIDS),
        by_pod={("default", "trainer"): frozenset({UUIDS[0], UUIDS[5]}), ("default", "sidecar"): frozenset({UUIDS[7]})},
    )
    assert indices_in_use(alloc, {u: i for i, u in enumerate(UUIDS)}) == (frozenset({0, 5, 7}), ())


def test_unimplemented_allocatable_falls_back_to_list_only(kubelet: Kubelet, client: PodResourcesClient) -> None:
    kubelet.pods = [pod("p", [devices("nvidia.com/gpu", UUIDS[2])])]
    first = client.gpu_allocation()
    second = client.gpu_allocation()
    by_pod = {("default", "p"): frozenset({UUIDS[2]})}
    assert first == second == GpuAllocation(in_use=frozenset({UUIDS[2]}), allocatable=None, by_pod=by_pod)
    assert (kubelet.list_calls, kubelet.allocatable_calls) == (2, 1)  # not asked again


def test_in_use_source_maps_uuids_and_reports_unknown_ids(socket_path: Path, kubelet: Kubelet) -> None:
    kubelet.pods = [pod("p", [devices("nvidia.com/gpu", UUIDS[3], "MIG-4f1c0e2a-0000")])]
    kubelet.allocatable = [devices("nvidia.com/gpu", *UUIDS)]
    source = PodResourcesInUse(socket_path)
    try:
        assert source.gpus_in_use(TOPO) == GpusInUse(other=frozenset({3}))  # no pod view: nothing attributed
    finally:
        source.close()


@dataclass(frozen=True)
class Known:
    uid: str


@dataclass
class Lookup:
    """The node-local pod view as attribution uses it; `late` pods show up only after a refresh."""

    known: dict[tuple[str, str], str]
    late: dict[tuple[str, str], str] = field(default_factory=dict)
    refreshes: int = 0

    def get(self, namespace: str, name: str) -> Known | None:
        uid = self.known.get((namespace, name))
        return None if uid is None else Known(uid)

    def refresh(self) -> None:
        self.refreshes += 1
        self.known.update(self.late)
        self.late = {}


def alloc(**pods: list[str]) -> GpuAllocation:
    by_pod = {("default", name): frozenset(ids) for name, ids in pods.items()}
    return GpuAllocation(in_use=frozenset(i for ids in pods.values() for i in ids), by_pod=by_pod)


@pytest.mark.parametrize(
    ("allocation", "uids", "expected", "unattributed"),
    [
        pytest.param(
            alloc(a=[UUIDS[0], UUIDS[1]], b=[UUIDS[4]]),
            {"a": "uid-a", "b": "uid-b"},
            GpusInUse(pods={"uid-a": frozenset({0, 1}), "uid-b": frozenset({4})}),
            (),
            id="every pod known: all per pod",
        ),
        pytest.param(
            alloc(a=[UUIDS[0]], stranger=[UUIDS[6], UUIDS[7]]),
            {"a": "uid-a"},
            GpusInUse(pods={"uid-a": frozenset({0})}, other=frozenset({6, 7})),
            (("default", "stranger"),),
            id="unknown pod: its GPUs are other",
        ),
        pytest.param(
            alloc(a=[UUIDS[2]], b=[UUIDS[2], UUIDS[3]]),
            {"a": "uid-a", "b": "uid-b"},
            GpusInUse(pods={"uid-b": frozenset({3})}, other=frozenset({2})),
            (),
            id="time-sliced GPU in two pods: other, not either pod's",
        ),
        pytest.param(
            alloc(a=["MIG-4f1c0e2a-0000"]),
            {"a": "uid-a"},
            GpusInUse(),
            (),
            id="ids naming no GPU of the node: nothing",
        ),
        pytest.param(
            GpuAllocation(in_use=frozenset({UUIDS[5]})),
            {},
            GpusInUse(other=frozenset({5})),
            (),
            id="in use without per-pod detail: other",
        ),
    ],
)
def test_podresources_map_to_per_pod_version_2(
    allocation: GpuAllocation, uids: dict[str, str], expected: GpusInUse, unattributed: tuple[tuple[str, str], ...]
) -> None:
    index = {g.uuid: g.index for g in TOPO.gpus}
    report, _, left = per_pod_in_use(allocation, index, lambda ns, name: uids.get(name) if ns == "default" else None)
    assert (report, left) == (expected, unattributed)


def test_a_pod_the_local_view_has_not_seen_yet_is_attributed_after_one_refresh(
    socket_path: Path, kubelet: Kubelet
) -> None:
    kubelet.pods = [
        pod("old", [devices("nvidia.com/gpu", UUIDS[0])]),
        pod("new", [devices("nvidia.com/gpu", UUIDS[1], UUIDS[2])]),
        pod("static", [devices("nvidia.com/gpu", UUIDS[7])]),
    ]
    lookup = Lookup({("default", "old"): "uid-old"}, late={("default", "new"): "uid-new"})
    source = PodResourcesInUse(socket_path, pods=lookup)
    try:
        want = GpusInUse(pods={"uid-old": frozenset({0}), "uid-new": frozenset({1, 2})}, other=frozenset({7}))
        assert source.gpus_in_use(TOPO) == want
        assert source.gpus_in_use(TOPO) == want
        assert lookup.refreshes == 1  # the pod that stays unknown does not refresh every cycle
    finally:
        source.close()


def test_kubelet_pods_lists_every_pod_with_its_containers_holding_the_resource(
    kubelet: Kubelet, client: PodResourcesClient
) -> None:
    kubelet.pods = [
        pod("trainer", [devices("nvidia.com/gpu", UUIDS[0])], [devices("rdma/hca_shared", "mlx5_0")], []),
        pod("admitting", [], []),  # the kubelet lists a pod before its devices are allocated
        pod("replica", [devices("nvidia.com/gpu", f"{UUIDS[1]}::2")]),
    ]
    assert client.kubelet_pods() == {
        ("default", "trainer"): frozenset({"c0"}),
        ("default", "admitting"): frozenset(),
        ("default", "replica"): frozenset({"c0"}),
    }
    assert kubelet.allocatable_calls == 0  # one List, nothing else, while the kubelet waits


def test_unreachable_kubelet_is_an_error_not_a_crash(socket_path: Path) -> None:
    c = PodResourcesClient(socket_path, timeout_s=1.0)  # nothing listens on this socket
    try:
        with pytest.raises(PodResourcesError, match="List"):
            c.gpu_allocation()
        with pytest.raises(PodResourcesError, match="List"):
            c.kubelet_pods()
    finally:
        c.close()
    source = PodResourcesInUse(socket_path, timeout_s=1.0)
    try:
        with pytest.raises(InUseError):
            source.gpus_in_use(TOPO)
    finally:
        source.close()


@pytest.mark.parametrize(
    ("device_id", "expected"),
    [
        pytest.param("GPU-0a1b::3", "GPU-0a1b", id="time-slicing replica suffix stripped"),
        pytest.param("GPU-0a1b", "GPU-0a1b", id="plain uuid unchanged"),
        pytest.param("GPU-0a1b::3::x", "GPU-0a1b", id="only the first separator counts"),
    ],
)
def test_strip_replica(device_id: str, expected: str) -> None:
    assert strip_replica(device_id) == expected


def test_indices_in_use_lists_ids_of_no_local_gpu() -> None:
    alloc = GpuAllocation(in_use=frozenset({"GPU-a", "GPU-zz"}))
    assert indices_in_use(alloc, {"GPU-a": 1}) == (frozenset({1}), ("GPU-zz",))


@pytest.mark.parametrize(
    ("fields", "kind"),
    [
        pytest.param({"backend": "nvml"}, PodResourcesInUse, id="nvml: the kubelet"),
        pytest.param({"backend": "fixture:dgx-h100", "device_plugin": True}, PodResourcesInUse, id="device plugin"),
        pytest.param({"backend": "fixture:dgx-h100"}, NoneInUse, id="simulated without a kubelet"),
        pytest.param({"backend": "nvml", "in_use_file": Path("in-use.json")}, InUseFile, id="in-use file wins"),
    ],
)
def test_the_in_use_source_follows_the_settings(socket_path: Path, fields: dict[str, Any], kind: type) -> None:
    source = make_in_use(AgentSettings(podresources_socket=socket_path, **fields), pods=None)
    try:
        assert isinstance(source, kind)
    finally:
        source.close()
