"""Fragmentation of free GPUs, and the fewest pod moves that would undo it. Pure: no I/O, recommends only.

A free GPU is *usable* for pods of k GPUs when it lies in one of the most disjoint free k-GPU NVLink
cliques the node can hold (k = 1: every free GPU). It is *stranded* when no packing of free cliques
of the sizes asked about (mixing sizes) covers it: no pod of those sizes can use it as things stand.
Only free healthy GPUs of nodes that take gputopo pods count; GPUs with a degraded link are kept out
of cliques of 2+, as the engine keeps them out of `nvlink: required` sets.

Moves (`plan`): greedy, one step at a time, each step the set of movable pods of one node (at most
`MAX_BUNDLE`, since freeing a whole clique often needs several small pods gone) relocated by the
engine's own verdict (`evaluate_node`, so each pod's requests hold on its new GPUs: NVLink policy,
HBM, network, size) to the other node (or, for one pod, the same node's other GPUs) that loses least.
A step is taken only when it strictly improves the cluster's figures, compared largest size first:
usable GPUs per size, then fewer stranded GPUs, and steps rank by that gain per move.
Group members are never moved: moving one can break its group's tier and spread constraints, and a
group is scheduled all together, so gputopo leaves them where they are and says so.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import combinations

from gputopo.engine.cliques import bits, k_cliques, popcount
from gputopo.engine.placement import Outcome, evaluate_node
from gputopo.engine.snapshot import NodeState, Shape, node_state, shape_of
from gputopo.model import PodRequest
from gputopo.tiers import DEFAULT_TIERS, TierConfig

# The pod sizes measured against when no pending gputopo pod says otherwise: the tensor-parallel
# degrees of typical training and inference jobs on 8-GPU nodes.
DEFAULT_SIZES: tuple[int, ...] = (8, 4, 2)
MAX_MOVES = 10
# Pods of one node relocated in one step. Freeing an 8-GPU clique held by four 2-GPU pods takes four;
# more pods per step grows the subsets tried (C(8,4) = 70 per node at most) for rarely any gain.
MAX_BUNDLE = 4
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


def node_figures(node: NodeState, sizes: tuple[int, ...]) -> Figures:
    """A node's figures (all zero for a node that takes no gputopo pod: stale, unreadable)."""
    if not takes_pods(node):
        return Figures(0, tuple(0 for _ in sizes), tuple(0 for _ in sizes), 0)
    assert node.shape is not None
    return _figures(node.shape, node.free_mask, node.impaired_mask, sizes)


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
        from gputopo.engine.gpusets import largest_clique

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


# --------------------------------------------------------------------------- moves


@dataclass(frozen=True)
class PlacedPod:
    """A pod holding GPUs on a node. `request` None: its annotations do not parse (never moved)."""

    ref: str  # namespace/name
    node: str
    gpus: frozenset[int]
    request: PodRequest | None

    @property
    def pinned(self) -> str | None:
        """Why the pod is never moved, or None when it may be."""
        if self.request is None:
            return "its gputopo annotations do not parse"
        if self.request.is_group:
            return "group member (never moved: its group's tier and spread constraints)"
        return None


@dataclass(frozen=True)
class Move:
    pod: str
    source: str
    source_gpus: tuple[int, ...]
    target: str
    target_gpus: tuple[int, ...]

    def text(self) -> str:
        if self.source == self.target:
            return (
                f"move {self.pod} on {self.source} from GPUs {_gpu_text(self.source_gpus)} "
                f"to GPUs {_gpu_text(self.target_gpus)}"
            )
        return (
            f"move {self.pod} from {self.source} GPUs {_gpu_text(self.source_gpus)} "
            f"to {self.target} GPUs {_gpu_text(self.target_gpus)}"
        )


@dataclass(frozen=True)
class Freed:
    node: str
    size: int
    cliques: int  # how many more free cliques of `size` the node has after the step


@dataclass(frozen=True)
class Step:
    moves: tuple[Move, ...]
    gain: tuple[int, ...]  # Figures.vector() after minus before, over the whole cluster
    freed: tuple[Freed, ...]

    def reason(self) -> str:
        parts = []
        for f in self.freed:
            article = "an" if str(f.size)[0] == "8" or f.size in (11, 18) else "a"
            what = f"{article} {f.size}-GPU clique" if f.cliques == 1 else f"{f.cliques} {f.size}-GPU cliques"
            parts.append(f"frees {what} on {f.node}")
        fewer = self.gain[-1]  # stranded before minus after
        if fewer > 0:
            parts.append(f"{fewer} fewer stranded GPU{'s' if fewer != 1 else ''}")
        return ", ".join(parts) or "more free GPUs usable in full cliques"

    def text(self) -> str:
        return "; ".join(m.text() for m in self.moves) + ": " + self.reason()


@dataclass
class Plan:
    sizes: tuple[int, ...]
    steps: list[Step] = field(default_factory=list)
    after: list[NodeState] = field(default_factory=list)
    pinned: list[tuple[PlacedPod, str]] = field(default_factory=list)

    @property
    def moves(self) -> list[Move]:
        return [m for s in self.steps for m in s.moves]


def _gpu_text(gpus: Iterable[int]) -> str:
    return ",".join(str(g) for g in sorted(gpus))


def _add(a: tuple[int, ...], b: tuple[int, ...], sign: int = 1) -> tuple[int, ...]:
    return tuple(x + sign * y for x, y in zip(a, b, strict=True))


_Rank = tuple[tuple[int, ...], bool, float]


class _Planner:
    def __init__(self, nodes: Sequence[NodeState], sizes: tuple[int, ...], tiers: TierConfig) -> None:
        self.sizes = sizes
        self.tiers = tiers
        self.state: dict[str, NodeState] = {n.name: n for n in nodes}
        self.outcomes: dict[tuple[PodRequest, int], Outcome] = {}
        self.zero = tuple(0 for _ in range(len(sizes) + 1))
        self.losses: dict[tuple[int, tuple[int, ...]], tuple[int, ...]] = {}
        self.regroup()

    def vector(self, node: NodeState) -> tuple[int, ...]:
        return node_figures(node, self.sizes).vector()

    def with_in_use(self, node: NodeState, in_use: frozenset[int]) -> NodeState:
        return node_state(
            node.name,
            node.topology,
            labels=node.labels,
            in_use=in_use,
            problem=node.problem,
            problem_detail=node.problem_detail,
            tiers=self.tiers,
        )

    def outcome(self, node: NodeState, req: PodRequest) -> Outcome:
        o = self.outcomes.get((req, node.key))
        if o is None:
            o = self.outcomes[(req, node.key)] = evaluate_node(node, req)
        return o

    def regroup(self) -> None:
        """Nodes by equivalence key, each list in name order: equal keys give equal verdicts and equal
        figures, so trying the first free one of a key is trying them all. Ranked targets per request
        are rebuilt lazily after every committed step."""
        self.by_key: dict[int, list[str]] = {}
        for name in sorted(self.state):
            n = self.state[name]
            if takes_pods(n):
                self.by_key.setdefault(n.key, []).append(name)
        self.ranked: dict[PodRequest, list[tuple[_Rank, int, tuple[int, ...]]]] = {}

    def loss(self, node: NodeState, gpus: tuple[int, ...]) -> tuple[int, ...]:
        """How `node`'s figures change when a pod takes `gpus` (memoised: it depends on the key only)."""
        got = self.losses.get((node.key, gpus))
        if got is None:
            after = self.with_in_use(node, node.in_use | frozenset(gpus))
            got = self.losses[(node.key, gpus)] = _add(self.vector(after), self.vector(node), -1)
        return got

    def rank(self, n: NodeState, req: PodRequest, source: str) -> tuple[_Rank, tuple[int, ...]] | None:
        """How good `n` is for a pod of `req` (None: it does not fit): the least loss of usable GPUs,
        then, on equal cost, the pod's own node (no other node's capacity needed), then the engine's score."""
        o = self.outcome(n, req)
        if not o.fits:
            return None
        return (self.loss(n, o.gpus), n.name == source, o.score), o.gpus

    def ranked_keys(self, req: PodRequest) -> list[tuple[_Rank, int, tuple[int, ...]]]:
        """Every key's rank for `req` in the committed state, best first (ties: the key's first node by name)."""
        out = self.ranked.get(req)
        if out is None:
            rows = []
            for key, names in self.by_key.items():
                r = self.rank(self.state[names[0]], req, "")
                if r is not None:
                    rows.append((r[0], key, r[1], names[0]))
            rows.sort(key=lambda row: row[3])
            rows.sort(key=lambda row: row[0], reverse=True)  # stable: equal ranks keep name order
            out = self.ranked[req] = [(r, key, gpus) for r, key, gpus, _ in rows]
        return out

    def place(
        self, pod: PlacedPod, overlay: dict[str, NodeState], source: str, same_node: bool
    ) -> tuple[NodeState, tuple[int, ...]] | None:
        """The node and GPUs where `pod` costs least (see `rank`), by the engine's choice of GPUs."""
        req = pod.request
        assert req is not None
        best: tuple[_Rank, NodeState, tuple[int, ...]] | None = None
        # Untouched nodes: the best key that still has a node the step has not touched.
        for r, key, gpus in self.ranked_keys(req):
            name = next((x for x in self.by_key[key] if x != source and x not in overlay), None)
            if name is not None:
                best = (r, self.state[name], gpus)
                break
        # Nodes the step has touched so far (another pod of the bundle went there), and the pod's own.
        for name, n in overlay.items():
            if name == source and not same_node:
                continue
            found = self.rank(n, req, source)
            if found is None or (name == source and frozenset(found[1]) == pod.gpus):
                continue  # the same GPUs again is not a move
            if best is None or found[0] > best[0]:
                best = (found[0], n, found[1])
        if best is None:
            return None
        _, n, gpus = best
        return self.with_in_use(n, n.in_use | frozenset(gpus)), gpus

    def bound(self, source: NodeState, bundle: tuple[PlacedPod, ...]) -> tuple[int, ...]:
        """An upper bound of the gain of moving `bundle` off `source`: what emptying gains there, plus
        every moved GPU leaving the stranded count. Taking GPUs never adds usable ones, and removes
        at most its own GPUs from the stranded count."""
        assert source.shape is not None
        freed = 0
        for p in bundle:
            for g in p.gpus:
                freed |= 1 << g
        before = self.vector(source)
        after = _figures(source.shape, source.free_mask | freed, source.impaired_mask, self.sizes).vector()
        gain = _add(after, before, -1)
        return (*gain[:-1], gain[-1] + popcount(freed))

    def try_step(self, source: NodeState, bundle: tuple[PlacedPod, ...]) -> Step | None:
        freed = frozenset().union(*(p.gpus for p in bundle))
        emptied = self.with_in_use(source, source.in_use - freed)
        overlay: dict[str, NodeState] = {source.name: emptied}
        moves = []
        # Largest pods first: they have the fewest places to go.
        for pod in sorted(bundle, key=lambda p: (-len(p.gpus), p.ref)):
            found = self.place(pod, overlay, source.name, same_node=len(bundle) == 1)
            if found is None:
                return None
            after, gpus = found
            overlay[after.name] = after
            moves.append(Move(pod.ref, source.name, tuple(sorted(pod.gpus)), after.name, tuple(gpus)))
        gain = self.zero
        freed_cliques = []
        for name, after in overlay.items():
            before = self.state[name]
            gain = _add(gain, _add(self.vector(after), self.vector(before), -1))
            fa, fb = node_figures(after, self.sizes), node_figures(before, self.sizes)
            for k, ca, cb in zip(self.sizes, fa.cliques, fb.cliques, strict=True):
                if ca > cb:
                    freed_cliques.append(Freed(name, k, ca - cb))
                    break  # the largest size that gained says it: an 8-clique is also two 4-cliques
        if gain <= self.zero:
            return None
        return Step(tuple(moves), gain, tuple(freed_cliques))

    def commit(self, step: Step) -> None:
        for m in step.moves:
            src = self.state[m.source]
            self.state[m.source] = self.with_in_use(src, src.in_use - frozenset(m.source_gpus))
        for m in step.moves:
            dst = self.state[m.target]
            self.state[m.target] = self.with_in_use(dst, dst.in_use | frozenset(m.target_gpus))
        self.regroup()


def _step_rank(gain: tuple[int, ...], bundle: tuple[PlacedPod, ...]) -> tuple[tuple[float, ...], int]:
    """Gain per move, largest size first (one move that frees an 8-GPU clique beats four that free one
    and also tidy up smaller sizes; an 8-GPU clique beats any number of 4-GPU ones), then fewer GPUs moved."""
    return tuple(g / len(bundle) for g in gain), -sum(len(p.gpus) for p in bundle)


def plan(
    nodes: Sequence[NodeState],
    pods: Sequence[PlacedPod],
    sizes: Iterable[int] = DEFAULT_SIZES,
    *,
    max_moves: int = MAX_MOVES,
    max_bundle: int = MAX_BUNDLE,
    tiers: TierConfig = DEFAULT_TIERS,
) -> Plan:
    """Greedy moves (see the module docstring), at most `max_moves` pods relocated, each once.

    `nodes` hold every pod's GPUs in their in-use sets already; `pods` are the pods that may be moved
    (pinned ones are reported back in `Plan.pinned` and stay)."""
    wanted = normalize_sizes(sizes)
    planner = _Planner(nodes, wanted, tiers)
    result = Plan(wanted)
    movable: dict[str, list[PlacedPod]] = {}
    for p in sorted(pods, key=lambda p: p.ref):
        why = p.pinned
        node = planner.state.get(p.node)
        if why is None and (node is None or not takes_pods(node)):
            why = "its node takes no gputopo pod now (stale or unreadable topology)"
        if why is not None:
            result.pinned.append((p, why))
        else:
            movable.setdefault(p.node, []).append(p)
    budget = max_moves
    while budget > 0:
        # Every bundle's bound first, then the real steps best bound first, until no bound can beat the
        # best step found: most bundles are never placed.
        tries: list[tuple[tuple[tuple[float, ...], int], str, tuple[PlacedPod, ...]]] = []
        for name in sorted(movable):
            source = planner.state[name]
            here = movable[name]
            for size in range(1, min(max_bundle, budget, len(here)) + 1):
                for bundle in combinations(here, size):
                    top = planner.bound(source, bundle)
                    if top > planner.zero:
                        tries.append((_step_rank(top, bundle), name, bundle))
        tries.sort(key=lambda t: t[0], reverse=True)  # stable: equal bounds keep name order
        best: tuple[tuple[tuple[float, ...], int], Step, tuple[PlacedPod, ...]] | None = None
        for bound, name, bundle in tries:
            if best is not None and bound <= best[0]:
                break
            step = planner.try_step(planner.state[name], bundle)
            if step is None:
                continue
            rank = _step_rank(step.gain, bundle)
            if best is None or rank > best[0]:
                best = (rank, step, bundle)
        if best is None:
            break
        _, step, bundle = best
        planner.commit(step)
        result.steps.append(step)
        budget -= len(step.moves)
        source_pods = movable[step.moves[0].source]
        for p in bundle:
            source_pods.remove(p)  # moved once: its new place is where the plan leaves it
        if not source_pods:
            del movable[step.moves[0].source]
    result.after = [planner.state[n.name] for n in nodes]
    return result
