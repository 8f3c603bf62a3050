"""Kubelet PodResources v1 client: which GPUs are allocated to which pods' containers.

`List` gives the devices of every pod's containers, by pod namespace and name;
`GetAllocatableResources` (GA since 1.28) gives what the device plugin advertises and is used where
the kubelet serves it. The NVIDIA device plugin
names GPUs by UUID; time-slicing and MPS replicas add `::<n>`, which is stripped. `List` may still
report pods in a terminal phase (kubernetes #119423): the agent accepts that conservative
over-reporting rather than asking the API server about every pod.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from gputopo.agent.podresources import api_pb2, api_pb2_grpc
from gputopo.model import GPU_RESOURCE, GpusInUse

log = logging.getLogger(__name__)

DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"


class PodResourcesError(RuntimeError):
    """The kubelet PodResources API could not be reached or answered with an error."""


def strip_replica(device_id: str) -> str:
    """`GPU-abc::3` (a time-slicing / MPS replica) → `GPU-abc`."""
    return device_id.split("::", 1)[0]


PodKey = tuple[str, str]  # (namespace, name): all PodResources says about a pod


@dataclass(frozen=True)
class GpuAllocation:
    """GPU device ids (replica suffix stripped) in use, per pod too, and the allocatable ones when served."""

    in_use: frozenset[str]
    allocatable: frozenset[str] | None = None
    by_pod: Mapping[PodKey, frozenset[str]] = field(default_factory=dict)


def indices_in_use(
    allocation: GpuAllocation, uuid_to_index: Mapping[str, int]
) -> tuple[frozenset[int], tuple[str, ...]]:
    """Map device ids to GPU indices; also return the ids that name no GPU of this node (e.g. MIG)."""
    found = {uuid_to_index[d] for d in allocation.in_use if d in uuid_to_index}
    unknown = tuple(sorted(d for d in allocation.in_use if d not in uuid_to_index))
    return frozenset(found), unknown


def per_pod_in_use(
    allocation: GpuAllocation, uuid_to_index: Mapping[str, int], uid_of: Callable[[str, str], str | None]
) -> tuple[GpusInUse, tuple[str, ...], tuple[PodKey, ...]]:
    """The per-pod report: each pod's GPU indices under its UID (`uid_of(namespace, name)`).

    GPUs of pods without a known UID go to `other`, and so do GPUs that two pods share (time-slicing
    or MPS replicas): neither pod holds them alone. Also returns the device ids that name no GPU of
    this node and the pods left unattributed."""
    per_uid: dict[str, set[int]] = {}
    other: set[int] = set()
    owners: dict[int, int] = {}
    unattributed: list[PodKey] = []
    for key, ids in sorted(allocation.by_pod.items()):
        gpus = {uuid_to_index[d] for d in ids if d in uuid_to_index}
        if not gpus:
            continue
        for i in gpus:
            owners[i] = owners.get(i, 0) + 1
        uid = uid_of(*key)
        if uid is None:
            unattributed.append(key)
            other |= gpus
        else:
            per_uid.setdefault(uid, set()).update(gpus)
    shared = {i for i, n in owners.items() if n > 1}
    other |= shared
    # Pods listed by the kubelet but not per pod (an older client shape) still count as in use.
    other |= {uuid_to_index[d] for d in allocation.in_use if d in uuid_to_index} - set(owners)
    pods = {uid: frozenset(g - shared) for uid, g in per_uid.items() if g - shared}
    unknown = tuple(sorted(d for d in allocation.in_use if d not in uuid_to_index))
    return GpusInUse(pods=pods, other=frozenset(other)), unknown, tuple(unattributed)


def _gpu_ids(devices: Iterable[api_pb2.ContainerDevices], resource: str) -> set[str]:
    return {strip_replica(i) for d in devices if d.resource_name == resource for i in d.device_ids}


class PodResourcesClient:
    """A long-lived channel to the kubelet socket; gRPC reconnects by itself after kubelet restarts."""

    def __init__(
        self, socket_path: str | Path = DEFAULT_SOCKET, timeout_s: float = 5.0, resource: str = GPU_RESOURCE
    ) -> None:
        self._resource = resource  # the device plugin's resource name: GPUs are counted under it
        self._target = f"unix://{Path(socket_path).absolute()}"
        self._timeout = timeout_s
        self._channel = grpc.insecure_channel(self._target)
        self._stub = api_pb2_grpc.PodResourcesListerStub(self._channel)
        self._allocatable_served = True

    def _list(self) -> api_pb2.ListPodResourcesResponse:
        try:
            listed: api_pb2.ListPodResourcesResponse = self._stub.List(
                api_pb2.ListPodResourcesRequest(), timeout=self._timeout
            )
        except grpc.RpcError as e:
            raise PodResourcesError(f"PodResources List on {self._target} failed: {_rpc_text(e)}") from None
        return listed

    def gpu_allocation(self) -> GpuAllocation:
        listed = self._list()
        in_use: set[str] = set()
        by_pod: dict[PodKey, frozenset[str]] = {}
        for pod in listed.pod_resources:
            ids: set[str] = set()
            for container in pod.containers:
                ids |= _gpu_ids(container.devices, self._resource)
            if ids:
                key = (pod.namespace, pod.name)
                by_pod[key] = by_pod.get(key, frozenset()) | ids
                in_use |= ids
        allocatable = None
        if self._allocatable_served:
            try:
                resp = self._stub.GetAllocatableResources(api_pb2.AllocatableResourcesRequest(), timeout=self._timeout)
                allocatable = frozenset(_gpu_ids(resp.devices, self._resource))
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise PodResourcesError(
                        f"PodResources GetAllocatableResources on {self._target} failed: {_rpc_text(e)}"
                    ) from None
                # Kubelets before 1.23 (feature gate off) only serve List; do not ask again.
                log.info("kubelet does not serve GetAllocatableResources; using List only")
                self._allocatable_served = False
        return GpuAllocation(in_use=frozenset(in_use), allocatable=allocatable, by_pod=by_pod)

    def kubelet_pods(self) -> dict[PodKey, frozenset[str]]:
        """Every pod the kubelet holds, the one it is admitting included, with the names of its
        containers that already hold a device of this resource.

        The kubelet adds a pod to the set `List` reads before it admits it, and admits one pod at a
        time; so during a device-plugin call the pod being admitted is listed and the pods it has
        not reached yet are not."""
        listed = self._list()
        out: dict[PodKey, frozenset[str]] = {}
        for pod in listed.pod_resources:
            holding = {c.name for c in pod.containers if _gpu_ids(c.devices, self._resource)}
            key = (pod.namespace, pod.name)
            out[key] = out.get(key, frozenset()) | holding
        return out

    def close(self) -> None:
        self._channel.close()


def _rpc_text(e: grpc.RpcError) -> str:
    code = e.code() if hasattr(e, "code") else None
    details = e.details() if hasattr(e, "details") else str(e)
    return f"{code.name if code else 'error'}: {details}"
