"""NVIDIA go-gpuallocator's `besteffort` policy, as a pure function over a `NodeTopology`.

This is what the NVIDIA device plugin does when kubelet asks it for a preferred allocation: it is
the fallback for pods without a usable gputopo placement, and the simulator's `default` policy.

The policy (go-gpuallocator `gpuallocator/besteffort_policy.go`):

- Every GPU pair gets a score: the sum over the P2P links between them, 100 per NVLink link plus
  one PCIe path score (`gputopo.engine.state.scoring.LINK_SCORE`): single switch (PIX) 50, multiple
  switches (PXB) 40, host bridge (PHB) 30, same CPU (NODE) 20, cross CPU (SYS) 10, and 0 when the
  path is unknown (upstream also has same board, 60). A set scores the sum over its pairs.
- The available GPUs, in the caller's order, are padded with empty slots up to a multiple of `size`
  and every partition into sets of `size` is considered in which the padding sits in one set; a
  partition counts only when one set without padding holds every `must_include` GPU. The partition
  with the highest sum of set scores wins, the first one in enumeration order on ties.
- From that partition, the highest-scoring set that holds every `must_include` GPU is returned, the
  first one on ties.

Two deliberate differences: the padded set is never returned (upstream can return it and then hands
out fewer GPUs than asked, go-gpuallocator PR #80), and the search is a memoised dynamic program over
the remaining GPUs, pruned by an upper bound, instead of a walk over every partition (upstream's walk
can take seconds, k8s-device-plugin #774). It finds the same partition, including the first-in-order
tie-break, because the partitions are enumerated lexicographically: the first optimal partition takes
the first optimal set for its lowest remaining GPU, then recurses.

Where the PCIe relation comes from: the topology document has no GPU-to-GPU PCIe matrix, so it is
derived from what the agent measures. A NIC that reports PIX (resp. PXB, PHB) to both GPUs puts
them under one PCIe switch (resp. one switch tree, one host bridge), so the pair is at most that
far apart; otherwise GPUs on the same `numaNode` are NODE and GPUs on different ones SYS; a GPU with
no `numaNode` and no shared NIC gives an unknown path (0, as upstream scores an unknown link).
`pciBusId` is not used: bus numbers alone do not reveal the switch hierarchy. Same board (60) is
never derived; nothing in the document says that two GPUs share a board. A caller that knows the
real distances (NVML's common ancestor, as the device plugin on the node can ask) passes `pcie`.

NVLink counts are `nvlink.links`, which already exclude down links. On an NVSwitch node upstream
sees no GPU-to-GPU NVLink at all (NVML names the switch as the remote end); with equal counts on
every pair, as on a healthy NVSwitch node, adding them changes no choice, because every candidate
partition has the same number of GPU pairs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache
from itertools import combinations
from math import comb

from gputopo.engine.state.scoring import LINK_SCORE
from gputopo.model import LinkType, NodeTopology, PcieDistance

PCIE_LINK_TYPE: dict[PcieDistance, LinkType] = {
    PcieDistance.PIX: LinkType.SINGLE_SWITCH,
    PcieDistance.PXB: LinkType.MULTI_SWITCH,
    PcieDistance.PHB: LinkType.HOST_BRIDGE,
    PcieDistance.NODE: LinkType.SAME_CPU,
    PcieDistance.SYS: LinkType.CROSS_CPU,
}

PcieMatrix = Sequence[Sequence[PcieDistance | None]]
ScoreMatrix = tuple[tuple[int, ...], ...]

# A NIC shared at these distances bounds the GPU-to-GPU path; NODE and SYS say nothing NUMA does not.
_BOUNDING_RANK = PcieDistance.PHB.rank
_BY_RANK = tuple(PcieDistance)
_NVLINK_POINTS = LINK_SCORE[LinkType.NVLINK]
_PCIE_POINTS = {d: LINK_SCORE[t] for d, t in PCIE_LINK_TYPE.items()}


def pcie_distances(topology: NodeTopology) -> tuple[tuple[PcieDistance | None, ...], ...]:
    """The PCIe path of every GPU pair as derived from the document (module docstring); None on the
    diagonal and where the path is unknown."""
    n = len(topology.gpus)
    ranks = [[d.rank for d in nic.gpu_affinity] for nic in topology.nics if nic.gpu_affinity]
    numa = [g.numa_node for g in topology.gpus]
    rows = []
    for a in range(n):
        row: list[PcieDistance | None] = []
        for b in range(n):
            nearest = min((max(r[a], r[b]) for r in ranks), default=len(_BY_RANK))
            if a == b:
                row.append(None)
            elif nearest <= _BOUNDING_RANK:
                row.append(_BY_RANK[nearest])
            elif numa[a] is None or numa[b] is None:
                row.append(None)
            else:
                row.append(PcieDistance.NODE if numa[a] == numa[b] else PcieDistance.SYS)
        rows.append(tuple(row))
    return tuple(rows)


def pcie_distance(topology: NodeTopology, a: int, b: int) -> PcieDistance | None:
    """The PCIe path between GPUs `a` and `b` (see `pcie_distances`)."""
    return pcie_distances(topology)[a][b]


def pair_scores(topology: NodeTopology, pcie: PcieMatrix | None = None) -> ScoreMatrix:
    """go-gpuallocator's score of every GPU pair: 100 per NVLink link plus the PCIe path score
    (symmetric, zero diagonal). `pcie` overrides the derived paths; compute once per node."""
    n = len(topology.gpus)
    if pcie is not None and (len(pcie) != n or any(len(row) != n for row in pcie)):
        raise ValueError(f"pcie must be a {n}x{n} matrix")
    paths = pcie if pcie is not None else pcie_distances(topology)
    links = topology.nvlink.links or ((0,) * n,) * n
    return tuple(
        tuple(
            0 if a == b else _NVLINK_POINTS * links[a][b] + (_PCIE_POINTS[p] if (p := paths[a][b]) is not None else 0)
            for b in range(n)
        )
        for a in range(n)
    )


def pair_score(topology: NodeTopology, a: int, b: int, pcie: PcieMatrix | None = None) -> int:
    """go-gpuallocator's score for one GPU pair (see `pair_scores`)."""
    return pair_scores(topology, pcie)[a][b]


def best_effort(
    topology: NodeTopology,
    available: Sequence[int],
    must_include: Sequence[int],
    size: int,
    *,
    pcie: PcieMatrix | None = None,
) -> tuple[int, ...]:
    """The `size` GPUs (sorted indices) go-gpuallocator's besteffort policy picks from `available`.

    `available` is taken in the caller's order, which decides ties as upstream. Raises ValueError
    when the request cannot be met: an index the node does not have, a repeated index, `must_include`
    not inside `available`, `size` below `len(must_include)` or above `len(available)`.
    """
    return best_effort_scores(pair_scores(topology, pcie), available, must_include, size)


def best_effort_scores(
    scores: ScoreMatrix, available: Sequence[int], must_include: Sequence[int], size: int
) -> tuple[int, ...]:
    """`best_effort` over a precomputed `pair_scores` matrix (memoised: callers repeat themselves)."""
    n = len(scores)
    for name, seq in (("available", available), ("must_include", must_include)):
        bad = [i for i in seq if not 0 <= i < n]
        if bad:
            raise ValueError(f"{name} names GPU {bad[0]}, the node has GPUs 0-{n - 1}" if n else "the node has no GPUs")
        if len(set(seq)) != len(seq):
            raise ValueError(f"{name} repeats a GPU: {list(seq)}")
    missing = sorted(set(must_include) - set(available))
    if missing:
        raise ValueError(f"must_include GPUs {missing} are not available")
    if size < len(must_include):
        raise ValueError(f"size {size} is smaller than must_include ({len(must_include)} GPUs)")
    if size > len(available):
        raise ValueError(f"size {size} exceeds the {len(available)} available GPUs")
    if size == 0:
        return ()
    return _search(scores, tuple(available), frozenset(must_include), size)


Solver = Callable[[int, bool, bool], tuple[int, int] | None]
# A candidate first set: (its GPUs' mask, upstream's enumeration key, its padding's mask or 0).
_Cand = tuple[int, tuple[int, ...], int]


@lru_cache(maxsize=4096)
def _search(scores: ScoreMatrix, order: tuple[int, ...], must: frozenset[int], size: int) -> tuple[int, ...]:
    # Positions 0..n-1 are `order`; padding slots are the bits above them, so (as upstream) they come
    # after every GPU and the lowest remaining position of a state is always a GPU.
    n = len(order)
    pad = -n % size
    real = (1 << n) - 1
    must_mask = sum(1 << p for p, g in enumerate(order) if g in must)
    rows = [[scores[a][b] for b in order] for a in order]
    score_of = _set_scorer(rows)
    best = _solver(rows, size, must_mask, score_of)
    no_must = not must_mask  # with nothing required, any partition counts
    if best(real, pad > 0, no_must) is None:
        raise ValueError("no partition holds must_include in one set")  # unreachable after validation
    pick = _first_best_set(best, score_of, n, pad, must_mask)
    return tuple(sorted(order[p] for p in range(n) if pick >> p & 1))


def _set_scorer(rows: list[list[int]]) -> Callable[[int], int]:
    """A set's score (the sum over its pairs) by position mask, memoised across the search."""
    n = len(rows)
    set_score: dict[int, int] = {0: 0}

    def score_of(mask: int) -> int:
        s = set_score.get(mask)
        if s is None:
            low = mask & -mask
            i = low.bit_length() - 1
            rest = mask ^ low
            s = score_of(rest) + sum(rows[i][j] for j in range(i + 1, n) if rest >> j & 1)
            set_score[mask] = s
        return s

    return score_of


def _bounds(
    rows: list[list[int]], size: int, pad: int
) -> tuple[Callable[[int, bool], int], Callable[[int, bool], int], Callable[[int, bool], bool]]:
    """Twice the best any partition of `mask` can score (`bound`, cheap; `local_bound`, tighter),
    and whether a state is worth the tighter one: lets a state skip sets that cannot beat its best.

    Every GPU pairs with at most `size - 1` others (each pair counted from both ends), and while the
    padding is unplaced `size - pad` GPUs pair with only `size - pad - 1`."""
    n = len(rows)
    ranked_rows = [sorted(row, reverse=True) for row in rows]
    top = [sum(r[: size - 1]) for r in ranked_rows]
    short = [top[i] - sum(r[: size - pad - 1]) for i, r in enumerate(ranked_rows)]
    bound_of: dict[tuple[int, bool], int] = {}

    def bound(mask: int, padded: bool) -> int:
        b = bound_of.get((mask, padded))
        if b is None:
            idx = [j for j in range(n) if mask >> j & 1]
            b = sum(top[j] for j in idx)
            if padded:
                b -= sum(sorted(short[j] for j in idx)[: size - pad])
            bound_of[(mask, padded)] = b
        return b

    local_of: dict[tuple[int, bool], int] = {}

    def local_bound(mask: int, padded: bool) -> int:
        """`bound` with each GPU's best partners taken among `mask` only: dearer, and tighter."""
        b = local_of.get((mask, padded))
        if b is None:
            idx = [j for j in range(n) if mask >> j & 1]
            b = 0
            shorts = []
            for v in idx:
                best_first = sorted((rows[v][u] for u in idx if u != v), reverse=True)
                full = sum(best_first[: size - 1])
                b += full
                shorts.append(full - sum(best_first[: size - pad - 1]))
            if padded:
                b -= sum(sorted(shorts)[: size - pad])
            local_of[(mask, padded)] = b
        return b

    def worth_bounding(gpus: int, padded: bool) -> bool:
        """Bounding a state costs about gpus² steps; a two-set state is solved in one per split."""
        if gpus + (pad if padded else 0) > 2 * size:
            return True
        splits = comb(gpus - 1, size - 1) + (comb(gpus - 1, size - 1 - pad) if padded else 0)
        return splits > gpus * gpus // 2

    return bound, local_bound, worth_bounding


def _solver(rows: list[list[int]], size: int, must_mask: int, score_of: Callable[[int], int]) -> Solver:
    """`best(left, padded, done)`: the best sum of set scores over the remaining GPUs `left` (padding
    still unplaced, must_include already in a set) and the first set achieving it, or None when no
    partition counts; memoised."""
    n = len(rows)
    pad = -n % size
    pads = ((1 << pad) - 1) << n
    pad_bits = tuple(1 << (n + j) for j in range(pad))
    bound, local_bound, worth_bounding = _bounds(rows, size, pad)
    memo: dict[tuple[int, bool, bool], tuple[int, int] | None] = {}

    def best(left: int, padded: bool, done: bool) -> tuple[int, int] | None:
        key = (left, padded, done)
        if key in memo:
            return memo[key]
        slots = left.bit_count() + (pad if padded else 0)
        result: tuple[int, int] | None = None
        if slots == size:
            if done or (not padded and left & must_mask == must_mask):
                result = (score_of(left), left | (pads if padded else 0))
            memo[key] = result
            return result
        low = left & -left
        rest = [1 << j for j in range(n) if (left ^ low) >> j & 1]
        # Upstream walks the sets holding the lowest remaining GPU in lexicographic order, padding
        # last, and keeps the first best. Sets with part of the padding never count, so only the
        # padding-free sets and those with all of it are built; `order_key` keeps upstream's order.
        cands: list[_Cand] = [(low + sum(c), c, 0) for c in combinations(rest, size - 1)]
        if padded:
            cands += [(low + sum(c), c + pad_bits, pads) for c in combinations(rest, size - 1 - pad)]
        if slots == 2 * size:
            result = _best_split(cands, left, padded, done, must_mask, score_of)
            memo[key] = result
            return result
        best_order: tuple[int, ...] = ()
        # Most promising first (score plus the bound on the rest): once a set's bound falls below
        # the best found, every later one's does too. Ties still go to upstream's order.
        ranked = [(2 * score_of(c[0]) + bound(left & ~c[0], padded and not c[2]), c) for c in cands]
        ranked.sort(key=lambda r: -r[0])
        for optimistic, (gpus, order_key, padding) in ranked:
            if result is not None and optimistic < 2 * result[0]:
                break
            now_done = done
            if not done and gpus & must_mask:
                if gpus & must_mask != must_mask or padding:
                    continue  # must_include split across sets, or only in the padded set
                now_done = True
            child = (left & ~gpus, padded and not padding, now_done)
            if (
                result is not None
                and child not in memo  # a solved child is cheaper to read than to bound
                and worth_bounding(child[0].bit_count(), child[1])
                and 2 * score_of(gpus) + local_bound(child[0], child[1]) < 2 * result[0]
            ):
                continue
            tail = best(*child)
            if tail is None:
                continue
            total = score_of(gpus) + tail[0]
            if result is None or total > result[0] or (total == result[0] and order_key < best_order):
                result, best_order = (total, gpus | padding), order_key
        memo[key] = result
        return result

    return best


def _best_split(
    cands: list[_Cand], left: int, padded: bool, done: bool, must_mask: int, score_of: Callable[[int], int]
) -> tuple[int, int] | None:
    """Two sets left, the second being whatever the first leaves: score every split exactly."""
    result: tuple[int, int] | None = None
    best_order: tuple[int, ...] = ()
    for gpus, order_key, padding in cands:
        other = left & ~gpus
        if not done:
            ok_here = gpus & must_mask == must_mask and not padding
            ok_there = other & must_mask == must_mask and not (padded and not padding)
            if not (ok_here or ok_there):
                continue
        total = score_of(gpus) + score_of(other)
        if result is None or total > result[0] or (total == result[0] and order_key < best_order):
            result, best_order = (total, gpus | padding), order_key
    return result


def _first_best_set(best: Solver, score_of: Callable[[int], int], n: int, pad: int, must_mask: int) -> int:
    """Walk the winning partition set by set and keep the first best set holding must_include."""
    real = (1 << n) - 1
    pads = ((1 << pad) - 1) << n
    left, padded, done = real, pad > 0, not must_mask
    pick: tuple[int, int] | None = None
    while left:
        step = best(left, padded, done)
        assert step is not None
        chosen = step[1]
        gpus = chosen & real
        padding = chosen & pads
        if not padding and gpus & must_mask == must_mask:
            s = score_of(gpus)
            if pick is None or s > pick[0]:
                pick = (s, gpus)
        done = done or (gpus & must_mask == must_mask and not padding and must_mask != 0)
        left &= ~gpus
        padded = padded and not padding
    assert pick is not None
    return pick[1]
