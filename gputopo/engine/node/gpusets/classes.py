"""The general GPU-set search: how many GPUs to take from each class of twins, within a step budget."""

from __future__ import annotations

from functools import lru_cache

from gputopo.engine.node.gpusets.rank import Found, Kind, lower, rank_key
from gputopo.engine.state.cliques import bits, mask_of, max_clique_within, popcount
from gputopo.engine.state.snapshot import Shape

# Steps one decision may spend on the general path: classes visited, plus the branch steps of finding
# the largest clique each ranked set leaves. Every node of today's systems (at most 8 GPUs, 70 sets)
# stays far below it; it bounds an irregular large node to milliseconds instead of an exponential search.
SEARCH_BUDGET = 8192


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
            rank = rank_key(kind, shape, candidates, chosen, near, rest_clique)
            if best is None or rank > best[0] or (rank == best[0] and lower(chosen, best[1])):
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
