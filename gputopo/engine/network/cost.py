"""Communication cost model: estimated collective and transfer times (docs/cost-model.md).

An α–β model: time = latency + bytes / bandwidth. Bandwidths are per GPU, per direction, in GB/s,
anchored on published nccl-tests bus bandwidths (docs/cost-model.md has the calibration table and
its sources); latency terms are rough and marked as such. Used to explain placements and to compare
policies in the simulator, never to reject a node.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# Re-exported: the message size of a pod that names no gputopo.io/message-size.
from gputopo.model import DEFAULT_MESSAGE_BYTES as DEFAULT_MESSAGE_BYTES
from gputopo.tiers import DEFAULT_TIERS

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
# Per ring step over the network: a NIC's own send/receive latency (NCCL over InfiniBand; rough).
NIC_STEP_LATENCY_S = 5e-6
# All-reduce bus bandwidth inside one multi-node NVLink domain (a GB200 NVL72 rack): nccl-tests over the
# rack's 72 GPUs reach 835-847 GB/s at 4-8 GiB and 745 GB/s on average over 0.5-8 GiB (public captures);
# the average is taken, as gputopo's default message is 1 GiB. A tier's `busbwGbps` overrides it.
NVLINK_DOMAIN_BUSBW_GBPS = 745.0
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


def domain_allreduce_seconds(message_bytes: float, ranks: int, busbw_gbps: float = NVLINK_DOMAIN_BUSBW_GBPS) -> float:
    """A ring all-reduce over `ranks` GPUs of one NVLink domain (or, given the trays' NIC bandwidth,
    over a TP group that straddles two domains: NCCL then crosses at the trays' NICs)."""
    return allreduce_seconds(message_bytes, ranks, busbw_gbps, NVLINK_STEP_LATENCY_S)


def nic_gbps(rate_gbit: float) -> float:
    return rate_gbit / 8 * NIC_EFFICIENCY


def tiers_crossed(a: Mapping[str, str | None], b: Mapping[str, str | None], network_tiers: Sequence[str]) -> int:
    """0 same node's switch path; 1 same leaf; 2 same spine; 3 beyond (network_tiers widest first)."""
    narrow_first = list(reversed(network_tiers))
    for depth, tier in enumerate(narrow_first, start=1):
        if a.get(tier) is not None and a.get(tier) == b.get(tier):
            return depth
    return len(narrow_first) + 1


def tier_share(crossed: int, narrow_first_oversubscription: Sequence[float]) -> float:
    """Share of a NIC's rate left to a flow that climbs to tier `crossed` (tiers_crossed's numbering).

    Traffic between two nodes under one leaf never uses an uplink. Past that, it climbs through the
    uplinks of every tier below the one the nodes share; each tier's oversubscription (downlink to
    uplink capacity, >= 1) divides what is left when every node sends at once, the case a collective
    is. Tiers past the configured ones count as 1:1."""
    share = 1.0
    for ratio in list(narrow_first_oversubscription)[: max(0, crossed - 1)]:
        share /= ratio
    return share


# Oversubscription of the default tiers (gputopo.tiers), narrowest first: leaf uplinks non-blocking,
# spine uplinks 2:1 (an assumption; set each tier's `oversubscription` in GPUTOPO_TIERS to your fabric's).
DEFAULT_OVERSUBSCRIPTION = DEFAULT_TIERS.narrow_first_oversubscription()


def pp_transfer_seconds(
    message_bytes: float,
    nic_rate_gbit: float,
    crossed: int,
    narrow_first_oversubscription: Sequence[float] = DEFAULT_OVERSUBSCRIPTION,
) -> float:
    """One activation transfer between pipeline stages on different nodes."""
    if nic_rate_gbit <= 0:
        return float("inf")
    share = tier_share(crossed, narrow_first_oversubscription)
    hops = 2 * crossed - 1 if crossed > 0 else 0
    return message_bytes / (nic_gbps(nic_rate_gbit) * share * 1e9) + hops * NETWORK_HOP_LATENCY_S


def network_allreduce_seconds(
    message_bytes: float, members: int, node_gbps: float, crossed: int, share: float
) -> float:
    """Ring all-reduce across `members` nodes, each sending at `node_gbps` (its rail NICs together),
    cut to `share` by the oversubscribed tiers the ring climbs; each step pays the NIC latency and the
    switch hops up to tier `crossed` and back."""
    if members < 2:
        return 0.0
    hops = 2 * crossed - 1 if crossed > 0 else 0
    return allreduce_seconds(
        message_bytes, members, node_gbps * share, NIC_STEP_LATENCY_S + hops * NETWORK_HOP_LATENCY_S
    )


@dataclass(frozen=True)
class Estimate:
    """The predicted time of one collective: what it moves, over how many ranks, at what bus bandwidth."""

    seconds: float
    message_bytes: int
    ranks: int
    busbw_gbps: float
    via: str  # SetBandwidth.via: "nvswitch" | "nvlink" | "pcie" | "local"


def tp_estimate(message_bytes: int, bw: SetBandwidth, ranks: int) -> Estimate:
    """The pod's tensor-parallel all-reduce over its own GPUs (0 s for one GPU)."""
    return Estimate(tp_allreduce_seconds(message_bytes, ranks, bw), message_bytes, ranks, bw.gbps, bw.via)


def format_bytes(n: float) -> str:
    """1073741824 -> '1 GiB', 1.5 GiB -> '1.5 GiB', 1000 -> '1000 B'."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def format_ms(seconds: float) -> str:
    """Milliseconds to a useful precision: '3.1 ms', '245 ms', '0.042 ms'."""
    ms = seconds * 1e3
    if ms >= 100:
        return f"{ms:.0f} ms"
    if ms >= 1:
        return f"{ms:.1f} ms"
    return f"{ms:.2g} ms"
