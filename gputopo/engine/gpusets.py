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
from math import comb

# The searches live in setrank, symmetric and classsearch; their public names are re-exported so
# callers keep importing the whole GPU-set choice from here.
from gputopo.engine.classsearch import SEARCH_BUDGET as SEARCH_BUDGET
from gputopo.engine.classsearch import class_search as class_search
from gputopo.engine.classsearch import greedy_clique as greedy_clique
from gputopo.engine.classsearch import twin_classes as twin_classes
from gputopo.engine.cliques import all_subsets, bits, connected_pairs, k_cliques, popcount
from gputopo.engine.setrank import Found as Found
from gputopo.engine.setrank import Kind as Kind
from gputopo.engine.setrank import _rank
from gputopo.engine.setrank import exhaustive_set as exhaustive_set
from gputopo.engine.setrank import largest_clique as largest_clique
from gputopo.engine.snapshot import Shape
from gputopo.engine.symmetric import _blocks, _clique_blocks, _clique_in_blocks
from gputopo.engine.symmetric import symmetric_set as symmetric_set

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
