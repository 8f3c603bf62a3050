"""The named real systems, built from public facts (nvidia-smi and NCCL captures, vendor guides).

Each builder returns a `NodeTopology` exactly as the agent would publish it for a healthy node of that
kind. Details that no public capture provides (marked synthetic there) are chosen plainly and noted.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence

from gputopo.model import (
    FabricInfo,
    GpuInfo,
    LinkLayer,
    NicInfo,
    NodeTopology,
    NvlinkInfo,
    PcieDistance,
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


def gb200_tray(node: str = "gb200-tray", clique: str = GB200_CLIQUE) -> NodeTopology:
    """One GB200 NVL72 compute tray: 4x B200 186GB, NV18 every pair through the rack's NVSwitches, a
    multi-node NVLink clique, 4x NDR InfiniBand (per-GPU PCIe distances unpublished: NODE/SYS by socket)."""
    numa = [0, 0, 1, 1]
    buses = ["0008:01:00.0", "0009:01:00.0", "0018:01:00.0", "0019:01:00.0"]
    nic_spec = [
        ("mlx5_0", "0000:03:00.0", 0),
        ("mlx5_1", "0002:03:00.0", 0),
        ("mlx5_4", "0010:03:00.0", 1),
        ("mlx5_5", "0012:03:00.0", 1),
    ]
    nics = [
        _nic(name, LinkLayer.INFINIBAND, 400, nn, bus, [N if numa[g] == nn else S for g in range(4)])
        for name, bus, nn in nic_spec
    ]
    return NodeTopology(
        gpus=_gpus("gb200-tray", node, "NVIDIA GB200", GB200_MIB, buses, numa),
        nvlink=NvlinkInfo(generation=5, gbps_per_link=NVLINK_GBPS_PER_LINK[5], nvswitch=True, links=_uniform(4, 18)),
        fabric=FabricInfo(clique=clique),
        nics=tuple(nics),
    )


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
}

# Test variants: not among the named systems above but accepted by name.
VARIANTS: dict[str, Callable[[str], NodeTopology]] = {
    "dgx-h100-sys-nics": dgx_h100_sys_nics,
    "a100-pcie-bridged-nonadjacent": a100_pcie_bridged_nonadjacent,
}


class UnknownSystemError(KeyError):
    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(name)

    def __str__(self) -> str:
        return f"unknown system {self.name!r}; known: {', '.join(sorted(SYSTEMS))}"


def build_system(name: str, node: str | None = None) -> NodeTopology:
    """The named system's topology; GPU UUIDs are derived from (system, node) so nodes differ."""
    builder = SYSTEMS.get(name) or VARIANTS.get(name)
    if builder is None:
        raise UnknownSystemError(name)
    return builder(node or name)
