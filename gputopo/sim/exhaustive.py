"""The best placement of a tiny instance, by exhaustive search: the yardstick for the policies.

Objective, lexicographic: place the most jobs (a group counts only when all its pods are placed), then
spend the least estimated communication time (gputopo.sim.comm). Every hard request of a pod is
honoured as the engine reads it: GPU count, healthy GPUs, HBM minimum, `nvlink: required` (a clique of
GPUs without degraded links), the network kind, `spread: node`, `required-tier`. Preferences are not
constraints here: they matter only through the communication time.

The search is a memoised recursion over jobs in order (any job may be left out). GPU sets that are
the same up to a symmetry of the node (a permutation of its GPUs that keeps links, NUMA, health and
HBM) lead to equivalent states, so each node's in-use mask is reduced to a canonical form. A budget of
option evaluations bounds the work; past it the best placement found so far is reported as incomplete.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import combinations

from gputopo.engine.cliques import bits, k_cliques, mask_of
from gputopo.engine.snapshot import NodeState
from gputopo.model import Health, NvlinkPolicy, PodRequest, Spread
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
    views = [_Node(n) for n in nodes]
    # Nodes with the same hardware, health, NICs and switches are interchangeable.
    classes: dict[tuple[object, ...], int] = {}
    node_class = [
        classes.setdefault((v.signature, v.usable, tuple(sorted(v.state.location.items(), key=str)), v.state.nics), i)
        for i, v in enumerate(views)
    ]
    memo: dict[tuple[int, tuple[tuple[int, int], ...]], tuple[int, float]] = {}
    counter = [0]
    complete = [True]

    def canon(masks: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
        return tuple(sorted((node_class[i], v.canonical(m)) for i, (v, m) in enumerate(zip(views, masks, strict=True))))

    def assignments(
        pods: Sequence[SimPod], masks: tuple[int, ...]
    ) -> Iterator[tuple[float, tuple[int, ...], tuple[tuple[str, int, tuple[int, ...]], ...]]]:
        """Every distinct placement of all `pods` (one job), as (cost, masks after, [(pod, node, gpus)])."""
        staged = sorted(pods, key=lambda p: (p.stage, p.name))
        lead = staged[0].request
        group = len(pods) > 1 or lead.is_group
        spread = group and lead.spread is Spread.NODE
        tier = lead.required_tier if group else None
        kind = lead.network
        # Sets equivalent under a node symmetry cost the same unless a stage shares the node.
        symmetric = spread or not group

        def rec(
            i: int, masks: tuple[int, ...], cost: float, chosen: tuple[tuple[str, int, tuple[int, ...]], ...]
        ) -> Iterator[tuple[float, tuple[int, ...], tuple[tuple[str, int, tuple[int, ...]], ...]]]:
            if i == len(staged):
                yield cost, masks, chosen
                return
            pod = staged[i]
            used_nodes = {c[1] for c in chosen}
            switch = views[chosen[0][1]].state.location.get(tier) if (tier and chosen) else None
            tried: set[tuple[object, ...]] = set()
            for n, view in enumerate(views):
                if spread and n in used_nodes:
                    continue
                if tier:
                    sw = view.state.location.get(tier)
                    if sw is None or (chosen and sw != switch):
                        continue
                for gpus in view.sets(pod.request, masks[n]):
                    after = masks[n] | mask_of(list(gpus))
                    if symmetric:
                        key = (node_class[n], view.canonical(masks[n]), view.canonical(after), n in used_nodes)
                        if key in tried:
                            continue
                        tried.add(key)
                    counter[0] += 1
                    if counter[0] > budget:
                        complete[0] = False
                        return
                    c = tp_seconds(view.state.shape, gpus, tp_message_bytes)
                    if chosen:
                        _, prev_node, prev_gpus = chosen[-1]
                        c += pp_seconds(
                            views[prev_node].state, prev_gpus, view.state, gpus, kind, pp_message_bytes, tiers
                        )
                    new_masks = (*masks[:n], after, *masks[n + 1 :])
                    yield from rec(i + 1, new_masks, cost + c, (*chosen, (pod.name, n, gpus)))

        yield from rec(0, masks, 0.0, ())

    def solve(j: int, masks: tuple[int, ...]) -> tuple[int, float]:
        if j == len(jobs):
            return 0, 0.0
        key = (j, canon(masks))
        if key in memo:
            return memo[key]
        best = solve(j + 1, masks)  # leave job j out
        if jobs[j]:
            for cost, after, _ in assignments(jobs[j], masks):
                placed, rest_cost = solve(j + 1, after)
                cand = (placed + 1, cost + rest_cost)
                if cand[0] > best[0] or (cand[0] == best[0] and cand[1] < best[1] - 1e-15):
                    best = cand
                if not complete[0]:
                    break
        memo[key] = best
        return best

    start = tuple(mask_of(list(v.state.in_use)) for v in views)
    placed, seconds = solve(0, start)
    return BestPlacement(placed, seconds, complete[0], counter[0])
