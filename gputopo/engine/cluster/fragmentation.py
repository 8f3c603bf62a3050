"""Fragmentation of free GPUs: which free GPUs pods of the wanted sizes can use. Pure: no I/O.

A free GPU is *usable* for pods of k GPUs when it lies in one of the most disjoint free k-GPU NVLink
cliques the node can hold (k = 1: every free GPU). It is *stranded* when no packing of free cliques
of the sizes asked about (mixing sizes) covers it: no pod of those sizes can use it as things stand.
Only free healthy GPUs of nodes that take gputopo pods count; GPUs with a degraded link are kept out
of cliques of 2+, as the engine keeps them out of `nvlink: required` sets. Figures add up over nodes
and over node classes (nodes of one kind fragment alike); `gputopo.engine.cluster.defrag` searches the pod
moves that improve them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

from gputopo.engine.state.cliques import bits, k_cliques, popcount
from gputopo.engine.state.snapshot import NodeState, Shape, shape_of

# The pod sizes measured against when no pending gputopo pod says otherwise: the tensor-parallel
# degrees of typical training and inference jobs on 8-GPU nodes.
DEFAULT_SIZES: tuple[int, ...] = (8, 4, 2)
# Branch steps the exact clique packing of one irregular free set may take before it settles for a
# greedy packing. An 8-GPU node has 256 subsets, each searched once, so it never gets near; the bound
# keeps an irregular 64-GPU topology from an exponential search.
COVER_BUDGET = 20_000


# --------------------------------------------------------------------------- clique packing


def _representable(total: int, sizes: tuple[int, ...]) -> int:
    """The largest sum of `sizes` (each any number of times) not above `total`."""
    reach = 1  # bit s set: sum s is reachable
    for s in range(1, total + 1):
        if any(k <= s and reach >> (s - k) & 1 for k in sizes):
            reach |= 1 << s
    return reach.bit_length() - 1


def _components(adj: tuple[int, ...], mask: int) -> list[int]:
    out = []
    left = mask
    while left:
        comp = seen = left & -left
        while seen:
            low = seen & -seen
            seen ^= low
            grow = adj[low.bit_length() - 1] & mask & ~comp
            comp |= grow
            seen |= grow
        out.append(comp)
        left &= ~comp
    return out


def _is_clique(adj: tuple[int, ...], mask: int) -> bool:
    return all((adj[i] | (1 << i)) & mask == mask for i in bits(mask))


@lru_cache(maxsize=65536)
def cover(shape: Shape, mask: int, sizes: tuple[int, ...]) -> int:
    """GPUs of `mask` covered by the best packing of disjoint NVLink cliques whose sizes are in `sizes`."""
    if 1 in sizes:
        return popcount(mask)
    total = 0
    for comp in _components(shape.adj, mask):
        if _is_clique(shape.adj, comp):  # NVSwitch nodes, bridged pairs: arithmetic, no search
            total += _representable(popcount(comp), sizes)
        else:
            total += _search_cover(shape.adj, comp, sizes)
    return total


def _search_cover(adj: tuple[int, ...], mask: int, sizes: tuple[int, ...]) -> int:
    memo: dict[int, int] = {}
    steps = 0

    def best(m: int) -> int:
        nonlocal steps
        if m == 0:
            return 0
        got = memo.get(m)
        if got is not None:
            return got
        steps += 1
        if steps > COVER_BUDGET:
            raise _OverBudget
        low = m & -m
        i = low.bit_length() - 1
        rest = m ^ low
        value = best(rest)  # GPU i stays uncovered
        for k in sizes:
            for c in k_cliques(adj, rest & adj[i], k - 1):
                value = max(value, k + best(rest & ~c))
                if value == popcount(m):
                    break
        memo[m] = value
        return value

    try:
        return best(mask)
    except _OverBudget:
        return _greedy_cover(adj, mask, sizes)


class _OverBudget(Exception):
    pass


def _greedy_cover(adj: tuple[int, ...], mask: int, sizes: tuple[int, ...]) -> int:
    """Largest sizes first, one greedy clique at a time (grow from the lowest GPU by its best-connected
    neighbour): a lower bound on the best packing, for free sets too irregular to search."""
    covered = 0
    for k in sorted(sizes, reverse=True):
        start = mask
        while start:
            low = start & -start
            start ^= low
            chosen, pool = low, adj[low.bit_length() - 1] & mask
            while popcount(chosen) < k and pool:
                nxt = max(bits(pool), key=lambda i: (popcount(adj[i] & pool), -i))
                chosen |= 1 << nxt
                pool &= adj[nxt]
            if popcount(chosen) == k:
                covered += k
                mask &= ~chosen
                start &= mask
    return covered


# --------------------------------------------------------------------------- figures per node


@dataclass(frozen=True)
class Figures:
    """Fragmentation figures of a node or of many added up. `usable[i]` and `cliques[i]` are for
    `sizes[i]`."""

    free: int = 0
    usable: tuple[int, ...] = ()
    cliques: tuple[int, ...] = ()
    stranded: int = 0

    def __add__(self, other: Figures) -> Figures:
        if not self.usable:
            return other
        if not other.usable:
            return self
        return Figures(
            self.free + other.free,
            tuple(a + b for a, b in zip(self.usable, other.usable, strict=True)),
            tuple(a + b for a, b in zip(self.cliques, other.cliques, strict=True)),
            self.stranded + other.stranded,
        )

    def vector(self) -> tuple[int, ...]:
        """What moves maximise: usable GPUs per size, largest size first, then fewer stranded GPUs."""
        return (*self.usable, -self.stranded)


def normalize_sizes(sizes: Iterable[int]) -> tuple[int, ...]:
    """Distinct positive sizes, largest first (the order figures and gains compare in)."""
    out = tuple(sorted({s for s in sizes if s > 0}, reverse=True))
    if not out:
        raise ValueError("no pod size of 1 GPU or more")
    return out


def takes_pods(node: NodeState) -> bool:
    return node.problem is None and node.shape is not None


@lru_cache(maxsize=65536)
def _figures(shape: Shape, free: int, impaired: int, sizes: tuple[int, ...]) -> Figures:
    good = free & ~impaired
    usable = []
    cliques = []
    for k in sizes:
        # One GPU needs no NVLink: every free GPU serves, degraded links or not.
        n = popcount(free) if k == 1 else cover(shape, good, (k,))
        usable.append(n)
        cliques.append(n // k)
    mixed = cover(shape, good, tuple(k for k in sizes if k > 1)) if 1 not in sizes else popcount(free)
    return Figures(popcount(free), tuple(usable), tuple(cliques), popcount(free) - mixed)


def node_figures(node: NodeState, sizes: tuple[int, ...], free: int | None = None) -> Figures:
    """A node's figures (all zero for a node that takes no gputopo pod: stale, unreadable). `free`, a
    GPU mask, stands for its free GPUs: what the figures would be with those GPUs free."""
    if not takes_pods(node):
        return Figures(0, tuple(0 for _ in sizes), tuple(0 for _ in sizes), 0)
    assert node.shape is not None
    return _figures(node.shape, node.free_mask if free is None else free, node.impaired_mask, sizes)


def cluster_figures(nodes: Iterable[NodeState], sizes: tuple[int, ...]) -> Figures:
    """Figures added up over nodes; equivalent nodes (one `key`) are computed once."""
    memo: dict[int, Figures] = {}
    total = Figures(0, tuple(0 for _ in sizes), tuple(0 for _ in sizes), 0)
    for n in nodes:
        f = memo.get(n.key)
        if f is None:
            f = memo[n.key] = node_figures(n, sizes)
        total = total + f
    return total


# --------------------------------------------------------------------------- node classes


@lru_cache(maxsize=1)
def _known_shapes() -> dict[tuple[str, Shape], str]:
    from gputopo.systems import SYSTEMS, VARIANTS  # local: only class names need the catalogue

    out: dict[tuple[str, Shape], str] = {}
    for name, build in (*SYSTEMS.items(), *VARIANTS.items()):
        topo = build(name)
        out.setdefault((topo.gpus[0].model, shape_of(topo)), name)
    return out


def node_class(node: NodeState) -> str:
    """The node's kind: its named system when the GPU model and NVLink wiring match one, else the
    model, GPU count and wiring. Nodes of one class fragment alike."""
    if node.topology is None or node.shape is None or not node.topology.gpus:
        return "unreadable"
    shape = node.shape
    model = node.topology.gpus[0].model
    if any(shape.adj):
        from gputopo.engine.node.gpusets import largest_clique

        wiring = "NVSwitch" if shape.nvswitch else f"NVLink, largest clique {largest_clique(shape, node.all_mask)}"
    else:
        wiring = "no NVLink"
    text = f"{model} x{shape.n}, {wiring}"
    name = _known_shapes().get((model, shape))
    return f"{name} ({text})" if name else text


@dataclass(frozen=True)
class ClassFigures:
    name: str
    nodes: int
    figures: Figures


def class_figures(nodes: Iterable[NodeState], sizes: tuple[int, ...]) -> list[ClassFigures]:
    """Figures per node class, in class name order (nodes that take no gputopo pod are left out)."""
    groups: dict[str, list[NodeState]] = {}
    for n in nodes:
        if takes_pods(n):
            groups.setdefault(node_class(n), []).append(n)
    return [ClassFigures(name, len(groups[name]), cluster_figures(groups[name], sizes)) for name in sorted(groups)]
