"""The NVML adapter against a fake pynvml that reproduces real systems and failures."""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gputopo.agent.nvml_backend import NvmlAdapter, NvmlUnavailableError
from gputopo.agent.nvml_health import Baseline, HealthTracker, LinkCounters, LinkVerdict, assess_link_errors
from gputopo.agent.nvml_topology import fabric_clique, normalize_bus_id, nvlink_generation
from gputopo.model import MAX_REASONS, DegradedLink, Health, LinkState, NodeTopology
from gputopo.systems import GB200_CLIQUE, NVLINK_GBPS_PER_LINK, build_system
from tests.agent.fake_pynvml import (
    GB200_CLUSTER_UUID,
    NVML_GPU_FABRIC_STATE_COMPLETED,
    NVML_GPU_FABRIC_STATE_IN_PROGRESS,
    NVML_NVLINK_DEVICE_TYPE_GPU,
    NVML_NVLINK_DEVICE_TYPE_UNKNOWN,
    NVML_NVLINK_ERROR_DL_CRC_DATA,
    NVML_NVLINK_ERROR_DL_CRC_FLIT,
    NVML_NVLINK_ERROR_DL_RECOVERY,
    NVML_NVLINK_ERROR_DL_REPLAY,
    NVML_SUCCESS,
    SYSTEM_WIRING,
    FakeFabric,
    FakeNvml,
    NVMLError,
    NVMLError_DriverNotLoaded,
    NVMLError_FunctionNotFound,
    NVMLError_GpuIsLost,
    NVMLError_LibraryNotFound,
    NVMLError_NotSupported,
    c_nvmlGpuFabricInfoV_t,
    c_nvmlGpuFabricInfoV_t_12_560,
    c_nvmlGpuFabricInfoV_t_12_570,
    fake_system,
    invisible_switch_wiring,
    nvml_bus,
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def adapter(fake: FakeNvml, sysfs: Path, clock: Clock | None = None) -> NvmlAdapter:
    return NvmlAdapter(fake, sysfs_root=sysfs, clock=clock or Clock())


def discover(fake: FakeNvml, sysfs: Path) -> NodeTopology:
    return adapter(fake, sysfs).discover().topology


# --------------------------------------------------------------------------------------------------
# Whole systems: the adapter rebuilds each named system's topology from its wiring


@pytest.mark.parametrize(
    "system",
    [
        pytest.param("dgx-1v", id="dgx-1v hybrid cube mesh: direct links give the NV1/NV2 matrix"),
        pytest.param("dgx-a100", id="dgx-a100 six NVSwitches x2 links: NV12 every pair, nvswitch"),
        pytest.param("dgx-h100", id="dgx-h100 four NVSwitches 4/5/5/4 links: NV18 every pair, no fabric"),
        pytest.param("hgx-h200", id="hgx-h200 through NVSwitch: NV18 every pair"),
        pytest.param("hgx-a100-4", id="hgx-a100-4 direct mesh: NV4 every pair"),
        pytest.param("a100-pcie-bridged", id="a100 pcie bridged pairs: NV12 on the pairs only"),
        pytest.param("a100-pcie-bridged-nonadjacent", id="bridged pairs need not be adjacent indices"),
        pytest.param("l40s-4", id="l40s NVLink NotSupported: no links, health ok"),
        pytest.param("rtx4090-8", id="rtx4090 PCIe only: no links"),
        pytest.param("gb200-tray", id="gb200 tray: invisible switches count as NVSwitch, fabric clique"),
        pytest.param("gb200-tray-degraded", id="gb200 tray, GPU 2's fabric healthMask 0xa9: degraded as published"),
        pytest.param("gb300-tray", id="gb300 tray: NVLink 5 as gb200, healthy fabric"),
        pytest.param("gb300-tray-degraded", id="gb300 tray with a degraded fabric GPU"),
    ],
)
def test_adapter_rebuilds_named_system(system: str, tmp_path: Path) -> None:
    expected = build_system(system).model_copy(update={"nics": ()})
    got = discover(fake_system(system), tmp_path)
    assert got.nvlink.links == expected.nvlink.links
    assert got == expected


def test_dgx1v_rows_sum_to_six_links(tmp_path: Path) -> None:
    got = discover(fake_system("dgx-1v"), tmp_path)
    assert [sum(r) for r in got.nvlink.links] == [6] * 8
    assert got.link_count(0, 5) == 0  # GPU0-GPU5 is SYS on a DGX-1V


def test_links_are_enumerated_by_state_not_capability(tmp_path: Path) -> None:
    # B200: capability says TRUE for all 36 indices; only the state call rejects index 18.
    fake = fake_system("gb200-tray")
    got = discover(fake, tmp_path)
    assert fake.calls["nvmlDeviceGetNvLinkCapability"] == 0
    assert fake.max_link_index_asked == 18
    assert got.link_count(0, 1) == 18


def test_unresolvable_remote_gpu_counts_as_switch(tmp_path: Path) -> None:
    fake = fake_system("dgx-h100")
    for gpu in fake.gpus:  # a VM: the remote says GPU but its bus id is nowhere on this node
        for lk in gpu.links or []:
            lk.remote_type = NVML_NVLINK_DEVICE_TYPE_GPU
            lk.remote_bus = b"FFFFFFFF:FF:FF.F"
    got = discover(fake, tmp_path)
    assert got.nvlink.nvswitch
    assert got.link_count(2, 6) == 18


def test_unknown_remote_type_counts_as_switch(tmp_path: Path) -> None:
    fake = fake_system("dgx-a100")
    for gpu in fake.gpus:
        for lk in gpu.links or []:
            lk.remote_type = NVML_NVLINK_DEVICE_TYPE_UNKNOWN
    assert discover(fake, tmp_path).link_count(0, 7) == 12


def test_remote_type_function_missing_falls_back_to_remote_bus(tmp_path: Path) -> None:
    fake = fake_system("dgx-1v")
    for gpu in fake.gpus:
        for lk in gpu.links or []:
            lk.remote_type_error = NVMLError_FunctionNotFound
    got = discover(fake, tmp_path)
    assert got.nvlink.links == build_system("dgx-1v").nvlink.links
    assert not got.nvlink.nvswitch


def test_numa_prefers_sysfs_over_memory_affinity(tmp_path: Path) -> None:
    fake = fake_system("l40s-4")  # affinity mask says NUMA 0 for GPU0
    dev = tmp_path / "bus" / "pci" / "devices" / build_system("l40s-4").gpus[0].pci_bus_id
    dev.mkdir(parents=True)
    (dev / "numa_node").write_text("1\n")
    got = discover(fake, tmp_path)
    assert got.gpus[0].numa_node == 1
    assert got.gpus[1].numa_node == 0


def test_numa_never_uses_gpu_numa_node_id(tmp_path: Path) -> None:
    fake = fake_system("dgx-h100")
    discover(fake, tmp_path)
    assert fake.calls["nvmlDeviceGetNumaNodeId"] == 0


# --------------------------------------------------------------------------------------------------
# Link state and error counters


def test_switch_link_down_is_reported_and_not_counted(tmp_path: Path) -> None:
    fake = fake_system("dgx-h100")
    ad = adapter(fake, tmp_path)
    assert ad.discover().topology.degraded_links == ()
    assert fake.gpus[3].links is not None
    fake.gpus[3].links[5].active = False
    got = ad.discover().topology
    assert got.degraded_links == (DegradedLink(gpu=3, link=5, state=LinkState.DOWN, detail="link not active"),)
    assert [got.link_count(3, j) for j in range(8) if j != 3] == [17] * 7
    assert got.link_count(0, 1) == 18
    assert got.gpus[3].health is Health.DEGRADED
    assert "NVLink link 5 down" in got.gpus[3].reasons


def test_direct_link_down_lowers_the_pair_on_both_sides(tmp_path: Path) -> None:
    fake = fake_system("dgx-1v")
    links = fake.gpus[0].links or []
    to_gpu3 = next(i for i, lk in enumerate(links) if lk.remote_bus == fake.gpus[3].bus_id)
    links[to_gpu3].active = False
    got = discover(fake, tmp_path)
    assert (got.link_count(0, 3), got.link_count(3, 0)) == (1, 1)
    assert got.degraded_links[0].gpu == 0


def test_all_links_of_a_gpu_going_down_are_reported(tmp_path: Path) -> None:
    fake = fake_system("a100-pcie-bridged")
    ad = adapter(fake, tmp_path)
    ad.discover()
    for lk in fake.gpus[1].links or []:  # the bridge came off
        lk.active = False
    got = ad.discover().topology
    assert len([d for d in got.degraded_links if d.gpu == 1]) == 12
    assert got.link_count(0, 1) == 0


def test_never_active_links_are_not_degraded(tmp_path: Path) -> None:
    fake = fake_system("a100-pcie-bridged")
    for gpu in fake.gpus:  # PCIe cards without a bridge: links enumerate but none is up
        for lk in gpu.links or []:
            lk.active = False
    got = discover(fake, tmp_path)
    assert got.degraded_links == ()
    assert all(g.health is Health.OK for g in got.gpus)


@pytest.mark.parametrize(
    ("counter", "delta", "state", "reason_part"),
    [
        pytest.param(0, 1, LinkState.DEGRADED, "1 replay errors", id="one replay error degrades the link"),
        pytest.param(1, 2, LinkState.DEGRADED, "2 recovery errors", id="recovery errors degrade the link"),
        pytest.param(2, 2000, LinkState.DEGRADED, "flit CRC errors at 200/s", id="crc flit at 200/s degrades"),
        pytest.param(3, 1000, LinkState.DEGRADED, "data CRC errors at 100/s", id="crc data at exactly 100/s degrades"),
        pytest.param(2, 50, None, "flit CRC errors below 100/s", id="crc below 100/s only warns"),
        pytest.param(0, 0, None, None, id="no change: healthy"),
    ],
)
def test_error_counters_rising_between_cycles(
    counter: int, delta: int, state: LinkState | None, reason_part: str | None, tmp_path: Path
) -> None:
    fake = fake_system("dgx-h100")
    clock = Clock()
    ad = adapter(fake, tmp_path, clock)
    ad.discover()
    link = (fake.gpus[1].links or [])[2]
    link.counters[counter] += delta
    clock.now = 10.0
    got = ad.discover().topology
    if state is None:
        assert got.degraded_links == ()
        assert got.link_count(1, 0) == 18
        assert got.gpus[1].health is Health.OK
    else:
        assert [(d.gpu, d.link, d.state) for d in got.degraded_links] == [(1, 2, state)]
        assert got.link_count(1, 0) == 17
        assert got.gpus[1].health is Health.DEGRADED
    if reason_part is None:
        assert got.gpus[1].reasons == ()
    else:
        assert any(reason_part in r for r in got.gpus[1].reasons), got.gpus[1].reasons


def test_degraded_verdict_holds_for_the_window_then_clears(tmp_path: Path) -> None:
    fake = fake_system("dgx-h100")
    clock = Clock()
    ad = adapter(fake, tmp_path, clock)
    ad.discover()
    (fake.gpus[0].links or [])[0].counters[0] += 1
    clock.now = 10.0
    first = ad.discover().topology
    clock.now = 20.0  # no new errors, but inside the 60 s window: same verdict, same words
    second = ad.discover().topology
    clock.now = 75.0
    third = ad.discover().topology
    assert first.degraded_links == second.degraded_links != ()
    assert first.to_annotation() == second.to_annotation()
    assert third.degraded_links == ()


def test_counters_not_supported_anywhere_are_absent_not_unknown(tmp_path: Path) -> None:
    fake = fake_system("dgx-h100")
    for gpu in fake.gpus:
        for lk in gpu.links or []:
            lk.counters_supported = False
    clock = Clock()
    ad = adapter(fake, tmp_path, clock)
    ad.discover()
    clock.now = 10.0
    result = ad.discover()
    assert result.topology == build_system("dgx-h100").model_copy(update={"nics": ()})
    assert "NVLink replay error counter: NotSupported" in result.notes


REPLAY, RECOVERY, FLIT, DATA = (
    NVML_NVLINK_ERROR_DL_REPLAY,
    NVML_NVLINK_ERROR_DL_RECOVERY,
    NVML_NVLINK_ERROR_DL_CRC_FLIT,
    NVML_NVLINK_ERROR_DL_CRC_DATA,
)


@pytest.mark.parametrize(
    ("unsupported", "counter", "delta", "reason_part"),
    [
        pytest.param((FLIT, DATA), REPLAY, 1, "1 replay errors", id="hopper crc N/A: replay still degrades"),
        pytest.param((FLIT, DATA), RECOVERY, 3, "3 recovery errors", id="hopper crc N/A: recovery still degrades"),
        pytest.param((DATA,), FLIT, 1500, "flit CRC errors at 150/s", id="data crc N/A: flit crc still rated"),
        pytest.param((REPLAY, RECOVERY), DATA, 1000, "data CRC errors at 100/s", id="only crc readable: still rated"),
    ],
)
def test_an_unsupported_counter_does_not_switch_off_the_others(
    unsupported: tuple[int, ...], counter: int, delta: int, reason_part: str, tmp_path: Path
) -> None:
    fake = fake_system("dgx-h100")
    for gpu in fake.gpus:
        for lk in gpu.links or []:
            lk.counter_errors = dict.fromkeys(unsupported, NVMLError_NotSupported)
    clock = Clock()
    ad = adapter(fake, tmp_path, clock)
    assert ad.discover().topology.gpus[2].health is Health.OK
    (fake.gpus[2].links or [])[7].counters[counter] += delta
    clock.now = 10.0
    got = ad.discover().topology
    assert [(d.gpu, d.link, d.state) for d in got.degraded_links] == [(2, 7, LinkState.DEGRADED)]
    assert any(reason_part in r for r in got.gpus[2].reasons), got.gpus[2].reasons
    assert all(g.health is Health.OK for g in got.gpus if g.index != 2)


def test_flit_and_data_crc_are_rated_separately(tmp_path: Path) -> None:
    # 60/s flit + 60/s data: 120/s together, but neither reaches DCGM's 100/s on its own.
    fake = fake_system("dgx-h100")
    clock = Clock()
    ad = adapter(fake, tmp_path, clock)
    ad.discover()
    link = (fake.gpus[0].links or [])[0]
    link.counters[FLIT] += 600
    link.counters[DATA] += 600
    clock.now = 10.0
    got = ad.discover().topology
    assert got.degraded_links == ()
    assert got.gpus[0].health is Health.OK
    assert got.gpus[0].reasons == ("NVLink link 0: flit CRC errors below 100/s, data CRC errors below 100/s",)


# --------------------------------------------------------------------------------------------------
# Stale counters: health that cannot be checked is reported as unknown, never as healthy


def _stale_after(change: str, fake: FakeNvml) -> None:
    link = (fake.gpus[4].links or [])[3]
    if change == "read fails":
        link.counter_errors = {REPLAY: NVMLError}
    elif change == "all reads fail":
        link.counter_errors = dict.fromkeys((REPLAY, RECOVERY, FLIT, DATA), NVMLError)
    elif change == "counter goes backwards":
        link.counters[FLIT] = 0
    elif change == "counter stops being supported":
        link.counter_errors = {RECOVERY: NVMLError_NotSupported}


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        pytest.param(
            "read fails", "NVLink link 3 health unknown: replay counter unreadable", id="failed read is unknown"
        ),
        pytest.param(
            "all reads fail",
            "NVLink link 3 health unknown: replay counter unreadable, recovery counter unreadable, "
            "flit CRC counter unreadable, data CRC counter unreadable",
            id="no fresh read at all is unknown",
        ),
        pytest.param(
            "counter goes backwards",
            "NVLink link 3 health unknown: flit CRC counter went backwards (reset)",
            id="reset counter is unknown",
        ),
        pytest.param(
            "counter stops being supported",
            "NVLink link 3 health unknown: recovery counter no longer readable",
            id="counter that vanished is unknown",
        ),
    ],
)
def test_stale_counters_are_reported_unknown_never_healthy(change: str, reason: str, tmp_path: Path) -> None:
    fake = fake_system("dgx-h100")
    (fake.gpus[4].links or [])[3].counters[FLIT] = 5
    clock = Clock()
    ad = adapter(fake, tmp_path, clock)
    ad.discover()
    _stale_after(change, fake)
    clock.now = 10.0
    got = ad.discover().topology
    assert got.gpus[4].health is Health.DEGRADED
    assert got.gpus[4].reasons == (reason,)
    assert got.degraded_links == ()  # not known bad: the link stays counted
    assert got.link_count(4, 0) == 18
    assert all(g.health is Health.OK for g in got.gpus if g.index != 4)


def test_unknown_clears_once_counters_compare_again_and_errors_in_the_gap_still_count(tmp_path: Path) -> None:
    fake = fake_system("dgx-h100")
    clock = Clock()
    ad = adapter(fake, tmp_path, clock)
    ad.discover()
    link = (fake.gpus[1].links or [])[0]
    link.counter_errors = {REPLAY: NVMLError}
    link.counters[REPLAY] += 1  # a replay error while the counter cannot be read
    clock.now = 10.0
    assert ad.discover().topology.gpus[1].health is Health.DEGRADED
    link.counter_errors = {}
    clock.now = 20.0
    got = ad.discover().topology  # compared with the last good reading, across the gap
    assert got.degraded_links == (
        DegradedLink(gpu=1, link=0, state=LinkState.DEGRADED, detail="1 replay errors in 20 s"),
    )
    clock.now = 100.0  # past the hold window, nothing new: healthy again
    assert ad.discover().topology.gpus[1].health is Health.OK


def test_a_held_degraded_verdict_is_not_softened_by_a_failed_read(tmp_path: Path) -> None:
    fake = fake_system("dgx-h100")
    clock = Clock()
    ad = adapter(fake, tmp_path, clock)
    ad.discover()
    link = (fake.gpus[0].links or [])[1]
    link.counters[RECOVERY] += 1
    clock.now = 10.0
    first = ad.discover().topology
    link.counter_errors = {RECOVERY: NVMLError}
    clock.now = 20.0
    assert ad.discover().topology.degraded_links == first.degraded_links != ()


def test_a_36_link_gpu_stays_within_the_reason_bound(tmp_path: Path) -> None:
    fake = fake_system("gb200-tray")
    for gpu in fake.gpus:
        gpu.links = invisible_switch_wiring(36)(0, [])
    clock = Clock()
    ad = adapter(fake, tmp_path, clock)
    ad.discover()
    for lk in fake.gpus[0].links or []:
        lk.counter_errors = {REPLAY: NVMLError}
    for lk in (fake.gpus[1].links or [])[:35]:
        lk.active = False
    for i, lk in enumerate(fake.gpus[2].links or []):
        lk.counters[REPLAY] += i + 1  # 36 different details: one reason each, cut at the bound
    clock.now = 10.0
    got = ad.discover().topology
    assert got.gpus[0].reasons == ("NVLink links 0-35 health unknown: replay counter unreadable",)
    assert got.gpus[1].reasons == ("NVLink links 0-34 down",)
    assert len(got.gpus[2].reasons) == MAX_REASONS
    assert got.gpus[2].reasons[-1] == f"and {36 - MAX_REASONS + 1} more reasons"
    assert len(got.degraded_links) == 35 + 36


def test_gpu_lost_while_reading_a_counter_fails_the_gpu(tmp_path: Path) -> None:
    fake = fake_system("dgx-h100")
    (fake.gpus[5].links or [])[0].counter_errors = {FLIT: NVMLError_GpuIsLost}
    got = discover(fake, tmp_path)
    assert got.gpus[5].health is Health.FAILED
    assert got.gpus[4].health is Health.OK


def at(when: float, **values: int) -> Baseline:
    return {name: (when, v) for name, v in values.items()}


@pytest.mark.parametrize(
    ("baseline", "cur", "now", "expected"),
    [
        pytest.param({}, LinkCounters(replay=5), 10.0, LinkVerdict(), id="first reading is only a baseline"),
        pytest.param(
            at(0.0, replay=5), LinkCounters(replay=6), 10.0,
            LinkVerdict(degraded=True, detail="1 replay errors in 10 s"), id="replay rise degrades",
        ),
        pytest.param(
            at(0.0, replay=0, recovery=1), LinkCounters(replay=1, recovery=2), 60.0,
            LinkVerdict(degraded=True, detail="1 replay errors in 60 s, 1 recovery errors in 60 s"), id="both named",
        ),
        pytest.param(
            at(0.0, crc_flit=10), LinkCounters(crc_flit=1010), 10.0,
            LinkVerdict(degraded=True, detail="flit CRC errors at 100/s (limit 100/s)"), id="flit at 100/s degrades",
        ),
        pytest.param(
            at(0.0, crc_flit=10, crc_data=0), LinkCounters(crc_flit=990, crc_data=20), 10.0,
            LinkVerdict(warning=True, detail="flit CRC errors below 100/s, data CRC errors below 100/s"),
            id="flit 98/s plus data 2/s: each below the limit, only warns",
        ),
        pytest.param(
            at(0.0, crc_data=0), LinkCounters(crc_data=999), 10.0,
            LinkVerdict(warning=True, detail="data CRC errors below 100/s"), id="99.9/s only warns",
        ),
        pytest.param(
            at(0.0, replay=9), LinkCounters(replay=0), 10.0,
            LinkVerdict(unknown=True, detail="replay counter went backwards (reset)"), id="reset counter is unknown",
        ),
        pytest.param(
            at(0.0, replay=0), LinkCounters(replay=None, failed=("replay",)), 10.0,
            LinkVerdict(unknown=True, detail="replay counter unreadable"), id="failed read is unknown",
        ),
        pytest.param(
            {}, LinkCounters(crc_flit=None, failed=("crc_flit",)), 10.0,
            LinkVerdict(unknown=True, detail="flit CRC counter unreadable"), id="failed first read is unknown",
        ),
        pytest.param(
            at(0.0, crc_data=4), LinkCounters(crc_data=None), 10.0,
            LinkVerdict(unknown=True, detail="data CRC counter no longer readable"), id="vanished counter is unknown",
        ),
        pytest.param(
            {}, LinkCounters(crc_flit=None, crc_data=None), 10.0, LinkVerdict(), id="unsupported counters are absent",
        ),
        pytest.param(
            at(0.0, replay=0, crc_flit=0), LinkCounters(replay=1, crc_flit=-1), 10.0,
            LinkVerdict(degraded=True, detail="1 replay errors in 10 s"), id="degraded outranks unknown",
        ),
        pytest.param(
            at(10.0, replay=0), LinkCounters(replay=3), 10.0, LinkVerdict(), id="same instant: nothing to rate yet",
        ),
    ],
)  # fmt: skip
def test_assess_link_errors(baseline: Baseline, cur: LinkCounters, now: float, expected: LinkVerdict) -> None:
    assert assess_link_errors(baseline, cur, now) == expected


def test_health_tracker_keeps_first_wording_while_errors_continue() -> None:
    tracker = HealthTracker(hold_s=60.0)
    key = ("GPU-x", 0)
    tracker.observe(key, LinkCounters(), 0.0)
    a = tracker.observe(key, LinkCounters(replay=1), 10.0)
    b = tracker.observe(key, LinkCounters(replay=4), 20.0)
    assert a == b and a.degraded


# --------------------------------------------------------------------------------------------------
# Fabric, memory health, MIG, lost GPUs


@pytest.mark.parametrize(
    ("state", "status", "cluster", "clique", "expected"),
    [
        pytest.param(NVML_GPU_FABRIC_STATE_COMPLETED, NVML_SUCCESS, GB200_CLUSTER_UUID, 4026, GB200_CLIQUE,
                     id="gb200 completed and successful: GFD clique string"),
        pytest.param(NVML_GPU_FABRIC_STATE_COMPLETED, NVML_SUCCESS, bytes(16), 0, None,
                     id="h100 completed with zero uuid: no clique"),
        pytest.param(NVML_GPU_FABRIC_STATE_COMPLETED, 23, GB200_CLUSTER_UUID, 4026, None,
                     id="insufficient resources status: no clique"),
        pytest.param(NVML_GPU_FABRIC_STATE_IN_PROGRESS, NVML_SUCCESS, GB200_CLUSTER_UUID, 4026, None,
                     id="registration in progress: no clique"),
    ],
)  # fmt: skip
def test_fabric_clique(state: int, status: int, cluster: bytes, clique: int, expected: str | None) -> None:
    assert fabric_clique(state, status, cluster, clique) == expected


@pytest.mark.parametrize(
    ("fabric", "expected"),
    [
        pytest.param(FakeFabric(cluster_uuid=GB200_CLUSTER_UUID, clique_id=4026), GB200_CLIQUE, id="valid clique"),
        pytest.param(FakeFabric(cluster_uuid=bytes(16)), None, id="zero uuid ignored"),
        pytest.param(None, None, id="fabric NotSupported ignored"),
    ],
)
def test_fabric_through_the_adapter(fabric: FakeFabric | None, expected: str | None, tmp_path: Path) -> None:
    fake = fake_system("gb200-tray")
    for gpu in fake.gpus:
        gpu.fabric = fabric
    got = discover(fake, tmp_path)
    assert (got.fabric.clique if got.fabric else None) == expected


@pytest.mark.parametrize(
    "struct_type",
    [
        pytest.param(c_nvmlGpuFabricInfoV_t, id="nvidia-ml-py 13.x: clusterUuid is c_uint8[16]"),
        pytest.param(c_nvmlGpuFabricInfoV_t_12_570, id="nvidia-ml-py 12.570-12.575: clusterUuid is char[16], a str"),
        pytest.param(c_nvmlGpuFabricInfoV_t_12_560, id="nvidia-ml-py 12.560.30: clusterUuid declared char[80]"),
    ],
)
def test_fabric_clique_and_health_read_with_either_binding_layout(
    struct_type: type[ctypes.Structure], tmp_path: Path
) -> None:
    fake = fake_system("gb200-tray")
    fake.c_nvmlGpuFabricInfoV_t = struct_type
    fake.gpus[1].fabric = FakeFabric(cluster_uuid=GB200_CLUSTER_UUID, clique_id=4026, health_mask=0xA9)
    got = discover(fake, tmp_path)
    assert got.fabric is not None and got.fabric.clique == GB200_CLIQUE
    assert [g.health for g in got.gpus] == [Health.OK, Health.DEGRADED, Health.OK, Health.OK]


@pytest.mark.parametrize(
    ("struct_type", "fields_right"),
    [
        pytest.param(c_nvmlGpuFabricInfoV_t_12_570, True, id="12.570-12.575: only clusterUuid unusable"),
        pytest.param(c_nvmlGpuFabricInfoV_t_12_560, False, id="12.560.30: fields after clusterUuid read zeros too"),
    ],
)
def test_old_binding_attributes_cannot_be_trusted_for_fabric_info(
    struct_type: type[ctypes.Structure], fields_right: bool
) -> None:
    # Why the adapter reads the bytes NVML wrote instead of the binding's fields.
    fake = fake_system("gb200-tray")
    info: Any = struct_type()
    fake.nvmlDeviceGetGpuFabricInfoV(fake.nvmlDeviceGetHandleByIndex(0), ctypes.byref(info))
    with pytest.raises(UnicodeDecodeError):
        _ = info.clusterUuid  # char arrays come back decoded to str, and 0x9c... is not UTF-8
    assert ((info.state, info.cliqueId) == (3, 4026)) is fields_right


@pytest.mark.parametrize(
    ("remapped", "mig", "health", "reason_part"),
    [
        pytest.param((0, 0, 1, 0), (0, 0), Health.DEGRADED, "row remapping pending", id="remap pending: degraded"),
        pytest.param((0, 3, 0, 1), (0, 0), Health.FAILED, "row remapping failed", id="remap failure: failed"),
        pytest.param((2, 0, 0, 0), (1, 1), Health.OK, "MIG mode enabled", id="MIG enabled: noted, still ok"),
        pytest.param(None, None, Health.OK, None, id="NotSupported everywhere: ok, no reasons"),
    ],
)
def test_memory_health_and_mig(
    remapped: tuple[int, int, int, int] | None,
    mig: tuple[int, int] | None,
    health: Health,
    reason_part: str | None,
    tmp_path: Path,
) -> None:
    fake = fake_system("dgx-a100")
    fake.gpus[4].remapped = remapped
    fake.gpus[4].mig = mig
    got = discover(fake, tmp_path)
    assert got.gpus[4].health is health
    if reason_part is None:
        assert got.gpus[4].reasons == ()
    else:
        assert any(reason_part in r for r in got.gpus[4].reasons)


def test_lost_gpu_is_failed_with_a_reason_and_others_still_discovered(tmp_path: Path) -> None:
    fake = fake_system("dgx-h100")
    fake.gpus[6].lost = True
    got = discover(fake, tmp_path)
    assert got.gpus[6].health is Health.FAILED
    assert "GPU is lost" in got.gpus[6].reasons[0]
    assert got.link_count(6, 0) == 0
    assert got.link_count(0, 1) == 18


def _fail_gpu(fake: FakeNvml, index: int, how: str) -> None:
    gpu = fake.gpus[index]
    if how == "lost":
        gpu.lost = True
    elif how == "lost at the memory read":
        gpu.raises["nvmlDeviceGetMemoryInfo"] = NVMLError_GpuIsLost()
    elif how == "bus unreadable":
        gpu.raises["nvmlDeviceGetPciInfo"] = OSError(5, "Input/output error")
    elif how == "out of range":
        gpu.memory_bytes = 1 << 62
    elif how == "decode error":
        gpu.raises["nvmlDeviceGetName"] = UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
    else:
        raise AssertionError(how)


FAILURES = ["lost", "lost at the memory read", "bus unreadable", "out of range", "decode error"]


@pytest.mark.parametrize("system", ["dgx-1v", "hgx-a100-4", "a100-pcie-bridged", "dgx-h100", "gb200-tray"])
@pytest.mark.parametrize("how", FAILURES)
@pytest.mark.parametrize("after_a_good_cycle", [False, True], ids=["from the first cycle", "after a good cycle"])
def test_a_gpu_that_cannot_be_read_changes_nothing_about_the_others(
    system: str, how: str, after_a_good_cycle: bool, tmp_path: Path
) -> None:
    healthy = build_system(system)
    fake = fake_system(system)
    nvml = adapter(fake, tmp_path)
    if after_a_good_cycle:
        nvml.discover()
    _fail_gpu(fake, 2, how)
    got = nvml.discover().topology
    assert got.gpus[2].health is Health.FAILED
    others = [i for i in range(len(healthy.gpus)) if i != 2]
    assert [[got.link_count(i, j) for j in others] for i in others] == [
        [healthy.link_count(i, j) for j in others] for i in others
    ]
    assert got.nvlink.nvswitch is healthy.nvlink.nvswitch
    if not healthy.nvlink.nvswitch:  # direct links: the failed GPU's own links were not read
        assert all(got.link_count(2, j) == 0 for j in others)
    assert all(g.health is Health.OK for g in got.gpus if g.index != 2 and healthy.gpus[g.index].health is Health.OK)


MIB_BYTES = 1024 * 1024


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        pytest.param(
            {"raises": {"nvmlDeviceGetPciInfo": OSError(5, "Input/output error")}},
            "reading it failed: OSError: [Errno 5] Input/output error",
            id="an OSError",
        ),
        pytest.param(
            {"raises": {"nvmlDeviceGetName": UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")}},
            "reading it failed: UnicodeDecodeError",
            id="a decode error",
        ),
        pytest.param(
            {"raises": {"nvmlDeviceGetNvLinkVersion": ValueError("bad version")}},
            "reading it failed: ValueError: bad version",
            id="a ValueError while reading links",
        ),
        pytest.param(
            {"memory_bytes": (1024**3 + 1) * MIB_BYTES},
            "a reading is out of range: memory_mib: Input should be less than or equal to",
            id="memory past the bound",
        ),
        pytest.param({"name": "x" * 300}, "a reading is out of range: model", id="a model name past the bound"),
        pytest.param({"numa_mask": 0}, None, id="no change: the control"),
    ],
)
def test_one_unreadable_gpu_is_failed_with_the_reason_and_the_rest_published(
    change: dict[str, Any], reason: str | None, tmp_path: Path
) -> None:
    fake = fake_system("dgx-h100")
    for key, value in change.items():
        setattr(fake.gpus[6], key, value)
    got = discover(fake, tmp_path)  # a valid topology: discovery as a whole did not fail
    assert [g.index for g in got.gpus] == list(range(8))
    assert all(g.health is Health.OK for g in got.gpus if g.index != 6)
    assert got.link_count(0, 1) == 18
    if reason is None:
        assert got.gpus[6].health is Health.OK and got.link_count(6, 0) == 18
        return
    bad = got.gpus[6]
    assert bad.health is Health.FAILED and bad.memory_mib == 0 and got.link_count(6, 0) == 0
    assert bad.reasons[0].startswith(f"health unknown: {reason}")
    assert bad.uuid == fake.gpus[6].uuid or len(fake.gpus[6].uuid) > 256


def test_an_unreadable_gpu_keeps_the_uuid_last_read_for_it(tmp_path: Path) -> None:
    fake = fake_system("dgx-h100")
    ad = adapter(fake, tmp_path)
    uuid = ad.discover().topology.gpus[3].uuid
    fake.gpus[3].raises = {"nvmlDeviceGetUUID": OSError("gone")}
    again = ad.discover().topology.gpus[3]
    assert (again.uuid, again.health) == (uuid, Health.FAILED)
    assert again.reasons == ("health unknown: reading it failed: OSError: gone",)


def test_not_supported_calls_are_recorded_as_notes(tmp_path: Path) -> None:
    result = adapter(fake_system("l40s-4"), tmp_path).discover()
    assert "NVLink: NotSupported" in result.notes
    assert "MIG mode: NotSupported" in result.notes


# --------------------------------------------------------------------------------------------------
# Init and small pure helpers


@pytest.mark.parametrize(
    "error",
    [
        pytest.param(NVMLError_LibraryNotFound, id="no libnvidia-ml: clear error"),
        pytest.param(NVMLError_DriverNotLoaded, id="driver not loaded: clear error"),
    ],
)
def test_no_driver_is_one_clear_error(error: type[NVMLError], tmp_path: Path) -> None:
    fake = FakeNvml([], init_error=error)
    with pytest.raises(NvmlUnavailableError, match="NVIDIA driver not available"):
        adapter(fake, tmp_path).open()


def test_close_shuts_nvml_down_once(tmp_path: Path) -> None:
    fake = fake_system("l40s-4")
    ad = adapter(fake, tmp_path)
    ad.discover()
    ad.close()
    ad.close()
    assert fake.calls["nvmlShutdown"] == 1


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        pytest.param(b"00000000:18:00.0", "0000:18:00.0", id="bytes with 8-digit domain"),
        pytest.param(b"00000000:8A:00.0", "0000:8a:00.0", id="upper-case hex lowered"),
        pytest.param("00000008:01:00.0", "0008:01:00.0", id="grace non-zero domain"),
        pytest.param("0000:c1:00.1", "0000:c1:00.1", id="already sysfs form"),
        pytest.param(b"00000000:18:00.0\x00", "0000:18:00.0", id="trailing NUL from a char array"),
    ],
)
def test_normalize_bus_id(raw: bytes | str, expected: str) -> None:
    assert normalize_bus_id(raw) == expected


def test_nvml_bus_round_trips_through_normalisation() -> None:
    assert normalize_bus_id(nvml_bus("0000:9d:00.0")) == "0000:9d:00.0"


@pytest.mark.parametrize(
    ("enum", "generation"),
    [(1, 1), (2, 2), (3, 2), (4, 3), (5, 3), (6, 4), (7, 5), (8, 6), (0, 0), (42, 0)],
    ids=["1.0", "2.0", "2.2", "3.0", "3.1", "4.0", "5.0", "6.0", "invalid", "future enum unknown"],
)
def test_nvlink_generation_from_version_enum(enum: int, generation: int) -> None:
    assert nvlink_generation(enum) == generation


@pytest.mark.parametrize(
    ("version_enum", "generation", "gbps"),
    [(1, 1, 20.0), (2, 2, 25.0), (3, 2, 25.0), (4, 3, 25.0), (5, 3, 25.0), (6, 4, 25.0), (7, 5, 50.0), (8, 6, 50.0)],
    ids=["1.0 P100", "2.0 V100", "2.2", "3.0 A100", "3.1", "4.0 H100", "5.0 B200", "6.0 Rubin"],
)
def test_every_nvlink_version_publishes_its_per_link_rate(
    version_enum: int, generation: int, gbps: float, tmp_path: Path
) -> None:
    fake = fake_system("dgx-1v")
    for gpu in fake.gpus:
        for lk in gpu.links or []:
            lk.version = version_enum
    got = discover(fake, tmp_path).nvlink
    assert (got.generation, got.gbps_per_link) == (generation, gbps)
    assert NVLINK_GBPS_PER_LINK[generation] == gbps


def test_fake_wiring_covers_every_named_system() -> None:
    from gputopo.systems import SYSTEMS, VARIANTS

    assert set(SYSTEM_WIRING) == set(SYSTEMS) | set(VARIANTS)
    assert len(invisible_switch_wiring(3)(0, [])) == 3


def test_import_pynvml_raises_no_future_warning() -> None:
    # The deprecated PyPI `pynvml` package warns on import; only nvidia-ml-py may provide the module.
    proc = subprocess.run(
        [sys.executable, "-W", "error::FutureWarning", "-c", "import pynvml; assert hasattr(pynvml, 'nvmlInit')"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
