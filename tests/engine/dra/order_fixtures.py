"""Wirings built against best-fit order's clique search (gputopo/engine/dra/order.py, "The bound")."""

from __future__ import annotations

from gputopo.model import NodeTopology
from tests.engine.dra.blocks_fixtures import linked


def irregular(i: int, j: int) -> int:
    """NV1 to NV3 by pair, symmetric and uneven: no two GPUs rank alike, so no rank term breaks early."""
    return 1 + (i * j + i + j) % 3


def mesh_minus_matching(n: int = 32, *, uneven: bool = True) -> NodeTopology:
    """`n` GPUs, each NVLinked to all but its partner (2k, 2k+1): 2^(n/2) maximal cliques of n/2, so the
    largest clique left is a long branch and bound; the clique encoding is capped (greedy cover: the even
    GPUs, then the odd ones, two blocks of n/2). Link counts `irregular` when `uneven`, else NV2."""
    return linked(
        [
            [0 if j in (i, i ^ 1) else irregular(min(i, j), max(i, j)) if uneven else 2 for j in range(n)]
            for i in range(n)
        ]
    )
