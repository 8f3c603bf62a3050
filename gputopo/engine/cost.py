"""Communication cost model (reference/performance.md §4): estimated collective and transfer times.

Bandwidths are per GPU, per direction, in GB/s. The constants are the measured anchors quoted there;
latency terms are rough and marked as such. Used to explain placements and to compare policies in the
simulator, never to reject a node.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# NCCL reaches about 82% of NVLink line rate (≈370 of 450 GB/s on H100, nccl-tests#212).
NVLINK_EFFICIENCY = 0.82
# Without NVLink: ~25 GB/s through PCIe Gen4 under one CPU, ~20 GB/s across sockets (nccl-tests#178).
PCIE_SAME_NUMA_GBPS = 25.0
PCIE_CROSS_NUMA_GBPS = 20.0
# A NIC delivers about 94% of its line rate in NCCL (NDR 400 Gb/s → 47 GB/s, nccl-tests#290).
NIC_EFFICIENCY = 0.94
# Per ring step latency, seconds (unverified; calibrate with nccl-tests on real hardware).
NVLINK_STEP_LATENCY_S = 3e-6
PCIE_STEP_LATENCY_S = 8e-6
NETWORK_HOP_LATENCY_S = 1.5e-6
# Share of a NIC's bandwidth left when traffic climbs the fabric (oversubscribed uplinks; assumption).
TIER_BANDWIDTH_SHARE = {0: 1.0, 1: 1.0, 2: 0.75, 3: 0.5}
# Reference for the bandwidth score: NVLink 4, NV18 (H100/H200 through NVSwitch).
REFERENCE_BUSBW_GBPS = 18 * 25.0 * NVLINK_EFFICIENCY


@dataclass(frozen=True)
class SetBandwidth:
    gbps: float
    via: str  # "nvswitch" | "nvlink" | "pcie" | "local"
    min_links: int


def intra_node_bandwidth(
    links: tuple[tuple[int, ...], ...],
    nvswitch: bool,
    gbps_per_link: float,
    numa: tuple[int | None, ...],
    gpus: Sequence[int],
) -> SetBandwidth:
    """Bottleneck per-GPU bandwidth of a ring over `gpus` inside one node."""
    g = list(gpus)
    if len(g) < 2:
        return SetBandwidth(float("inf"), "local", 0)
    pair_links = [links[a][b] for i, a in enumerate(g) for b in g[i + 1 :]]
    min_links = min(pair_links)
    if min_links == 0:
        same_numa = len({numa[i] for i in g}) == 1 and numa[g[0]] is not None
        return SetBandwidth(PCIE_SAME_NUMA_GBPS if same_numa else PCIE_CROSS_NUMA_GBPS, "pcie", 0)
    per_link = gbps_per_link or 25.0
    if nvswitch:
        # links[i][j] already is min(switch links of i, of j): every GPU drives that many links at once.
        return SetBandwidth(min_links * per_link * NVLINK_EFFICIENCY, "nvswitch", min_links)
    # Direct links: NCCL builds several rings; each GPU's bandwidth is bounded by its links inside the set.
    degree = min(sum(links[a][b] for b in g if b != a) for a in g)
    return SetBandwidth(degree * per_link * NVLINK_EFFICIENCY, "nvlink", min_links)


def allreduce_seconds(message_bytes: float, ranks: int, busbw_gbps: float, step_latency_s: float) -> float:
    """Ring allreduce: 2(n-1)/n · S/B plus 2(n-1) latency steps."""
    if ranks < 2:
        return 0.0
    return 2 * (ranks - 1) / ranks * message_bytes / (busbw_gbps * 1e9) + 2 * (ranks - 1) * step_latency_s


def tp_allreduce_seconds(message_bytes: float, ranks: int, bw: SetBandwidth) -> float:
    latency = PCIE_STEP_LATENCY_S if bw.via == "pcie" else NVLINK_STEP_LATENCY_S
    return allreduce_seconds(message_bytes, ranks, bw.gbps, latency)


def nic_gbps(rate_gbit: float) -> float:
    return rate_gbit / 8 * NIC_EFFICIENCY


def tiers_crossed(a: Mapping[str, str | None], b: Mapping[str, str | None], network_tiers: Sequence[str]) -> int:
    """0 same node's switch path; 1 same leaf; 2 same spine; 3 beyond (network_tiers widest first)."""
    narrow_first = list(reversed(network_tiers))
    for depth, tier in enumerate(narrow_first, start=1):
        if a.get(tier) is not None and a.get(tier) == b.get(tier):
            return depth
    return len(narrow_first) + 1


def pp_transfer_seconds(message_bytes: float, nic_rate_gbit: float, crossed: int) -> float:
    """One activation transfer between pipeline stages on different nodes."""
    if nic_rate_gbit <= 0:
        return float("inf")
    share = TIER_BANDWIDTH_SHARE.get(crossed, 0.5)
    hops = 2 * crossed - 1 if crossed > 0 else 0
    return message_bytes / (nic_gbps(nic_rate_gbit) * share * 1e9) + hops * NETWORK_HOP_LATENCY_S
