"""Tensor-parallel groups larger than a node: each TP group inside one multi-node NVLink domain (an NVL72
rack's 18 trays), a gang too big for one domain split over the fewest domains, in balance, on TP-group
boundaries, with at most a cap of trays per domain (docs/annotations.md, "Tensor parallelism across
nodes").

A group asks for it with `gputopo.io/tp-size` larger than a member's GPUs: consecutive GPU-holding
members in stage order, `tp-size / GPUs` of them, form one TP group. Members claiming one ComputeDomain's
IMEX channel (`PodRequest.compute_domain`) keep the whole group in one domain. Only trays whose fabric
reads healthy take part (`NodeState.fabric`: degraded and unknown alike are left out, and domains with
such trays come after the others). Pipeline stages cross domains in rank order: TP group t is stages
t*k..t*k+k-1, and the domains are taken in fabric order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from gputopo.engine.gang.packed import capacity
from gputopo.engine.gang.plan import (
    Assignment,
    DomainShare,
    DomainSplit,
    Gang,
    GroupFailure,
    GroupPlan,
    Member,
    Placed,
    switches_of,
)
from gputopo.engine.gang.tpgroups import DOMAIN, TpShape, straddle_gbps, tp_shape
from gputopo.engine.network.cost import domain_allreduce_seconds
from gputopo.engine.network.estimate import domain_busbw
from gputopo.engine.network.rails import assess
from gputopo.engine.node.placement import evaluate_node
from gputopo.engine.state.scoring import ScoreWeights
from gputopo.engine.state.snapshot import NodeState, with_in_use
from gputopo.model import FabricHealth, NvlinkPolicy, PodRequest, Spread
from gputopo.model.k8snames import ascii_int
from gputopo.model.names import LABEL_NVLINK_DOMAIN_CAP
from gputopo.tiers import TierConfig

LABEL_DOMAIN_CAP = LABEL_NVLINK_DOMAIN_CAP
MAX_CAP = 4096


@dataclass(frozen=True)
class _Tray:
    node: NodeState
    room: int  # members it holds alone
    score: float


@dataclass
class _Domain:
    name: str
    trays: list[_Tray]
    cap: int | None
    skipped: list[NodeState]  # trays of the domain left out for their fabric
    free: int  # free GPUs of the domain's fitting healthy trays (best fit: the fullest first)
    reserved: int = 0  # members of TP groups placed here before (a re-plan) that the domain must still hold
    taken: int = 0  # trays of the domain the group's placed members hold (they count against the cap)

    @property
    def trays_left(self) -> int | None:
        """Trays the cap leaves to the new members (None: no cap)."""
        return None if self.cap is None else max(0, self.cap - self.taken)

    def room(self) -> int:
        """Members the domain holds besides `reserved`: its roomiest trays, at most the cap's."""
        rooms = sorted((t.room for t in self.trays), reverse=True)
        left = self.trays_left
        return sum(rooms[:left] if left is not None else rooms) - self.reserved

    def key(self) -> tuple[int, int, str]:
        return (len(self.skipped), self.free, self.name)


def _cap_label(node: NodeState) -> int | str | None:
    """The tray's `gputopo.io/nvlink-domain-cap` (None: no label); a sentence naming the node and value when
    it is not ASCII digits from 1 to 4096."""
    value = node.labels.get(LABEL_DOMAIN_CAP)
    if value is None:
        return None
    n = ascii_int(value, 1, MAX_CAP)
    if n is None:
        return f"node {node.name} label {LABEL_DOMAIN_CAP}={value!r} is not a whole number from 1 to {MAX_CAP}"
    return n


def _cap(nodes: Sequence[NodeState], default: int | None) -> int | None:
    """A domain's cap: the `gputopo.io/nvlink-domain-cap` every one of its trays carries, when they all carry
    the same value; else `default` (the nvlink-domain tier's groupCap). So one tray, relabelled or added
    without the label, cannot set its neighbours' cap: it can only leave the domain to the chart's tier."""
    values = {_cap_label(n) for n in nodes}
    if len(values) == 1:
        (only,) = values
        if isinstance(only, int):
            return only
    return default


def domain_cap(trays: Sequence[NodeState], tiers: TierConfig) -> int | None:
    """The cap of the NVLink domain whose trays are `trays` now (what a plan was made under: `_cap` over the
    trays with a well-formed label, else the nvlink-domain tier's groupCap); None: no cap."""
    default = next((t.group_cap for t in tiers.tiers if t.name == DOMAIN), None)
    return _cap([t for t in trays if not isinstance(_cap_label(t), str)], default)


def _domains(
    nodes: Sequence[NodeState], req: PodRequest, spread: Spread, limit: int, weights: ScoreWeights, tiers: TierConfig
) -> tuple[dict[str, _Domain], list[str]]:
    """Each NVLink domain's trays that fit a member and whose fabric is healthy; the problems of the trays
    left out for a malformed cap label (each such tray alone: the rest of its domain takes part)."""
    by: dict[str, list[NodeState]] = {}
    problems: list[str] = []
    for node in nodes:
        d = node.location.get(DOMAIN)
        if d is None:
            continue
        label = _cap_label(node)
        if isinstance(label, str):
            problems.append(label)
            continue
        by.setdefault(d, []).append(node)
    default = next((t.group_cap for t in tiers.tiers if t.name == DOMAIN), None)
    out: dict[str, _Domain] = {}
    memo: dict[int, tuple[int, float]] = {}  # equivalent nodes (equal keys) hold the same: count once per key
    for name, members in by.items():
        cap = _cap(members, default)
        trays, skipped = [], []
        for node in members:
            if node.fabric is not FabricHealth.HEALTHY:  # counted even when full: its domain comes later
                skipped.append(node)
                continue
            if node.key not in memo:
                memo[node.key] = capacity(node, req, 1 if spread is Spread.NODE else limit, weights, tiers)
            room, score = memo[node.key]
            if room > 0:
                trays.append(_Tray(node, room, score))
        trays.sort(key=lambda t: (-t.score, t.node.name))
        free = sum(t.node.free_mask.bit_count() for t in trays)
        out[name] = _Domain(name, trays, cap, skipped, free)
    if len(problems) > 1:  # one sentence, not one per tray of a mislabelled rack
        problems = [f"{problems[0]} (and {len(problems) - 1} more tray(s) left out for their cap label)"]
    return out, problems


def balanced(capacities: Sequence[int], groups: int) -> list[int] | None:
    """`groups` TP groups over domains holding `capacities` TP groups each, the smallest share as large
    as it can be (water filling); None when they hold too few."""
    if sum(capacities) < groups:
        return None
    order = sorted(range(len(capacities)), key=lambda i: capacities[i])
    shares = [0] * len(capacities)
    left = groups
    for pos, i in enumerate(order):
        shares[i] = min(capacities[i], left // (len(order) - pos))
        left -= shares[i]
    return shares if left == 0 else None


def _fewest(caps: Sequence[int], groups: int) -> int | None:
    total = 0
    for m, c in enumerate(sorted(caps, reverse=True), start=1):
        total += c
        if total >= groups:
            return m
    return None


def _scope(domain: _Domain, tier: str) -> str | None:
    """The switch of `tier` all the domain's trays sit under, or None when they sit under several."""
    switches = {t.node.location.get(tier) for t in domain.trays}
    return switches.pop() if len(switches) == 1 else None


def choose(domains: Sequence[_Domain], per: int, groups: int, tiers: TierConfig) -> list[tuple[_Domain, int]] | None:
    """The fewest domains that hold `groups` TP groups of `per` members, in balance; among equal splits,
    domains under one switch (leaf, then spine), then without skipped trays, then the fullest (best
    fit), then names. Each with its share of TP groups."""
    caps = {d.name: d.room() // per for d in domains}
    usable = [d for d in domains if caps[d.name] > 0]
    m = _fewest([caps[d.name] for d in usable], groups)
    if m is None:
        return None
    scopes: list[dict[str | None, list[_Domain]]] = []
    for tier in reversed(tiers.network_tiers()):
        under: dict[str | None, list[_Domain]] = {}
        for d in usable:
            under.setdefault(_scope(d, tier), []).append(d)
        under.pop(None, None)
        scopes.append(under)
    scopes.append({None: usable})
    for scope in scopes:
        options = [opt for group in scope.values() if (opt := _pick(group, m, groups, caps)) is not None]
        if options:
            return min(options, key=lambda o: _rank(o))
    return None


def _pick(cands: Sequence[_Domain], m: int, groups: int, caps: Mapping[str, int]) -> list[tuple[_Domain, int]] | None:
    """m of `cands` holding `groups` in balance: those that hold a whole even share first (best key),
    then the roomiest."""
    target = -(-groups // m)
    ranked = sorted(cands, key=_Domain.key)
    chosen = [d for d in ranked if caps[d.name] >= target][:m]
    rest = sorted((d for d in ranked if d not in chosen), key=lambda d: (-caps[d.name], d.key()))
    chosen += rest[: m - len(chosen)]
    shares = balanced([caps[d.name] for d in chosen], groups) if len(chosen) == m else None
    return None if shares is None else list(zip(chosen, shares, strict=True))


def _rank(option: Sequence[tuple[_Domain, int]]) -> tuple[int, int, int, list[str]]:
    shares = [s for _, s in option]
    return (
        max(shares) - min(shares),
        sum(len(d.skipped) for d, _ in option),
        sum(d.free for d, _ in option),
        sorted(d.name for d, _ in option),
    )


def _fabric_order(domain: _Domain, tiers: TierConfig) -> tuple[str, ...]:
    first = min((t.node for t in domain.trays), key=lambda n: n.name)
    return (*[(first.location.get(t) or "~") for t in tiers.network_tiers()], domain.name)


def _take(domain: _Domain, members: int) -> list[_Tray]:
    """Trays of the domain for `members` members: the best-scoring trays (roomiest first when members
    share trays), at most `cap` of them."""
    pool = sorted(domain.trays, key=lambda t: (-t.room, -t.score, t.node.name))
    picked: list[_Tray] = []
    need = members
    for tray in pool:
        left = domain.trays_left
        if need <= 0 or (left is not None and len(picked) >= left):
            break
        picked.append(tray)
        need -= tray.room
    return sorted(picked, key=lambda t: t.node.name)


def plan_rack(gang: Gang) -> GroupPlan | GroupFailure | None:
    """The plan of a group whose TP groups span nodes; None when none does (or when the group only
    prefers NVLink and no domain split holds it: the other planners place it then).

    Members placed before (a re-plan) keep their TP groups where they are: the new members of a TP group
    with placed members go to its domain (a ComputeDomain's, to the one domain its placed members use);
    TP groups with none placed are split afresh over what the domains hold besides."""
    group, staged, nodes, tiers, weights = gang.group, gang.staged, gang.nodes, gang.tiers, gang.weights
    held = gang.before[1]
    lead = staged[0][1].request
    placed = [p for p in held if p.gpus]
    shape = tp_shape(lead, [m.request.gpus for _, m in staged] + [len(p.gpus) for p in placed])
    if shape is None:
        return None
    if isinstance(shape, str):
        return GroupFailure(group, f"group {group}: {shape}")
    demanding = max((m.request for _, m in staged), key=lambda r: (r.gpus, r.min_gpu_memory_mib or 0))
    domains, problems = _domains(nodes, demanding, lead.spread, len(staged), weights, tiers)
    new, where = _tp_groups(staged, placed, shape.per_group)
    if shape.one_domain and where:
        first = next(iter(where.values()))
        where = dict.fromkeys(range(shape.groups), first)
    fresh = [t for t in sorted(new) if t not in where]
    for t, d in where.items():
        if t in new and d in domains:
            domains[d].reserved += len(new[t])
    for d in set(where.values()):
        if d in domains:
            domains[d].taken = len(
                {p.node.name for p in placed if p.node is not None and p.node.location.get(DOMAIN) == d}
            )
    pinned_ok = all(d in domains and domains[d].room() >= 0 for t, d in where.items() if t in new)
    pool = [d for d in domains.values() if not (shape.one_domain and where) or d.name in where.values()]
    split = choose(pool, shape.per_group, len(fresh), tiers) if fresh else []
    if split is not None and shape.one_domain and len({d.name for d, _ in split} | set(where.values())) > 1:
        split = None
    if split is None or not pinned_ok:
        if lead.nvlink is not NvlinkPolicy.REQUIRED:
            return None
        return GroupFailure(group, _failure(group, shape, list(domains.values()), problems))
    ordered = iter(d for d, share in sorted(split, key=lambda ds: _fabric_order(ds[0], tiers)) for _ in range(share))
    where.update({t: next(ordered).name for t in fresh})
    return _assemble(gang, new, where, shape, domains, lead)


def _tp_groups(
    staged: Sequence[tuple[int, Member]], placed: Sequence[Placed], per: int
) -> tuple[dict[int, list[tuple[int, Member]]], dict[int, str]]:
    """The new members of each TP group (stage order over new and placed GPU holders; a placed member of
    unknown stage counts first), and the domain of each TP group with a placed member."""
    rows: list[tuple[int, int, tuple[int, Member] | Placed]] = [(s, 0, (s, m)) for s, m in staged]
    rows += [(p.stage if p.stage is not None else -1, 1, p) for p in placed]
    rows.sort(key=lambda r: (r[0], r[1]))
    new: dict[int, list[tuple[int, Member]]] = {}
    where: dict[int, str] = {}
    for i, (_, _, x) in enumerate(rows):
        t = i // per
        if isinstance(x, Placed):
            d = x.node.location.get(DOMAIN) if x.node is not None else None
            if d is not None:
                where.setdefault(t, d)
        else:
            new.setdefault(t, []).append(x)
    return new, where


def _assemble(
    gang: Gang,
    new: Mapping[int, Sequence[tuple[int, Member]]],
    where: Mapping[int, str],
    shape: TpShape,
    domains: Mapping[str, _Domain],
    lead: PodRequest,
) -> GroupPlan | GroupFailure:
    """Each domain's new members on the trays `gang` gives it (`new`: the new members of each TP group,
    `where`: each TP group's domain), stage order; the split over every TP group."""
    group, tiers, weights = gang.group, gang.tiers, gang.weights
    fixed, held = gang.before
    assignments: list[Assignment] = []
    for name in dict.fromkeys(where[t] for t in sorted(new)):
        domain = domains[name]
        mine = [m for t in sorted(new) if where[t] == name for m in new[t]]
        current = [t.node for t in _take(domain, len(mine))]
        for stage, member in mine:
            for j, node in enumerate(current):
                outcome = evaluate_node(node, member.request, weights)
                if outcome.fits:
                    assignments.append(Assignment(member.name, stage, node, outcome))
                    current[j] = with_in_use(node, frozenset(outcome.gpus), tiers)
                    break
            else:
                return GroupFailure(group, f"group {group}: NVLink domain {name} no longer holds {member.name}")
    assignments.sort(key=lambda a: (a.stage, a.member))
    trays: dict[str, set[str]] = {}
    for node in [a.node for a in assignments] + [p.node for p in held if p.node is not None and p.gpus]:
        trays.setdefault(node.location.get(DOMAIN) or "", set()).add(node.name)
    shares: list[DomainShare] = []
    for t in range(shape.groups):
        name = where.get(t, "?")
        if shares and shares[-1].domain == name:
            shares[-1] = replace(shares[-1], tp_groups=shares[-1].tp_groups + 1)
            continue
        d = domains.get(name)
        shares.append(
            DomainShare(
                name, 1, len(trays.get(name, ())), d.cap if d else None, d.free if d else 0, len(d.skipped) if d else 0
            )
        )
    rails = assess([*((a.node, a.outcome.gpus) for a in assignments), *fixed])
    used = [domains[n] for n in dict.fromkeys(where.values()) if n in domains]
    info = _split_info(shape, shares, used, assignments, lead, tiers)
    return GroupPlan(group, tuple(assignments), switches_of(assignments, tiers), rails, fixed, held, None, info)


def _split_info(
    shape: TpShape,
    shares: Sequence[DomainShare],
    domains: Sequence[_Domain],
    assignments: Sequence[Assignment],
    lead: PodRequest,
    tiers: TierConfig,
) -> DomainSplit:
    """The split and its predicted TP all-reduce: inside a domain, and across two domains over the
    trays' NICs (what a TP group straddling domains gets), against a fill by trays that ignores TP
    boundaries (the roomiest domains first, each full up to its cap)."""
    message = lead.message_bytes
    inside = domain_allreduce_seconds(message, shape.tp_gpus, domain_busbw(tiers))
    tray = assignments[0].node if assignments else None
    across = None
    if tray is not None:
        across = domain_allreduce_seconds(message, shape.tp_gpus, straddle_gbps(tray, len(assignments[0].outcome.gpus)))
    members = sum(s.tp_groups for s in shares) * shape.per_group
    fill, left = [], members
    for d in sorted(domains, key=lambda d: (-d.room(), d.name)):
        part = min(left, d.room())
        if part > 0:
            fill.append(part)
        left -= part
    edges = [sum(fill[: i + 1]) for i in range(len(fill) - 1)]
    straddling = sum(1 for e in edges if e % shape.per_group)
    return DomainSplit(shape.tp_gpus, shape.per_group, tuple(shares), inside, across, tuple(fill), straddling)


def _failure(group: str, shape: TpShape, domains: Sequence[_Domain], problems: Sequence[str]) -> str:
    per = shape.per_group
    best = max(domains, key=lambda d: (d.room() // per, d.name), default=None)
    what = f"{shape.groups} TP group{'s' if shape.groups > 1 else ''} of {shape.tp_gpus} GPUs ({per} members each)"
    where = "all in one NVLink domain (one ComputeDomain)" if shape.one_domain else "each in one NVLink domain"
    text = f"group {group} needs {what}, {where}"
    if best is None:
        text += "; no node with room sits in a known NVLink domain"
    else:
        total = sum(d.room() // per for d in domains)
        text += f"; the domains hold {total}, the roomiest ({best.name}) {best.room() // per}"
        if best.cap is not None:
            text += f" with its cap of {best.cap} trays ({LABEL_DOMAIN_CAP} or the nvlink-domain tier's groupCap)"
    skipped = [n for d in domains for n in d.skipped]
    if skipped:
        first = min(skipped, key=lambda n: n.name)
        text += (
            f"; {len(skipped)} tray{'s' if len(skipped) > 1 else ''} left out for their NVLink fabric "
            f"({first.name}: {first.fabric.value}, {first.fabric_detail})"
        )
    return "; ".join([text, *problems])
