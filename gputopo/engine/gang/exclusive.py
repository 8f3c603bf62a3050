"""JobSet exclusive placement: a domain for every Job, the whole JobSet planned at once. Pure: no I/O.

Under JobSet's exclusive placement (docs/annotations.md, "JobSet exclusive placement") each Job's pods run
in one domain of a node label and no two Jobs share a domain. A domain is the nodes with one value of
that label: what JobSet's webhook pins a Job's followers to (its leader's node's value), whether or not a
gputopo tier reads the label. `plan_exclusive` gives every Job a domain where the whole Job fits as
`plan_group` judges it (GPU counts, NVLink cliques, rails), distinct domains for distinct Jobs, chosen
together: under as few switches of the tiers wider than the label's tier as possible (every network tier
when no tier reads the label), widest first, each Job preferring its best-scoring domains. A Job with a
member bound already keeps that member's domain.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gputopo.engine.gang.groups import plan_group
from gputopo.engine.gang.plan import (
    Assignment,
    GroupFailure,
    GroupPlan,
    Member,
    Placed,
    PlacedBefore,
    alongside_of,
    switches_of,
)
from gputopo.engine.network.rails import assess
from gputopo.engine.state.scoring import DEFAULT_WEIGHTS, ScoreWeights
from gputopo.engine.state.snapshot import NodeState
from gputopo.model import PodRequest, Spread
from gputopo.model.jobs import tier_of_label
from gputopo.tiers import DEFAULT_TIERS, TierConfig


@dataclass(frozen=True)
class ExclusiveJob:
    """One Job of the JobSet: its leader's rank in the JobSet (`offset`), the members to plan (each
    request's stage: the member's rank in the JobSet), those bound already (`pinned`, each stage its
    completion index in the Job, each with its node), and the only nodes its members may go to (`only`,
    None for any: the asking pod's Job gets the nodes kube-scheduler offered it)."""

    name: str
    offset: int
    members: tuple[Member, ...]
    pinned: tuple[Placed, ...] = ()
    only: frozenset[str] | None = None

    def within(self, nodes: Sequence[NodeState]) -> list[NodeState]:
        return list(nodes) if self.only is None else [n for n in nodes if n.name in self.only]


# Job (its index) -> domain -> the Job's plan score there, the best first
Options = dict[int, dict[str, float]]


def domain_words(key: str, tiers: TierConfig) -> str:
    """'domain of gputopo.io/network-leaf (tier leaf)': what one value of `key` is, for reasons."""
    tier = tier_of_label(tiers.labels_by_tier(), key)
    return f"domain of {key}" + (f" (tier {tier})" if tier else "")


def plan_exclusive(
    group: str,
    jobs: Sequence[ExclusiveJob],
    key: str,
    nodes: Sequence[NodeState],
    tiers: TierConfig = DEFAULT_TIERS,
    weights: ScoreWeights = DEFAULT_WEIGHTS,
) -> GroupPlan | GroupFailure:
    """Every Job's members planned in a domain of node label `key` of its own, or the reason none is.
    `nodes`: where members may go; a pinned member's node need not be among them."""
    domains: dict[str, list[NodeState]] = {}
    for n in nodes:
        value = n.labels.get(key)
        if value:
            domains.setdefault(value, []).append(n)
    fixed: dict[int, str] = {}
    for i, job in enumerate(jobs):
        values = {(p.node.labels.get(key) or "") if p.node is not None else "" for p in job.pinned}
        if len(values) > 1 or "" in values:
            spots = ", ".join(sorted(f"{key}={v}" if v else f"a node without {key}" for v in values))
            return GroupFailure(group, f"group {group}: Job {job.name}'s bound pods are not in one domain: {spots}")
        if values:
            fixed[i] = values.pop()
    if not domains:
        return GroupFailure(group, f"group {group}: no node offered has the label {key} (JobSet exclusive placement)")
    options, failed = _options(jobs, key, fixed, domains, tiers, weights)
    if failed:
        return GroupFailure(group, f"group {group}: {failed}")
    tier = tier_of_label(tiers.labels_by_tier(), key)
    wider = tiers.names[: tiers.names.index(tier)] if tier is not None else tiers.names
    order = [t for t in tiers.network_tiers() if t in wider]
    where = {d: ns[0].location for d, ns in domains.items()}
    chosen = _pick(options, sorted({d for o in options.values() for d in o}), order, where)
    if chosen is None:
        held = len(_matching(options, sorted({d for o in options.values() for d in o})))
        return GroupFailure(
            group,
            f"group {group}: {len(options)} Jobs need a {domain_words(key, tiers)} each (JobSet exclusive "
            f"placement); only {held} can have one at once",
        )
    assignments: list[Assignment] = []
    for i, d in sorted(chosen.items()):
        planned = _plan_in(jobs[i], jobs[i].within(domains[d]), tiers, weights)
        assert isinstance(planned, GroupPlan)  # it fit there a moment ago, on the same states
        assignments.extend(planned.assignments)
    assignments.sort(key=lambda a: (a.stage, a.member))
    placed = tuple(
        Placed(None if p.stage is None else job.offset + p.stage, p.node, p.gpus) for job in jobs for p in job.pinned
    )
    rails = assess([*((a.node, a.outcome.gpus) for a in assignments), *alongside_of(placed)])
    return GroupPlan(group, tuple(assignments), switches_of(assignments, tiers), rails, placed=placed)


def _options(
    jobs: Sequence[ExclusiveJob],
    key: str,
    fixed: Mapping[int, str],
    domains: Mapping[str, list[NodeState]],
    tiers: TierConfig,
    weights: ScoreWeights,
) -> tuple[Options, str]:
    """The domains each Job with members to plan fits in, with its plan score there; or why a Job fits in
    none. Jobs alike on domains alike (the same node kinds) are planned once: a JobSet's Jobs usually
    share one template, and a hostname's domains a few node kinds."""
    taken = set(fixed.values())
    memo: dict[
        tuple[frozenset[tuple[PodRequest, int]], tuple[tuple[int, tuple[str | None, ...]], ...]],
        GroupPlan | GroupFailure,
    ] = {}
    options: Options = {}
    for i, job in enumerate(jobs):
        if not job.members:
            continue  # every pod bound: nothing to plan, its domain stays taken
        shape = frozenset(Counter(m.request.model_copy(update={"stage": None}) for m in job.members).items())
        # Node kinds decide whether a Job fits, unless it requires a tier: then where the nodes sit does too.
        tiered = job.members[0].request.required_tier is not None
        cands = (
            {fixed[i]: domains.get(fixed[i], [])}
            if i in fixed
            else {d: ns for d, ns in domains.items() if d not in taken}
        )
        found: dict[str, float] = {}
        why: tuple[int, str] = (-1, "")
        for d, all_ns in cands.items():
            ns = job.within(all_ns)
            sig = (shape, tuple((n.key, tuple(n.location.values()) if tiered else ()) for n in ns))
            out = memo.get(sig) if not job.pinned else None
            if out is None:
                out = _plan_in(job, ns, tiers, weights)
                if not job.pinned:
                    memo[sig] = out
            if isinstance(out, GroupPlan):
                found[d] = sum(a.outcome.score for a in out.assignments)
            elif len(ns) > why[0]:
                why = (len(ns), out.message)  # the roomiest domain's reason speaks for the Job
        if not found:
            if i in fixed:
                where = f"{key}={fixed[i]}"
                return (
                    options,
                    f"Job {job.name} does not fit in its leader's domain {where}: {why[1] or 'no node offered'}",
                )
            return options, f"Job {job.name} fits in no free domain: {why[1] or 'every domain is taken by another Job'}"
        options[i] = dict(sorted(found.items(), key=lambda kv: (-kv[1], kv[0])))  # best first, for matching
    return options, ""


def _plan_in(
    job: ExclusiveJob, nodes: Sequence[NodeState], tiers: TierConfig, weights: ScoreWeights
) -> GroupPlan | GroupFailure:
    """The Job's members planned on `nodes` (one domain) beside its bound members, each at its completion
    index in the Job; the plan's stages are JobSet ranks."""
    local = [
        Member(m.name, m.request.model_copy(update={"stage": (m.request.stage or 0) - job.offset})) for m in job.members
    ]
    if job.pinned and local[0].request.spread is Spread.NODE:
        taken = {p.node.name for p in job.pinned if p.node is not None}
        nodes = [n for n in nodes if n.name not in taken]
    out = plan_group(job.name, local, nodes, tiers, weights, before=PlacedBefore(placed=job.pinned))
    if isinstance(out, GroupFailure):
        return out
    moved = tuple(Assignment(a.member, job.offset + a.stage, a.node, a.outcome) for a in out.assignments)
    return GroupPlan(out.group, moved, out.switches_used, out.rails, placed=out.placed)


def _matching(options: Options, domains: Sequence[str]) -> dict[int, str]:
    """A largest set of Jobs with a distinct domain each among `domains` (augmenting paths); each Job
    tries its best-scoring domains first."""
    allowed = set(domains)
    prefs = {i: [d for d in o if d in allowed] for i, o in options.items()}
    owner: dict[str, int] = {}

    def augment(i: int, seen: set[str]) -> bool:
        for d in prefs[i]:
            if d in seen:
                continue
            seen.add(d)
            if d not in owner or augment(owner[d], seen):
                owner[d] = i
                return True
        return False

    for i in sorted(prefs):
        augment(i, set())
    return {i: d for d, i in owner.items()}


def _pick(
    options: Options, domains: Sequence[str], order: Sequence[str], where: Mapping[str, Mapping[str, str | None]]
) -> dict[int, str] | None:
    """Every Job's domain among `domains`, under as few switches of `order`'s tiers as possible, tier by
    tier; None when they cannot all have one."""
    if len(domains) < len(options):
        return None  # fewer domains than Jobs: no need to match
    if not order:
        found = _matching(options, domains)
        return found if len(found) == len(options) else None
    tier, rest = order[0], order[1:]
    buckets: dict[str, list[str]] = {}
    for d in domains:
        buckets.setdefault(where[d].get(tier) or f"?{d}", []).append(d)
    picks = [p for b in buckets.values() if (p := _pick(options, b, rest, where)) is not None]
    if picks:
        return min(picks, key=lambda p: _cost(p, options, order, where))
    # No one switch holds every Job: the switches holding the most Jobs first, until all have a domain.
    held = {s: len(_matching(options, b)) for s, b in buckets.items()}
    pool: list[str] = []
    for s in sorted(buckets, key=lambda s: (-held[s], s)):
        pool.extend(buckets[s])
        found = _matching(options, pool)
        if len(found) == len(options):
            return found
    return None


def _cost(
    pick: Mapping[int, str], options: Options, order: Sequence[str], where: Mapping[str, Mapping[str, str | None]]
) -> tuple[object, ...]:
    """Switches per tier (widest first), then the plans' scores, then the domains' names."""
    counts = [len({where[d].get(t) or f"?{d}" for d in pick.values()}) for t in order]
    return (*counts, -sum(options[i][d] for i, d in pick.items()), sorted(pick.values()))
