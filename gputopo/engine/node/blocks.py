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

This module is the one place of that rule (`aligned_blocks`, `fit_key`): the agent's slice
(gputopo.engine.dra.blocks) and the extender's choice read it here. The maximal cliques are enumerated
as the agent's encoding does; past `MAX_CLIQUE_STEPS` steps, on wiring no real node has, the extender
finds no block rather than a wrong one.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache

from gputopo.engine.node.gpusets import rank_key
from gputopo.engine.state.cliques import bits, capped_cliques, popcount
from gputopo.engine.state.snapshot import Shape
from gputopo.model.dra import BLOCK_SIZES

MAX_BLOCK_GPUS = 32  # counters per counter set (resource.k8s.io/v1): one set covers at most 32 GPUs
MAX_BLOCKS = 96  # with up to 32 singles: two slices of 64 devices, the per-slice limit with counters
MAX_CLIQUE_STEPS = 1 << 16


def _key(mask: int) -> tuple[int, list[int]]:
    return (-popcount(mask), bits(mask))


def aligned_blocks(cliques: Iterable[int], max_blocks: int = MAX_BLOCKS) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The blocks of a node whose maximal cliques are `cliques` (masks): each clique's aligned
    sub-blocks of every size in `BLOCK_SIZES`, each once, largest first, then lowest GPUs; and those
    left out past `max_blocks` (the smallest: a large block has no stand-in, a pair has the singles)."""
    found: set[int] = set()
    for clique in cliques:
        gpus = bits(clique)
        for size in BLOCK_SIZES:
            if size > len(gpus):
                break
            for start in range(0, len(gpus) - size + 1, size):
                found.add(sum(1 << g for g in gpus[start : start + size]))
    ordered = sorted(found, key=_key)
    return tuple(ordered[:max_blocks]), tuple(ordered[max_blocks:])


@lru_cache(maxsize=4096)
def published_blocks(shape: Shape, usable: int, size: int) -> tuple[int, ...]:
    """The blocks of `size` GPUs a node of `shape` publishes when `usable` are its healthy GPUs."""
    if shape.n > MAX_BLOCK_GPUS or size not in BLOCK_SIZES:
        return ()
    cliques, capped = capped_cliques(shape.adj, usable, max_cliques=None, max_steps=MAX_CLIQUE_STEPS)
    if capped:
        return ()
    kept, _ = aligned_blocks(cliques)
    return tuple(sorted((m for m in kept if popcount(m) == size), key=bits))


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
    the NVLink pairs left), then link strength and the rest, as gputopo.engine.dra.order ranks single GPUs."""
    r = rank_key("clique", shape, free, block, 0)
    return (r[1], r[2], r[0], *r[3:])
