"""The named real systems, built from public facts (nvidia-smi and NCCL captures, vendor guides).

Each builder returns a `NodeTopology` exactly as the agent would publish it for a healthy node of that
kind. Details that no public capture provides (marked synthetic there) are chosen plainly and noted.
Named racks (RACKS) are trays of one NVLink domain: a tray built for a node named `<rack>-tray-NN`
takes that rack's clique, so the agent's fixture backend and the cluster files agree on racks.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from functools import partial

from gputopo.model import (
    HEALTHY_MASK,
    FabricInfo,
    FabricState,
    GpuFabric,
    GpuInfo,
    Health,
    LinkLayer,
    NicInfo,
    NodeTopology,
    NvlinkInfo,
    PcieDistance,
    decode_health,
    degraded_reason,
)

_UUID_NS = uuid.UUID("6c1d0e3c-8a55-4b0e-9d55-6770757470f0")

# Per-link, per-direction NVLink rate in GB/s by generation: the per-GPU bidirectional figure NVIDIA
# publishes, halved and divided by the GPU's link count.
# 1: P100, 4 links, 160 GB/s per GPU → 20.      2: V100, 6 links, 300 GB/s → 25.
# 3: A100, 12 links, 600 GB/s → 25.             4: H100/H200, 18 links, 900 GB/s → 25.
# 5: B200/GB200, 18 links, 1.8 TB/s → 50 (`nvidia-smi nvlink -s` on GB200 shows 53.125 GB/s raw).
# 6: Rubin, 3.6 TB/s per GPU (NVIDIA's NVLink page) over 36 links (third-party tables; NVIDIA has not
#    published a link count) → 50. Unverified on hardware: no Rubin capture is public yet.
NVLINK_GBPS_PER_LINK = {1: 20.0, 2: 25.0, 3: 25.0, 4: 25.0, 5: 50.0, 6: 50.0}

# GPU memory as NVML reports it (nvmlDeviceGetMemoryInfo total, nvidia-smi's MiB column), never the
# marketing size: a pod asking for 32Gi does not fit a "32GB" V100, so the fixtures must not let it.
# Sources are public nvidia-smi captures.
V100_SXM2_32GB_MIB = 32510  # Tesla V100-SXM2-32GB: "0MiB / 32510MiB" in many public captures
A100_80GB_MIB = 81920  # A100-SXM4-80GB (NVIDIA/nccl-tests #228) and A100 80GB PCIe alike
H100_80GB_HBM3_MIB = 81559  # NVIDIA H100 80GB HBM3 (modal-labs/modal-client #2797)
H200_MIB = 143771  # NVIDIA H200 141GB: "0MiB / 143771MiB" (public HGX H200 captures)
L40S_MIB = 46068  # NVIDIA L40S (modal-labs/modal-client #2797)
RTX4090_MIB = 24564  # NVIDIA GeForce RTX 4090 (RLinf/RLinf #255)
GB200_MIB = 189471  # NVIDIA GB200 "186GB": "0MiB / 189471MiB" (public GB200 NVL72 tray captures)
# NVIDIA GB300 (B300, 288 GB HBM3e): synthetic, no public nvidia-smi capture gives the figure. 288 GiB
# less the 7137 MiB GB200 keeps back from its 192 GiB.
GB300_MIB = 288 * 1024 - (192 * 1024 - GB200_MIB)

P, X, B, N, S = PcieDistance.PIX, PcieDistance.PXB, PcieDistance.PHB, PcieDistance.NODE, PcieDistance.SYS


def _uuid(system: str, node: str, index: int) -> str:
    return "GPU-" + str(uuid.uuid5(_UUID_NS, f"{system}/{node}/{index}"))


def _gpus(
    system: str,
    node: str,
    model: str,
    memory_mib: int,
    bus_ids: Sequence[str],
    numa: Sequence[int | None],
) -> tuple[GpuInfo, ...]:
    return tuple(
        GpuInfo(
            index=i,
            uuid=_uuid(system, node, i),
            model=model,
            memory_mib=memory_mib,
            pci_bus_id=bus,
            numa_node=numa[i],
        )
        for i, bus in enumerate(bus_ids)
    )


def _uniform(n: int, count: int) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(0 if i == j else count for j in range(n)) for i in range(n))


def _pairs(n: int, pairs: Sequence[tuple[int, int]], count: int) -> tuple[tuple[int, ...], ...]:
    m = [[0] * n for _ in range(n)]
    for a, b in pairs:
        m[a][b] = m[b][a] = count
    return tuple(tuple(r) for r in m)


def _nic(
    name: str,
    layer: LinkLayer,
    rate: float,
    numa: int | None,
    bus: str,
    affinity: Sequence[PcieDistance],
    state: str = "ACTIVE",
) -> NicInfo:
    return NicInfo(
        name=name,
        link_layer=layer,
        state=state,
        rate_gbps=rate,
        numa_node=numa,
        pci_bus_id=bus,
        gpu_affinity=tuple(affinity),
    )


def _rail_affinity(
    gpu: int, numa: Sequence[int | None], near: PcieDistance, group: Sequence[int]
) -> list[PcieDistance]:
    """A NIC that sits `near` the GPUs in `group`: NODE to the rest of its socket, SYS across sockets."""
    return [near if g in group else (N if numa[g] == numa[gpu] else S) for g in range(len(numa))]


def dgx_1v(node: str = "dgx-1v") -> NodeTopology:
    """DGX-1 with 8x V100 32GB: hybrid cube mesh of direct NVLink 2 (NV1/NV2), 4x EDR InfiniBand."""
    numa = [0, 0, 0, 0, 1, 1, 1, 1]
    links = (
        (0, 1, 1, 2, 2, 0, 0, 0),
        (1, 0, 2, 1, 0, 2, 0, 0),
        (1, 2, 0, 2, 0, 0, 1, 0),
        (2, 1, 2, 0, 0, 0, 0, 1),
        (2, 0, 0, 0, 0, 1, 1, 2),
        (0, 2, 0, 0, 1, 0, 2, 1),
        (0, 0, 1, 0, 1, 2, 0, 2),
        (0, 0, 0, 1, 2, 1, 2, 0),
    )
    buses = ["06", "07", "0a", "0b", "85", "86", "89", "8a"]
    # mlx5_0 is PIX to GPU2/3 as in the public capture; the other three extend the pattern per pair.
    nic_pairs = [("mlx5_0", (2, 3), "08"), ("mlx5_1", (0, 1), "05"), ("mlx5_2", (6, 7), "8b"), ("mlx5_3", (4, 5), "84")]
    return NodeTopology(
        gpus=_gpus("dgx-1v", node, "Tesla V100-SXM2-32GB", V100_SXM2_32GB_MIB, [f"0000:{b}:00.0" for b in buses], numa),
        nvlink=NvlinkInfo(generation=2, gbps_per_link=NVLINK_GBPS_PER_LINK[2], nvswitch=False, links=links),
        nics=tuple(
            _nic(
                name,
                LinkLayer.INFINIBAND,
                100,
                numa[pair[0]],
                f"0000:{bus}:00.0",
                _rail_affinity(pair[0], numa, P, pair),
            )
            for name, pair, bus in nic_pairs
        ),
    )


def dgx_a100(node: str = "dgx-a100") -> NodeTopology:
    """DGX A100: 8x A100 80GB on 6 NVSwitches (NV12 every pair), AMD NPS4, 8x HDR InfiniBand."""
    numa = [3, 3, 1, 1, 7, 7, 5, 5]
    buses = ["07", "0f", "47", "4e", "87", "90", "b7", "bd"]
    nic_buses = ["0c", "12", "4b", "54", "8d", "94", "ba", "cc"]
    nics = []
    for k in range(8):
        pair = (k - k % 2, k - k % 2 + 1)  # two NICs share a PCIe switch with each GPU pair
        aff = [X if g in pair else S for g in range(8)]
        nics.append(_nic(f"mlx5_{k}", LinkLayer.INFINIBAND, 200, numa[pair[0]], f"0000:{nic_buses[k]}:00.0", aff))
    return NodeTopology(
        gpus=_gpus("dgx-a100", node, "NVIDIA A100-SXM4-80GB", A100_80GB_MIB, [f"0000:{b}:00.0" for b in buses], numa),
        nvlink=NvlinkInfo(generation=3, gbps_per_link=NVLINK_GBPS_PER_LINK[3], nvswitch=True, links=_uniform(8, 12)),
        nics=tuple(nics),
    )


def _hopper_8(system: str, node: str, model: str, memory_mib: int, same_socket: PcieDistance) -> NodeTopology:
    numa = [0, 0, 0, 0, 1, 1, 1, 1]
    gpu_buses = ["1b", "43", "52", "61", "9d", "c3", "d1", "df"]
    nic_names = ["mlx5_0", "mlx5_3", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_9", "mlx5_10", "mlx5_11"]
    nic_buses = ["18", "40", "4f", "5e", "9a", "c0", "ce", "dc"]
    nics = []
    for g in range(8):
        aff = [P if h == g else (same_socket if numa[h] == numa[g] else S) for h in range(8)]
        nics.append(_nic(nic_names[g], LinkLayer.INFINIBAND, 400, numa[g], f"0000:{nic_buses[g]}:00.0", aff))
    return NodeTopology(
        gpus=_gpus(system, node, model, memory_mib, [f"0000:{b}:00.0" for b in gpu_buses], numa),
        nvlink=NvlinkInfo(generation=4, gbps_per_link=NVLINK_GBPS_PER_LINK[4], nvswitch=True, links=_uniform(8, 18)),
        nics=tuple(nics),
    )


def dgx_h100(node: str = "dgx-h100") -> NodeTopology:
    """DGX H100: 8x H100 80GB on 4 NVSwitches (NV18 every pair), 8x NDR InfiniBand, one PIX per GPU."""
    return _hopper_8("dgx-h100", node, "NVIDIA H100 80GB HBM3", H100_80GB_HBM3_MIB, N)


def dgx_h100_sys_nics(node: str = "dgx-h100-sys-nics") -> NodeTopology:
    """HGX H100 variant (NVIDIA/nccl #1264) whose same-socket NICs report SYS instead of NODE."""
    return _hopper_8("dgx-h100", node, "NVIDIA H100 80GB HBM3", H100_80GB_HBM3_MIB, S)


def hgx_h200(node: str = "hgx-h200") -> NodeTopology:
    """HGX H200: 8x H200 141GB on NVSwitch (NV18 every pair), 8x NDR InfiniBand, DGX H100 layout."""
    return _hopper_8("hgx-h200", node, "NVIDIA H200", H200_MIB, N)


def hgx_a100_4(node: str = "hgx-a100-4") -> NodeTopology:
    """HGX A100 4-GPU: direct NVLink 3, NV4 every pair, no NVSwitch, 4x HDR InfiniBand."""
    numa = [0, 0, 0, 0]
    buses = ["01", "41", "81", "c1"]
    nics = [
        _nic(
            f"mlx5_{g}",
            LinkLayer.INFINIBAND,
            200,
            0,
            f"0000:{int(buses[g], 16) + 2:02x}:00.0",
            [X if h == g else N for h in range(4)],
        )
        for g in range(4)
    ]
    return NodeTopology(
        gpus=_gpus("hgx-a100-4", node, "NVIDIA A100-SXM4-80GB", A100_80GB_MIB, [f"0000:{b}:00.0" for b in buses], numa),
        nvlink=NvlinkInfo(generation=3, gbps_per_link=NVLINK_GBPS_PER_LINK[3], nvswitch=False, links=_uniform(4, 4)),
        nics=tuple(nics),
    )


def a100_pcie_bridged(
    node: str = "a100-pcie-bridged", pairs: Sequence[tuple[int, int]] = ((0, 1), (2, 3), (4, 5), (6, 7))
) -> NodeTopology:
    """8x A100 80GB PCIe with NVLink bridges (NV12) on pairs; PCIe otherwise. NUMA and NICs synthetic."""
    numa = [0, 0, 0, 0, 1, 1, 1, 1]
    buses = ["17", "31", "4b", "65", "98", "b1", "ca", "e3"]
    nics = [
        _nic("mlx5_0", LinkLayer.ETHERNET, 100, 0, "0000:18:00.0", [X, X, N, N, S, S, S, S]),
        _nic("mlx5_1", LinkLayer.ETHERNET, 100, 1, "0000:99:00.0", [S, S, S, S, X, X, N, N]),
    ]
    return NodeTopology(
        gpus=_gpus(
            "a100-pcie-bridged", node, "NVIDIA A100 80GB PCIe", A100_80GB_MIB, [f"0000:{b}:00.0" for b in buses], numa
        ),
        nvlink=NvlinkInfo(
            generation=3, gbps_per_link=NVLINK_GBPS_PER_LINK[3], nvswitch=False, links=_pairs(8, pairs, 12)
        ),
        nics=tuple(nics),
    )


def a100_pcie_bridged_nonadjacent(node: str = "a100-pcie-bridged-nonadjacent") -> NodeTopology:
    """Bridge pairs that are not adjacent indices (0-5, 1-2, 3-4, 6-7), as on a public 8x H100 PCIe box."""
    return a100_pcie_bridged(node, pairs=((0, 5), (1, 2), (3, 4), (6, 7)))


def l40s_4(node: str = "l40s-4") -> NodeTopology:
    """4x L40S 48GB, PCIe only; both NICs on NUMA 1 (2x 100G RoCE is synthetic)."""
    numa = [0, 0, 1, 1]
    buses = ["01", "21", "81", "a1"]
    nics = [
        _nic("mlx5_0", LinkLayer.ETHERNET, 100, 1, "0000:c1:00.0", [S, S, N, N]),
        _nic("mlx5_1", LinkLayer.ETHERNET, 100, 1, "0000:c1:00.1", [S, S, N, N]),
    ]
    return NodeTopology(
        gpus=_gpus("l40s-4", node, "NVIDIA L40S", L40S_MIB, [f"0000:{b}:00.0" for b in buses], numa),
        nvlink=NvlinkInfo(generation=0, gbps_per_link=0, nvswitch=False, links=_uniform(4, 0)),
        nics=tuple(nics),
    )


def rtx4090_8(node: str = "rtx4090-8") -> NodeTopology:
    """8x RTX 4090 24GB, PCIe only, no P2P, no NICs (synthetic layout)."""
    numa = [0, 0, 0, 0, 1, 1, 1, 1]
    buses = ["1a", "1b", "3d", "3e", "9c", "9d", "bc", "bd"]
    return NodeTopology(
        gpus=_gpus("rtx4090-8", node, "NVIDIA GeForce RTX 4090", RTX4090_MIB, [f"0000:{b}:00.0" for b in buses], numa),
        nvlink=NvlinkInfo(generation=0, gbps_per_link=0, nvswitch=False, links=_uniform(8, 0)),
    )


GB200_CLIQUE = "9c6f5af3-53bf-49b5-a436-b66766c413c3.4026"
# The cliqueId every named rack's GPUs report; the public GB200 capture's (one partition per rack).
RACK_CLIQUE_ID = 4026
TRAYS_PER_RACK = 18  # GB200/GB300 NVL72: 18 compute trays of 4 GPUs in one NVLink domain
_TRAY_NODE = re.compile(r"^(?P<rack>.+)-tray-(?P<tray>[0-9]{2})$")
# nvml.h healthMask with every field FALSE except DEGRADED_BW = TRUE (bits 0-1 = 1): 0b10101001.
DEGRADED_BW_MASK = 0xA9
_DEGRADED_GPU = 2  # the GPU whose fabric reports degraded bandwidth on a degraded tray


def rack_clique(rack: str) -> str:
    """The NVLink domain (GFD's `<clusterUUID>.<cliqueId>`) of the rack named `rack`: one per name."""
    return f"{uuid.uuid5(_UUID_NS, f'rack/{rack}')}.{RACK_CLIQUE_ID}"


def _tray_clique(node: str, default: str) -> str:
    """A node named `<rack>-tray-NN` is a tray of that rack; any other tray is in the system's default domain."""
    m = _TRAY_NODE.match(node)
    return rack_clique(m["rack"]) if m else default


def _fabric_gpus(gpus: Sequence[GpuInfo], degraded: Collection[int]) -> tuple[GpuInfo, ...]:
    """Each GPU's fabric as the agent publishes it: registered, healthy unless its index is `degraded`
    (degraded bandwidth, so the agent also marks the GPU degraded with the decoded reason)."""
    out = []
    for g in gpus:
        mask = DEGRADED_BW_MASK if g.index in degraded else HEALTHY_MASK
        fabric = GpuFabric(state=FabricState.COMPLETED, status=0, health_mask=mask)
        update: dict[str, object] = {"fabric": fabric}
        if g.index in degraded:
            update |= {"health": Health.DEGRADED, "reasons": (degraded_reason(decode_health(fabric)[1]),)}
        out.append(g.model_copy(update=update))
    return tuple(out)


def _grace_tray(
    system: str, node: str, model: str, memory_mib: int, nic_gbps: float, clique: str, degraded: Collection[int]
) -> NodeTopology:
    """A Grace Blackwell NVL72 compute tray: 4 GPUs on two Grace sockets, NV18 every pair through the
    rack's NVSwitches, a multi-node NVLink clique, 4 InfiniBand NICs (per-GPU PCIe distances unpublished:
    NODE/SYS by socket)."""
    numa = [0, 0, 1, 1]
    buses = ["0008:01:00.0", "0009:01:00.0", "0018:01:00.0", "0019:01:00.0"]
    nic_spec = [
        ("mlx5_0", "0000:03:00.0", 0),
        ("mlx5_1", "0002:03:00.0", 0),
        ("mlx5_4", "0010:03:00.0", 1),
        ("mlx5_5", "0012:03:00.0", 1),
    ]
    nics = [
        _nic(name, LinkLayer.INFINIBAND, nic_gbps, nn, bus, [N if numa[g] == nn else S for g in range(4)])
        for name, bus, nn in nic_spec
    ]
    return NodeTopology(
        gpus=_fabric_gpus(_gpus(system, node, model, memory_mib, buses, numa), degraded),
        nvlink=NvlinkInfo(generation=5, gbps_per_link=NVLINK_GBPS_PER_LINK[5], nvswitch=True, links=_uniform(4, 18)),
        fabric=FabricInfo(clique=clique),
        nics=tuple(nics),
    )


def gb200_tray(node: str = "gb200-tray", clique: str | None = None, degraded: Collection[int] = ()) -> NodeTopology:
    """One GB200 NVL72 compute tray: 4x B200 186GB, 4x NDR InfiniBand. Its clique is its rack's when the
    node is named `<rack>-tray-NN`, else GB200_CLIQUE; `degraded` GPUs report degraded fabric bandwidth."""
    clique = clique or _tray_clique(node, GB200_CLIQUE)
    return _grace_tray("gb200-tray", node, "NVIDIA GB200", GB200_MIB, 400, clique, degraded)


# Synthetic: the domain of GB300 trays whose node names name no rack.
GB300_CLIQUE = f"{uuid.uuid5(_UUID_NS, 'gb300-tray')}.{RACK_CLIQUE_ID}"


def gb300_tray(node: str = "gb300-tray", clique: str | None = None, degraded: Collection[int] = ()) -> NodeTopology:
    """One GB300 NVL72 compute tray: 4x B300 288GB HBM3e, NVLink 5 as on GB200, 4x 800G ConnectX-8
    InfiniBand (one per GPU; bus addresses synthetic, as GB200's). Clique and `degraded` as gb200_tray."""
    clique = clique or _tray_clique(node, GB300_CLIQUE)
    return _grace_tray("gb300-tray", node, "NVIDIA GB300", GB300_MIB, 800, clique, degraded)


SYSTEMS: dict[str, Callable[[str], NodeTopology]] = {
    "dgx-1v": dgx_1v,
    "dgx-a100": dgx_a100,
    "dgx-h100": dgx_h100,
    "hgx-h200": hgx_h200,
    "hgx-a100-4": hgx_a100_4,
    "a100-pcie-bridged": a100_pcie_bridged,
    "l40s-4": l40s_4,
    "rtx4090-8": rtx4090_8,
    "gb200-tray": gb200_tray,
    "gb300-tray": gb300_tray,
}

# Test variants: not among the named systems above but accepted by name.
VARIANTS: dict[str, Callable[[str], NodeTopology]] = {
    "dgx-h100-sys-nics": dgx_h100_sys_nics,
    "a100-pcie-bridged-nonadjacent": a100_pcie_bridged_nonadjacent,
    # GPU 2's fabric reports degraded bandwidth (healthMask 0xa9): a tray NVLink placement avoids.
    "gb200-tray-degraded": partial(gb200_tray, degraded=(_DEGRADED_GPU,)),
    "gb300-tray-degraded": partial(gb300_tray, degraded=(_DEGRADED_GPU,)),
}


@dataclass(frozen=True)
class RackSystem:
    """A named rack: `trays` compute trays of the named system `tray`, all in one NVLink domain."""

    tray: str  # VARIANTS holds `<tray>-degraded`, whose GPU 2 reports degraded fabric bandwidth
    trays: int = TRAYS_PER_RACK


RACKS: dict[str, RackSystem] = {
    "gb200-nvl72": RackSystem("gb200-tray"),
    "gb300-nvl72": RackSystem("gb300-tray"),
}


class UnknownSystemError(KeyError):
    def __init__(self, name: str, known: Collection[str] | None = None) -> None:
        self.name = name
        self.known = sorted(SYSTEMS if known is None else known)
        super().__init__(name)

    def __str__(self) -> str:
        return f"unknown system {self.name!r}; known: {', '.join(self.known)}"


def build_system(name: str, node: str | None = None) -> NodeTopology:
    """The named system's topology; GPU UUIDs are derived from (system, node) so nodes differ."""
    builder = SYSTEMS.get(name) or VARIANTS.get(name)
    if builder is None:
        raise UnknownSystemError(name)
    return builder(node or name)


def tray_count(name: str, trays: int | None = None) -> int:
    """How many trays rack system `name` offers: `trays` (1 to the full rack) or, by default, the full rack."""
    system = RACKS.get(name)
    if system is None:
        raise UnknownSystemError(name, RACKS)
    count = system.trays if trays is None else trays
    if not 1 <= count <= system.trays:
        raise ValueError(f"a {name} rack holds 1 to {system.trays} trays, not {count}")
    return count


def check_tray_numbers(count: int, numbers: Iterable[int], what: str) -> None:
    """ValueError naming `what` trays unless every tray number is among 1..`count`."""
    outside = sorted(set(numbers) - set(range(1, count + 1)))
    if outside:
        raise ValueError(f"{what} trays {outside} are not among the rack's trays 1-{count}")


def rack_trays(name: str, rack: str, trays: int | None = None, degraded: Collection[int] = ()) -> list[tuple[str, str]]:
    """(node name `<rack>-tray-NN`, tray system name) of each tray of rack `rack`, a named rack `name`:
    trays 1..`trays` (default all), those in `degraded` (tray numbers) as the degraded variant."""
    count = tray_count(name, trays)
    check_tray_numbers(count, degraded, "degraded")
    tray = RACKS[name].tray
    return [(f"{rack}-tray-{t:02d}", f"{tray}-degraded" if t in degraded else tray) for t in range(1, count + 1)]


def build_rack(
    name: str, rack: str, trays: int | None = None, degraded: Collection[int] = ()
) -> list[tuple[str, NodeTopology]]:
    """Each tray of rack `rack` (see rack_trays) with its topology: one NVLink domain per rack name."""
    return [(node, build_system(tray, node)) for node, tray in rack_trays(name, rack, trays, degraded)]
