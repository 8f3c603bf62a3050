"""The profile the NVML mock library answers from: what `gputopo.systems` says, as NVML would report it.

A text file, one fact per line, that C parses with strtok (nvmlmock.c):

    gputopo-nvml-profile 1
    driver 570.124.06
    absent nvmlDeviceGetGpuFabricInfoV    # that call answers NVML_ERROR_FUNCTION_NOT_FOUND
    init-error 9                          # nvmlInit fails with that code
    gpu 0                                 # GPUs in index order; the lines below describe it
    uuid GPU-...
    name NVIDIA H100 80GB HBM3            # the rest of the line; \\xNN for any byte
    bus 00000000:1B:00.0                  # NVML's form: 8-digit domain, upper case
    memory 85520531456                    # bytes
    numa-mask 1                           # nvmlDeviceGetMemoryAffinity's first word
    mig 0 0 / remapped 0 0 0 0            # absent: NVML_ERROR_NOT_SUPPORTED
    fabric STATE STATUS CLUSTER-UUID-HEX CLIQUE HEALTH-MASK
    nvlink 18                             # link count; absent: NVLink NOT_SUPPORTED
    link I ACTIVE REMOTE-TYPE REMOTE-BUS VERSION REPLAY RECOVERY CRC-FLIT CRC-DATA
    counter-error LINK COUNTER CODE       # that counter's read answers CODE
    p2p PEER STATUS                       # NVLink P2P status to PEER (default NOT_SUPPORTED)
    fail FUNCTION CODE                    # FUNCTION (or *) answers CODE for this GPU
    xid GPU CODE                          # after the GPUs: an Xid event, delivered once per event set

Systems are built from their wiring (which peer or switch each link reaches), not from the NV# matrix
the agent is expected to rebuild from it.
"""

from __future__ import annotations

import os
import re
import tempfile
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gputopo.model import FabricState, NodeTopology
from gputopo.systems import build_system

MIB = 1024 * 1024
DEVICE_TYPE_GPU = 0x00
DEVICE_TYPE_SWITCH = 0x02
P2P_STATUS_OK = 0
P2P_STATUS_NOT_SUPPORTED = 5
FABRIC_STATES = {
    FabricState.NOT_SUPPORTED: 0,
    FabricState.NOT_STARTED: 1,
    FabricState.IN_PROGRESS: 2,
    FabricState.COMPLETED: 3,
}
# nvmlDeviceGetNvLinkVersion's enum per GPU family (NVML_NVLINK_VERSION_*).
VERSION_V100, VERSION_A100, VERSION_H100, VERSION_B200 = 2, 4, 6, 7
# The C side's bounds (nvmlmock.c): 96-byte text buffers, 16-character bus ids, 64 GPUs and links,
# 4096 Xid lines.
_MAX_TEXT, _MAX_BUS, _MAX_GPUS, _MAX_LINKS, _MAX_XIDS = 95, 16, 64, 64, 4096
_TOKEN = re.compile(r"^[\x21-\x7e]+$")
_FUNCTION = re.compile(r"^(\*|nvml\w{1,59})$")


@dataclass
class LinkSpec:
    """One NVLink port: state, far end, NVLink version enum, error counters and counter read errors."""

    active: bool = True
    remote_type: int = DEVICE_TYPE_SWITCH
    remote_bus: str = "00000000:05:00.0"
    version: int = 0
    counters: list[int] = field(default_factory=lambda: [0, 0, 0, 0])  # replay, recovery, flit CRC, data CRC
    counter_errors: dict[int, int] = field(default_factory=dict)  # counter -> NVML return code


@dataclass
class FabricSpec:
    """nvmlGpuFabricInfo_v2_t's fields."""

    state: int = 3
    status: int = 0
    cluster_uuid: bytes = bytes(16)
    clique_id: int = 0
    health_mask: int = 0


@dataclass
class GpuSpec:
    uuid: str
    name: str | bytes
    bus: str  # NVML's form
    memory_bytes: int
    numa_mask: int = 0
    links: list[LinkSpec] | None = None  # None: NVLink NOT_SUPPORTED
    mig: tuple[int, int] | None = None
    remapped: tuple[int, int, int, int] | None = None
    fabric: FabricSpec | None = None
    p2p: dict[int, int] = field(default_factory=dict)  # peer index -> NVML_P2P_STATUS_* over NVLink
    fails: dict[str, int] = field(default_factory=dict)  # function or "*" -> NVML return code


@dataclass
class Profile:
    gpus: list[GpuSpec]
    absent: set[str] = field(default_factory=set)
    init_error: int = 0
    driver: str = "570.124.06"
    # (GPU index, Xid code) in the order they happen; append to inject one under a running agent.
    xids: list[tuple[int, int]] = field(default_factory=list)

    def render(self) -> str:
        """The profile's text; ValueError naming the field the C side would refuse."""
        if len(self.gpus) > _MAX_GPUS:
            raise ValueError(f"profile: {len(self.gpus)} GPUs, at most {_MAX_GPUS}")
        lines = ["gputopo-nvml-profile 1", f"driver {_token(self.driver, 'driver', _MAX_BUS * 2 - 1)}"]
        lines += [f"absent {_function(f)}" for f in sorted(self.absent)]
        if self.init_error:
            lines.append(f"init-error {int(self.init_error)}")
        for i, g in enumerate(self.gpus):
            lines += _gpu_lines(i, g)
        if len(self.xids) > _MAX_XIDS:
            raise ValueError(f"profile: {len(self.xids)} Xids, at most {_MAX_XIDS}")
        for gpu, code in self.xids:
            if not 0 <= gpu < len(self.gpus) or not 0 <= code <= 0xFFFFFFFF:
                raise ValueError(f"profile: Xid {code} on GPU {gpu}: needs a GPU of the profile and a 32-bit code")
            lines.append(f"xid {int(gpu)} {int(code)}")
        return "\n".join(lines) + "\n"


def _token(value: str, what: str, limit: int) -> str:
    if not _TOKEN.match(value) or len(value) > limit:
        raise ValueError(f"profile: {what} {value!r} must be 1-{limit} printable characters without spaces")
    return value


def _function(name: str) -> str:
    if not _FUNCTION.match(name):
        raise ValueError(f"profile: {name!r} is not an NVML function name (or *)")
    return name


def _escape(name: str | bytes) -> str:
    raw = name.encode() if isinstance(name, str) else name
    if not 0 < len(raw) <= _MAX_TEXT or 0 in raw:
        raise ValueError(f"profile: GPU name {name!r} must be 1-{_MAX_TEXT} bytes without NUL")
    return "".join(chr(b) if 0x20 <= b < 0x7F and b != 0x5C else f"\\x{b:02x}" for b in raw)


def _gpu_lines(index: int, g: GpuSpec) -> list[str]:
    out = [
        f"gpu {index}",
        f"uuid {_token(g.uuid, 'uuid', _MAX_TEXT)}",
        f"name {_escape(g.name)}",
        f"bus {_token(g.bus, 'bus', _MAX_BUS)}",
        f"memory {int(g.memory_bytes)}",
        f"numa-mask {int(g.numa_mask)}",
    ]
    if g.mig is not None:
        out.append("mig {} {}".format(*g.mig))
    if g.remapped is not None:
        out.append("remapped {} {} {} {}".format(*g.remapped))
    if (f := g.fabric) is not None:
        if len(f.cluster_uuid) != 16:
            raise ValueError(f"profile: GPU {index} fabric cluster uuid must be 16 bytes")
        out.append(f"fabric {f.state} {f.status} {f.cluster_uuid.hex()} {f.clique_id} {f.health_mask}")
    if g.links is not None:
        if len(g.links) > _MAX_LINKS:
            raise ValueError(f"profile: GPU {index} has {len(g.links)} links, at most {_MAX_LINKS}")
        out.append(f"nvlink {len(g.links)}")
        for li, lk in enumerate(g.links):
            bus = _token(lk.remote_bus, f"GPU {index} link {li} remote bus", _MAX_BUS)
            counters = " ".join(str(int(c)) for c in lk.counters)
            out.append(f"link {li} {int(lk.active)} {lk.remote_type} {bus} {lk.version} {counters}")
            out += [f"counter-error {li} {c} {code}" for c, code in sorted(lk.counter_errors.items())]
    out += [f"p2p {peer} {status}" for peer, status in sorted(g.p2p.items())]
    out += [f"fail {_function(fn)} {code}" for fn, code in g.fails.items()]
    return out


def write_profile(path: Path, profile: Profile) -> None:
    """Write `profile` to `path` atomically (a new file renamed over the old), so a library reading it
    sees the old or the new profile, never half of one, and notices the change by its new inode."""
    text = profile.render()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# --------------------------------------------------------------------------------------------------
# The named systems, by wiring

Wiring = Callable[[int, Sequence[str]], list[LinkSpec]]


def nvml_bus(sysfs_bus: str) -> str:
    """`0000:18:00.0` (sysfs) → `00000000:18:00.0` as NVML returns it (8-digit domain, upper case)."""
    domain, rest = sysfs_bus.split(":", 1)
    return f"{int(domain, 16):08X}:{rest.upper()}"


def direct_wiring(edges: dict[tuple[int, int], int]) -> Wiring:
    """Direct GPU-GPU links: `edges[(a, b)]` links between a and b, spread over the ports as boards do."""

    def wire(index: int, buses: Sequence[str]) -> list[LinkSpec]:
        peers: list[int] = []
        for (a, b), count in sorted(edges.items()):
            if index in (a, b):
                peers += [b if index == a else a] * count
        ports = peers[::2] + peers[1::2]
        return [LinkSpec(remote_type=DEVICE_TYPE_GPU, remote_bus=buses[p]) for p in ports]

    return wire


def switch_wiring(per_switch: Sequence[int]) -> Wiring:
    """Every link to an NVSwitch on the board: `per_switch[k]` links to the switch at bus 0x05+k."""
    buses = [f"00000000:{0x05 + k:02X}:00.0" for k in range(len(per_switch))]
    return lambda _i, _b: [LinkSpec(remote_bus=buses[k]) for k, n in enumerate(per_switch) for _ in range(n)]


def tray_wiring(links: int) -> Wiring:
    """GB200-style: the NVSwitches are in other trays; NVML cannot place the remote end."""
    return lambda _i, _b: [LinkSpec(remote_bus="FFFFFFFF:FF:FF.F") for _ in range(links)]


# DGX-1V hybrid cube mesh as NCCL's XML shows it (NVIDIA/nccl #671): six links per GPU.
DGX1V_EDGES = {
    (0, 1): 1, (0, 2): 1, (0, 3): 2, (0, 4): 2, (1, 2): 2, (1, 3): 1, (1, 5): 2, (2, 3): 2, (2, 6): 1,
    (3, 7): 1, (4, 5): 1, (4, 6): 1, (4, 7): 2, (5, 6): 2, (5, 7): 1, (6, 7): 2,
}  # fmt: skip
_HOPPER = (VERSION_H100, switch_wiring([4, 5, 5, 4]))  # 4 NVSwitches, 4/5/5/4 links (aliyun/SimAI #128)
_TRAY = (VERSION_B200, tray_wiring(18))
SYSTEM_WIRING: dict[str, tuple[int, Wiring | None]] = {
    "dgx-1v": (VERSION_V100, direct_wiring(DGX1V_EDGES)),
    "dgx-a100": (VERSION_A100, switch_wiring([2] * 6)),  # 6 NVSwitches, 2 links each (NVIDIA/nccl #1505)
    "dgx-h100": _HOPPER,
    "dgx-h100-sys-nics": _HOPPER,
    "hgx-h200": _HOPPER,
    "hgx-a100-4": (VERSION_A100, direct_wiring({(a, b): 4 for a in range(4) for b in range(a + 1, 4)})),
    "a100-pcie-bridged": (VERSION_A100, direct_wiring(dict.fromkeys([(0, 1), (2, 3), (4, 5), (6, 7)], 12))),
    "a100-pcie-bridged-nonadjacent": (VERSION_A100, direct_wiring(dict.fromkeys([(0, 5), (1, 2), (3, 4), (6, 7)], 12))),
    "l40s-4": (0, None),
    "rtx4090-8": (0, None),
    "gb200-tray": _TRAY,
    "gb200-tray-degraded": _TRAY,
    "gb300-tray": _TRAY,
    "gb300-tray-degraded": _TRAY,
}


def _fabric(topology: NodeTopology, index: int, board: bool) -> FabricSpec | None:
    gpu = topology.gpus[index]
    if topology.fabric is not None and gpu.fabric is not None:
        cluster, clique_id = topology.fabric.clique.rsplit(".", 1)
        return FabricSpec(
            state=FABRIC_STATES[gpu.fabric.state],
            status=gpu.fabric.status,
            cluster_uuid=uuid.UUID(cluster).bytes,
            clique_id=int(clique_id),
            health_mask=gpu.fabric.health_mask,
        )
    # HGX H100/H200 boards report COMPLETED with an all-zero cluster UUID: not a multi-node domain.
    return FabricSpec() if board else None


def profile_for_system(name: str, node: str | None = None) -> Profile:
    """The profile of `gputopo.systems.build_system(name, node)`, wired as the real box is, with NVLink
    peer-to-peer working between every NVLink-connected pair."""
    if name not in SYSTEM_WIRING:
        raise ValueError(f"no NVML wiring for system {name!r}; known: {', '.join(sorted(SYSTEM_WIRING))}")
    topology = build_system(name, node)
    version, wiring = SYSTEM_WIRING[name]
    buses = [nvml_bus(g.pci_bus_id) for g in topology.gpus]
    hopper_board = name.startswith(("dgx-h100", "hgx-h200"))
    modern = name.startswith(("dgx-a100", "dgx-h100", "hgx", "a100", "gb"))
    gpus = []
    for g in topology.gpus:
        links = wiring(g.index, buses) if wiring is not None else None
        for lk in links or []:
            lk.version = version
        gpus.append(
            GpuSpec(
                uuid=g.uuid,
                name=g.model,
                bus=buses[g.index],
                # NVML reports a little more than whole MiB on real boards; the agent floors.
                memory_bytes=g.memory_mib * MIB + 123_456,
                numa_mask=(1 << g.numa_node) if g.numa_node is not None else 0,
                links=links,
                mig=(0, 0) if modern else None,
                remapped=(0, 0, 0, 0) if modern else None,
                fabric=_fabric(topology, g.index, hopper_board),
                p2p={p: P2P_STATUS_OK for p in range(len(topology.gpus)) if topology.link_count(g.index, p) > 0},
            )
        )
    return Profile(gpus=gpus)
