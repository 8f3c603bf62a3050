"""PodResources client against a real gRPC server on a unix socket (a stand-in kubelet)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from agent.backends import InUseError, PodResourcesInUse
from agent.podresources import api_pb2, api_pb2_grpc
from agent.podresources.client import (
    GpuAllocation,
    PodResourcesClient,
    PodResourcesError,
    indices_in_use,
    strip_replica,
)
from gputopo.systems import build_system

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


@dataclass
class Kubelet(api_pb2_grpc.PodResourcesListerServicer):  # type: ignore[misc]
    pods: list[Any] = field(default_factory=list)
    allocatable: list[Any] | None = None  # None: answer UNIMPLEMENTED like an old kubelet
    list_calls: int = 0
    allocatable_calls: int = 0

    def List(self, request: Any, context: Any) -> Any:
        self.list_calls += 1
        return api_pb2.ListPodResourcesResponse(pod_resources=self.pods)

    def GetAllocatableResources(self, request: Any, context: Any) -> Any:
        self.allocatable_calls += 1
        if self.allocatable is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "GetAllocatableResources is not served")
        return api_pb2.AllocatableResourcesResponse(devices=self.allocatable)


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
    servicer = Kubelet()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    api_pb2_grpc.add_PodResourcesListerServicer_to_server(servicer, server)
    server.add_insecure_port(f"unix:{socket_path}")
    server.start()
    try:
        yield servicer
    finally:
        server.stop(grace=None).wait()


@pytest.fixture
def client(socket_path: Path) -> Iterator[PodResourcesClient]:
    c = PodResourcesClient(socket_path, timeout_s=5.0)
    try:
        yield c
    finally:
        c.close()


def test_list_and_allocatable_with_replicas_stripped(kubelet: Kubelet, client: PodResourcesClient) -> None:
    kubelet.pods = [
        pod("trainer", [devices("nvidia.com/gpu", f"{UUIDS[0]}::0", f"{UUIDS[0]}::1", UUIDS[5])]),
        pod("sidecar", [devices("rdma/hca_shared", "mlx5_0")], [devices("nvidia.com/gpu", f"{UUIDS[7]}::3")]),
        pod("cpu-only", []),
    ]
    kubelet.allocatable = [devices("nvidia.com/gpu", *UUIDS), devices("rdma/hca_shared", "mlx5_0")]
    alloc = client.gpu_allocation()
    assert alloc == GpuAllocation(in_use=frozenset({UUIDS[0], UUIDS[5], UUIDS[7]}), allocatable=frozenset(UUIDS))
    assert indices_in_use(alloc, {u: i for i, u in enumerate(UUIDS)}) == (frozenset({0, 5, 7}), ())


def test_unimplemented_allocatable_falls_back_to_list_only(kubelet: Kubelet, client: PodResourcesClient) -> None:
    kubelet.pods = [pod("p", [devices("nvidia.com/gpu", UUIDS[2])])]
    first = client.gpu_allocation()
    second = client.gpu_allocation()
    assert first == second == GpuAllocation(in_use=frozenset({UUIDS[2]}), allocatable=None)
    assert (kubelet.list_calls, kubelet.allocatable_calls) == (2, 1)  # not asked again


def test_in_use_source_maps_uuids_and_reports_unknown_ids(socket_path: Path, kubelet: Kubelet) -> None:
    kubelet.pods = [pod("p", [devices("nvidia.com/gpu", UUIDS[3], "MIG-4f1c0e2a-0000")])]
    kubelet.allocatable = [devices("nvidia.com/gpu", *UUIDS)]
    source = PodResourcesInUse(socket_path)
    try:
        assert source.gpus_in_use(TOPO) == frozenset({3})
    finally:
        source.close()


def test_unreachable_kubelet_is_an_error_not_a_crash(socket_path: Path) -> None:
    c = PodResourcesClient(socket_path, timeout_s=1.0)  # nothing listens on this socket
    try:
        with pytest.raises(PodResourcesError, match="List"):
            c.gpu_allocation()
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
