"""Clique blocks: the partitionable devices a node publishes beside its single GPUs, and their order. Pure.

A block is one DRA device that stands for a whole NVLink clique (KEP-4815, partitionable devices): a
pod asks for one block of k GPUs (`block_class(k)`) and gets k GPUs that are one clique, with no
`matchAttribute` constraint. Every GPU is one counter of the node's counter set; a single GPU consumes
its own counter and a block consumes its GPUs' counters, so the allocator never hands out a block
together with any of its GPUs, or two overlapping blocks.

**Which blocks.** For every maximal clique of two or more healthy GPUs (`Encoding.cliques`): the clique
itself when its size is one of `BLOCK_SIZES`, and its aligned sub-blocks of each smaller size in
`BLOCK_SIZES` (positions [j*s, (j+1)*s) of the clique's GPUs in ascending order), without duplicates.
Aligned sub-blocks keep the count linear in the clique's size (an NVSwitch node of 8: one 8, two 4s,
four 2s), and a claim for 2 that takes an aligned pair never breaks two quads. A node of more than
`MAX_BLOCK_GPUS` GPUs publishes no blocks (one counter set holds 32 counters); past `MAX_BLOCKS`
blocks the smallest are left out (largest first: a large block has no stand-in, a pair has the
single GPUs), and `Blocks.left_out` says which.

**Best-fit order** (`block_order`). The allocator takes the first free block of the requested size in
slice order, and each size has its own DeviceClass, so each size is ordered on its own: free blocks
by `fit_key`, the engine's own rank of a clique set (`rank_key("clique", ...)` over the free GPUs)
with its fragmentation terms first, as `gputopo.engine.dra.order` ranks single GPUs: the largest
clique left free, then the NVLink pairs left, then link strength, NUMA span and link sum; best first,
lowest GPUs on ties, as the engine's exhaustive search breaks them. That puts blocks inside
already-broken cliques first, then blocks of fuller cliques, and whole large cliques last. Blocks
that overlap a GPU in use (which the allocator cannot take anyway) follow, in index order. So the
first fit of a k-block claim is the engine's best published k-block on those terms. Like
`gputopo.engine.dra.order` it ranks fragmentation before link strength where the engine's own
choice of GPUs does the reverse: on a DGX-1V with nothing in use the engine takes the NV2 pair 0,3
(no aligned block), and with 2-3 busy the NV2 cross-quad pair 0,4, breaking both quads; the blocks'
order takes pairs inside one quad and keeps the other whole for a 4-GPU claim. Where the clique
enumeration was capped (`Encoding.capped`: adversarial wiring) the blocks stay in index order:
ranking them would cost a hard clique search per block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from gputopo.engine.dra.devices import (
    ATTR_BLOCK_GPUS,
    ATTR_BLOCK_SIZE,
    ATTR_CLIQUE_SIZE,
    ATTR_HEALTH,
    ATTR_IMPAIRED,
    ATTR_PRODUCT,
    Device,
    Scalar,
    block_id,
    encoding,
)
from gputopo.engine.node.blocks import MAX_BLOCK_GPUS, MAX_BLOCKS, aligned_blocks, fit_key
from gputopo.engine.state.cliques import bits, mask_of, popcount
from gputopo.engine.state.snapshot import Shape, shape_of
from gputopo.model.dra import block_name
from gputopo.model.topology import Health, NodeTopology


@dataclass(frozen=True)
class Blocks:
    """The blocks a node publishes (GPU masks, largest first, then lowest GPUs), those left out past
    `MAX_BLOCKS`, and why none are published when that is so ('' otherwise)."""

    masks: tuple[int, ...]
    left_out: tuple[int, ...] = ()
    none_because: str = ""


@lru_cache(maxsize=64)
def clique_blocks(n: int, cliques: tuple[int, ...], max_blocks: int = MAX_BLOCKS) -> Blocks:
    """The blocks of a node of `n` GPUs whose maximal cliques are `cliques` (masks); see the module."""
    if n > MAX_BLOCK_GPUS:
        return Blocks((), (), f"{n} GPUs: one counter set holds {MAX_BLOCK_GPUS}")
    return Blocks(*aligned_blocks(cliques, max_blocks))


@lru_cache(maxsize=4096)
def block_order(shape: Shape, masks: tuple[int, ...], usable: int, in_use: int, rank: bool = True) -> tuple[int, ...]:
    """`masks` in the order the slice lists them: by size ascending, and in each size the free blocks
    best first (module docstring), then those that overlap GPUs in use or not usable, by index. Without
    `rank` the free blocks are in index order: a capped encoding's wiring (exponentially many cliques)
    makes every rank a hard clique search, seconds per block."""
    free = usable & ~in_use
    out: list[int] = []
    for size in sorted({popcount(m) for m in masks}):
        same = [m for m in masks if popcount(m) == size]
        takeable = [m for m in same if m & free == m]
        ranked = sorted(takeable, key=lambda m: bits(m))
        # Stable sort on the rank alone: equal ranks keep the lowest GPUs first.
        if rank:
            ranked.sort(key=lambda m: fit_key(shape, free, m), reverse=True)
        out += ranked
        out += sorted((m for m in same if m & free != m), key=lambda m: bits(m))
    return tuple(out)


def first_free(order: Sequence[int], size: int, taken: int) -> int | None:
    """The block a first-fit allocator gives a claim for one block of `size` GPUs: the first in `order`
    of that size none of whose GPUs is `taken` (its counters all unconsumed)."""
    return next((m for m in order if popcount(m) == size and not m & taken), None)


def node_blocks(topology: NodeTopology) -> Blocks:
    """The blocks of a node's healthy GPUs (a failed GPU is in no clique, so in no block)."""
    return clique_blocks(len(topology.gpus), encoding(topology).cliques)


_WORST = {Health.OK: 0, Health.DEGRADED: 1, Health.FAILED: 2}


def block_devices(topology: NodeTopology, in_use: frozenset[int] | None = None) -> list[Device]:
    """The node's blocks as DRA devices, in slice order: best-fit order from `in_use` (the GPUs allocated
    now), or, with None, the order with every GPU free. Attributes: `blockSize`, `gpus` (the block's id),
    the GPUs' product, the worst health of its GPUs, `nvlinkImpaired` when any is, the size of the largest
    maximal clique holding the block; capacity `memory` is its size times its smallest GPU's HBM, so a
    claim's N times a per-GPU minimum admits the block only when each of its GPUs has that minimum (a sum
    would let a large GPU make up for one under it)."""
    found = node_blocks(topology)
    if not found.masks:
        return []
    gpus = {g.index: g for g in topology.gpus}
    enc = encoding(topology)
    impaired = {d.gpu for d in topology.degraded_links}
    usable = sum(1 << g.index for g in topology.gpus if g.health is not Health.FAILED)
    busy = mask_of(sorted(in_use or frozenset())) & usable
    out: list[Device] = []
    for mask in block_order(shape_of(topology), found.masks, usable, busy, not enc.capped):
        members = [gpus[i] for i in bits(mask)]
        attrs: dict[str, Scalar | tuple[str, ...]] = {
            ATTR_BLOCK_SIZE: len(members),
            ATTR_BLOCK_GPUS: block_id(mask),
            ATTR_PRODUCT: members[0].model,
            ATTR_HEALTH: str(max((g.health for g in members), key=_WORST.__getitem__)),
            ATTR_IMPAIRED: any(g.health is Health.DEGRADED or g.index in impaired for g in members),
            ATTR_CLIQUE_SIZE: max((popcount(c) for c in enc.cliques if c & mask == mask), default=len(members)),
        }
        memory = len(members) * min(g.memory_mib for g in members)
        out.append(Device(block_name(bits(mask)), members[0].index, attrs, memory, False, tuple(bits(mask))))
    return out
