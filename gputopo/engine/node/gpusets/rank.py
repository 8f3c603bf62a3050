"""The rank every GPU-set search maximises, its lowest-index tie-break, and the exhaustive reference."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from itertools import islice
from typing import Literal

from gputopo.engine.state.cliques import all_subsets, bits, connected_pairs, k_cliques, max_clique_size, popcount
from gputopo.engine.state.snapshot import Shape

Kind = Literal["clique", "connected", "any"]


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


def rank_key(kind: Kind, shape: Shape, candidates: int, s: int, near: int, rest_clique: int = -1) -> tuple[int, ...]:
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
        rank = rank_key(kind, shape, candidates, s, near)
        if best is None or rank > best[0]:
            best = (rank, s)
    return None if best is None else best[1]


def lower(a: int, b: int) -> bool:
    """Whether set `a` comes before `b` in ascending index order (the exhaustive search's tie-break)."""
    return bits(a) < bits(b)
