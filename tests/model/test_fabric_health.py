"""gputopo.model.fabric: a GPU's NVLink fabric health decoded from NVML's healthMask, and a tray's.

nvml.h: 2-bit fields at bits 0 (degraded bandwidth), 2 (route recovery), 4 (route unhealthy) and 6
(access-timeout recovery), each 0 = not supported, 1 = TRUE (a problem), 2 = FALSE; bits 8-11 the
incorrect configuration (0 = not supported, 1 = none, more = a fault)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gputopo.model import (
    HEALTHY_MASK,
    FabricHealth,
    FabricState,
    GpuFabric,
    GpuInfo,
    decode_health,
    tray_health,
)

HEALTHY, DEGRADED, UNKNOWN = FabricHealth.HEALTHY, FabricHealth.DEGRADED, FabricHealth.UNKNOWN


def completed(mask: int) -> GpuFabric:
    return GpuFabric(state=FabricState.COMPLETED, status=0, health_mask=mask)


@pytest.mark.parametrize(
    ("fabric", "health", "why"),
    [
        pytest.param(completed(0xAA), HEALTHY, "", id="0xaa every field FALSE: healthy"),
        pytest.param(completed(0x02), HEALTHY, "", id="0x02 only degraded-bandwidth reported, FALSE: healthy"),
        pytest.param(completed(0x1AA), HEALTHY, "", id="0x1aa configuration none: healthy"),
        pytest.param(completed(0x0), UNKNOWN, "healthMask 0x0 reports no field", id="0x0 reports nothing: unknown"),
        pytest.param(completed(0xFF), UNKNOWN, "healthMask 0xff reports no field", id="0xff reserved values: unknown"),
        pytest.param(completed(0xA9), DEGRADED, "healthMask 0xa9: degraded bandwidth", id="0xa9 degraded bandwidth"),
        pytest.param(completed(0xA6), DEGRADED, "healthMask 0xa6: route recovery in progress",
                     id="0xa6 route recovery"),
        pytest.param(completed(0x9A), DEGRADED, "healthMask 0x9a: route unhealthy", id="0x9a route unhealthy"),
        pytest.param(completed(0x6A), DEGRADED, "healthMask 0x6a: access-timeout recovery",
                     id="0x6a access-timeout recovery"),
        pytest.param(completed(0xA5), DEGRADED, "healthMask 0xa5: degraded bandwidth, route recovery in progress",
                     id="0xa5 two fields TRUE: both named"),
        pytest.param(completed(0x5AA), DEGRADED, "healthMask 0x5aa: insufficient NVLinks",
                     id="0x5aa configuration 5: insufficient NVLinks"),
        pytest.param(completed(0x2AA), DEGRADED, "healthMask 0x2aa: incorrect system GUID",
                     id="0x2aa configuration 2: incorrect system GUID"),
        pytest.param(completed(0xFAA), DEGRADED, "healthMask 0xfaa: configuration fault 15",
                     id="0xfaa configuration 15 unnamed: a fault by number"),
        pytest.param(completed(0x500), DEGRADED, "healthMask 0x500: insufficient NVLinks",
                     id="0x500 configuration fault without any 2-bit field: degraded"),
        pytest.param(None, UNKNOWN, "no fabric info", id="no fabric info: unknown"),
        pytest.param(GpuFabric(state=FabricState.IN_PROGRESS, health_mask=0xAA), UNKNOWN,
                     "fabric registration in-progress", id="registration in progress: unknown, mask ignored"),
        pytest.param(GpuFabric(state=FabricState.NOT_STARTED), UNKNOWN, "fabric registration not-started",
                     id="not started: unknown"),
        pytest.param(GpuFabric(state=FabricState.NOT_SUPPORTED), UNKNOWN, "fabric registration not-supported",
                     id="not supported: unknown"),
        pytest.param(GpuFabric(state=FabricState.COMPLETED, status=23, health_mask=0xA9), UNKNOWN,
                     "fabric registration failed (NVML status 23)", id="failed registration: unknown, even 0xa9"),
    ],
)  # fmt: skip
def test_decode_health(fabric: GpuFabric | None, health: FabricHealth, why: str) -> None:
    assert decode_health(fabric) == (health, why)


def test_the_healthy_mask_is_every_field_false() -> None:
    assert HEALTHY_MASK == 0b10_10_10_10
    assert decode_health(completed(HEALTHY_MASK)) == (HEALTHY, "")


def _gpus(*fabrics: GpuFabric | None) -> list[GpuInfo]:
    return [
        GpuInfo(index=i, uuid=f"GPU-{i}", model="NVIDIA GB200", memory_mib=189471, fabric=f)
        for i, f in enumerate(fabrics)
    ]


OK = completed(HEALTHY_MASK)
BAD = completed(0xA9)
PENDING = GpuFabric(state=FabricState.IN_PROGRESS)


@pytest.mark.parametrize(
    ("gpus", "expected"),
    [
        pytest.param(_gpus(OK, OK, OK, OK), (HEALTHY, ""), id="every GPU healthy: healthy"),
        pytest.param(_gpus(OK, OK, BAD, OK), (DEGRADED, "GPU 2: healthMask 0xa9: degraded bandwidth"),
                     id="one degraded: degraded, named"),
        pytest.param(_gpus(OK, PENDING, BAD, OK), (DEGRADED, "GPU 2: healthMask 0xa9: degraded bandwidth"),
                     id="degraded wins over an earlier unknown"),
        pytest.param(_gpus(OK, PENDING, None, OK), (UNKNOWN, "GPU 1: fabric registration in-progress"),
                     id="unknown: the first unknown GPU named"),
        pytest.param(_gpus(None, None), (UNKNOWN, "GPU 0: no fabric info"), id="no fabric info at all: unknown"),
        pytest.param([], (UNKNOWN, "no GPUs"), id="no GPUs: unknown"),
    ],
)  # fmt: skip
def test_tray_health(gpus: list[GpuInfo], expected: tuple[FabricHealth, str]) -> None:
    assert tray_health(gpus) == expected


u32 = st.integers(min_value=0, max_value=0xFFFFFFFF)
fabrics = st.builds(GpuFabric, state=st.sampled_from(FabricState), status=u32, health_mask=u32)


@given(state=st.sampled_from(FabricState), status=u32, mask=u32)
def test_degraded_iff_registered_and_a_field_true_or_a_configuration_fault(
    state: FabricState, status: int, mask: int
) -> None:
    health, why = decode_health(GpuFabric(state=state, status=status, health_mask=mask))
    registered = state is FabricState.COMPLETED and status == 0
    fields = [(mask >> shift) & 0x3 for shift in (0, 2, 4, 6)]
    fault = 1 in fields or (mask >> 8) & 0xF > 1
    assert (health is DEGRADED) == (registered and fault)
    assert (health is HEALTHY) == (registered and not fault and 2 in fields)
    assert (why == "") == (health is HEALTHY)
    if health is DEGRADED:
        assert why.startswith(f"healthMask {mask:#x}: ")


@given(st.lists(st.one_of(st.none(), fabrics), max_size=8))
def test_a_tray_is_as_bad_as_its_worst_gpu(fabric_list: list[GpuFabric | None]) -> None:
    each = [decode_health(f)[0] for f in fabric_list]
    health, why = tray_health(_gpus(*fabric_list))
    if DEGRADED in each:
        assert health is DEGRADED and why.startswith(f"GPU {each.index(DEGRADED)}: ")
    elif not each or UNKNOWN in each:
        assert health is UNKNOWN
    else:
        assert (health, why) == (HEALTHY, "")
