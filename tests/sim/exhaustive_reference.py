"""Reference: the exhaustive search as it was before counting interchangeable GPUs by class (it permuted
every symmetry of a node). Kept verbatim, for tests/sim/test_exhaustive_classes.py and bench/exhaustive_cost.py
to compare against: same answers where it finishes."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import combinations

from gputopo.engine.state.cliques import bits, k_cliques, mask_of
from gputopo.engine.state.snapshot import NodeState
from gputopo.model import Health, NetworkKind, NvlinkPolicy, PodRequest, Spread
from gputopo.sim.comm import pp_seconds, tp_seconds
from gputopo.sim.records import SimPod
from gputopo.tiers import TierConfig

EXHAUSTIVE_MAX_NODES = 6
EXHAUSTIVE_MAX_PODS = 8
DEFAULT_BUDGET = 100_000


@dataclass(frozen=True)
class BestPlacement:
    jobs_placed: int
    seconds: float
    complete: bool
    states: int


@lru_cache(maxsize=256)
def _automorphisms(signature: tuple[object, ...]) -> tuple[tuple[int, ...], ...]:
    """Permutations of a node's GPUs that keep the link matrix and every per-GPU attribute."""
    links, attrs = signature
    assert isinstance(links, tuple) and isinstance(attrs, tuple)
    n = len(attrs)
    out: list[tuple[int, ...]] = []
    perm: list[int] = []
    used = [False] * n

    def grow(i: int) -> None:
        if i == n:
            out.append(tuple(perm))
            return
        for p in range(n):
            if used[p] or attrs[p] != attrs[i]:
                continue
            if any(links[i][j] != links[p][perm[j]] for j in range(i)):
                continue
            used[p] = True
            perm.append(p)
            grow(i + 1)
            perm.pop()
            used[p] = False

    grow(0)
    return tuple(out)


@lru_cache(maxsize=65536)
def _canonical(signature: tuple[object, ...], mask: int) -> int:
    best = mask
    for perm in _automorphisms(signature):
        m = 0
        for i in bits(mask):
            m |= 1 << perm[i]
        best = min(best, m)
    return best


class _Node:
    def __init__(self, state: NodeState) -> None:
        self.state = state
        topo = state.topology
        self.usable = state.problem is None and state.shape is not None and topo is not None
        self.signature: tuple[object, ...] = ()
        self.healthy = 0
        if self.usable and state.shape is not None and topo is not None:
            self.healthy = state.all_mask & ~state.failed_mask
            attrs = tuple(
                (g.numa_node, g.health is Health.FAILED, bool(state.impaired_mask >> g.index & 1), g.memory_mib)
                for g in topo.gpus
            )
            self.signature = (state.shape.links, attrs)

    def canonical(self, mask: int) -> int:
        return _canonical(self.signature, mask) if self.usable else mask

    def sets(self, req: PodRequest, in_use: int) -> Iterator[tuple[int, ...]]:
        """Every GPU set of this node that meets the pod's hard requests, given GPUs in use."""
        st = self.state
        if not self.usable or st.shape is None:
            return
        k = req.gpus
        if not st.has_network(req.network):
            return
        if k == 0:
            yield ()
            return
        eligible = self.healthy
        if req.min_gpu_memory_mib:
            eligible &= mask_of([i for i, m in enumerate(st.memory_mib) if m >= req.min_gpu_memory_mib])
        free = eligible & ~in_use
        needs_nvlink = k > 1 and req.nvlink is not NvlinkPolicy.IGNORE
        if needs_nvlink:
            free &= ~st.impaired_mask
        if k > 1 and req.nvlink is NvlinkPolicy.REQUIRED:
            for s in k_cliques(st.shape.adj, free, k):
                yield tuple(bits(s))
            return
        yield from combinations(bits(free), k)


def best_placement(
    nodes: Sequence[NodeState],
    jobs: Sequence[Sequence[SimPod]],
    tiers: TierConfig,
    tp_message_bytes: float,
    pp_message_bytes: float,
    budget: int = DEFAULT_BUDGET,
) -> BestPlacement:
    search = _Search(nodes, jobs, tiers, tp_message_bytes, pp_message_bytes, budget)
    start = tuple(mask_of(list(v.state.in_use)) for v in search.views)
    placed, seconds = search.solve(0, start)
    return BestPlacement(placed, seconds, search.complete, search.counter)


_Chosen = tuple[tuple[str, int, tuple[int, ...]], ...]  # (pod, node index, GPUs) per pod placed so far
_Assignment = tuple[float, tuple[int, ...], _Chosen]  # (cost, in-use masks after, what was chosen)


class _Search:
    """One exhaustive search: the nodes' views, the memo and the budget spent."""

    def __init__(
        self,
        nodes: Sequence[NodeState],
        jobs: Sequence[Sequence[SimPod]],
        tiers: TierConfig,
        tp_message_bytes: float,
        pp_message_bytes: float,
        budget: int,
    ) -> None:
        self.views = [_Node(n) for n in nodes]
        self.jobs = jobs
        self.tiers = tiers
        self.tp_message_bytes = tp_message_bytes
        self.pp_message_bytes = pp_message_bytes
        self.budget = budget
        # Nodes with the same hardware, health, NICs and switches are interchangeable.
        classes: dict[tuple[object, ...], int] = {}
        self.node_class = [
            classes.setdefault(
                (v.signature, v.usable, tuple(sorted(v.state.location.items(), key=str)), v.state.nics), i
            )
            for i, v in enumerate(self.views)
        ]
        self.memo: dict[tuple[int, tuple[tuple[int, int], ...]], tuple[int, float]] = {}
        self.counter = 0
        self.complete = True

    def canon(self, masks: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
        return tuple(
            sorted((self.node_class[i], v.canonical(m)) for i, (v, m) in enumerate(zip(self.views, masks, strict=True)))
        )

    def solve(self, j: int, masks: tuple[int, ...]) -> tuple[int, float]:
        """(jobs placed, communication seconds) of the best placement of jobs j.. from `masks` on."""
        if j == len(self.jobs):
            return 0, 0.0
        key = (j, self.canon(masks))
        if key in self.memo:
            return self.memo[key]
        best = self.solve(j + 1, masks)  # leave job j out
        if self.jobs[j]:
            for cost, after, _ in self.assignments(self.jobs[j], masks):
                placed, rest_cost = self.solve(j + 1, after)
                cand = (placed + 1, cost + rest_cost)
                if cand[0] > best[0] or (cand[0] == best[0] and cand[1] < best[1] - 1e-15):
                    best = cand
                if not self.complete:
                    break
        self.memo[key] = best
        return best

    def assignments(self, pods: Sequence[SimPod], masks: tuple[int, ...]) -> Iterator[_Assignment]:
        """Every distinct placement of all `pods` (one job), as (cost, masks after, [(pod, node, gpus)])."""
        staged = sorted(pods, key=lambda p: (p.stage, p.name))
        yield from self._extend(_JobRules.of(pods, staged[0].request), staged, 0, masks, 0.0, ())

    def _extend(
        self, rules: _JobRules, staged: Sequence[SimPod], i: int, masks: tuple[int, ...], cost: float, chosen: _Chosen
    ) -> Iterator[_Assignment]:
        """Every placement of pods i.. of the job, the earlier ones placed as `chosen`."""
        if i == len(staged):
            yield cost, masks, chosen
            return
        pod = staged[i]
        used_nodes = {c[1] for c in chosen}
        tier = rules.tier
        switch = self.views[chosen[0][1]].state.location.get(tier) if (tier and chosen) else None
        tried: set[tuple[object, ...]] = set()
        for n, view in enumerate(self.views):
            if rules.spread and n in used_nodes:
                continue
            if tier:
                sw = view.state.location.get(tier)
                if sw is None or (chosen and sw != switch):
                    continue
            for gpus in view.sets(pod.request, masks[n]):
                after = masks[n] | mask_of(list(gpus))
                if rules.symmetric:
                    key = (self.node_class[n], view.canonical(masks[n]), view.canonical(after), n in used_nodes)
                    if key in tried:
                        continue
                    tried.add(key)
                self.counter += 1
                if self.counter > self.budget:
                    self.complete = False
                    return
                c = tp_seconds(view.state.shape, gpus, self.tp_message_bytes)
                if chosen:
                    _, prev_node, prev_gpus = chosen[-1]
                    c += pp_seconds(
                        self.views[prev_node].state,
                        prev_gpus,
                        view.state,
                        gpus,
                        rules.kind,
                        self.pp_message_bytes,
                        self.tiers,
                    )
                new_masks = (*masks[:n], after, *masks[n + 1 :])
                yield from self._extend(rules, staged, i + 1, new_masks, cost + c, (*chosen, (pod.name, n, gpus)))


@dataclass(frozen=True)
class _JobRules:
    """What a job's lead pod asks of where its pods go."""

    spread: bool
    tier: str | None
    kind: NetworkKind
    symmetric: bool  # sets equivalent under a node symmetry cost the same unless a stage shares the node

    @staticmethod
    def of(pods: Sequence[SimPod], lead: PodRequest) -> _JobRules:
        group = len(pods) > 1 or lead.is_group
        spread = group and lead.spread is Spread.NODE
        return _JobRules(spread, lead.required_tier if group else None, lead.network, spread or not group)
