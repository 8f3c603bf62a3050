"""A fake `pynvml` for the NVML adapter's tests: same names, same error classes, same quirks.

It reproduces what the real binding does where it matters: bus ids come back as bytes with an 8-digit
upper-case domain; `nvmlDeviceGetNvLinkState` raises NotSupported on GPUs without NVLink and
InvalidArgument past the last link; `nvmlDeviceGetNvLinkCapability` answers TRUE for every index (the
B200 trap); each NVLink error counter can be unsupported or fail on its own; fabric info is written,
as libnvidia-ml writes it, in the C v2 layout into a caller-allocated struct declared the way either
nvidia-ml-py 12.560.30 or a later release declares it.
Systems are built from their wiring (which peer or switch each link goes to), not from the
expected NV# matrix.

The same calls also run through the real binding against the NVML mock library
(tests/agent/test_agent_libnvml.py); this fake stays for what the library cannot express or is not
NVML's to give: nvidia-ml-py releases that declare the fabric struct differently, counting which calls
were made, a remote-type error on one link, and exceptions that are not NVML errors.
"""

from __future__ import annotations

import ctypes
import struct
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from gputopo.model import FabricState, NodeTopology
from gputopo.systems import build_system

MIB = 1024 * 1024

NVML_FEATURE_ENABLED = 1
NVML_FEATURE_DISABLED = 0
NVML_NVLINK_DEVICE_TYPE_GPU = 0x00
NVML_NVLINK_DEVICE_TYPE_IBMNPU = 0x01
NVML_NVLINK_DEVICE_TYPE_SWITCH = 0x02
NVML_NVLINK_DEVICE_TYPE_UNKNOWN = 0xFF
NVML_GPU_FABRIC_STATE_NOT_SUPPORTED = 0
NVML_GPU_FABRIC_STATE_NOT_STARTED = 1
NVML_GPU_FABRIC_STATE_IN_PROGRESS = 2
NVML_GPU_FABRIC_STATE_COMPLETED = 3
NVML_SUCCESS = 0
NVML_ERROR_INSUFFICIENT_RESOURCES = 23
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
NVML_NVLINK_ERROR_DL_REPLAY = 0
NVML_NVLINK_ERROR_DL_RECOVERY = 1
NVML_NVLINK_ERROR_DL_CRC_FLIT = 2
NVML_NVLINK_ERROR_DL_CRC_DATA = 3
NVML_DEVICE_UUID_BUFFER_SIZE = 80
NVML_P2P_CAPS_INDEX_NVLINK = 2
NVML_GPU_FABRIC_UUID_LEN = 16
nvmlGpuFabricInfo_v2 = 0x02000024  # NVML_STRUCT_VERSION: sizeof(nvmlGpuFabricInfo_v2_t) = 36, version 2

# nvmlDeviceGetNvLinkVersion enum values per GPU family (NVML_NVLINK_VERSION_*).
VERSION_V100 = 2  # NVLink 2.0
VERSION_A100 = 4  # NVLink 3.0
VERSION_H100 = 6  # NVLink 4.0
VERSION_B200 = 7  # NVLink 5.0


class NVMLError(Exception):
    _names: ClassVar[dict[int, str]] = {
        2: "Invalid Argument",
        3: "Not Supported",
        9: "Driver Not Loaded",
        12: "NVML Shared Library Not Found",
        13: "Function Not Found",
        15: "GPU is lost",
        23: "Insufficient Resources",
        25: "Argument version mismatch",
        999: "Unknown Error",
    }

    def __init__(self, value: int = 999) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return self._names.get(self.value, f"NVML error {self.value}")


class NVMLError_InvalidArgument(NVMLError):
    def __init__(self) -> None:
        super().__init__(2)


class NVMLError_NotSupported(NVMLError):
    def __init__(self) -> None:
        super().__init__(3)


class NVMLError_DriverNotLoaded(NVMLError):
    def __init__(self) -> None:
        super().__init__(9)


class NVMLError_LibraryNotFound(NVMLError):
    def __init__(self) -> None:
        super().__init__(12)


class NVMLError_FunctionNotFound(NVMLError):
    def __init__(self) -> None:
        super().__init__(13)


class NVMLError_GpuIsLost(NVMLError):
    def __init__(self) -> None:
        super().__init__(15)


class NVMLError_Timeout(NVMLError):
    def __init__(self) -> None:
        super().__init__(10)


ErrorClass = type[NVMLError]


class _PrintableStructure(ctypes.Structure):
    """pynvml's struct base: every bytes attribute comes back UTF-8 decoded to str."""

    def __getattribute__(self, name: str) -> Any:
        res = super().__getattribute__(name)
        return res.decode() if isinstance(res, bytes) else res


class c_nvmlGpuFabricInfoV_t(_PrintableStructure):
    """nvidia-ml-py 13.x (13.615.71 checked): matches C, 36 bytes, `clusterUuid` a byte array."""

    _fields_ = [
        ("version", ctypes.c_uint),
        ("clusterUuid", ctypes.c_uint8 * NVML_GPU_FABRIC_UUID_LEN),
        ("status", ctypes.c_uint),
        ("cliqueId", ctypes.c_uint32),
        ("state", ctypes.c_uint),
        ("healthMask", ctypes.c_uint32),
    ]

    def __init__(self) -> None:
        super().__init__(version=nvmlGpuFabricInfo_v2)


class c_nvmlGpuFabricInfoV_t_12_570(_PrintableStructure):
    """nvidia-ml-py 12.570.86 and 12.575.51: the right size, but `clusterUuid` is `c_char * 16`, which
    reads back cut at the first NUL and decoded to str."""

    _fields_ = [
        ("version", ctypes.c_uint),
        ("clusterUuid", ctypes.c_char * NVML_GPU_FABRIC_UUID_LEN),
        ("status", ctypes.c_uint),
        ("cliqueId", ctypes.c_uint32),
        ("state", ctypes.c_uint),
        ("healthMask", ctypes.c_uint32),
    ]

    def __init__(self) -> None:
        super().__init__(version=nvmlGpuFabricInfo_v2)


class c_nvmlGpuFabricInfoV_t_12_560(_PrintableStructure):
    """nvidia-ml-py 12.560.30: `clusterUuid` declared as an 80-byte char array, so the struct is 100 bytes
    and every field after it sits past the 36 bytes NVML writes."""

    _fields_ = [
        ("version", ctypes.c_uint),
        ("clusterUuid", ctypes.c_char * NVML_DEVICE_UUID_BUFFER_SIZE),
        ("status", ctypes.c_uint),
        ("cliqueId", ctypes.c_uint32),
        ("state", ctypes.c_uint),
        ("healthMask", ctypes.c_uint32),
    ]

    def __init__(self) -> None:
        super().__init__(version=nvmlGpuFabricInfo_v2)


# nvmlGpuFabricInfo_v2_t as libnvidia-ml fills it: version, clusterUuid[16], status, cliqueId,
# state (unsigned char + 3 padding bytes), healthMask.
_FABRIC_V2_C = struct.Struct("<I16sIIB3xI")


@dataclass
class PciInfo:
    busId: bytes


@dataclass
class MemoryInfo:
    total: int
    free: int
    used: int


def nvml_bus(sysfs_bus: str) -> bytes:
    """`0000:18:00.0` (sysfs) → `b"00000000:18:00.0"` as NVML returns it (8-digit domain, upper case)."""
    domain, rest = sysfs_bus.split(":", 1)
    return f"{int(domain, 16):08X}:{rest.upper()}".encode()


@dataclass
class FakeLink:
    remote_type: int = NVML_NVLINK_DEVICE_TYPE_SWITCH
    remote_bus: bytes = b"00000000:05:00.0"
    active: bool = True
    version: int = VERSION_H100
    # replay, recovery, crc_flit, crc_data (NVML_NVLINK_ERROR_DL_* order)
    counters: list[int] = field(default_factory=lambda: [0, 0, 0, 0])
    counters_supported: bool = True
    # Per counter index: the error its read raises instead of answering (NotSupported: absent).
    counter_errors: dict[int, ErrorClass] = field(default_factory=dict)
    remote_type_error: ErrorClass | None = None


@dataclass
class FakeFabric:
    state: int = NVML_GPU_FABRIC_STATE_COMPLETED
    status: int = NVML_SUCCESS
    cluster_uuid: bytes = bytes(16)
    clique_id: int = 0
    health_mask: int = 0


@dataclass
class FakeGpu:
    uuid: str
    name: str
    memory_bytes: int
    bus_id: bytes
    numa_mask: int = 0  # nvmlDeviceGetMemoryAffinity's first word; 0 = unknown
    links: list[FakeLink] | None = field(default_factory=list)  # None: NVLink calls raise NotSupported
    mig: tuple[int, int] | None = None  # None: NotSupported (no MIG on this GPU)
    remapped: tuple[int, int, int, int] | None = None  # None: NotSupported (pre-Ampere)
    fabric: FakeFabric | None = None  # None: NotSupported
    lost: bool = False  # every call raises GpuIsLost
    raises: dict[str, Exception] = field(default_factory=dict)  # call name -> what that call raises
    p2p: dict[int, int] = field(default_factory=dict)  # peer index -> NVLink P2P status (absent: OK)


@dataclass(frozen=True)
class Handle:
    index: int


class FakeNvml:
    """Stands in for the `pynvml` module. `calls` counts every function called, by name."""

    NVMLError = NVMLError
    NVMLError_InvalidArgument = NVMLError_InvalidArgument
    NVMLError_NotSupported = NVMLError_NotSupported
    NVMLError_DriverNotLoaded = NVMLError_DriverNotLoaded
    NVMLError_LibraryNotFound = NVMLError_LibraryNotFound
    NVMLError_FunctionNotFound = NVMLError_FunctionNotFound
    NVMLError_GpuIsLost = NVMLError_GpuIsLost
    NVMLError_Timeout = NVMLError_Timeout

    def __init__(
        self,
        gpus: Sequence[FakeGpu],
        init_error: ErrorClass | None = None,
        fabric_struct: type[ctypes.Structure] = c_nvmlGpuFabricInfoV_t,
    ) -> None:
        self.gpus = list(gpus)
        self.init_error = init_error
        self.c_nvmlGpuFabricInfoV_t = fabric_struct
        self.calls: Counter[str] = Counter()
        self.max_link_index_asked = -1
        self.initialised = False

    def _gpu(self, h: Handle, call: str) -> FakeGpu:
        self.calls[call] += 1
        gpu = self.gpus[h.index]
        if gpu.lost:
            raise NVMLError_GpuIsLost()
        if call in gpu.raises:
            raise gpu.raises[call]
        return gpu

    def _link(self, h: Handle, link: int, call: str) -> FakeLink:
        gpu = self._gpu(h, call)
        if gpu.links is None:
            raise NVMLError_NotSupported()
        if not 0 <= link < len(gpu.links):
            raise NVMLError_InvalidArgument()
        return gpu.links[link]

    def nvmlInit(self) -> None:
        self.calls["nvmlInit"] += 1
        if self.init_error is not None:
            raise self.init_error()
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self.calls["nvmlShutdown"] += 1
        self.initialised = False

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Handle:
        if not 0 <= index < len(self.gpus):
            raise NVMLError_InvalidArgument()
        return Handle(index)

    def nvmlDeviceGetUUID(self, h: Handle) -> str:
        return self._gpu(h, "nvmlDeviceGetUUID").uuid

    def nvmlDeviceGetName(self, h: Handle) -> str:
        return self._gpu(h, "nvmlDeviceGetName").name

    def nvmlDeviceGetMemoryInfo(self, h: Handle) -> MemoryInfo:
        total = self._gpu(h, "nvmlDeviceGetMemoryInfo").memory_bytes
        return MemoryInfo(total=total, free=total, used=0)

    def nvmlDeviceGetPciInfo(self, h: Handle) -> PciInfo:
        return PciInfo(busId=self._gpu(h, "nvmlDeviceGetPciInfo").bus_id)

    def nvmlDeviceGetMemoryAffinity(self, h: Handle, node_set_size: int, scope: int) -> list[int]:
        gpu = self._gpu(h, "nvmlDeviceGetMemoryAffinity")
        return [gpu.numa_mask] + [0] * (node_set_size - 1)

    def nvmlDeviceGetNumaNodeId(self, h: Handle) -> int:
        self._gpu(h, "nvmlDeviceGetNumaNodeId")
        raise NVMLError_NotSupported()  # x86: the GPU is not a NUMA node

    def nvmlDeviceGetNvLinkState(self, h: Handle, link: int) -> int:
        self.max_link_index_asked = max(self.max_link_index_asked, link)
        lk = self._link(h, link, "nvmlDeviceGetNvLinkState")
        return NVML_FEATURE_ENABLED if lk.active else NVML_FEATURE_DISABLED

    def nvmlDeviceGetNvLinkCapability(self, h: Handle, link: int, cap: int) -> int:
        self._gpu(h, "nvmlDeviceGetNvLinkCapability")
        return 1  # TRUE for every index, as on B200: must not be used to enumerate links

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h: Handle, link: int) -> int:
        lk = self._link(h, link, "nvmlDeviceGetNvLinkRemoteDeviceType")
        if lk.remote_type_error is not None:
            raise lk.remote_type_error()
        return lk.remote_type

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h: Handle, link: int) -> PciInfo:
        return PciInfo(busId=self._link(h, link, "nvmlDeviceGetNvLinkRemotePciInfo").remote_bus)

    def nvmlDeviceGetNvLinkVersion(self, h: Handle, link: int) -> int:
        return self._link(h, link, "nvmlDeviceGetNvLinkVersion").version

    def nvmlDeviceGetNvLinkErrorCounter(self, h: Handle, link: int, counter: int) -> int:
        lk = self._link(h, link, "nvmlDeviceGetNvLinkErrorCounter")
        if not lk.counters_supported:
            raise NVMLError_NotSupported()
        if not 0 <= counter < 4:
            raise NVMLError_InvalidArgument()
        if counter in lk.counter_errors:
            raise lk.counter_errors[counter]()
        return lk.counters[counter]

    # No event API, as an older driver: Xid events are the NVML mock library's (tests/agent/test_agent_libnvml.py).
    def nvmlEventSetCreate(self) -> Any:
        raise NVMLError_FunctionNotFound()

    def nvmlDeviceRegisterEvents(self, handle: Any, event_types: int, event_set: Any) -> None:
        raise NVMLError_FunctionNotFound()

    def nvmlEventSetWait_v2(self, event_set: Any, timeout_ms: int) -> Any:
        raise NVMLError_FunctionNotFound()

    def nvmlEventSetFree(self, event_set: Any) -> None:
        raise NVMLError_FunctionNotFound()

    def nvmlDeviceGetP2PStatus(self, h1: Handle, h2: Handle, index: int) -> int:
        gpu = self._gpu(h1, "nvmlDeviceGetP2PStatus")
        self._gpu(h2, "nvmlDeviceGetP2PStatus")
        return gpu.p2p.get(h2.index, 0) if index == NVML_P2P_CAPS_INDEX_NVLINK else 5

    def nvmlDeviceGetMigMode(self, h: Handle) -> list[int]:
        gpu = self._gpu(h, "nvmlDeviceGetMigMode")
        if gpu.mig is None:
            raise NVMLError_NotSupported()
        return list(gpu.mig)

    def nvmlDeviceGetRemappedRows(self, h: Handle) -> tuple[int, int, int, int]:
        gpu = self._gpu(h, "nvmlDeviceGetRemappedRows")
        if gpu.remapped is None:
            raise NVMLError_NotSupported()
        return gpu.remapped

    def nvmlDeviceGetGpuFabricInfoV(self, h: Handle, ref: Any) -> int:
        gpu = self._gpu(h, "nvmlDeviceGetGpuFabricInfoV")
        if gpu.fabric is None:
            raise NVMLError_NotSupported()
        info = ref._obj  # ctypes.byref(struct) keeps the struct here
        address = ctypes.addressof(info)
        version = ctypes.c_uint.from_address(address).value
        if version != nvmlGpuFabricInfo_v2:
            raise NVMLError(NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        # The library knows only the C layout: it writes these 36 bytes whatever Python declared.
        f = gpu.fabric
        raw = _FABRIC_V2_C.pack(version, f.cluster_uuid, f.status, f.clique_id, f.state, f.health_mask)
        ctypes.memmove(address, raw, len(raw))
        return NVML_SUCCESS


# --------------------------------------------------------------------------------------------------
# Real systems, by wiring


Wiring = Callable[[int, Sequence[bytes]], list[FakeLink]]


def _gpus_like(topology: NodeTopology, version: int, wiring: Wiring | None) -> list[FakeGpu]:
    """FakeGpus with the identity of a named system's GPUs; NUMA via the memory affinity mask."""
    buses = [nvml_bus(g.pci_bus_id) for g in topology.gpus]
    out = []
    for g in topology.gpus:
        links = None
        if wiring is not None:
            links = wiring(g.index, buses)
            for lk in links:
                lk.version = version
        out.append(
            FakeGpu(
                uuid=g.uuid,
                name=g.model,
                # NVML reports a little more than whole MiB on real boards; the adapter floors.
                memory_bytes=g.memory_mib * MIB + 123_456,
                bus_id=buses[g.index],
                numa_mask=(1 << g.numa_node) if g.numa_node is not None else 0,
                links=links,
            )
        )
    return out


def direct_wiring(edges: dict[tuple[int, int], int]) -> Wiring:
    """Direct GPU-GPU links: `edges[(a, b)]` links between a and b, interleaved over link ports."""

    def wire(index: int, buses: Sequence[bytes]) -> list[FakeLink]:
        peers: list[int] = []
        for (a, b), count in sorted(edges.items()):
            if index in (a, b):
                peers += [b if index == a else a] * count
        # Spread peers over ports the way boards do (not grouped), so nothing depends on order.
        ports = peers[::2] + peers[1::2]
        return [FakeLink(remote_type=NVML_NVLINK_DEVICE_TYPE_GPU, remote_bus=buses[p]) for p in ports]

    return wire


def switch_wiring(per_switch: Sequence[int], first_switch_bus: int = 0x05) -> Wiring:
    """Every link to an NVSwitch: `per_switch[k]` links to the switch at bus first+k."""

    def wire(_index: int, _buses: Sequence[bytes]) -> list[FakeLink]:
        out = []
        for k, count in enumerate(per_switch):
            bus = f"00000000:{first_switch_bus + k:02X}:00.0".encode()
            out += [FakeLink(remote_type=NVML_NVLINK_DEVICE_TYPE_SWITCH, remote_bus=bus) for _ in range(count)]
        return out

    return wire


def invisible_switch_wiring(links: int) -> Wiring:
    """GB200-style: the switch trays are outside the node; the remote is a switch NVML cannot place."""

    def wire(_index: int, _buses: Sequence[bytes]) -> list[FakeLink]:
        return [
            FakeLink(remote_type=NVML_NVLINK_DEVICE_TYPE_SWITCH, remote_bus=b"FFFFFFFF:FF:FF.F") for _ in range(links)
        ]

    return wire


# DGX-1V hybrid cube mesh as NCCL's XML shows it (NVIDIA/nccl #671): GPU0 → GPU1 ×1, GPU2 ×1,
# GPU3 ×2, GPU4 ×2, and the same pattern on every GPU: six links each.
DGX1V_EDGES = {
    (0, 1): 1, (0, 2): 1, (0, 3): 2, (0, 4): 2,
    (1, 2): 2, (1, 3): 1, (1, 5): 2,
    (2, 3): 2, (2, 6): 1,
    (3, 7): 1,
    (4, 5): 1, (4, 6): 1, (4, 7): 2,
    (5, 6): 2, (5, 7): 1,
    (6, 7): 2,
}  # fmt: skip


def _full_mesh(n: int, per_pair: int) -> dict[tuple[int, int], int]:
    return {(a, b): per_pair for a in range(n) for b in range(a + 1, n)}


def _pairs(pairs: Sequence[tuple[int, int]], per_pair: int) -> dict[tuple[int, int], int]:
    return dict.fromkeys(pairs, per_pair)


# name → (NVLink version enum, wiring or None for no NVLink, fabric)
SYSTEM_WIRING: dict[str, tuple[int, Wiring | None]] = {
    "dgx-1v": (VERSION_V100, direct_wiring(DGX1V_EDGES)),
    # DGX A100: 6 NVSwitches, 2 links to each (NVIDIA/nccl #1505).
    "dgx-a100": (VERSION_A100, switch_wiring([2] * 6)),
    # HGX H100: 4 NVSwitches with 4, 5, 5, 4 links (aliyun/SimAI #128).
    "dgx-h100": (VERSION_H100, switch_wiring([4, 5, 5, 4])),
    "dgx-h100-sys-nics": (VERSION_H100, switch_wiring([4, 5, 5, 4])),
    "hgx-h200": (VERSION_H100, switch_wiring([4, 5, 5, 4])),
    # HGX A100 4-GPU: 12 links spread over 3 peers.
    "hgx-a100-4": (VERSION_A100, direct_wiring(_full_mesh(4, 4))),
    # PCIe A100s with NVLink bridges: 12 links to the partner.
    "a100-pcie-bridged": (VERSION_A100, direct_wiring(_pairs([(0, 1), (2, 3), (4, 5), (6, 7)], 12))),
    "a100-pcie-bridged-nonadjacent": (VERSION_A100, direct_wiring(_pairs([(0, 5), (1, 2), (3, 4), (6, 7)], 12))),
    "l40s-4": (0, None),
    "rtx4090-8": (0, None),
    "gb200-tray": (VERSION_B200, invisible_switch_wiring(18)),
    "gb200-tray-degraded": (VERSION_B200, invisible_switch_wiring(18)),
    "gb300-tray": (VERSION_B200, invisible_switch_wiring(18)),  # NVLink 5 as on GB200
    "gb300-tray-degraded": (VERSION_B200, invisible_switch_wiring(18)),
}

GB200_CLUSTER_UUID = bytes.fromhex("9c6f5af353bf49b5a436b66766c413c3")
GB200_CLIQUE_ID = 4026
_FABRIC_STATE = {
    FabricState.NOT_SUPPORTED: NVML_GPU_FABRIC_STATE_NOT_SUPPORTED,
    FabricState.NOT_STARTED: NVML_GPU_FABRIC_STATE_NOT_STARTED,
    FabricState.IN_PROGRESS: NVML_GPU_FABRIC_STATE_IN_PROGRESS,
    FabricState.COMPLETED: NVML_GPU_FABRIC_STATE_COMPLETED,
}


def _tray_fabric(topology: NodeTopology, gpus: Sequence[FakeGpu]) -> None:
    """Each GPU's fabric info as NVML would report what the system publishes (its clique, state, mask)."""
    assert topology.fabric is not None
    cluster, clique_id = topology.fabric.clique.rsplit(".", 1)
    for fake, gpu in zip(gpus, topology.gpus, strict=True):
        assert gpu.fabric is not None
        fake.fabric = FakeFabric(
            state=_FABRIC_STATE[gpu.fabric.state],
            status=gpu.fabric.status,
            cluster_uuid=uuid.UUID(cluster).bytes,
            clique_id=int(clique_id),
            health_mask=gpu.fabric.health_mask,
        )


def fake_system(name: str) -> FakeNvml:
    """A FakeNvml whose GPUs match `gputopo.systems.build_system(name)`, wired as the real box is."""
    topology = build_system(name)
    version, wiring = SYSTEM_WIRING[name]
    gpus = _gpus_like(topology, version, wiring)
    if topology.fabric is not None:
        _tray_fabric(topology, gpus)
    elif name in ("dgx-h100", "hgx-h200"):
        # H100 HGX boards report COMPLETED with an all-zero cluster UUID: not a multi-node domain.
        for g in gpus:
            g.fabric = FakeFabric(cluster_uuid=bytes(16), clique_id=0)
    if name.startswith(("dgx-a100", "dgx-h100", "hgx", "a100", "gb")):
        for g in gpus:
            g.mig = (0, 0)
            g.remapped = (0, 0, 0, 0)
    return FakeNvml(gpus)
