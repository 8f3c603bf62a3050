"""The GPU-set choice itself: `best_set` dispatches to the search the wiring allows; `rail_options`
ranks sets by rails for group planning. The package docstring gives the ranking and the searches."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import comb

from gputopo.engine.node.gpusets.classes import SEARCH_BUDGET, class_search
from gputopo.engine.node.gpusets.rank import Found, Kind, exhaustive_set, largest_clique, rank_key
from gputopo.engine.node.gpusets.symmetric import clique_blocks, clique_in_blocks, link_blocks, symmetric_set
from gputopo.engine.state.cliques import all_subsets, bits, connected_pairs, k_cliques, popcount
from gputopo.engine.state.snapshot import Shape

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
        blocks = clique_blocks(shape, candidates, k)
        if blocks is not None:
            return Found(clique_in_blocks(shape, candidates, blocks, k, near))
    elif kind != "clique":
        # `any` ranks by which GPUs stay linked, not by how strongly: there link counts need not be equal
        # (an NVSwitch node with one degraded GPU is still symmetric for it).
        blocks = link_blocks(shape, candidates, 1, kind != "any")
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
        rank = rank_key(kind, shape, candidates, s, near)
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
