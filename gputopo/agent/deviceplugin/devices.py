"""The node's GPUs as device plugin devices, and what Allocate tells the NVIDIA Container Toolkit.

One device per GPU of the agent's NodeTopology, ID = GPU UUID. A device is Unhealthy only when the GPU's
health is `failed`: a degraded GPU or a degraded NVLink still runs work, and the extender already
weighs those. MIG-mode GPUs are refused: their schedulable units are MIG slices, not whole GPUs.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from gputopo.agent.deviceplugin import api_pb2
from gputopo.agent.nvml_backend import MIG_REASON
from gputopo.model import AGENT_COMPONENT, Health, NodeTopology

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
CDI_KIND = "nvidia.com/gpu"
CDI_ANNOTATION_PREFIX = "cdi.k8s.io/"
CDI_PLUGIN_NAME = AGENT_COMPONENT
VISIBLE_DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"
# The CDI annotation key's name part (plugin + "_" + id) is at most 63 characters, alnum at both ends.
_CDI_NAME_MAX = 63


class DeviceListStrategy(StrEnum):
    ENVVAR = "envvar"
    CDI_ANNOTATIONS = "cdi-annotations"
    CDI_CRI = "cdi-cri"


class MigModeError(RuntimeError):
    """A GPU of the node is in MIG mode; the message names it."""


class UnknownDeviceError(ValueError):
    """Allocate named a device ID that is not a GPU of this node."""

    def __init__(self, device_id: str) -> None:
        self.device_id = device_id
        super().__init__(f"unknown device id {device_id!r}: not a GPU of this node")


def mig_gpus(topology: NodeTopology) -> list[str]:
    """`index (uuid)` of every GPU the agent's discovery reports in MIG mode."""
    return [f"{g.index} ({g.uuid})" for g in topology.gpus if MIG_REASON in g.reasons]


def check_no_mig(topology: NodeTopology) -> None:
    found = mig_gpus(topology)
    if found:
        raise MigModeError(
            "the gputopo device plugin advertises whole GPUs and cannot serve MIG mode; "
            f"GPU {', '.join(found)} is in MIG mode: disable MIG (nvidia-smi -mig 0) or run "
            "without --device-plugin and let NVIDIA's device plugin serve MIG slices"
        )


@dataclass(frozen=True)
class DeviceState:
    """What ListAndWatch reports for one GPU; equal states mean no update is streamed."""

    id: str
    index: int
    healthy: bool
    numa: int | None

    def to_proto(self) -> api_pb2.Device:
        topo = api_pb2.TopologyInfo(nodes=[api_pb2.NUMANode(ID=self.numa)]) if self.numa is not None else None
        return api_pb2.Device(ID=self.id, health=HEALTHY if self.healthy else UNHEALTHY, topology=topo)


def device_states(topology: NodeTopology) -> tuple[DeviceState, ...]:
    mig = {g.index for g in topology.gpus if MIG_REASON in g.reasons}
    return tuple(
        DeviceState(
            id=g.uuid,
            index=g.index,
            # A GPU switched to MIG after start cannot be handed out whole any more.
            healthy=g.health is not Health.FAILED and g.index not in mig,
            numa=g.numa_node if g.numa_node is not None and g.numa_node >= 0 else None,
        )
        for g in sorted(topology.gpus, key=lambda g: g.index)
    )


def cdi_name(device_id: str, kind: str = CDI_KIND) -> str:
    return f"{kind}={device_id}"


def cdi_annotation_key(unique: str | None = None) -> str:
    """`cdi.k8s.io/gputopo-agent_<id>`: unique per response, as the runtime merges keys across plugins."""
    name = f"{CDI_PLUGIN_NAME}_{unique or uuid.uuid4()}"
    if len(name) > _CDI_NAME_MAX or not (name[0].isalnum() and name[-1].isalnum()):
        raise ValueError(f"invalid CDI annotation name {name!r}")
    return CDI_ANNOTATION_PREFIX + name


def container_response(
    device_ids: Sequence[str], strategy: DeviceListStrategy, kind: str = CDI_KIND
) -> api_pb2.ContainerAllocateResponse:
    """The response for one container whose (known, ordered) GPU UUIDs are `device_ids`."""
    if strategy is DeviceListStrategy.ENVVAR:
        return api_pb2.ContainerAllocateResponse(envs={VISIBLE_DEVICES_ENV: ",".join(device_ids)})
    names = [cdi_name(d, kind) for d in device_ids]
    # CUDA images set NVIDIA_VISIBLE_DEVICES=all; "void" keeps a runtime in legacy mode from adding every GPU
    # next to the CDI devices (nvidia-ctk's generated CDI specs set the same value).
    envs = {VISIBLE_DEVICES_ENV: "void"}
    if strategy is DeviceListStrategy.CDI_ANNOTATIONS:
        return api_pb2.ContainerAllocateResponse(envs=envs, annotations={cdi_annotation_key(): ",".join(names)})
    return api_pb2.ContainerAllocateResponse(envs=envs, cdi_devices=[api_pb2.CDIDevice(name=n) for n in names])
