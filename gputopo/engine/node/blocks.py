"""Which clique blocks a node publishes as DRA devices, and which one a pod asking for one whole block
gets. Pure and memoised on (shape, usable GPUs, size).

A block is one device standing for an NVLink clique (KEP-4815, partitionable devices; the agent's
`--dra-blocks`): for every maximal clique of the node's usable GPUs, the clique itself when its size is
one of `BLOCK_SIZES`, and its aligned sub-blocks of each smaller size in `BLOCK_SIZES` (positions
[j*s, (j+1)*s) of the clique's GPUs in ascending order). A node of more than `MAX_BLOCK_GPUS` GPUs
publishes none (one counter set holds 32 counters). A pod asking `gputopo.io/gpu-clique<N>: 1` gets one
of those blocks from the allocator and never any other N GPUs, so the engine chooses among the free
ones, ranked as the agent orders them for the allocator's first fit: the engine's own rank of a clique
set over the node's free GPUs with its fragmentation terms first (`fit_key`), lowest GPUs on ties
(gputopo.engine.dra.blocks orders the agent's slice by the same rule; a test pins the two equal). That
first fit is what the pod gets, so a node whose first free block the pod may not have (a degraded link,
too little HBM) fails rather than passing on another block the allocator would not give: the filter,
the bind's sentence and the claim name one block.

The maximal cliques are enumerated as the agent's encoding does (Bron-Kerbosch with pivoting); past
`MAX_CLIQUE_STEPS` steps, on wiring no real node has, no block is found rather than a wrong one.
"""

from __future__ import annotations

from functools import lru_cache

from gputopo.engine.node.gpusets import rank_key
from gputopo.engine.state.cliques import bits, popcount
from gputopo.engine.state.snapshot import Shape
from gputopo.model.dra import BLOCK_SIZES

MAX_BLOCK_GPUS = 32  # counters per counter set (resource.k8s.io/v1)
MAX_CLIQUE_STEPS = 1 << 16


class _Capped(Exception):
    pass


def maximal_cliques(adj: tuple[int, ...], usable: int) -> tuple[int, ...]:
    """The maximal cliques inside `usable` (masks, largest first, then lowest); () past the step cap."""
    out: list[int] = []
    steps = 0

    def expand(r: int, p: int, x: int) -> None:
        nonlocal steps
        steps += 1
        if steps > MAX_CLIQUE_STEPS:
            raise _Capped
        if not p and not x:
            out.append(r)
            return
        pivot = max(bits(p | x), key=lambda u: popcount(p & adj[u]))
        for v in bits(p & ~adj[pivot]):
            bit = 1 << v
            expand(r | bit, p & adj[v], x & adj[v])
            p &= ~bit
            x |= bit

    if usable:
        try:
            expand(0, usable, 0)
        except _Capped:
            return ()
    return tuple(sorted(out, key=lambda m: (-popcount(m), m)))


@lru_cache(maxsize=4096)
def published_blocks(shape: Shape, usable: int, size: int) -> tuple[int, ...]:
    """The blocks of `size` GPUs a node of `shape` publishes when `usable` are its healthy GPUs."""
    if shape.n > MAX_BLOCK_GPUS or size not in BLOCK_SIZES:
        return ()
    found: set[int] = set()
    for clique in maximal_cliques(shape.adj, usable):
        gpus = bits(clique)
        if popcount(clique) < 2:
            continue
        for start in range(0, len(gpus) - size + 1, size):
            found.add(sum(1 << g for g in gpus[start : start + size]))
    return tuple(sorted(found, key=bits))


@lru_cache(maxsize=65536)
def first_fit_block(shape: Shape, usable: int, free: int, size: int) -> int | None:
    """The block of `size` the allocator hands out: among the published blocks wholly inside `free` (the
    node's usable GPUs not in use), the first in the agent's best-fit order; None when none is free."""
    takeable = [m for m in published_blocks(shape, usable, size) if m & free == m]
    # Stable sort on the rank alone keeps the lowest GPUs first among equals, as the agent orders them.
    takeable.sort(key=lambda m: fit_key(shape, free, m), reverse=True)
    return takeable[0] if takeable else None


def fit_key(shape: Shape, free: int, block: int) -> tuple[int, ...]:
    """Best fit's rank of taking `block` out of the `free` GPUs, as the agent orders blocks: the engine's
    rank of a clique set (`rank_key`) with its fragmentation terms first (the largest clique left free,
    the NVLink pairs left), then link strength and the rest."""
    r = rank_key("clique", shape, free, block, 0)
    return (r[1], r[2], r[0], *r[3:])
