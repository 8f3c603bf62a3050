"""The order a node's DRA devices are published in, so that the allocator's first fit is best fit. Pure.

kube-scheduler's DRA allocator takes the first devices, in slice order, that a claim's selectors and
constraints allow (since 1.36 the documented order: slices and pools by name, devices in slice order).
gputopo's clique claims ask for devices that share one block of a scalar partition (`nvlinkPartition0`
first, docs/annotations.md), so the first fit of a k-GPU claim is the first block, in slice order, with
k free GPUs, and in it the first k free GPUs. `bounded_order` orders the node's GPUs so that this is
the set gputopo's engine would choose among the sets the claim can match:

- blocks by how few GPUs they have free (blocks with none first, where order does not matter), then
  broken blocks before whole ones, then lowest index: the first block with k free is the one with the
  fewest free GPUs that still fits, best fit, as the engine's "largest clique left" term prefers. On
  blocks that are cliques of equal links (NVSwitch, NV-bridged pairs, a GB200 tray) best fit also
  keeps the most NVLink pairs free, the engine's next term;
- inside a block its free GPUs nested by the engine's rank terms (`rank_key`), the clique and NVLink
  pairs left free first, then link strength: the first GPU, then the one that makes the best pair
  with it, then the best third, ... so a claim's first k free GPUs there are the best k-set that
  contains the best (k-1)-set. On a DGX-1V quad with its cross-quad partners busy that puts an NV2
  pair first;
- GPUs in use last in their block (the allocator skips them).

What one order cannot say: the engine ranks link strength before fragmentation, and no single order
gives every claim size the engine's choice where they disagree (on a DGX-1V an NV2 pair from a whole
quad against an NV1 pair from a broken one: the order keeps the quad whole); NIC nearness is the pod's,
and NUMA span may want GPUs from two blocks at once. So first fit is best fit on the engine's
fragmentation terms (the largest clique and the NVLink pairs left free) among the sets the claim can
match: for a partition claim the k-sets inside one block of the first partition that has room, for a
list claim (KEP-5491) every k-clique, a DGX-1V's cross-quad pairs included; and it equals the engine's
own choice on all its NVLink terms where a block's links are equal (NVSwitch, bridged pairs, a GB200
tray). `tests/engine/dra/test_order.py` checks both on random node states. Identity
never depends on order: a device's name is its GPU, so a slice published before an allocation that it
does not know of costs only optimality, never a double allocation or a claim on GPUs that are no clique.

**The bound.** Each nesting step ranks every free GPU left in the block, and each rank asks for the
largest clique left among the node's free GPUs: a branch and bound, quick on real wiring, exponential on
a node wired against it (32 GPUs, each linked to all but its partner: 25-29 s per order, spent again on
every re-publish after an allocation). So an order spends at most `ORDER_BUDGET` work units: one per
rank, one per branch step of its clique search; the named systems spend a few hundred at most
(docs/benchmarks.md). Past the budget the order stays correct and gets cheap: the GPUs nested so far
keep their places, and the rest of that block and every later block list their free GPUs by index, as a
block past `MAX_NESTED_BLOCK` does. `Order.capped` says so (the agent logs it once).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from gputopo.engine.node.gpusets import rank_key
from gputopo.engine.state.cliques import bits, max_clique_within, popcount
from gputopo.engine.state.snapshot import Shape

# Past this many free GPUs in one block the nesting (quadratic in rank evaluations) is skipped: such a
# block is an NVSwitch domain, where every GPU ranks alike on the NVLink terms, and index order stands.
MAX_NESTED_BLOCK = 16
# Work units one order may spend (module docstring): under 20 ms of CPU; the named systems spend at most
# 238 (a DGX H100), a 32-GPU node wired against the clique search 44 million (25-29 s) unbounded.
ORDER_BUDGET = 20_000


@dataclass(frozen=True)
class Order:
    """A node's GPUs in slice order, the work units spent on it, and whether the budget ran out (then
    part of it is in index order: correct, maybe not best fit)."""

    gpus: tuple[int, ...]
    work: int
    capped: bool


class _Budget:
    """The work units an order has left, spent as the work is done; `out` once the next rank did not fit."""

    def __init__(self, units: int) -> None:
        self.left = units
        self.out = False

    def rank(self, shape: Shape, free: int, s: int) -> tuple[int, ...] | None:
        """`rank_key` of the clique set `s` among the `free` GPUs, or None once the budget is spent."""
        if self.left < 2:  # no room for a search step and the rank
            self.out = True
            return None
        # One unit stays for the rank itself; the clique search may take the rest.
        size, steps = max_clique_within(shape.adj, free & ~s, self.left - 1)
        self.left -= min(steps, self.left - 1)  # past its limit the search stops before the step it counts
        if size is None:
            self.out = True
            return None
        self.left -= 1
        return rank_key("clique", shape, free, s, 0, rest_clique=size)


def _nested(shape: Shape, free: int, block_free: int, budget: _Budget) -> list[int]:
    """The block's free GPUs, each next one the best extension of those before it (lowest index on ties);
    once the budget is spent, the rest by index."""
    order: list[int] = []
    taken = 0
    left = bits(block_free)
    while len(left) > 1 and not budget.out:
        best: tuple[tuple[int, ...], int] | None = None
        for g in left:
            r = budget.rank(shape, free, taken | 1 << g)
            if r is None:
                break
            key = (r[1], r[2], r[0], *r[3:])  # fragmentation first, as between blocks; then link strength
            if best is None or key > best[0]:
                best = (key, g)
        if budget.out:
            break
        assert best is not None
        order.append(best[1])
        taken |= 1 << best[1]
        left = [g for g in left if g != best[1]]
    return order + left


@lru_cache(maxsize=4096)
def bounded_order(
    shape: Shape, partition: tuple[int, ...], usable: int, in_use: int, budget: int = ORDER_BUDGET
) -> Order:
    """GPU indices in the order the slice lists them, within `budget` work units. `partition`: per GPU,
    the mask of its block in the scalar partition claims try first; `usable`: the GPUs that can be
    allocated (healthy); `in_use`: the GPUs allocated now. Every GPU of the node appears once."""
    n = len(partition)
    free = usable & ~in_use
    blocks: dict[int, None] = {}
    for g in range(n):
        blocks.setdefault(partition[g] or 1 << g, None)

    def block_key(block: int) -> tuple[int, bool, int]:
        f = popcount(block & free)
        return (f, f == popcount(block), (block & -block).bit_length() - 1)

    spend = _Budget(budget)
    out: list[int] = []
    for block in sorted(blocks, key=block_key):
        block_free = block & free
        if popcount(block_free) > MAX_NESTED_BLOCK or spend.out:
            out += bits(block_free)
        else:
            out += _nested(shape, free, block_free, spend)
        out += bits(block & ~free)
    assert sorted(out) == list(range(n)), "partition blocks must cover every GPU once"
    return Order(tuple(out), budget - spend.left, spend.out)
