"""The fewest pod moves that would undo GPU fragmentation. Pure: no I/O, recommends only.

The figures moves improve (usable GPUs per pod size, stranded GPUs) are `gputopo.engine.cluster.fragmentation`'s.

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
from itertools import combinations

from gputopo.engine.cluster.fragmentation import DEFAULT_SIZES, node_figures, normalize_sizes, takes_pods
from gputopo.engine.node.placement import Outcome, evaluate_node
from gputopo.engine.state.cliques import popcount
from gputopo.engine.state.snapshot import NodeState, node_state
from gputopo.model import PodRequest
from gputopo.tiers import DEFAULT_TIERS, TierConfig

MAX_MOVES = 10
# Pods of one node relocated in one step. Freeing an 8-GPU clique held by four 2-GPU pods takes four;
# more pods per step grows the subsets tried (C(8,4) = 70 per node at most) for rarely any gain.
MAX_BUNDLE = 4


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
        freed = 0
        for p in bundle:
            for g in p.gpus:
                freed |= 1 << g
        before = self.vector(source)
        after = node_figures(source, self.sizes, free=source.free_mask | freed).vector()
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
