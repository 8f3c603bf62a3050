"""Choosing which GPUs inside one node a pod gets. Deterministic, and bounded in time.

Ranking, for `nvlink: required` (and `preferred` when a clique exists): strongest links first (the
minimum pairwise NVLink count), then the set that leaves the best clique free for later pods
(fragmentation-aware), then GPUs near an accepted NIC, then one NUMA node, then lowest indices.
Results are memoised on (shape, candidate mask, size, preferences): thousands of identical nodes cost
one search.

The answer is the one an exhaustive search over every candidate set would give (`exhaustive_set`, kept
as the reference the tests compare against), found without enumerating subsets where the wiring allows:

- Symmetric candidates (every pair linked with one link count, as behind NVSwitch, or no pair linked,
  as on PCIe-only nodes): every k-set ties on all link and fragmentation terms, so only NIC nearness and
  NUMA span separate them, and `symmetric_set` builds the lowest-index best set directly.
- Blocks, for cliques (two NVSwitch trays, joined by weaker links or not; bridged pairs): at the
  strongest link count some k-clique has, the best cliques lie inside blocks whose GPUs are linked
  alike, so each block is decided as above and the blocks' best sets compared.
- Anything else: GPUs the ranking cannot tell apart (twins: the same links to every other candidate,
  the same NUMA node and NIC nearness) are interchangeable, so `class_search` enumerates only how many to
  take from each class of twins, up to `SEARCH_BUDGET` steps. Past it the best set ranked so far is
  returned and flagged `truncated` (when none was ranked: the first set reached, else a greedy clique
  or the lowest-index GPUs), never a false "no clique" that the greedy would have disproved.
- Tiny cases (a handful of sets) are ranked exhaustively: cheaper than recognising the wiring.

Rails (group planning only, `rail_options`): a group whose members take part of a node wants the same
fabric rails on every member's node. That preference is one more rank term after the terms each kind
ranks first (`RAIL_AFTER`): for cliques link strength, the clique left free and its pairs; for
`connected` NVLink pairs and link sum; for `any` the clique left free and its pairs. Every term after
them (NIC nearness, NUMA span, link sum, the rest) and the lowest indices come after rails. `rail_options` ranks
every set against those leading terms and returns, per reachable rail set, the best set below them; the
rail set the engine's own choice uses always maps back to that choice, so a group already on one rail
set, and every pod outside a group, is decided exactly as without rails.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from itertools import islice
from math import comb
from typing import Literal

from gputopo.engine.cliques import (
    all_subsets,
    bits,
    connected_pairs,
    k_cliques,
    mask_of,
    max_clique_size,
    max_clique_within,
    popcount,
)
from gputopo.engine.snapshot import Shape

Kind = Literal["clique", "connected", "any"]

# Steps one decision may spend on the general path: classes visited, plus the branch steps of finding
# the largest clique each ranked set leaves. Every node of today's systems (at most 8 GPUs, 70 sets)
# stays far below it; it bounds an irregular large node to milliseconds instead of an exponential search.
SEARCH_BUDGET = 8192

# Where ranking every set costs less than recognising the wiring: at most this many k-subsets in all,
# or, for cliques on irregular wiring, this many k-subsets to draw cliques from (any k on 8 GPUs: the
# clique enumeration prunes as it goes, so a DGX-1's two 4-cliques cost two ranks).
FEW_SETS = 4
FEW_CLIQUE_SUBSETS = 70


@dataclass(frozen=True)
class GpuChoice:
    gpus: tuple[int, ...]
    clique: bool  # fully NVLink-connected (trivially true for one GPU)
    min_links: int
    remaining_clique: int  # largest clique left among the candidates not taken
    remaining_free: int
    linked_pairs: int = 0  # chosen GPU pairs joined by NVLink
    truncated: bool = False  # the search hit SEARCH_BUDGET: the best set found, not proven the best


# Sets `rail_options` ranks at most: every 8-GPU node needs 70 at worst; a larger node past it keeps
# the engine's own choice (its group is reported as not rail-aligned when rails then differ).
RAIL_SEARCH_SETS = 4096

# How many leading terms of each kind's rank outrank rails: the NVLink and fragmentation terms.
RAIL_AFTER: dict[Kind, int] = {"clique": 3, "connected": 2, "any": 2}


@dataclass(frozen=True)
class RailOption:
    rails: int  # the rails the set uses (bit r: rail r)
    mask: int  # the best GPU set on exactly these rails
    rest: tuple[int, ...]  # that set's rank terms after rails (higher is better)


@dataclass(frozen=True)
class Found:
    mask: int | None  # None: no admissible set (for cliques: none exists, or none found within budget)
    truncated: bool = False


def _numa_span(shape: Shape, mask: int) -> int:
    return len({shape.numa[i] for i in bits(mask)})


def _pair_link_sum(shape: Shape, gpus: list[int]) -> int:
    return sum(shape.links[a][b] for i, a in enumerate(gpus) for b in gpus[i + 1 :])


@lru_cache(maxsize=65536)
def largest_clique(shape: Shape, mask: int) -> int:
    return max_clique_size(shape.adj, mask)


def _rank(kind: Kind, shape: Shape, candidates: int, s: int, near: int, rest_clique: int = -1) -> tuple[int, ...]:
    """What `kind` maximises for the set `s`; on equal ranks the lowest indices win. `rest_clique`: the
    largest clique left, when the caller already knows it."""
    g = bits(s)
    rest = candidates & ~s
    left_clique = largest_clique(shape, rest) if rest_clique < 0 else rest_clique
    if kind == "clique":
        return (
            shape.min_link(tuple(g)),
            left_clique,
            connected_pairs(shape.adj, rest),
            popcount(s & near),
            -_numa_span(shape, s),
            _pair_link_sum(shape, g),
        )
    if kind == "connected":  # most NVLink pairs, then link strength
        return (
            connected_pairs(shape.adj, s),
            _pair_link_sum(shape, g),
            -_numa_span(shape, s),
            left_clique,
            popcount(s & near),
        )
    # any: break the fewest cliques, on as few NUMA nodes as possible
    return (left_clique, connected_pairs(shape.adj, rest), -_numa_span(shape, s), popcount(s & near))


def exhaustive_set(
    kind: Kind, shape: Shape, candidates: int, k: int, near: int = 0, limit: int | None = None
) -> int | None:
    """The reference: rank every admissible k-set. Exponential; kept to check the fast paths against.
    `limit` ranks only the first sets, for benchmarks that extrapolate what the whole search costs."""
    best: tuple[tuple[int, ...], int] | None = None
    sets = k_cliques(shape.adj, candidates, k) if kind == "clique" else all_subsets(candidates, k)
    for s in islice(sets, limit):  # ascending index order, so on ties the first found is the lowest
        rank = _rank(kind, shape, candidates, s, near)
        if best is None or rank > best[0]:
            best = (rank, s)
    return None if best is None else best[1]


def _lower(a: int, b: int) -> bool:
    """Whether set `a` comes before `b` in ascending index order (the exhaustive search's tie-break)."""
    return bits(a) < bits(b)


def best_set(
    kind: Kind,
    shape: Shape,
    candidates: int,
    k: int,
    near: int = 0,
    budget: int = SEARCH_BUDGET,
    exhaustive_below: tuple[int, int] = (FEW_SETS, FEW_CLIQUE_SUBSETS),
) -> Found:
    """The set `exhaustive_set` would choose, by the cheapest exact route the wiring allows.
    `exhaustive_below`: (FEW_SETS, FEW_CLIQUE_SUBSETS); tests pass (0, 0) to exercise the fast paths."""
    if k > popcount(candidates):
        return Found(None)
    if k <= 0:
        return Found(0)
    subsets = comb(popcount(candidates), k)
    if subsets <= exhaustive_below[0]:
        return Found(exhaustive_set(kind, shape, candidates, k, near))
    if kind == "clique" and k >= 2:
        blocks = _clique_blocks(shape, candidates, k)
        if blocks is not None:
            return Found(_clique_in_blocks(shape, candidates, blocks, k, near))
    elif kind != "clique":
        # `any` ranks by which GPUs stay linked, not by how strongly: there link counts need not be equal
        # (an NVSwitch node with one degraded GPU is still symmetric for it).
        blocks = _blocks(shape, candidates, 1, kind != "any")
        if blocks is not None and (len(blocks) == 1 or all(popcount(b) == 1 for b in blocks)):
            # All pairs linked alike (or none linked): the rank reduces to NUMA span, then NIC nearness.
            return Found(symmetric_set(shape, candidates, k, near, near_first=False))
    if kind == "clique" and subsets <= exhaustive_below[1]:
        return Found(exhaustive_set(kind, shape, candidates, k, near))
    return class_search(kind, shape, candidates, k, near, budget)


def set_rails(gpu_rails: tuple[int, ...], s: int) -> int:
    out = 0
    for i in bits(s):
        out |= gpu_rails[i] if i < len(gpu_rails) else 0
    return out


@lru_cache(maxsize=16384)
def rail_options(
    kind: Kind, shape: Shape, candidates: int, k: int, near: int, gpu_rails: tuple[int, ...]
) -> tuple[RailOption, ...] | None:
    """Among the k-sets that tie the best on the terms ranked above rails (`RAIL_AFTER`), the best set
    for each rail set reachable, best by the remaining terms, lowest indices on ties (the exhaustive
    search's order). None when more than RAIL_SEARCH_SETS sets would need ranking."""
    if k <= 0 or k > popcount(candidates):
        return ()
    if kind != "clique" and comb(popcount(candidates), k) > RAIL_SEARCH_SETS:
        return None
    cut = RAIL_AFTER[kind]
    sets = k_cliques(shape.adj, candidates, k) if kind == "clique" else all_subsets(candidates, k)
    head: tuple[int, ...] | None = None
    best: dict[int, RailOption] = {}
    for count, s in enumerate(sets):  # ascending index order, as exhaustive_set
        if count >= RAIL_SEARCH_SETS:
            return None
        rank = _rank(kind, shape, candidates, s, near)
        if head is None or rank[:cut] > head:
            head, best = rank[:cut], {}
        elif rank[:cut] < head:
            continue
        rails = set_rails(gpu_rails, s)
        known = best.get(rails)
        if known is None or rank[cut:] > known.rest:
            best[rails] = RailOption(rails, s, rank[cut:])
    return tuple(best[r] for r in sorted(best))


def choice_of(shape: Shape, candidates: int, mask: int) -> GpuChoice:
    """The GpuChoice for a set chosen elsewhere (a group's rail-aligned set) among `candidates`."""
    choice = _choice(shape, candidates, Found(mask))
    assert choice is not None
    return choice


# --- symmetric candidates ----------------------------------------------------------------------------


@lru_cache(maxsize=4096)
def _blocks(shape: Shape, candidates: int, floor: int = 1, equal_links: bool = True) -> tuple[int, ...] | None:
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


def _clique_blocks(shape: Shape, candidates: int, k: int) -> tuple[int, ...] | None:
    """Blocks (as `_blocks`) at the strongest link floor where some block holds k GPUs: every best
    clique has that minimum link count, so lies in one of them. None when the wiring is not blocks."""
    counts = _link_counts(shape)
    for floor in counts:
        # At the weakest count linked means adjacent: the cheap adjacency masks answer.
        blocks = _blocks(shape, candidates, 1 if floor == counts[-1] else floor)
        if blocks is None:
            return None
        if any(popcount(b) >= k for b in blocks):
            return blocks
    return ()  # no k-clique at any floor


def _clique_in_blocks(shape: Shape, candidates: int, blocks: tuple[int, ...], k: int, near: int) -> int | None:
    # Inside one block the link and fragmentation terms are equal for every k-set, and NIC nearness
    # outranks NUMA span; the blocks' winners are then compared on the full rank.
    best: tuple[tuple[int, ...], int] | None = None
    for block in blocks:
        if popcount(block) < k:
            continue
        s = symmetric_set(shape, block, k, near, near_first=True)
        rank = _rank("clique", shape, candidates, s, near)
        if best is None or rank > best[0] or (rank == best[0] and _lower(s, best[1])):
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


# --- general path: enumerate counts per class of interchangeable GPUs -----------------------------------


@lru_cache(maxsize=256)
def _symmetric_links(shape: Shape) -> bool:
    return all(shape.links[a][b] == shape.links[b][a] for a in range(shape.n) for b in range(a))


@lru_cache(maxsize=4096)
def twin_classes(shape: Shape, pool: int, near: int) -> tuple[tuple[int, ...], ...]:
    """`pool` split into classes of GPUs that swap without changing any rank term, each ascending."""
    members = bits(pool)
    if not _symmetric_links(shape):  # swapping needs symmetric links; validated topologies have them
        return tuple((i,) for i in members)
    pos = {i: p for p, i in enumerate(members)}
    rows = {i: [0 if x == i else shape.links[i][x] for x in members] for i in members}
    classes: list[list[int]] = []
    for i in members:
        for cls in classes:
            j = cls[0]
            if shape.numa[i] != shape.numa[j] or (near >> i & 1) != (near >> j & 1):
                continue
            # Twins: i's row with the i/j entries swapped is j's row (same links to everyone else).
            row = rows[i].copy()
            row[pos[i]], row[pos[j]] = row[pos[j]], row[pos[i]]
            if row == rows[j]:
                cls.append(i)
                break
        else:
            classes.append([i])
    return tuple(tuple(c) for c in classes)


def class_search(
    kind: Kind, shape: Shape, candidates: int, k: int, near: int = 0, budget: int = SEARCH_BUDGET
) -> Found:
    """Exact over how many GPUs to take from each twin class; within a class the lowest indices, which is
    the exhaustive search's tie-break. Stops after `budget` steps with the best found, flagged."""
    classes = twin_classes(shape, candidates, near)
    prefix = [[mask_of(list(c[:x])) for x in range(len(c) + 1)] for c in classes]
    linked_inside = [len(c) == 1 or bool(shape.adj[c[0]] >> c[1] & 1) for c in classes]
    members_after = [0] * (len(classes) + 1)  # GPUs of classes c.. (what is left to choose from)
    for c in range(len(classes) - 1, -1, -1):
        members_after[c] = members_after[c + 1] | prefix[c][-1]
    class_of = {i: c for c, cls in enumerate(classes) for i in cls}
    clique = kind == "clique"
    best: tuple[tuple[int, ...], int] | None = None
    first: int | None = None  # the first admissible set reached, ranked or not
    steps = 0

    def visit(c: int, need: int, chosen: int, allowed: int) -> bool:
        """False once the budget is spent. `allowed`: GPUs linked to every chosen one (for cliques; all
        candidates otherwise)."""
        nonlocal best, first, steps
        steps += 1
        if steps > budget:
            return False
        if need == 0:
            if first is None:
                first = chosen
            # Ranking needs the largest clique left, itself a search: its steps count too.
            rest_clique, spent = max_clique_within(shape.adj, candidates & ~chosen, budget - steps)
            steps += spent
            if rest_clique is None:
                return False
            rank = _rank(kind, shape, candidates, chosen, near, rest_clique)
            if best is None or rank > best[0] or (rank == best[0] and _lower(chosen, best[1])):
                best = (rank, chosen)
            return True
        left = members_after[c] & allowed
        if popcount(left) < need:
            return True
        # Skip to the class of the lowest GPU still allowed: a class is allowed whole or not at all, and
        # classes are ordered by their lowest GPU, so no usable class lies between.
        c = class_of[(left & -left).bit_length() - 1]
        cls = classes[c]
        top = min(len(cls), need) if linked_inside[c] or not clique else 1
        for x in range(top, -1, -1):  # the largest takes first: the lowest indices are ranked early
            narrowed = allowed & shape.adj[cls[0]] if clique and x else allowed
            if not visit(c + 1, need - x, chosen | prefix[c][x], narrowed):
                return False
        return True

    complete = visit(0, k, 0, candidates)
    if best is not None:
        return Found(best[1], not complete)
    if complete:
        return Found(None)
    # Out of budget before any set was ranked: some admissible set rather than a false "none".
    if first is None:
        first = greedy_clique(shape, candidates, k) if clique else mask_of(bits(candidates)[:k])
    return Found(first, True)


def greedy_clique(shape: Shape, candidates: int, k: int) -> int | None:
    """Some k-clique when a simple greedy finds one (from each start, add the best-connected neighbour)."""
    for start in bits(candidates):
        chosen = 1 << start
        pool = shape.adj[start] & candidates
        while popcount(chosen) < k and pool:
            nxt = max(bits(pool), key=lambda i: (popcount(shape.adj[i] & pool), -i))
            chosen |= 1 << nxt
            pool &= shape.adj[nxt]
        if popcount(chosen) == k:
            return chosen
    return None


# --- the engine's entry points ------------------------------------------------------------------------


@lru_cache(maxsize=65536)
def choose_clique(
    shape: Shape, candidates: int, k: int, near_nic: int = 0, budget: int = SEARCH_BUDGET
) -> GpuChoice | None:
    """Best fully connected k-set inside `candidates`, or None when there is none."""
    return _choice(shape, candidates, best_set("clique", shape, candidates, k, near_nic, budget))


@lru_cache(maxsize=65536)
def choose_connected(
    shape: Shape, candidates: int, k: int, near_nic: int = 0, budget: int = SEARCH_BUDGET
) -> GpuChoice | None:
    """`nvlink: preferred` fallback: the best-connected k-set (most NVLink pairs, then link strength)."""
    return _choice(shape, candidates, best_set("connected", shape, candidates, k, near_nic, budget))


@lru_cache(maxsize=65536)
def choose_any(
    shape: Shape, candidates: int, k: int, near_nic: int = 0, budget: int = SEARCH_BUDGET
) -> GpuChoice | None:
    """`nvlink: ignore`: take GPUs that break the fewest cliques, on as few NUMA nodes as possible."""
    return _choice(shape, candidates, best_set("any", shape, candidates, k, near_nic, budget))


def _choice(shape: Shape, candidates: int, found: Found) -> GpuChoice | None:
    if found.mask is None:
        return None
    chosen = found.mask
    g = tuple(bits(chosen))
    rest = candidates & ~chosen
    linked = connected_pairs(shape.adj, chosen)
    k = len(g)
    return GpuChoice(
        g,
        linked == k * (k - 1) // 2,
        shape.min_link(g),
        largest_clique(shape, rest),
        popcount(rest),
        linked,
        found.truncated,
    )
