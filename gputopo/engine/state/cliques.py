"""NVLink clique search over GPU bitmasks. Exact and deterministic.

GPUs are bits; `adj[i]` is the mask of GPUs with at least one NVLink link to GPU i. Enumerating cliques
is exponential in the node's size, so callers bound it (the gpusets package) and memoise results on (shape,
usable mask, size); the largest clique is a branch and bound, quick on the regular wiring of real nodes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import combinations


def bits(mask: int) -> list[int]:
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


def popcount(mask: int) -> int:
    return mask.bit_count()


def mask_of(indices: tuple[int, ...] | list[int] | frozenset[int]) -> int:
    m = 0
    for i in indices:
        m |= 1 << i
    return m


def k_cliques(adj: tuple[int, ...], candidates: int, k: int) -> Iterator[int]:
    """Every fully connected set of exactly k GPUs inside `candidates`, as masks, in ascending order."""
    if k <= 0:
        yield 0
        return

    def grow(chosen: int, cand: int, need: int) -> Iterator[int]:
        if need == 0:
            yield chosen
            return
        while cand and popcount(cand) >= need:
            low = cand & -cand
            i = low.bit_length() - 1
            cand ^= low
            yield from grow(chosen | low, cand & adj[i], need - 1)

    yield from grow(0, candidates, k)


def max_clique_size(adj: tuple[int, ...], candidates: int) -> int:
    """Size of the largest fully connected set inside `candidates` (0 for an empty mask)."""
    size, _ = max_clique_within(adj, candidates, None)
    assert size is not None  # no limit, so always answered
    return size


class _OverLimit(Exception):
    pass


def max_clique_within(adj: tuple[int, ...], candidates: int, limit: int | None) -> tuple[int | None, int]:
    """`max_clique_size` and the branch steps it took; (None, steps) once more than `limit` steps were
    needed, so a caller with a work budget can stop instead of waiting on a dense irregular node."""
    best = 0
    steps = 0

    def expand(size: int, cand: int) -> None:
        nonlocal best, steps
        steps += 1
        if limit is not None and steps > limit:
            raise _OverLimit
        if not cand:
            best = max(best, size)
            return
        if size + popcount(cand) <= best:
            return
        while cand:
            if size + popcount(cand) <= best:
                return
            low = cand & -cand
            i = low.bit_length() - 1
            cand ^= low
            expand(size + 1, cand & adj[i])

    try:
        expand(0, candidates)
    except _OverLimit:
        return None, steps
    return best, steps


def connected_pairs(adj: tuple[int, ...], mask: int) -> int:
    """Number of NVLink-connected GPU pairs inside `mask`."""
    return sum(popcount(adj[i] & mask) for i in bits(mask)) // 2


def all_subsets(candidates: int, k: int) -> Iterator[int]:
    """Every k-subset of `candidates` (for `nvlink: preferred|ignore`, where sets need not be cliques)."""
    for combo in combinations(bits(candidates), k):
        yield mask_of(combo)


class _Capped(Exception):
    pass


def maximal_cliques(adj: Sequence[int], usable: int) -> list[int]:
    """Every maximal fully connected set inside `usable` (masks), largest first, then lowest mask.
    Unbounded: for a node's own topology use `capped_cliques` (exponential in the worst case)."""
    out, _ = capped_cliques(adj, usable, max_cliques=None, max_steps=None)
    return out


def capped_cliques(
    adj: Sequence[int], usable: int, max_cliques: int | None, max_steps: int | None
) -> tuple[list[int], bool]:
    """Maximal cliques inside `usable`, largest first, then lowest mask, and whether a cap stopped the
    enumeration (then the list holds the first `max_cliques` found, not all). Bron-Kerbosch with pivoting."""
    out: list[int] = []
    steps = 0

    def expand(r: int, p: int, x: int) -> None:
        nonlocal steps
        steps += 1
        if max_steps is not None and steps > max_steps:
            raise _Capped
        if not p and not x:
            if max_cliques is not None and len(out) >= max_cliques:
                raise _Capped
            out.append(r)
            return
        pivot = max(bits(p | x), key=lambda u: popcount(p & adj[u]))
        for v in bits(p & ~adj[pivot]):
            bit = 1 << v
            expand(r | bit, p & adj[v], x & adj[v])
            p &= ~bit
            x |= bit

    capped = False
    if usable:
        try:
            expand(0, usable, 0)
        except _Capped:
            capped = True
    out.sort(key=lambda m: (-popcount(m), m))
    return out, capped
