"""Planning all N pods of a group at once (pipeline stages, replicas): all placed or none.

The plan puts one member per node by default, each on its own clique; honours `required-tier` (all
members under one switch of that tier); packs members under as few switches as possible, widest tier
first, or the `preferred-tier` first when the pod names one; and orders stages along the fabric so
consecutive stages share the nearest switch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gputopo.engine.placement import NodeVerdict, Outcome, evaluate_node, evaluate_pod, rank
from gputopo.engine.scoring import DEFAULT_WEIGHTS, ScoreWeights
from gputopo.engine.snapshot import NodeState, with_in_use
from gputopo.model import NetworkKind, NvlinkPolicy, PodRequest, Spread
from gputopo.tiers import DEFAULT_TIERS, TierConfig


@dataclass(frozen=True)
class Member:
    name: str
    request: PodRequest


@dataclass(frozen=True)
class Assignment:
    member: str
    stage: int
    node: NodeState
    outcome: Outcome


@dataclass(frozen=True)
class GroupPlan:
    group: str
    assignments: tuple[Assignment, ...]  # in stage order
    switches_used: Mapping[str, int]  # tier -> distinct switches the plan spans

    def for_member(self, name: str) -> Assignment | None:
        return next((a for a in self.assignments if a.member == name), None)


@dataclass(frozen=True)
class GroupFailure:
    group: str
    message: str  # one categorical sentence, the same for every node


def _requirement_words(req: PodRequest) -> str:
    parts = []
    if req.network is not NetworkKind.ANY:
        word = {"infiniband": "InfiniBand", "roce": "RoCE", "rdma": "RDMA"}[req.network.value]
        parts.append(f"an active {word} NIC")
    if req.gpus > 1 and req.nvlink is NvlinkPolicy.REQUIRED:
        parts.append(f"a free {req.gpus}-GPU NVLink clique")
    elif req.gpus > 0:
        parts.append(f"{req.gpus} free GPUs")
    return " and ".join(parts) or "room"


def _pack_order(tiers: TierConfig, preferred: str | None) -> list[str]:
    order = list(tiers.network_tiers())
    if preferred and preferred in order:
        order.remove(preferred)
        order.insert(0, preferred)
    return order


def _cost(chosen: Sequence[NodeVerdict], order: Sequence[str]) -> tuple[float, ...]:
    counts = []
    for tier in order:
        ids = {v.node.location.get(tier) or f"?{v.name}" for v in chosen}
        counts.append(float(len(ids)))
    return (*counts, -sum(v.outcome.score for v in chosen))


def _pack(cands: list[NodeVerdict], n: int, order: Sequence[str]) -> list[NodeVerdict]:
    """Pick n nodes spanning as few switches as possible, tier by tier, best scores within a switch."""
    if not order:
        return cands[:n]
    tier, rest = order[0], order[1:]
    buckets: dict[str, list[NodeVerdict]] = {}
    for v in cands:
        buckets.setdefault(v.node.location.get(tier) or f"?{v.name}", []).append(v)
    whole = [b for b in buckets.values() if len(b) >= n]
    if whole:
        options = [_pack(b, n, rest) for b in whole]
        return min(options, key=lambda c: (_cost(c, order), [v.name for v in c]))
    # No single switch holds the group: fill the fullest switches first (fewest switches overall).
    ordered = sorted(buckets.items(), key=lambda kv: (-len(kv[1]), -sum(v.outcome.score for v in kv[1]), kv[0]))
    picked: list[NodeVerdict] = []
    for _, bucket in ordered:
        need = n - len(picked)
        if need <= 0:
            break
        picked.extend(bucket if len(bucket) <= need else _pack(bucket, need, rest))
    return picked


def _stage_order(chosen: Sequence[NodeVerdict], tiers: TierConfig) -> list[NodeVerdict]:
    """Consecutive stages on neighbouring nodes: sort by switch path, widest tier first."""
    net = tiers.network_tiers()
    return sorted(chosen, key=lambda v: (*[(v.node.location.get(t) or "~") for t in net], v.name))


def plan_group(
    group: str,
    members: Sequence[Member],
    nodes: Sequence[NodeState],
    tiers: TierConfig = DEFAULT_TIERS,
    weights: ScoreWeights = DEFAULT_WEIGHTS,
) -> GroupPlan | GroupFailure:
    """Place every member or none. Members carry their own GPU counts; group-level settings (network,
    tiers, spread) come from the first member, as all members of one job share them."""
    if not members:
        return GroupFailure(group, f"group {group}: no members")
    lead = members[0].request
    n = len(members)
    stages = [m.request.stage for m in members if m.request.stage is not None]
    if len(stages) != len(set(stages)):
        dup = sorted({s for s in stages if stages.count(s) > 1})
        return GroupFailure(group, f"group {group}: stage {dup[0]} is claimed by more than one pod")
    if any(s >= n for s in stages):
        return GroupFailure(group, f"group {group}: stage numbers must be below the group size {n}")
    staged = _assign_stages(members)
    if lead.spread is Spread.NONE:
        return _plan_packed(group, staged, nodes, tiers, weights)

    # One member per node. Members may differ in GPU count; plan for the most demanding one.
    demanding = max((m.request for _, m in staged), key=lambda r: (r.gpus, r.min_gpu_memory_mib or 0))
    feasible = rank(evaluate_pod(nodes, demanding, weights))
    required = lead.required_tier
    if required:
        domains: dict[str, list[NodeVerdict]] = {}
        for v in feasible:
            sw = v.node.location.get(required)
            if sw is not None:
                domains.setdefault(sw, []).append(v)
        big = {k: d for k, d in domains.items() if len(d) >= n}
        if not big:
            best = max((len(d) for d in domains.values()), default=0)
            return GroupFailure(
                group,
                f"group needs {n} nodes with {_requirement_words(demanding)} under one "
                f"{required}; best {required} has {best}",
            )
        order = _pack_order(tiers, lead.preferred_tier)
        options = [_pack(d, n, order) for d in big.values()]
        chosen = min(options, key=lambda c: (_cost(c, order), [v.name for v in c]))
    else:
        if len(feasible) < n:
            return GroupFailure(
                group, f"group needs {n} nodes with {_requirement_words(demanding)}; {len(feasible)} have it"
            )
        chosen = _pack(feasible, n, _pack_order(tiers, lead.preferred_tier))

    ordered = _stage_order(chosen, tiers)
    assignments = []
    for (stage, member), v in zip(staged, ordered, strict=True):
        outcome = v.outcome if member.request == demanding else evaluate_node(v.node, member.request, weights)
        assignments.append(Assignment(member.name, stage, v.node, outcome))
    return GroupPlan(group, tuple(assignments), _switches(assignments, tiers))


def _plan_packed(
    group: str,
    staged: Sequence[tuple[int, Member]],
    nodes: Sequence[NodeState],
    tiers: TierConfig,
    weights: ScoreWeights,
) -> GroupPlan | GroupFailure:
    """`spread: none`: members may share a node; place them one by one, each seeing the GPUs taken."""
    current = {n.name: n for n in nodes}
    assignments: list[Assignment] = []
    used_switch: dict[str, str | None] = {}
    for stage, member in staged:
        verdicts = rank(evaluate_pod(current.values(), member.request, weights))
        if not verdicts:
            return GroupFailure(
                group,
                f"group needs room for {len(staged)} members with "
                f"{_requirement_words(member.request)}; {len(assignments)} fit",
            )
        if used_switch:
            # Keep the group together: prefer nodes already used, then their leaf.
            leaf = tiers.network_tiers()[-1] if tiers.network_tiers() else None
            verdicts.sort(
                key=lambda v: (
                    v.name not in used_switch,
                    leaf is not None and v.node.location.get(leaf) not in used_switch.values(),
                    -v.outcome.score,
                    v.name,
                )
            )
        best = verdicts[0]
        assignments.append(Assignment(member.name, stage, best.node, best.outcome))
        leaf = tiers.network_tiers()[-1] if tiers.network_tiers() else None
        used_switch[best.name] = best.node.location.get(leaf) if leaf else None
        current[best.name] = with_in_use(best.node, frozenset(best.outcome.gpus), tiers)
    return GroupPlan(group, tuple(assignments), _switches(assignments, tiers))


def _assign_stages(members: Sequence[Member]) -> list[tuple[int, Member]]:
    """Members with an explicit stage keep it; the others fill the free stage numbers in name order."""
    taken = {m.request.stage for m in members if m.request.stage is not None}
    free = iter(i for i in range(len(members)) if i not in taken)
    out = []
    for m in sorted(members, key=lambda m: m.name):
        out.append((m.request.stage if m.request.stage is not None else next(free), m))
    return sorted(out, key=lambda sm: (sm[0], sm[1].name))


def _switches(assignments: Sequence[Assignment], tiers: TierConfig) -> dict[str, int]:
    return {t: len({a.node.location.get(t) or f"?{a.node.name}" for a in assignments}) for t in tiers.network_tiers()}


def group_waiting_message(group: str, present: int, size: int) -> str:
    return f"group {group}: {present}/{size} pods exist, waiting"
