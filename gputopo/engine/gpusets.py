"""Choosing which GPUs inside one node a pod gets. Exact over all candidate sets, deterministic.

Ranking, for `nvlink: required` (and `preferred` when a clique exists): strongest links first (the
minimum pairwise NVLink count), then the set that leaves the best clique free for later pods
(fragmentation-aware), then GPUs near an accepted NIC, then one NUMA node, then lowest indices.
Results are memoised on (shape, candidate mask, size, preferences): thousands of identical nodes cost
one search.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from gputopo.engine.cliques import all_subsets, bits, connected_pairs, k_cliques, max_clique_size, popcount
from gputopo.engine.snapshot import Shape


@dataclass(frozen=True)
class GpuChoice:
    gpus: tuple[int, ...]
    clique: bool  # fully NVLink-connected (trivially true for one GPU)
    min_links: int
    remaining_clique: int  # largest clique left among the candidates not taken
    remaining_free: int
    linked_pairs: int = 0  # chosen GPU pairs joined by NVLink


def _numa_span(shape: Shape, mask: int) -> int:
    return len({shape.numa[i] for i in bits(mask)})


def _pair_link_sum(shape: Shape, gpus: list[int]) -> int:
    return sum(shape.links[a][b] for i, a in enumerate(gpus) for b in gpus[i + 1 :])


@lru_cache(maxsize=65536)
def largest_clique(shape: Shape, mask: int) -> int:
    return max_clique_size(shape.adj, mask)


@lru_cache(maxsize=65536)
def choose_clique(shape: Shape, candidates: int, k: int, near_nic: int = 0) -> GpuChoice | None:
    """Best fully connected k-set inside `candidates`, or None when there is none."""
    best: tuple[tuple[int, ...], int] | None = None
    for s in k_cliques(shape.adj, candidates, k):
        g = bits(s)
        rest = candidates & ~s
        rank = (
            shape.min_link(tuple(g)),
            largest_clique(shape, rest),
            connected_pairs(shape.adj, rest),
            popcount(s & near_nic),
            -_numa_span(shape, s),
            _pair_link_sum(shape, g),
        )
        if best is None or rank > best[0]:  # strict: on ties the lowest indices (found first) win
            best = (rank, s)
    return None if best is None else _choice(shape, candidates, best[1])


@lru_cache(maxsize=65536)
def choose_connected(shape: Shape, candidates: int, k: int, near_nic: int = 0) -> GpuChoice | None:
    """`nvlink: preferred` fallback: the best-connected k-set (most NVLink pairs, then link strength)."""
    best: tuple[tuple[int, ...], int] | None = None
    for s in all_subsets(candidates, k):
        g = bits(s)
        rest = candidates & ~s
        rank = (
            connected_pairs(shape.adj, s),
            _pair_link_sum(shape, g),
            -_numa_span(shape, s),
            largest_clique(shape, rest),
            popcount(s & near_nic),
        )
        if best is None or rank > best[0]:
            best = (rank, s)
    return None if best is None else _choice(shape, candidates, best[1])


@lru_cache(maxsize=65536)
def choose_any(shape: Shape, candidates: int, k: int, near_nic: int = 0) -> GpuChoice | None:
    """`nvlink: ignore`: take GPUs that break the fewest cliques, on as few NUMA nodes as possible."""
    best: tuple[tuple[int, ...], int] | None = None
    for s in all_subsets(candidates, k):
        rest = candidates & ~s
        rank = (
            largest_clique(shape, rest),
            connected_pairs(shape.adj, rest),
            -_numa_span(shape, s),
            popcount(s & near_nic),
        )
        if best is None or rank > best[0]:
            best = (rank, s)
    return None if best is None else _choice(shape, candidates, best[1])


def _choice(shape: Shape, candidates: int, chosen: int) -> GpuChoice:
    g = tuple(bits(chosen))
    rest = candidates & ~chosen
    linked = connected_pairs(shape.adj, chosen)
    k = len(g)
    return GpuChoice(
        g, linked == k * (k - 1) // 2, shape.min_link(g), largest_clique(shape, rest), popcount(rest), linked
    )
