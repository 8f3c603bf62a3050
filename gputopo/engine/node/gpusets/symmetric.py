"""Best GPU sets built directly where candidates are linked alike: symmetric wiring, or blocks of it."""

from __future__ import annotations

from functools import lru_cache

from gputopo.engine.node.gpusets.rank import lower, rank_key
from gputopo.engine.state.cliques import bits, mask_of, popcount
from gputopo.engine.state.snapshot import Shape


@lru_cache(maxsize=4096)
def link_blocks(shape: Shape, candidates: int, floor: int = 1, equal_links: bool = True) -> tuple[int, ...] | None:
    """The candidates as disjoint blocks of GPUs linked pairwise by at least `floor` links (by one link
    count inside each block, if `equal_links`), each block's GPUs linked alike to every candidate outside
    it, so that any reordering inside a block changes no link or fragmentation term; or None."""
    out = []
    left = candidates
    everyone = bits(candidates)
    while left:
        low = left & -left
        first = low.bit_length() - 1
        block = _linked(shape, candidates, first, floor, everyone) | low
        members = bits(block)
        outside = [x for x in everyone if not block >> x & 1]
        count = shape.links[members[0]][members[1]] if len(members) > 1 else 0
        for a in members:
            if _linked(shape, candidates, a, floor, everyone) | (1 << a) != block:
                return None
            row = shape.links[a]
            if equal_links and any(row[b] != count for b in members if b != a):
                return None
            if floor > 1 and any(row[x] != shape.links[first][x] for x in outside):
                return None
        out.append(block)
        left &= ~block
    return tuple(out)


def _linked(shape: Shape, candidates: int, i: int, floor: int, everyone: list[int]) -> int:
    """Candidates joined to GPU i by at least `floor` NVLink links."""
    if floor <= 1:
        return shape.adj[i] & candidates
    row = shape.links[i]
    return mask_of([j for j in everyone if j != i and row[j] >= floor])


@lru_cache(maxsize=256)
def _link_counts(shape: Shape) -> tuple[int, ...]:
    """The node's distinct positive NVLink link counts, strongest first."""
    return tuple(sorted({c for row in shape.links for c in row if c > 0}, reverse=True))


def clique_blocks(shape: Shape, candidates: int, k: int) -> tuple[int, ...] | None:
    """Blocks (as `link_blocks`) at the strongest link floor where some block holds k GPUs: every best
    clique has that minimum link count, so lies in one of them. None when the wiring is not blocks."""
    counts = _link_counts(shape)
    for floor in counts:
        # At the weakest count linked means adjacent: the cheap adjacency masks answer.
        blocks = link_blocks(shape, candidates, 1 if floor == counts[-1] else floor)
        if blocks is None:
            return None
        if any(popcount(b) >= k for b in blocks):
            return blocks
    return ()  # no k-clique at any floor


def clique_in_blocks(shape: Shape, candidates: int, blocks: tuple[int, ...], k: int, near: int) -> int | None:
    # Inside one block the link and fragmentation terms are equal for every k-set, and NIC nearness
    # outranks NUMA span; the blocks' winners are then compared on the full rank.
    best: tuple[tuple[int, ...], int] | None = None
    for block in blocks:
        if popcount(block) < k:
            continue
        s = symmetric_set(shape, block, k, near, near_first=True)
        rank = rank_key("clique", shape, candidates, s, near)
        if best is None or rank > best[0] or (rank == best[0] and lower(s, best[1])):
            best = (rank, s)
    return None if best is None else best[1]


def symmetric_set(shape: Shape, pool: int, k: int, near: int, *, near_first: bool) -> int:
    """Lowest-index k-subset of `pool` with the most GPUs in `near` and the fewest NUMA nodes, in the
    order `near_first` says. Only valid where every k-subset ties on all other rank terms."""
    if popcount(pool) == k:  # e.g. a bridged pair for a 2-GPU pod
        return pool
    if not near_first:
        return _spread_set(shape, pool, k, near, ())
    near_pool = pool & near
    if k <= popcount(near_pool):  # the most near GPUs means only near GPUs
        return _spread_set(shape, near_pool, k, 0, ())
    # The most near GPUs means all of them; the rest come from the others, counting their NUMA nodes.
    rest = _spread_set(shape, pool & ~near, k - popcount(near_pool), 0, tuple(shape.numa[i] for i in bits(near_pool)))
    return near_pool | rest


def _spread_set(shape: Shape, pool: int, k: int, near: int, base_numa: tuple[int | None, ...]) -> int:
    """Lowest-index k-subset of `pool` spanning the fewest NUMA nodes (those in `base_numa` are already
    spanned), then with the most GPUs in `near`. Built GPU by GPU in index order: each is taken when an
    optimal set that includes it still exists, which is what makes the result the lowest-index one."""
    if k == 0:
        return 0
    group_of: dict[int | None, int] = {}
    base = {group_of.setdefault(v, len(group_of)) for v in base_numa}
    members = bits(pool)
    gid = [group_of.setdefault(shape.numa[i], len(group_of)) for i in members]
    tot = [0] * len(group_of)
    nr = [0] * len(group_of)
    for i, g in zip(members, gid, strict=True):
        tot[g] += 1
        nr[g] += near >> i & 1
    used = frozenset(base)
    span = next(s for s in range(len(used), len(tot) + 1) if _can_finish(tot, nr, used, k, 0, s))
    most = min(k, popcount(pool & near))
    need = next(m for m in range(most, -1, -1) if _can_finish(tot, nr, used, k, m, span))
    chosen = taken = have = 0
    left = len(members)
    for i, g in zip(members, gid, strict=True):
        if taken == k:
            break
        is_near = near >> i & 1
        tot[g] -= 1
        nr[g] -= is_near
        left -= 1
        with_i = used | {g}
        # The state before i is feasible, so when every remaining GPU is needed i is too.
        if left + 1 == k - taken or _can_finish(tot, nr, with_i, k - taken - 1, max(0, need - have - is_near), span):
            chosen |= 1 << i
            taken += 1
            have += is_near
            used = with_i
    return chosen


def _can_finish(tot: list[int], nr: list[int], used: frozenset[int], r: int, need: int, span: int) -> bool:
    """Can r more GPUs (group g offers tot[g], nr[g] of them near) be picked with at least `need` near,
    the NUMA groups in `used` plus any new ones numbering at most `span`?"""
    if len(used) > span or need > r:
        return False
    if r == 0:
        return True
    have_t = sum(tot[g] for g in used)
    have_n = sum(nr[g] for g in used)
    extra = span - len(used)
    others = [g for g in range(len(tot)) if tot[g] and g not in used]
    if have_n >= need:  # only the count matters: the largest groups first
        return have_t + sum(sorted((tot[g] for g in others), reverse=True)[:extra]) >= r
    if extra == 0 or have_n + sum(sorted((nr[g] for g in others), reverse=True)[:extra]) < need:
        return False
    # Both counts matter: per number of new groups, the most GPUs reachable for each (capped) near count.
    reach: list[dict[int, int]] = [{} for _ in range(extra + 1)]
    reach[0][min(have_n, need)] = min(have_t, r)
    for g in others:
        for j in range(extra - 1, -1, -1):
            for n0, t0 in list(reach[j].items()):
                n1, t1 = min(n0 + nr[g], need), min(t0 + tot[g], r)
                if n1 >= need and t1 >= r:
                    return True
                if reach[j + 1].get(n1, -1) < t1:
                    reach[j + 1][n1] = t1
    return False
