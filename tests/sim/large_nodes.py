"""Node topologies beyond the named systems, for the exhaustive search's tests and bench/exhaustive_cost.py:
PCIe nodes of any size (optionally with NVLink-bridged pairs) and NVSwitch nodes of up to 64 GPUs."""

from __future__ import annotations

from collections.abc import Sequence

from gputopo.model import DegradedLink, GpuInfo, Health, LinkState, NodeTopology, NvlinkInfo


def topology(
    links: Sequence[Sequence[int]],
    numa: Sequence[int],
    *,
    failed: int = 0,
    degraded: int = 0,
    small: int = 0,
    nvswitch: bool = False,
) -> NodeTopology:
    """GPU i on NUMA node numa[i], links[i][j] NVLink links to GPU j; the bits of `failed`, `degraded`
    and `small` mark failed GPUs, GPUs with a degraded link, and 40 GB GPUs (80 GB otherwise)."""
    n = len(numa)
    gpus = tuple(
        GpuInfo(
            index=i,
            uuid=f"GPU-{i}",
            model="test",
            memory_mib=40000 if small >> i & 1 else 80000,
            numa_node=numa[i],
            health=Health.FAILED if failed >> i & 1 else Health.OK,
        )
        for i in range(n)
    )
    nvlink = NvlinkInfo(generation=4, gbps_per_link=25.0, nvswitch=nvswitch, links=tuple(tuple(r) for r in links))
    bad = tuple(DegradedLink(gpu=i, link=0, state=LinkState.DEGRADED) for i in range(n) if degraded >> i & 1)
    return NodeTopology(gpus=gpus, nvlink=nvlink, degraded_links=bad)


def pcie(n: int, numa_nodes: int = 1, pairs: Sequence[tuple[int, int]] = ()) -> NodeTopology:
    """n PCIe GPUs split evenly over `numa_nodes`, NVLink bridges (NV12) on `pairs`."""
    links = [[0] * n for _ in range(n)]
    for a, b in pairs:
        links[a][b] = links[b][a] = 12
    return topology(links, [i * numa_nodes // n for i in range(n)])


def bridged_pairs(n: int) -> NodeTopology:
    """n PCIe GPUs on one NUMA node, GPUs 2i and 2i+1 bridged."""
    return pcie(n, 1, [(2 * i, 2 * i + 1) for i in range(n // 2)])


def nvswitch(n: int, numa_nodes: int = 2) -> NodeTopology:
    """n GPUs behind NVSwitch (NV18 every pair), split evenly over `numa_nodes`."""
    links = [[0 if i == j else 18 for j in range(n)] for i in range(n)]
    return topology(links, [i * numa_nodes // n for i in range(n)], nvswitch=True)
