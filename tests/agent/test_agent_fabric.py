"""Multi-node NVLink fabric health through the NVML adapter: what each GPU publishes, how a degraded
fabric marks the GPU, and the node's `gputopo.io/nvlink-fabric` label."""

from __future__ import annotations

from pathlib import Path

import pytest

from gputopo.agent.labels import node_labels
from gputopo.agent.nvml_backend import NvmlAdapter
from gputopo.agent.nvml_topology import FabricReading, gpu_fabric
from gputopo.model import (
    LABEL_NVLINK_FABRIC,
    FabricHealth,
    FabricState,
    GpuFabric,
    Health,
    NodeTopology,
    decode_health,
)
from gputopo.systems import GB200_CLIQUE, build_system
from tests.agent.fake_pynvml import (
    GB200_CLUSTER_UUID,
    NVML_ERROR_INSUFFICIENT_RESOURCES,
    NVML_GPU_FABRIC_STATE_COMPLETED,
    NVML_GPU_FABRIC_STATE_IN_PROGRESS,
    NVML_GPU_FABRIC_STATE_NOT_STARTED,
    NVML_GPU_FABRIC_STATE_NOT_SUPPORTED,
    NVML_SUCCESS,
    FakeFabric,
    fake_system,
)

TRAY_GPU = 2  # the GPU whose fabric each case changes


def discover(fabric: FakeFabric | None, tmp_path: Path) -> NodeTopology:
    fake = fake_system("gb200-tray")
    fake.gpus[TRAY_GPU].fabric = fabric
    return NvmlAdapter(fake, sysfs_root=tmp_path).discover().topology


def tray(state: int = NVML_GPU_FABRIC_STATE_COMPLETED, status: int = NVML_SUCCESS, mask: int = 0xAA) -> FakeFabric:
    return FakeFabric(state=state, status=status, cluster_uuid=GB200_CLUSTER_UUID, clique_id=4026, health_mask=mask)


@pytest.mark.parametrize(
    ("fabric", "published", "health", "gpu_health", "reason", "label"),
    [
        pytest.param(tray(), GpuFabric(state=FabricState.COMPLETED, health_mask=0xAA), FabricHealth.HEALTHY,
                     Health.OK, None, "healthy", id="completed, healthMask 0xaa: healthy"),
        pytest.param(tray(mask=0xA9), GpuFabric(state=FabricState.COMPLETED, health_mask=0xA9), FabricHealth.DEGRADED,
                     Health.DEGRADED, "NVLink fabric degraded: healthMask 0xa9: degraded bandwidth", "degraded",
                     id="0xa9 degraded bandwidth: the GPU degraded, the mask named"),
        pytest.param(tray(mask=0x9A), GpuFabric(state=FabricState.COMPLETED, health_mask=0x9A), FabricHealth.DEGRADED,
                     Health.DEGRADED, "NVLink fabric degraded: healthMask 0x9a: route unhealthy", "degraded",
                     id="0x9a route unhealthy"),
        pytest.param(tray(mask=0x5AA), GpuFabric(state=FabricState.COMPLETED, health_mask=0x5AA),
                     FabricHealth.DEGRADED, Health.DEGRADED,
                     "NVLink fabric degraded: healthMask 0x5aa: insufficient NVLinks", "degraded",
                     id="0x5aa incorrect configuration: insufficient NVLinks"),
        pytest.param(tray(state=NVML_GPU_FABRIC_STATE_IN_PROGRESS),
                     GpuFabric(state=FabricState.IN_PROGRESS, health_mask=0xAA), FabricHealth.UNKNOWN,
                     Health.OK, None, "unknown", id="registration in progress: unknown, the GPU itself ok"),
        pytest.param(tray(status=NVML_ERROR_INSUFFICIENT_RESOURCES),
                     GpuFabric(state=FabricState.COMPLETED, status=23, health_mask=0xAA), FabricHealth.UNKNOWN,
                     Health.DEGRADED, "NVLink fabric registration failed: Insufficient Resources (NVML status 23)",
                     "unknown", id="registration failed (status 23): the GPU degraded, NVML's words for the status"),
        pytest.param(tray(mask=0), GpuFabric(state=FabricState.COMPLETED, health_mask=0), FabricHealth.UNKNOWN,
                     Health.OK, None, "unknown", id="healthMask 0 reports no field: unknown"),
        pytest.param(None, None, FabricHealth.UNKNOWN, Health.OK, None, "unknown",
                     id="NotSupported on one GPU of a tray: none published, the tray unknown"),
    ],
)  # fmt: skip
def test_each_gpu_publishes_its_fabric_and_a_degraded_one_is_degraded(
    fabric: FakeFabric | None,
    published: GpuFabric | None,
    health: FabricHealth,
    gpu_health: Health,
    reason: str | None,
    label: str,
    tmp_path: Path,
) -> None:
    got = discover(fabric, tmp_path)
    gpu = got.gpus[TRAY_GPU]
    assert gpu.fabric == published
    assert decode_health(gpu.fabric)[0] is health
    assert gpu.health is gpu_health
    assert gpu.reasons == ((reason,) if reason else ())
    assert node_labels(got)[LABEL_NVLINK_FABRIC] == label
    others = [g for g in got.gpus if g.index != TRAY_GPU]
    assert all(g.fabric == GpuFabric(state=FabricState.COMPLETED, health_mask=0xAA) for g in others)


@pytest.mark.parametrize(
    ("state", "status", "cluster", "published"),
    [
        pytest.param(NVML_GPU_FABRIC_STATE_NOT_SUPPORTED, NVML_SUCCESS, bytes(16), None,
                     id="state not-supported: the same as NVML raising NotSupported"),
        pytest.param(NVML_GPU_FABRIC_STATE_COMPLETED, NVML_SUCCESS, bytes(16), None,
                     id="completed with a zero cluster UUID: an HGX board's own NVSwitches, no tray"),
        pytest.param(7, NVML_SUCCESS, GB200_CLUSTER_UUID, None, id="a state this gputopo does not know: none"),
        pytest.param(NVML_GPU_FABRIC_STATE_NOT_STARTED, NVML_SUCCESS, bytes(16),
                     GpuFabric(state=FabricState.NOT_STARTED), id="not started (no UUID yet): published, unknown"),
        pytest.param(NVML_GPU_FABRIC_STATE_COMPLETED, 23, bytes(16),
                     GpuFabric(state=FabricState.COMPLETED, status=23), id="failed registration: published"),
        pytest.param(NVML_GPU_FABRIC_STATE_COMPLETED, NVML_SUCCESS, GB200_CLUSTER_UUID,
                     GpuFabric(state=FabricState.COMPLETED), id="completed in a cluster: published"),
    ],
)  # fmt: skip
def test_which_fabric_readings_are_published(
    state: int, status: int, cluster: bytes, published: GpuFabric | None
) -> None:
    reading = FabricReading(state=state, status=status, cluster_uuid=cluster, clique_id=1, health_mask=0)
    assert gpu_fabric(reading) == published


def test_a_state_this_gputopo_does_not_know_is_noted(tmp_path: Path) -> None:
    fake = fake_system("gb200-tray")
    for g in fake.gpus:
        g.fabric = tray(state=9)
    result = NvmlAdapter(fake, sysfs_root=tmp_path).discover()
    assert "GPU fabric: unknown registration state 9" in result.notes
    assert all(g.fabric is None for g in result.topology.gpus)
    assert LABEL_NVLINK_FABRIC not in node_labels(result.topology)


@pytest.mark.parametrize(
    ("system", "label"),
    [
        pytest.param("gb200-tray", "healthy", id="gb200 tray: healthy"),
        pytest.param("gb200-tray-degraded", "degraded", id="gb200 tray with a degraded GPU: degraded"),
        pytest.param("gb300-tray", "healthy", id="gb300 tray: healthy"),
        pytest.param("dgx-h100", None, id="HGX H100 reports fabric info with no cluster: no label"),
        pytest.param("l40s-4", None, id="PCIe GPUs, fabric NotSupported: no label"),
    ],
)
def test_the_fabric_label_is_only_on_trays(system: str, label: str | None, tmp_path: Path) -> None:
    got = NvmlAdapter(fake_system(system), sysfs_root=tmp_path).discover().topology
    assert node_labels(got).get(LABEL_NVLINK_FABRIC) == label
    assert node_labels(build_system(system)).get(LABEL_NVLINK_FABRIC) == label  # what the fixture backend shows


def test_the_fabric_keeps_the_clique_logic(tmp_path: Path) -> None:
    got = discover(tray(mask=0xA9), tmp_path)
    assert got.fabric is not None and got.fabric.clique == GB200_CLIQUE
