"""Planning all N pods of a group at once (pipeline stages, replicas): all placed or none.

The plan puts one member per node by default, each on its own clique; honours `required-tier` (all
members under one switch of that tier); packs members under as few switches as possible, widest tier
first, or the `preferred-tier` first when the pod names one; and orders stages along the fabric so
consecutive stages share the nearest switch.

Members that take part of a node get their GPUs on the same fabric rails on every node where the
ranking allows (gputopo.engine.network.rails): among the sets of a member's node that tie the engine's best on
NVLink strength and fragmentation, the plan takes, for every member, a set on one common rail set
(gpusets.rail_options says where rails sit in the ranking). When the chosen nodes have no such common
set, other nodes that do are taken instead if they span no more switches of any tier (the best scores
among them); failing that the members keep the engine's own sets and the plan says why they are not
rail-aligned.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gputopo.engine.gang.beside import place_beside
from gputopo.engine.gang.packed import plan_packed
from gputopo.engine.gang.plan import (
    NOTHING_BEFORE,
    REFINED,
    Assignment,
    Fabric,
    Gang,
    GroupFailure,
    GroupPlan,
    Member,
    Packing,
    PlacedBefore,
    Refinements,
    alongside_of,
    assign_stages,
    fit_tiers,
    pack_order,
    requirement_words,
    switches_of,
    under_switches,
)
from gputopo.engine.gang.rack import plan_rack
from gputopo.engine.gang.tiersets import plan_in_one_tier_set
from gputopo.engine.network.domains import domain_free
from gputopo.engine.network.rails import RailAlignment, assess, is_partial, rails_of
from gputopo.engine.node.gpusets import RailOption, rail_options
from gputopo.engine.node.placement import NodeVerdict, evaluate_node, evaluate_pod, outcome_on, rank
from gputopo.engine.state.cliques import bits, mask_of
from gputopo.engine.state.scoring import DEFAULT_WEIGHTS, ScoreWeights
from gputopo.engine.state.snapshot import NodeState
from gputopo.model import PodRequest, Spread
from gputopo.tiers import DEFAULT_TIERS, TierConfig


def _packing(lead: PodRequest, tiers: TierConfig, fabric: Fabric) -> Packing[NodeVerdict]:
    """One member per node: a node holds one member; with no tier left, the best-ranked nodes."""
    order = tuple(pack_order(tiers, lead.preferred_tier))
    return Packing(fabric, order, len, lambda v: v.outcome.score, lambda cands, n: list(cands[:n]))


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
    *,
    before: PlacedBefore = NOTHING_BEFORE,
    refine: Refinements = REFINED,
) -> GroupPlan | GroupFailure:
    """Place every member or none. Members carry their own GPU counts; group-level settings (network,
    tiers, spread) come from the first member, as all members of one job share them.

    `before`: what the group holds already: GPUs whose rails the new members line up with, and members
    placed already (a re-plan's pinned ones): the group is they and `members`, their stages (where known)
    are taken. `refine`: rail alignment and best fit, either off for the figures before it.

    Members that ask for no GPUs (a job's driver, a leader) take their stage but neither a GPU nor a
    node of their own: the others are planned as if they were not there, then each goes beside its
    nearest GPU-holding stage (gputopo.engine.gang.beside). A group of such members alone is planned whole.

    Within one tier set's nodes (gputopo.engine.gang.tiersets): a group never spans two hardware shapes. A
    group whose TP groups span nodes (`gputopo.io/tp-size`, a ComputeDomain) is gputopo.engine.gang.rack's."""
    fixed = [node for node, _ in before.alongside] + [p.node for p in before.placed if p.node is not None]
    return plan_in_one_tier_set(
        group,
        nodes,
        fixed,
        tiers,
        lambda name, part: _plan_shape(group, members, part, tiers.of_set(name), weights, before, refine),
    )


def _plan_shape(
    group: str,
    members: Sequence[Member],
    nodes: Sequence[NodeState],
    tiers: TierConfig,
    weights: ScoreWeights,
    placed_before: PlacedBefore,
    refine: Refinements,
) -> GroupPlan | GroupFailure:
    """`plan_group` over nodes of one tier set (`tiers` that set's)."""
    if not members:
        return GroupFailure(group, f"group {group}: no members")
    held = tuple(placed_before.placed)
    before = (tuple((node, tuple(gpus)) for node, gpus in placed_before.alongside) + alongside_of(held), held)
    n = len(members) + len(held)
    taken = [p.stage for p in held if p.stage is not None]
    stages = [m.request.stage for m in members if m.request.stage is not None] + taken
    if len(stages) != len(set(stages)):
        dup = sorted({s for s in stages if stages.count(s) > 1})
        return GroupFailure(group, f"group {group}: stage {dup[0]} is claimed by more than one pod")
    if any(s >= n for s in stages):
        return GroupFailure(group, f"group {group}: stage numbers must be below the group size {n}")
    staged = assign_stages(members, taken)
    holders = [(s, m) for s, m in staged if m.request.gpus > 0]
    if not holders or len(holders) == len(staged):
        holders = staged
    lead = members[0].request
    fabric = Fabric(
        domain_free(nodes, tiers),
        fit_tiers(tiers, lead.required_tier or lead.preferred_tier),
        tiers.network_tiers(),
        tuple(p.node for p in held if p.node is not None),
        refine.best_fit,
    )
    gang = Gang(group, holders, nodes, tiers, weights, before)
    rack = plan_rack(gang)
    if rack is not None:  # TP groups that span nodes: each in one NVLink domain
        plan = rack
    elif lead.spread is Spread.NONE:
        plan = plan_packed(gang, fabric)
    else:
        plan = _plan_spread(gang, lead, refine.align_rails, fabric)
    if isinstance(plan, GroupFailure) or len(holders) == len(staged):
        return plan
    return place_beside(plan, [(s, m) for s, m in staged if m.request.gpus == 0], nodes, tiers, weights)


def _plan_spread(gang: Gang, lead: PodRequest, align_rails: bool, fabric: Fabric) -> GroupPlan | GroupFailure:
    """`spread: node`: one member per node, each on its own clique."""
    group, staged, nodes, tiers, weights = gang.group, gang.staged, gang.nodes, gang.tiers, gang.weights
    n = len(staged)
    fixed, held = gang.before
    # One member per node. Members may differ in GPU count; plan for the most demanding one.
    demanding = max((m.request for _, m in staged), key=lambda r: (r.gpus, r.min_gpu_memory_mib or 0))
    feasible = rank(evaluate_pod(nodes, demanding, weights))
    required = lead.required_tier
    if required:
        domains = under_switches(feasible, required)
        big = {k: d for k, d in domains.items() if len(d) >= n}
        if not big:
            best = max((len(d) for d in domains.values()), default=0)
            return GroupFailure(
                group,
                f"group needs {n} nodes with {requirement_words(demanding)} under one "
                f"{required}; best {required} has {best}",
            )
    elif len(feasible) < n:
        return GroupFailure(
            group, f"group needs {n} nodes with {requirement_words(demanding)}; {len(feasible)} have it"
        )
    pack = _packing(lead, tiers, fabric)
    chosen = _select(feasible, n, lead, pack)
    assert chosen is not None  # enough nodes, under one switch of the required tier where one is named

    def assemble(chosen: Sequence[NodeVerdict]) -> GroupPlan:
        ordered = _stage_order(chosen, tiers)
        assignments = []
        for (stage, member), v in zip(staged, ordered, strict=True):
            outcome = v.outcome if member.request == demanding else evaluate_node(v.node, member.request, weights)
            assignments.append(Assignment(member.name, stage, v.node, outcome))
        requests = {m.name: m.request for _, m in staged}
        if align_rails:
            assignments, rails = _align_rails(assignments, requests, fixed, weights)
        else:
            rails = assess([*((a.node, a.outcome.gpus) for a in assignments), *fixed])
        fit = pack.note(feasible, chosen, n)
        return GroupPlan(group, tuple(assignments), switches_of(assignments, tiers), rails, fixed, held, fit)

    plan = assemble(chosen)
    unstaged = demanding.model_copy(update={"stage": None})
    alike = all(m.request.model_copy(update={"stage": None}) == unstaged for _, m in staged)
    if align_rails and not plan.rails.aligned and alike:
        # No common rails on these nodes: other nodes that offer one rail set may do, as long as the
        # group spans no more switches than it does now.
        other = _rail_nodes(feasible, chosen, n, lead, pack, demanding.gpus, fixed)
        if other is not None:
            retry = assemble(other)
            if retry.rails.aligned:
                return retry
    return plan


def _select(
    feasible: list[NodeVerdict], n: int, lead: PodRequest, pack: Packing[NodeVerdict]
) -> list[NodeVerdict] | None:
    """The n nodes for a spread-node group among `feasible` (ranked), or None when there are too few."""
    required = lead.required_tier
    if not required:
        return pack.cover(feasible, n, pack.order) if len(feasible) >= n else None
    domains = under_switches(feasible, required)
    options = [pack.cover(d, n, pack.order) for d in domains.values() if len(d) >= n]
    return pack.best(options) if options else None


# Rail sets tried when re-choosing a group's nodes for common rails: the ones most nodes offer.
RAIL_NODE_TRIES = 8


def _offers(v: NodeVerdict, k: int) -> frozenset[int] | None:
    """The rail sets node `v` can give a k-GPU member among its equally good GPU sets (as _align_rails
    judges them); None when the member takes the whole node (every rail: aligned with any)."""
    shape, search, choice = v.node.shape, v.outcome.search, v.outcome.choice
    if not is_partial(v.node, v.outcome.gpus) or shape is None:
        return None
    found = None
    if search is not None and (choice is None or not choice.truncated):
        found = rail_options(search.kind, shape, search.candidates, k, search.near, v.node.gpu_rails)
    if found is None:
        return frozenset({rails_of(v.node, v.outcome.gpus)})
    return frozenset(o.rails for o in found if o.rails)


def _rail_nodes(
    feasible: list[NodeVerdict],
    chosen: Sequence[NodeVerdict],
    n: int,
    lead: PodRequest,
    pack: Packing[NodeVerdict],
    k: int,
    fixed: Sequence[tuple[NodeState, tuple[int, ...]]],
) -> list[NodeVerdict] | None:
    """Nodes on which every member can have one common rail set, spanning as many switches per tier as
    `chosen` does (rails never spread a group wider); the best node scores among them, then the lowest
    rails. None when no rail set tried gives that."""
    span = pack.cost(chosen)
    offers = [_offers(v, k) for v in feasible]
    wild = sum(1 for o in offers if o is None)
    counts: dict[int, int] = {}
    for o in offers:
        for r in o or ():
            counts[r] = counts.get(r, 0) + 1
    pinned = {rails_of(node, g) for node, g in fixed if is_partial(node, g)}
    tries = [r for r in counts if counts[r] + wild >= n and (not pinned or r in pinned)]
    tries.sort(key=lambda r: (-counts[r], bits(r)))
    best: tuple[tuple[float, list[str]], list[NodeVerdict]] | None = None
    for r in tries[:RAIL_NODE_TRIES]:
        pool = [v for v, o in zip(feasible, offers, strict=True) if o is None or r in o]
        picked = _select(pool, n, lead, pack)
        if picked is None or pack.cost(picked) != span:
            continue
        key = (-sum(v.outcome.score for v in picked), sorted(v.name for v in picked))
        if best is None or key < best[0]:
            best = (key, picked)
    return None if best is None else best[1]


def _align_rails(
    assignments: list[Assignment],
    requests: Mapping[str, PodRequest],
    fixed: Sequence[tuple[NodeState, tuple[int, ...]]],
    weights: ScoreWeights,
) -> tuple[list[Assignment], RailAlignment]:
    """Re-choose partial members' GPUs onto one common rail set, each among the sets of its node that
    tie the engine's best above rails. The common rail set kept is the one whose sets rank best below
    rails (summed over members), then the one the most members already use, then the lowest rails."""
    current = assess([*((a.node, a.outcome.gpus) for a in assignments), *fixed])
    if current.aligned:
        return assignments, current
    partial = [i for i, a in enumerate(assignments) if is_partial(a.node, a.outcome.gpus)]
    pinned = {rails_of(n, g) for n, g in fixed if is_partial(n, g)}
    sizes = {len(assignments[i].outcome.gpus) for i in partial} | {len(g) for n, g in fixed if is_partial(n, g)}
    if len(pinned) > 1 or len(sizes) > 1:
        return assignments, current  # placed members already differ, or sizes do: no common set exists
    options: list[dict[int, RailOption]] = []
    for i in partial:
        a = assignments[i]
        search, choice = a.outcome.search, a.outcome.choice
        found = None
        if a.node.shape is not None and search is not None and (choice is None or not choice.truncated):
            found = rail_options(
                search.kind, a.node.shape, search.candidates, len(a.outcome.gpus), search.near, a.node.gpu_rails
            )
        if found is None:  # too many sets to rank: this member can only keep its own set
            found = (RailOption(rails_of(a.node, a.outcome.gpus), mask_of(list(a.outcome.gpus)), ()),)
        options.append({o.rails: o for o in found})
    common = set.intersection(*(set(o) for o in options)) if options else set()
    if pinned:
        common &= pinned
    common.discard(0)  # GPUs with no NIC near them are on no rail: nothing to align on
    if not common:
        why = current.why.replace("members use ", "", 1)
        return assignments, RailAlignment(
            True, False, why=f"no equally good GPU sets on one rail set were free on every member's node ({why})"
        )

    def merit(rails: int) -> tuple[tuple[int, ...], int]:
        picks = [o[rails] for o in options]
        rest = tuple(sum(col) for col in zip(*(p.rest for p in picks), strict=False))
        kept = sum(p.mask == mask_of(list(assignments[i].outcome.gpus)) for p, i in zip(picks, partial, strict=True))
        return rest, kept

    target = max(sorted(common, key=bits), key=merit)  # max keeps the first of equals: the lowest rails
    out = list(assignments)
    for o, i in zip(options, partial, strict=True):
        a = assignments[i]
        pick = o[target].mask
        if pick != mask_of(list(a.outcome.gpus)):
            outcome = outcome_on(a.node, requests[a.member], a.outcome, pick, weights)
            if outcome is not None:  # always, as the pick came from the same candidates
                out[i] = Assignment(a.member, a.stage, a.node, outcome)
    return out, assess([*((a.node, a.outcome.gpus) for a in out), *fixed])
