"""Topologies for the clique-block tests: an NVSwitch node of any size, and links from a matrix."""

from __future__ import annotations

from collections.abc import Sequence

from gputopo.model import NodeTopology
from gputopo.systems import build_system


def linked(links: Sequence[Sequence[int]]) -> NodeTopology:
    """A node whose GPUs' NVLink counts are `links` (a symmetric matrix, zero diagonal)."""
    base = build_system("dgx-h100", "node-a")
    gpu = base.gpus[0]
    n = len(links)
    gpus = tuple(gpu.model_copy(update={"index": i, "uuid": f"GPU-{i:04d}", "pci_bus_id": ""}) for i in range(n))
    nvlink = base.nvlink.model_copy(update={"links": tuple(tuple(row) for row in links)})
    return base.model_copy(update={"gpus": gpus, "nvlink": nvlink, "nics": (), "degraded_links": ()})


def nvswitch(n: int) -> NodeTopology:
    """`n` GPUs all linked to each other alike (an NVSwitch node of any size)."""
    return linked([[0 if i == j else 18 for j in range(n)] for i in range(n)])
