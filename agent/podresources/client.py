"""Kubelet PodResources v1 client: which GPUs are allocated to containers (nvml-and-nodes.md §7).

`List` gives the devices of every pod's containers; `GetAllocatableResources` (GA since 1.28) gives
what the device plugin advertises and is used where the kubelet serves it. The NVIDIA device plugin
names GPUs by UUID; time-slicing and MPS replicas add `::<n>`, which is stripped. `List` may still
report pods in a terminal phase (kubernetes #119423): the agent accepts that conservative
over-reporting rather than asking the API server about every pod.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc

from agent.podresources import api_pb2, api_pb2_grpc
from gputopo.model import GPU_RESOURCE

log = logging.getLogger(__name__)

DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"


class PodResourcesError(RuntimeError):
    """The kubelet PodResources API could not be reached or answered with an error."""


def strip_replica(device_id: str) -> str:
    """`GPU-abc::3` (a time-slicing / MPS replica) → `GPU-abc`."""
    return device_id.split("::", 1)[0]


@dataclass(frozen=True)
class GpuAllocation:
    """GPU device ids (replica suffix stripped) in use, and the allocatable ones when served."""

    in_use: frozenset[str]
    allocatable: frozenset[str] | None = None


def indices_in_use(
    allocation: GpuAllocation, uuid_to_index: Mapping[str, int]
) -> tuple[frozenset[int], tuple[str, ...]]:
    """Map device ids to GPU indices; also return the ids that name no GPU of this node (e.g. MIG)."""
    found = {uuid_to_index[d] for d in allocation.in_use if d in uuid_to_index}
    unknown = tuple(sorted(d for d in allocation.in_use if d not in uuid_to_index))
    return frozenset(found), unknown


def _gpu_ids(devices: Iterable[api_pb2.ContainerDevices]) -> set[str]:
    return {strip_replica(i) for d in devices if d.resource_name == GPU_RESOURCE for i in d.device_ids}


class PodResourcesClient:
    """A long-lived channel to the kubelet socket; gRPC reconnects by itself after kubelet restarts."""

    def __init__(self, socket_path: str | Path = DEFAULT_SOCKET, timeout_s: float = 5.0) -> None:
        self._target = f"unix://{Path(socket_path).absolute()}"
        self._timeout = timeout_s
        self._channel = grpc.insecure_channel(self._target)
        self._stub = api_pb2_grpc.PodResourcesListerStub(self._channel)
        self._allocatable_served = True

    def gpu_allocation(self) -> GpuAllocation:
        try:
            listed = self._stub.List(api_pb2.ListPodResourcesRequest(), timeout=self._timeout)
        except grpc.RpcError as e:
            raise PodResourcesError(f"PodResources List on {self._target} failed: {_rpc_text(e)}") from None
        in_use: set[str] = set()
        for pod in listed.pod_resources:
            for container in pod.containers:
                in_use |= _gpu_ids(container.devices)
        allocatable = None
        if self._allocatable_served:
            try:
                resp = self._stub.GetAllocatableResources(api_pb2.AllocatableResourcesRequest(), timeout=self._timeout)
                allocatable = frozenset(_gpu_ids(resp.devices))
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise PodResourcesError(
                        f"PodResources GetAllocatableResources on {self._target} failed: {_rpc_text(e)}"
                    ) from None
                # Kubelets before 1.23 (feature gate off) only serve List; do not ask again.
                log.info("kubelet does not serve GetAllocatableResources; using List only")
                self._allocatable_served = False
        return GpuAllocation(in_use=frozenset(in_use), allocatable=allocatable)

    def close(self) -> None:
        self._channel.close()


def _rpc_text(e: grpc.RpcError) -> str:
    code = e.code() if hasattr(e, "code") else None
    details = e.details() if hasattr(e, "details") else str(e)
    return f"{code.name if code else 'error'}: {details}"
