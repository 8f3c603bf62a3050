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

from gputopo.engine.node.gpusets.choose import (
    FEW_CLIQUE_SUBSETS,
    FEW_SETS,
    RAIL_AFTER,
    GpuChoice,
    RailOption,
    best_set,
    choice_of,
    choose_any,
    choose_clique,
    choose_connected,
    rail_options,
    set_rails,
)
from gputopo.engine.node.gpusets.classes import SEARCH_BUDGET, class_search, greedy_clique, twin_classes
from gputopo.engine.node.gpusets.rank import Found, Kind, exhaustive_set, largest_clique, rank_key
from gputopo.engine.node.gpusets.symmetric import symmetric_set

__all__ = [
    "FEW_CLIQUE_SUBSETS",
    "FEW_SETS",
    "RAIL_AFTER",
    "SEARCH_BUDGET",
    "Found",
    "GpuChoice",
    "Kind",
    "RailOption",
    "best_set",
    "choice_of",
    "choose_any",
    "choose_clique",
    "choose_connected",
    "class_search",
    "exhaustive_set",
    "greedy_clique",
    "largest_clique",
    "rail_options",
    "rank_key",
    "set_rails",
    "symmetric_set",
    "twin_classes",
]
