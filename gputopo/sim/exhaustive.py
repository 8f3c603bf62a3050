"""The best placement of a tiny instance, by exhaustive search: the yardstick for the policies.

Objective, lexicographic: place the most jobs (a group counts only when all its pods are placed), then
spend the least estimated communication time (gputopo.sim.comm). Every hard request of a pod is
honoured as the engine reads it: GPU count, healthy GPUs, HBM minimum, `nvlink: required` (a clique of
GPUs without degraded links), the network kind, `spread: node`, `required-tier`. Preferences are not
constraints here: they matter only through the communication time.

The search is a memoised recursion over jobs in order (any job may be left out). GPU sets that are
the same up to a symmetry of the node (a permutation of its GPUs that keeps links, NUMA, health and
HBM) lead to equivalent states, so each node's in-use mask is reduced to a canonical form counted per
class of interchangeable GPUs (gputopo.sim.symmetry), never by permuting GPUs. A lone pod, a pod of a
`spread: node` group and a pod of a group of 1-GPU pods are tried as how many GPUs to take from each
class. The multi-GPU stages of other groups may share a node, where the transfer estimate reads each
set's lowest GPU, which twins do not preserve: they still try every GPU set.

A budget of steps bounds the work: options tried, class-count steps, canonical forms computed (each
costs its kind's permutations of blocks) and node kinds built. Past it the best placement found so far
is reported as incomplete. The engine's clique enumeration, used for those multi-GPU stages only, is
counted by the cliques it yields.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import combinations

from gputopo.engine.state.cliques import bits, k_cliques, mask_of
from gputopo.engine.state.snapshot import NodeState
from gputopo.model import Health, NetworkKind, NvlinkPolicy, PodRequest, Spread
from gputopo.sim.comm import pp_seconds, tp_seconds
from gputopo.sim.records import SimPod
from gputopo.sim.symmetry import Budget, NodeKind, node_kind
from gputopo.tiers import TierConfig

EXHAUSTIVE_MAX_NODES = 6
EXHAUSTIVE_MAX_PODS = 8
DEFAULT_BUDGET = 1_000_000  # steps; a few seconds at most


@dataclass(frozen=True)
class BestPlacement:
    jobs_placed: int
    seconds: float
    complete: bool  # False: the budget ran out, and this is the best placement found before it did
    states: int  # options (a pod on a node with a GPU set) tried
    steps: int = 0  # steps counted against the budget (the module docstring says which)


class _Node:
    def __init__(self, state: NodeState) -> None:
        self.state = state
        topo = state.topology
        self.usable = state.problem is None and state.shape is not None and topo is not None
        self.kind: NodeKind | None = None
        self.signature: tuple[object, ...] = ()
        self.healthy = 0
        self.class_memo: dict[tuple[int, int, bool], tuple[tuple[tuple[int, ...], ...], int]] = {}
        if self.usable and state.shape is not None and topo is not None:
            self.healthy = state.all_mask & ~state.failed_mask
            attrs = tuple(
                (g.numa_node, g.health is Health.FAILED, bool(state.impaired_mask >> g.index & 1), g.memory_mib)
                for g in topo.gpus
            )
            self.signature = (state.shape, attrs)  # the shape: links, NVLink generation and NUMA
            self.kind = node_kind(state.shape.links, attrs)

    def sets(self, req: PodRequest, in_use: int, by_class: bool, budget: Budget) -> Iterator[tuple[int, ...]]:
        """The GPU sets of this node that meet the pod's hard requests, given GPUs in use: one per way of
        counting them from each class when `by_class`, else every one."""
        st = self.state
        if self.kind is None or st.shape is None or not st.has_network(req.network):
            return
        k = req.gpus
        if k == 0:
            yield ()
            return
        eligible = self.healthy
        if req.min_gpu_memory_mib:
            eligible &= mask_of([i for i, m in enumerate(st.memory_mib) if m >= req.min_gpu_memory_mib])
        free = eligible & ~in_use
        if k > 1 and req.nvlink is not NvlinkPolicy.IGNORE:
            free &= ~st.impaired_mask
        clique = k > 1 and req.nvlink is NvlinkPolicy.REQUIRED
        if by_class:
            # The same question comes back from many states: answered once, charged every time alike.
            found = self.class_memo.get((free, k, clique))
            if found is None:
                before = budget.steps
                sets = tuple(tuple(bits(s)) for s in self.kind.class_sets(st.shape.adj, free, k, clique, budget))
                found = (sets, budget.steps - before)
                if budget.complete:
                    self.class_memo[(free, k, clique)] = found
            else:
                budget.spend(found[1])
            yield from found[0]
        elif clique:
            for s in k_cliques(st.shape.adj, free, k):
                yield tuple(bits(s))
        else:
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
    return BestPlacement(placed, seconds, search.budget.complete, search.options, search.budget.steps)


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
        self.budget = Budget(budget)
        # A kind is built once per process; every search that meets it is charged for it alike.
        for kind in {id(v.kind): v.kind for v in self.views if v.kind is not None}.values():
            self.budget.spend(kind.build_steps)
        # Nodes with the same hardware, health, NICs and switches are interchangeable.
        classes: dict[tuple[object, ...], int] = {}
        self.node_class = [
            classes.setdefault(
                (v.signature, v.usable, tuple(sorted(v.state.location.items(), key=str)), v.state.nics), i
            )
            for i, v in enumerate(self.views)
        ]
        self.memo: dict[tuple[int, tuple[tuple[int, tuple[int, ...]], ...]], tuple[int, float]] = {}
        self.canonical_memo: dict[tuple[int, int], tuple[int, ...]] = {}
        self.tp_memo: dict[tuple[int, tuple[int, ...]], float] = {}
        self.pp_memo: dict[tuple[object, ...], float] = {}
        self.options = 0

    def canonical(self, n: int, mask: int) -> tuple[int, ...]:
        """Node n's in-use mask up to its symmetries; computing one is charged to the budget (looking
        one up again costs no more than the option that asks)."""
        kind = self.views[n].kind
        if kind is None:
            return (mask,)
        key = (self.node_class[n], mask)
        found = self.canonical_memo.get(key)
        if found is None:
            self.budget.spend(kind.canonical_cost())
            found = self.canonical_memo[key] = kind.canonical(mask)
        return found

    def canon(self, masks: tuple[int, ...]) -> tuple[tuple[int, tuple[int, ...]], ...]:
        return tuple(sorted((self.node_class[n], self.canonical(n, m)) for n, m in enumerate(masks)))

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
                if not self.budget.complete:
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
            for gpus in view.sets(pod.request, masks[n], rules.by_class, self.budget):
                after = masks[n] | mask_of(list(gpus))
                c = self._cost(rules, n, gpus, chosen)
                if rules.symmetric:
                    # Equivalent when the node's state before and after match up to symmetry and the
                    # set costs the same: the rest of the search cannot tell them apart.
                    before_after = (self.canonical(n, masks[n]), self.canonical(n, after))
                    key = (self.node_class[n], *before_after, n in used_nodes, c)
                    if key in tried:
                        continue
                    tried.add(key)
                self.options += 1
                if not self.budget.spend():
                    return
                new_masks = (*masks[:n], after, *masks[n + 1 :])
                yield from self._extend(rules, staged, i + 1, new_masks, cost + c, (*chosen, (pod.name, n, gpus)))
            if not self.budget.complete:
                return

    def _cost(self, rules: _JobRules, n: int, gpus: tuple[int, ...], chosen: _Chosen) -> float:
        """The set's TP allreduce, and the transfer from the previous stage when there is one."""
        node = self.views[n].state
        key = (self.node_class[n], gpus)  # nodes of one class share a shape
        c = self.tp_memo.get(key)
        if c is None:
            c = self.tp_memo[key] = tp_seconds(node.shape, gpus, self.tp_message_bytes)
        if chosen:
            _, prev_node, prev_gpus = chosen[-1]
            # Between two nodes the transfer runs over NICs and switches, whichever GPUs either stage has.
            pp_key = (prev_node, n, rules.kind, *((prev_gpus, gpus) if prev_node == n else ()))
            pp = self.pp_memo.get(pp_key)
            if pp is None:
                prev = self.views[prev_node].state
                pp = pp_seconds(prev, prev_gpus, node, gpus, rules.kind, self.pp_message_bytes, self.tiers)
                self.pp_memo[pp_key] = pp
            c += pp
        return c


@dataclass(frozen=True)
class _JobRules:
    """What a job's lead pod asks of where its pods go."""

    spread: bool
    tier: str | None
    kind: NetworkKind
    symmetric: bool  # sets equivalent under a node symmetry cost the same unless a stage shares the node
    # Twins swap without changing any cost unless a stage sharing the node reads a set's lowest GPU
    # (gputopo.sim.comm): never for a lone pod, a spread group, or a group of single-GPU pods.
    by_class: bool

    @staticmethod
    def of(pods: Sequence[SimPod], lead: PodRequest) -> _JobRules:
        group = len(pods) > 1 or lead.is_group
        spread = group and lead.spread is Spread.NODE
        symmetric = spread or not group
        by_class = symmetric or all(p.request.gpus <= 1 for p in pods)
        return _JobRules(spread, lead.required_tier if group else None, lead.network, symmetric, by_class)
