"""Which GPUs of a node kind are interchangeable, for the exhaustive search (gputopo.sim.exhaustive).

Twin classes first: GPUs with the same attributes the search honours (NUMA node, health, degraded
links, HBM) and the same links to every other GPU, the twins of gputopo.engine.node.gpusets with those
attributes added. Any permutation inside a class keeps the node as it is, so a class's state is how
many of its GPUs are in use, and a pod's GPU sets are tried as how many to take from each class.
The same step repeats one level up: classes (then groups of them) of the same make-up, linked alike
to everything else, swap as wholes, and their state is the sorted list of theirs. Nothing is
permuted GPU by GPU: a 64-GPU NVSwitch node, like a PCIe node, is one class per NUMA node.

What is left when nothing more merges are blocks of which no two swap alone; the permutations of
those that keep make-up and links (the DGX-1's cube symmetries, say) are enumerated once per kind,
up to `MAX_PERM_STEPS` backtracking steps, and the canonical state is the least image under them.
Exact either way: two masks share a canonical state only when a symmetry maps one onto the other.
A kind whose block symmetries pass the cap keeps those found, which merges fewer states (more work,
the same answer); no named system comes near it.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from gputopo.engine.state.cliques import bits, mask_of, popcount

MAX_PERM_STEPS = 20_000

Block = int | tuple["Block", ...]  # a twin class (its index), or blocks that swap as wholes


@dataclass
class Budget:
    """Steps a search may spend: options tried, class-count steps, symmetries applied, kinds built."""

    limit: int
    steps: int = 0
    complete: bool = True

    def spend(self, n: int = 1) -> bool:
        """Count `n` steps; False (and incomplete from then on) once past the limit."""
        self.steps += n
        if self.steps > self.limit:
            self.complete = False
        return self.complete


@dataclass(frozen=True, eq=False)  # one object per kind (node_kind is memoised): compared by identity
class NodeKind:
    class_masks: tuple[int, ...]  # GPUs of each twin class, classes ordered by their lowest GPU
    reps: tuple[int, ...]  # the lowest GPU of each class
    linked_inside: tuple[bool, ...]  # whether a class's GPUs are NVLink-linked to each other
    blocks: tuple[Block, ...]  # the top blocks: no two swap alone
    perms: tuple[tuple[int, ...], ...]  # permutations of the top blocks keeping make-up and links
    build_steps: int  # what building this cost, charged to each search that meets the kind
    all_perms: bool  # every such permutation was found within MAX_PERM_STEPS

    def canonical(self, mask: int) -> tuple[int, ...]:
        """The in-use state up to the node's symmetries: per block, its classes' counts (interchangeable
        blocks sorted), the least over the block permutations."""
        counts = [popcount(mask & m) for m in self.class_masks]
        top = [_state(b, counts) for b in self.blocks]
        return min(tuple(x for i in p for x in top[i]) for p in self.perms)

    def canonical_cost(self) -> int:
        """Steps one canonical form costs: a count per class, then each permutation of the blocks."""
        return len(self.class_masks) + len(self.perms) * len(self.blocks)

    def class_sets(self, adj: Sequence[int], free: int, k: int, clique: bool, budget: Budget) -> list[int]:
        """Every way to take `k` of the `free` GPUs counted per class (the lowest free GPUs of each
        class taken), for a `clique` only ways whose GPUs are pairwise linked. Stops when `budget` does."""
        frees = [bits(free & m) for m in self.class_masks]
        left = [0] * (len(frees) + 1)  # free GPUs in classes c..
        for c in range(len(frees) - 1, -1, -1):
            left[c] = left[c + 1] + len(frees[c])
        out: list[int] = []

        def take(c: int, need: int, chosen: int) -> None:
            if need == 0:
                out.append(chosen)
                return
            if left[c] < need or not budget.spend():
                return
            most = min(need, len(frees[c]))
            if clique and most:
                rep = self.reps[c]
                if (adj[rep] & chosen) != chosen:  # classes are linked alike: one GPU answers for its class
                    most = 0
                elif not self.linked_inside[c]:
                    most = 1
            for x in range(most, -1, -1):
                take(c + 1, need - x, chosen | mask_of(frees[c][:x]))

        take(0, k, 0)
        return out


def _state(block: Block, counts: Sequence[int]) -> tuple[int, ...]:
    if isinstance(block, int):
        return (counts[block],)
    # Blocks that swap have equal make-up, so their states have one length and concatenate unambiguously.
    return tuple(x for s in sorted(_state(b, counts) for b in block) for x in s)


@lru_cache(maxsize=256)
def node_kind(links: tuple[tuple[int, ...], ...], attrs: tuple[Hashable, ...]) -> NodeKind:
    """The symmetry structure of a node whose GPU i has `attrs[i]` and `links[i][j]` links to GPU j."""
    n = len(attrs)
    symmetric = all(links[a][b] == links[b][a] for a in range(n) for b in range(a))
    groups, steps = _twins(list(attrs), list(range(n)), links, symmetric)
    class_masks = tuple(mask_of(g) for g in groups)
    reps = tuple(g[0] for g in groups)
    linked_inside = tuple(len(g) == 1 or links[g[0]][g[1]] > 0 for g in groups)
    kinds: list[Hashable] = [("class", attrs[g[0]], len(g), links[g[0]][g[1]] if len(g) > 1 else 0) for g in groups]
    blocks: list[Block] = list(range(len(groups)))
    item_reps = list(reps)
    while True:  # merge swappable blocks until none are left
        merged, spent = _twins(kinds, item_reps, links, symmetric)
        steps += spent
        if len(merged) == len(blocks):
            break
        kinds = [
            kinds[g[0]] if len(g) == 1 else ("group", kinds[g[0]], len(g), _link(links, item_reps, g)) for g in merged
        ]
        blocks = [blocks[g[0]] if len(g) == 1 else tuple(blocks[i] for i in g) for g in merged]
        item_reps = [item_reps[g[0]] for g in merged]
    perms, spent, complete = _block_perms(kinds, item_reps, links)
    return NodeKind(
        class_masks, reps, linked_inside, tuple(blocks), perms, steps + spent + len(perms) * len(blocks), complete
    )


def _link(links: tuple[tuple[int, ...], ...], reps: Sequence[int], group: Sequence[int]) -> int:
    return links[reps[group[0]]][reps[group[1]]]


def _twins(
    kinds: Sequence[Hashable], reps: Sequence[int], links: tuple[tuple[int, ...], ...], symmetric: bool
) -> tuple[list[list[int]], int]:
    """Items grouped where swapping two of them is a symmetry: the same make-up, the same links to every
    other item (an item's GPUs are linked alike to any GPU outside it). Swapping is transitive (the
    symmetries form a group), so comparing with each group's first member suffices. With the steps spent."""
    groups: list[list[int]] = []
    steps = 0
    m = len(kinds)
    for i in range(m):
        for g in groups:
            j = g[0]
            steps += m
            row_i, row_j = links[reps[i]], links[reps[j]]
            if (
                symmetric
                and kinds[i] == kinds[j]
                and all(row_i[reps[x]] == row_j[reps[x]] for x in range(m) if x != i and x != j)
            ):
                g.append(i)
                break
        else:
            groups.append([i])
    return groups, steps


def _block_perms(
    kinds: Sequence[Hashable], reps: Sequence[int], links: tuple[tuple[int, ...], ...]
) -> tuple[tuple[tuple[int, ...], ...], int, bool]:
    """Permutations of the blocks that keep each block's make-up and the links between blocks, identity
    first, found by backtracking within MAX_PERM_STEPS steps; with the steps spent and whether all were."""
    m = len(kinds)
    between = [[links[reps[a]][reps[b]] for b in range(m)] for a in range(m)]
    out: list[tuple[int, ...]] = []
    perm: list[int] = []
    used = [False] * m
    steps = 0

    def grow(i: int) -> bool:
        nonlocal steps
        if i == m:
            out.append(tuple(perm))
            return True
        for p in range(m):
            steps += 1 + i
            if steps > MAX_PERM_STEPS:
                return False
            if used[p] or kinds[p] != kinds[i]:
                continue
            if any(between[i][j] != between[p][perm[j]] or between[j][i] != between[perm[j]][p] for j in range(i)):
                continue
            used[p] = True
            perm.append(p)
            ok = grow(i + 1)
            perm.pop()
            used[p] = False
            if not ok:
                return False
        return True

    complete = grow(0)
    identity = tuple(range(m))
    if not out or out[0] != identity:  # cut off before the identity: keep that one at least
        out.insert(0, identity)
    return tuple(out), steps, complete
