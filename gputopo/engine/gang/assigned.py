"""Planning a group whose members are held to nodes by their own `spec.nodeSelector`, as Kueue's
topology-aware scheduling (TAS) holds them: Kueue admits the group onto topology domains, by rank, and
writes each member's domain into its nodeSelector (at the `kubernetes.io/hostname` level one node per
member; at a leaf level the leaf's labels). kube-scheduler then offers each member only those nodes.

Within those nodes gputopo still chooses: the GPUs, the NVLink cliques, the rails. Members whose
selectors allow the same nodes are planned together with `plan_group`; the most constrained set of
members first, each set on the nodes as the earlier ones left them, so that members held to one node take
its GPUs one after the other. A set that has fewer nodes than members (Kueue put two on one node) shares
them, whatever the group's spread. Ranks stay Kueue's: every member keeps the stage it asked for.

TP groups across nodes (`gputopo.io/tp-size`, gputopo.engine.gang.rack) are kept whole where the selectors
allow: a set of members that are whole TP groups of the group is planned with them; a set that holds part
of a TP group is planned as members alone, and the TP groups are checked over the whole group afterwards.
Where the selectors put a TP group over two NVLink domains (or a ComputeDomain's pods over two), a group
that requires NVLink is told so; one that prefers it is placed as the selectors say, without a split.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from gputopo.engine.gang.groups import plan_group
from gputopo.engine.gang.plan import (
    Assignment,
    DomainSplit,
    GroupFailure,
    GroupPlan,
    Member,
    Placed,
    PlacedBefore,
    alongside_of,
    assign_stages,
    switches_of,
)
from gputopo.engine.gang.tpgroups import TpShape, placed_split, tp_shape
from gputopo.engine.network.rails import assess, is_partial, rails_of
from gputopo.engine.state.scoring import DEFAULT_WEIGHTS, ScoreWeights
from gputopo.engine.state.snapshot import NodeState, with_in_use
from gputopo.model import NvlinkPolicy, PodRequest, Spread
from gputopo.tiers import DEFAULT_TIERS, TierConfig

Selector = tuple[tuple[str, str], ...]  # spec.nodeSelector, sorted
Select = Callable[[Selector], Collection[str]]  # the names of the nodes a selector selects
HOSTNAME = "kubernetes.io/hostname"  # a node without the label answers to its name, as kubelets set it


def selects(selector: Selector, name: str, labels: Mapping[str, str]) -> bool:
    """Whether a node (its name and labels) satisfies a nodeSelector: every key equal."""
    for key, value in selector:
        have = labels.get(key)
        if have is None and key == HOSTNAME:
            have = name
        if have != value:
            return False
    return True


MAX_SELECTOR_TEXT = 200  # reasons quote selectors: a tenant's may be long


def selector_text(selector: Selector) -> str:
    text = ", ".join(f"{k}={v}" for k, v in selector)
    return text if len(text) <= MAX_SELECTOR_TEXT else text[: MAX_SELECTOR_TEXT - 1] + "…"


@dataclass(frozen=True)
class Held:
    """A member to plan and its own nodeSelector (empty: it may go wherever the asking pod may)."""

    member: Member
    selector: Selector = ()


@dataclass(frozen=True)
class Candidates:
    """The nodes a group's members may be planned onto: `nodes`, the asking pod's candidates; `extra`,
    nodes beyond them that other members' selectors name; `select`, where given, the names of the nodes a
    selector selects (gputopo.engine.gang.labelindex), else each node is matched."""

    nodes: Sequence[NodeState]
    extra: Sequence[NodeState] = ()
    select: Select | None = None


def plan_held(
    group: str,
    members: Sequence[Held],
    where: Candidates,
    tiers: TierConfig = DEFAULT_TIERS,
    weights: ScoreWeights = DEFAULT_WEIGHTS,
    *,
    placed: Sequence[Placed] = (),
    mine: Selector = (),
) -> GroupPlan | GroupFailure:
    """Place every member or none, each on a node its selector allows.

    `where.nodes`: the asking pod's candidates (kube-scheduler's verdict for its selector `mine`), where
    members with its selector or none go, as every member does without selectors; `where.extra`: other
    nodes that members' selectors name. `placed`: members placed already (a re-plan's pinned ones): their
    stages are taken, their GPUs line up the rails, and a `spread: node` set avoids their nodes."""
    nodes, extra = where.nodes, where.extra
    if not members:
        return GroupFailure(group, f"group {group}: no members")
    pinned = tuple(placed)
    stages = [h.member.request.stage for h in members if h.member.request.stage is not None] + _stages(pinned)
    if len(stages) != len(set(stages)):
        dup = sorted({s for s in stages if stages.count(s) > 1})
        return GroupFailure(group, f"group {group}: stage {dup[0]} is claimed by more than one pod")
    stage_of = {m.name: s for s, m in assign_stages([h.member for h in members], _stages(pinned))}
    by_nodes = _sets(members, where, mine)
    # The most constrained set first (it has the fewest choices), then in Kueue's rank order.
    sets = sorted(by_nodes.items(), key=lambda kv: (len(kv[0]), min(stage_of[h.member.name] for h in kv[1])))
    lead = members[0].member.request
    if len(sets) == 1 and (lead.tp_size or lead.compute_domain):
        # TP groups across nodes (gputopo.engine.gang.rack) must see the whole group: its stages and where the
        # placed members are, which a set renumbered alone would lose. One set: plan it as the group.
        ((allowed, _),) = sets
        taken = {p.node.name for p in pinned if p.node is not None and p.gpus} if lead.spread is Spread.NODE else set()
        whole = [n for n in (*nodes, *extra) if n.name in allowed and n.name not in taken]
        return plan_group(group, [h.member for h in members], whole, tiers, weights, before=PlacedBefore(placed=pinned))
    tp = _tp(group, members, pinned, stage_of)
    if isinstance(tp, GroupFailure):
        return tp
    shape, tp_groups = tp
    seen = Counter(n for allowed in by_nodes for n in allowed)
    current = {n.name: n for n in (*nodes, *extra)}
    # What later sets line their rails up with: one member per rail set and size is all alignment reads
    # (keeping every member made a 1,024-member hostname-level group cost O(members^2)).
    fixed: dict[tuple[int, int], tuple[NodeState, tuple[int, ...]]] = {}
    for node, gpus in alongside_of(pinned):
        _keep(fixed, node, gpus)
    used = {p.node.name for p in pinned if p.node is not None and p.gpus}
    assignments: list[Assignment] = []
    for allowed, held in sets:
        if not allowed:
            return _failure(group, held, "matches none of the nodes gputopo may use")
        held = sorted(held, key=lambda h: (stage_of[h.member.name], h.member.name))
        keep_tp = tp_groups is None or tp_groups.whole(held)
        todo, over = _set_members(held, [current[n] for n in allowed], used, keep_tp)
        plan = plan_group(group, todo, over, tiers, weights, before=PlacedBefore(alongside=list(fixed.values())))
        if isinstance(plan, GroupFailure):
            return _failure(group, held, plan.message) if held[0].selector else plan
        for a in plan.assignments:
            assignments.append(Assignment(a.member, stage_of[a.member], a.node, a.outcome))
            if a.outcome.gpus:  # a member without GPUs holds neither a GPU nor a node
                _keep(fixed, a.node, a.outcome.gpus)
                used.add(a.node.name)
                if seen[a.node.name] > 1:  # another set may use this node: it sees these GPUs taken
                    current[a.node.name] = with_in_use(current[a.node.name], frozenset(a.outcome.gpus), tiers)
    assignments.sort(key=lambda a: (a.stage, a.member))
    return _whole(group, members, assignments, pinned, stage_of, shape, tiers)


def _whole(
    group: str,
    members: Sequence[Held],
    assignments: Sequence[Assignment],
    pinned: tuple[Placed, ...],
    stage_of: Mapping[str, int],
    shape: TpShape | None,
    tiers: TierConfig,
) -> GroupPlan | GroupFailure:
    """The group's plan from its sets' assignments, or why the selectors rule it out over the whole group:
    a required tier they span, a TP group they put over two NVLink domains."""
    spanned = _spanned(group, members, [*(a.node for a in assignments), *(p.node for p in pinned if p.node)])
    if spanned is not None:
        return spanned
    split = None if shape is None else _split(group, members, assignments, pinned, stage_of, shape, tiers)
    if isinstance(split, GroupFailure):
        return split
    rails = assess([*((a.node, a.outcome.gpus) for a in assignments), *alongside_of(pinned)])
    return GroupPlan(
        group,
        tuple(assignments),
        switches_of(assignments, tiers),
        rails,
        alongside=alongside_of(pinned),
        placed=pinned,
        split=split,
    )


def _tp(
    group: str, members: Sequence[Held], pinned: Sequence[Placed], stage_of: Mapping[str, int]
) -> tuple[TpShape | None, _TpGroups | None] | GroupFailure:
    """The group's TP shape across nodes (None: no TP group spans nodes) and its members' TP groups, or the
    failure naming sizes that do not divide."""
    lead = members[0].member.request
    if lead.tp_size is None and lead.compute_domain is None:
        return None, None
    shape = tp_shape(lead, [g for _, _, g in _holders(members, pinned, stage_of)])
    if isinstance(shape, str):
        return GroupFailure(group, f"group {group}: {shape}")
    return shape, None if shape is None else _TpGroups(members, pinned, stage_of, shape.per_group)


def _holders(
    members: Sequence[Held], pinned: Sequence[Placed], stage_of: Mapping[str, int]
) -> list[tuple[int, str | Placed, int]]:
    """The group's GPU-holding members in the order TP groups are counted (gputopo.engine.gang.rack): by stage,
    a new member before a placed one of the same stage, a placed one of unknown stage first. Each is
    (stage, the member's name or the placed member, its GPUs)."""
    rows: list[tuple[int, int, str | Placed, int]] = [
        (stage_of[h.member.name], 0, h.member.name, h.member.request.gpus) for h in members if h.member.request.gpus
    ]
    rows += [(-1 if p.stage is None else p.stage, 1, p, len(p.gpus)) for p in pinned if p.gpus]
    rows.sort(key=lambda r: (r[0], r[1]))
    return [(stage, who, gpus) for stage, _, who, gpus in rows]


class _TpGroups:
    """Which TP group each new GPU-holding member is in, and which TP groups have a placed member."""

    def __init__(self, members: Sequence[Held], pinned: Sequence[Placed], stage_of: Mapping[str, int], per: int):
        self.of: dict[str, int] = {}
        self.members: dict[int, set[str]] = {}
        self.partial: set[int] = set()
        for i, (_, who, _) in enumerate(_holders(members, pinned, stage_of)):
            if isinstance(who, str):
                self.of[who] = i // per
                self.members.setdefault(i // per, set()).add(who)
            else:
                self.partial.add(i // per)

    def whole(self, held: Sequence[Held]) -> bool:
        """Whether these members are whole TP groups with no placed member (or hold no GPUs): planned
        with their TP groups (gputopo.engine.gang.rack); any other set, as members alone."""
        names = {h.member.name for h in held}
        touched = {self.of[n] for n in names if n in self.of}
        return all(t not in self.partial and self.members[t] <= names for t in touched)


def _split(
    group: str,
    members: Sequence[Held],
    assignments: Sequence[Assignment],
    pinned: Sequence[Placed],
    stage_of: Mapping[str, int],
    shape: TpShape,
    tiers: TierConfig,
) -> DomainSplit | GroupFailure | None:
    """The whole group's TP split where the sets were planned apart; a failure where the selectors break
    the TP rule and the group requires it; None where it only prefers NVLink, or a placed member's node
    is unknown."""
    node_of = {a.member: a.node for a in assignments}
    holders: list[tuple[NodeState, int]] = []
    for _, who, gpus in _holders(members, pinned, stage_of):
        node = node_of.get(who) if isinstance(who, str) else who.node
        if node is None:
            return None
        holders.append((node, gpus))
    lead: PodRequest = members[0].member.request
    out = placed_split(shape, holders, lead, tiers)
    if not isinstance(out, str):
        return out
    if lead.nvlink is not NvlinkPolicy.REQUIRED and lead.compute_domain is None:
        return None
    held = [h for h in members if h.selector][:4]
    where = "; ".join(f"{h.member.name}: {selector_text(h.selector)}" for h in held)
    rule = (
        "one ComputeDomain's pods share one NVLink domain"
        if shape.one_domain
        else ("gputopo.io/nvlink: required keeps each TP group in one NVLink domain")
    )
    return GroupFailure(
        group, f"group {group}: the members' spec.nodeSelector (Kueue's topology assignment) {out}; {rule} ({where})"
    )


def _stages(placed: Sequence[Placed]) -> list[int]:
    return [p.stage for p in placed if p.stage is not None]


def _keep(
    fixed: dict[tuple[int, int], tuple[NodeState, tuple[int, ...]]], node: NodeState, gpus: Sequence[int]
) -> None:
    if is_partial(node, gpus):  # a whole node is on every rail: nothing to line up with
        fixed.setdefault((rails_of(node, gpus), len(gpus)), (node, tuple(gpus)))


def _spanned(group: str, members: Sequence[Held], placed: Sequence[NodeState]) -> GroupFailure | None:
    """`required-tier` over the whole group: each set kept it alone, but the selectors may part the sets."""
    tier = members[0].member.request.required_tier
    if not tier:
        return None
    switches = {node.location.get(tier) for node in placed}
    if len(switches) <= 1 and None not in switches:
        return None
    held = [h for h in members if h.selector][:4]
    where = "; ".join(f"{h.member.name}: {selector_text(h.selector)}" for h in held)
    return GroupFailure(
        group,
        f"group {group}: the members' spec.nodeSelector (Kueue's topology assignment) spans {len(switches)} "
        f"{tier} switches; gputopo.io/required-tier asks one ({where})",
    )


def _sets(members: Sequence[Held], where: Candidates, mine: Selector) -> dict[tuple[str, ...], list[Held]]:
    """Members by the nodes they may use (in the order of `nodes`, then `extra`). With `select`, a selector's
    nodes are looked up, not matched node by node: thousands of distinct selectors cost one lookup each."""
    nodes, extra, select = where.nodes, where.extra, where.select
    every = (*nodes, *extra)
    order: dict[str, int] = {}
    hosts: dict[str, list[str]] = {}  # a hostname selector (Kueue's lowest level) finds its node at once
    for n in every:
        hosts.setdefault(n.labels.get(HOSTNAME, n.name), []).append(n.name)
    by_nodes: dict[tuple[str, ...], list[Held]] = {}
    memo: dict[Selector, tuple[str, ...]] = {
        (): tuple(n.name for n in nodes),
        mine: tuple(n.name for n in nodes if selects(mine, n.name, n.labels)),
    }
    for h in members:
        allowed = memo.get(h.selector)
        if allowed is None:
            if len(h.selector) == 1 and h.selector[0][0] == HOSTNAME:
                allowed = tuple(hosts.get(h.selector[0][1], ()))
            elif select is not None:
                if not order:
                    order.update((n.name, i) for i, n in enumerate(every))
                found = select(h.selector)  # often none (a selector of nodes gone): nothing to sort
                allowed = tuple(sorted((n for n in found if n in order), key=order.__getitem__)) if found else ()
            else:
                allowed = tuple(n.name for n in every if selects(h.selector, n.name, n.labels))
            memo[h.selector] = allowed
        by_nodes.setdefault(allowed, []).append(h)
    return by_nodes


def _set_members(
    held: Sequence[Held], allowed: Sequence[NodeState], used: set[str], keep_tp: bool = True
) -> tuple[list[Member], Sequence[NodeState]]:
    """One set of members as plan_group plans them, and the nodes it plans them over. Stages are the whole
    group's, so the set is numbered afresh; members share nodes when the set has fewer free nodes than
    members. `keep_tp=False`: the set holds part of a TP group, planned as members alone (module docstring)."""
    k = len(held)
    spread = held[0].member.request.spread
    if spread is Spread.NODE:
        free = [n for n in allowed if n.name not in used]
        if len(free) >= k:
            allowed = free
        else:
            spread = Spread.NONE
    # `held` comes in the group's rank order: the set's plan numbers its members 0..k-1 in that order, so
    # that consecutive ranks share a node and the nearest switch, as they do without selectors.
    update: dict[str, object] = {"spread": spread} if keep_tp else {"spread": spread, "tp_size": None}
    todo = [
        Member(h.member.name, h.member.request.model_copy(update={**update, "stage": i})) for i, h in enumerate(held)
    ]
    return todo, allowed


def _failure(group: str, held: Sequence[Held], why: str) -> GroupFailure:
    """The reason every member is told: which members, held where (Kueue's assignment, where Kueue wrote
    the selector), and what does not fit there."""
    names = sorted(h.member.name for h in held)
    who = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    where = selector_text(held[0].selector)
    noun = "members" if len(names) > 1 else "member"
    if any(h.selector != held[0].selector for h in held):  # selectors that select the same nodes (often none)
        return GroupFailure(
            group, f"group {group}: {noun} {who} held by their spec.nodeSelectors ({where}, ...): {why}"
        )
    return GroupFailure(
        group, f"group {group}: {noun} {who} held by spec.nodeSelector {where} (Kueue's topology assignment): {why}"
    )
