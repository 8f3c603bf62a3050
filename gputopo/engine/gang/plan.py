"""What a group plan is (its members, their assignments, the failure sentence) and the helpers both
of gputopo.engine.gang.groups' planners share: one member per node, and members packed onto shared nodes."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Generic, Protocol, TypeVar

from gputopo.engine.network.domains import DomainFree, domain_of
from gputopo.engine.network.rails import NOT_APPLICABLE, RailAlignment
from gputopo.engine.node.placement import Outcome
from gputopo.engine.state.scoring import ScoreWeights
from gputopo.engine.state.snapshot import NodeState
from gputopo.model import NetworkKind, NvlinkPolicy, PodRequest
from gputopo.tiers import TierConfig

T = TypeVar("T")


class _OnNode(Protocol):
    @property
    def node(self) -> NodeState: ...


N = TypeVar("N", bound=_OnNode)


def under_switches(items: Iterable[N], tier: str) -> dict[str, list[N]]:
    """`items` by their node's switch of `tier`, in order; those whose node has none are left out."""
    domains: dict[str, list[N]] = {}
    for item in items:
        sw = item.node.location.get(tier)
        if sw is not None:
            domains.setdefault(sw, []).append(item)
    return domains


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
class Placed:
    """A member placed before this plan (a re-plan's pinned member): its stage in the group (None when
    neither its placement nor its request says), its node (None when not among the nodes planned over)
    and GPUs. Its stage is taken, its GPUs line the new members' rails up, its node is a neighbour."""

    stage: int | None
    node: NodeState | None
    gpus: tuple[int, ...] = ()


def alongside_of(placed: Iterable[Placed]) -> tuple[tuple[NodeState, tuple[int, ...]], ...]:
    """The placed members' nodes and GPUs, where known: the new members line their rails up with these."""
    return tuple((p.node, p.gpus) for p in placed if p.node is not None)


# What a plan is made alongside: the GPUs placed before (node, GPUs: rails) and the members placed before.
Before = tuple[tuple[tuple[NodeState, tuple[int, ...]], ...], tuple[Placed, ...]]


@dataclass(frozen=True, kw_only=True)
class PlacedBefore:
    """What a group holds before a plan: `alongside`, GPUs placed already (node, GPUs) whose rails the new
    members line up with; `placed`, members placed already (a re-plan's pinned ones), whose stages are
    taken and whose GPUs count as `alongside`'s."""

    alongside: Sequence[tuple[NodeState, Sequence[int]]] = ()
    placed: Sequence[Placed] = ()


NOTHING_BEFORE = PlacedBefore()


@dataclass(frozen=True, kw_only=True)
class Refinements:
    """The planner's steps past its first choice, each switchable off for the figures before it:
    `align_rails=False` keeps each node's own GPU choice; `best_fit=False` chooses among domains by
    scores and names (`Fabric`)."""

    align_rails: bool = True
    best_fit: bool = True


REFINED = Refinements()


@dataclass(frozen=True)
class Gang:
    """One planner's inputs (rack, packed, one member per node): the group, its members with their
    stages, the nodes of one tier set planned over, that set's tiers, the score weights, and what the
    group holds already."""

    group: str
    staged: Sequence[tuple[int, Member]]
    nodes: Sequence[NodeState]
    tiers: TierConfig
    weights: ScoreWeights
    before: Before


@dataclass(frozen=True)
class BestFit:
    """Why the group went to `domain` of `tier`: of the domains there that held it at equal packing cost,
    the one with the fewest free GPUs (`free`); `runner`, the next fullest, keeps its `runner_free`."""

    tier: str
    domain: str
    free: int
    runner: str
    runner_free: int


@dataclass(frozen=True)
class DomainShare:
    """One NVLink domain's part of a TP split (gputopo.engine.gang.rack): its TP groups, the trays they take,
    its cap (None: none), its free GPUs before the plan and the trays left out for their fabric."""

    domain: str
    tp_groups: int
    trays: int
    cap: int | None
    free: int
    skipped: int


@dataclass(frozen=True)
class DomainSplit:
    """How a group's TP groups lie over NVLink domains, in stage order, and the predicted TP all-reduce
    (seconds) inside a domain and across two; `fill`, members per domain of a fill by trays that
    ignores TP boundaries, and how many TP groups that fill would straddle two domains."""

    tp_gpus: int
    per_group: int
    shares: tuple[DomainShare, ...]
    inside_s: float
    across_s: float | None
    fill: tuple[int, ...]
    straddling: int

    def domain_of_group(self, tp_group: int) -> DomainShare | None:
        """The share holding TP group `tp_group` (0-based, stage order)."""
        start = 0
        for share in self.shares:
            if tp_group < start + share.tp_groups:
                return share
            start += share.tp_groups
        return None


@dataclass(frozen=True)
class GroupPlan:
    group: str
    assignments: tuple[Assignment, ...]  # in stage order
    switches_used: Mapping[str, int]  # tier -> distinct switches the plan spans
    rails: RailAlignment = NOT_APPLICABLE  # over the planned members and `alongside`
    # GPUs placed before this plan (a re-plan's pinned members, `placed`'s among them): node and GPUs,
    # for rail alignment.
    alongside: tuple[tuple[NodeState, tuple[int, ...]], ...] = ()
    placed: tuple[Placed, ...] = ()  # members placed before this plan: the group is they and `assignments`
    fit: BestFit | None = None  # the domain best fit chose, when it chose one among several that held the group
    split: DomainSplit | None = None  # TP groups over NVLink domains (gputopo.engine.gang.rack), when they span nodes
    # What every member's bind reads of the whole plan (its position, the group's all-reduce), derived
    # once: computed per bind, a 1,024-member group cost each bind O(members), the group O(members^2).
    _positions: dict[str, int] = field(default_factory=dict, init=False, repr=False, compare=False)
    _derived: dict[Hashable, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def size(self) -> int:
        """The whole group's member count: the planned members and those placed before."""
        return len(self.assignments) + len(self.placed)

    def position(self, name: str) -> int | None:
        """The member's index in `assignments` (stage order)."""
        positions = self._positions
        if not positions:
            positions.update((a.member, i) for i, a in enumerate(self.assignments))
        return positions.get(name)

    def for_member(self, name: str) -> Assignment | None:
        i = self.position(name)
        return None if i is None else self.assignments[i]

    def derived(self, key: Hashable, compute: Callable[[], T]) -> T:
        """`compute()` once per plan and key: what every member reads of the whole plan (its all-reduce,
        who shares which switch). The key names the computation and its inputs."""
        memo = self._derived
        if key not in memo:
            memo[key] = compute()
        value: T = memo[key]
        return value


@dataclass(frozen=True)
class GroupFailure:
    group: str
    message: str  # one categorical sentence, the same for every node


def requirement_words(req: PodRequest) -> str:
    parts = []
    if req.network is not NetworkKind.ANY:
        word = {"infiniband": "InfiniBand", "roce": "RoCE", "rdma": "RDMA"}[req.network.value]
        parts.append(f"an active {word} NIC")
    if req.gpus > 1 and req.nvlink is NvlinkPolicy.REQUIRED:
        parts.append(f"a free {req.gpus}-GPU NVLink clique")
    elif req.gpus > 0:
        parts.append(f"{req.gpus} free GPUs")
    return " and ".join(parts) or "room"


def pack_order(tiers: TierConfig, preferred: str | None) -> list[str]:
    order = list(tiers.network_tiers())
    if preferred and preferred in order:
        order.remove(preferred)
        order.insert(0, preferred)
    return order


def assign_stages(members: Sequence[Member], placed: Iterable[int] = ()) -> list[tuple[int, Member]]:
    """Members with an explicit stage keep it; the others fill the stage numbers free (of the members'
    own and the `placed` members' stages) in name order."""
    held = set(placed)
    taken = {m.request.stage for m in members if m.request.stage is not None} | held
    free = iter(i for i in range(len(members) + len(held)) if i not in taken)
    out = []
    for m in sorted(members, key=lambda m: m.name):
        out.append((m.request.stage if m.request.stage is not None else next(free), m))
    return sorted(out, key=lambda sm: (sm[0], sm[1].name))


def switches_of(assignments: Sequence[Assignment], tiers: TierConfig) -> dict[str, int]:
    return {t: len({a.node.location.get(t) or f"?{a.node.name}" for a in assignments}) for t in tiers.network_tiers()}


def group_waiting_message(group: str, present: int, size: int) -> str:
    return f"group {group}: {present}/{size} pods exist, waiting"


# Packing members above the node: one rule for both planners (one member per node, members sharing nodes).


@dataclass(frozen=True)
class Fabric:
    """What packing reads above the node. `free`: free GPUs per domain over the nodes planned over (best
    fit); `fit`: the tiers best fit compares, the group's tightest constraint first, then outward;
    `placed`: the nodes of members placed before (their domains are spanned already); `network`: the
    network tiers, widest first; `best_fit=False` keeps the choice before best fit (names and scores)."""

    free: DomainFree
    fit: tuple[str, ...]
    network: tuple[str, ...]
    placed: tuple[NodeState, ...] = ()
    best_fit: bool = True

    @cached_property
    def _seated(self) -> dict[str, set[str]]:
        return {t: {domain_of(p, t) for p in self.placed} for t in self.network}

    def holds(self, tier: str, domain: str) -> bool:
        """Whether a member placed before sits in `domain` of `tier`."""
        return domain in self._seated.get(tier, ())

    def within(self, tier: str, domain: str) -> bool:
        """Whether every member placed before sits in `domain` (so the domain can hold the whole group)."""
        return self._seated.get(tier, set()) <= {domain}

    def wider(self, tier: str, order: Sequence[str]) -> list[str]:
        """The network tiers wider than `tier` still to pack (in `order`), narrowest first: where a
        preferred tier that no domain meets falls back to."""
        if tier not in self.network:
            return []
        return [t for t in reversed(self.network[: self.network.index(tier)]) if t in order]

    def spent(self, nodes: Iterable[NodeState]) -> tuple[int, ...]:
        """Best fit's measure of a choice: tier by tier in `fit` order, the free GPUs of the one domain it
        lies in (with the placed members), 0 where it spans several. Choices of equal packing cost span
        one domain at the same tiers, so the least is the fullest enclosing domain that holds the group."""
        if not self.best_fit:
            return ()
        chosen = [*nodes, *self.placed]
        out = []
        for t in self.fit:
            spanned = {domain_of(x, t) for x in chosen}
            out.append(self.free.by_tier[t].get(spanned.pop(), 0) if len(spanned) == 1 else 0)
        return tuple(out)


def fit_tiers(tiers: TierConfig, constraint: str | None) -> tuple[str, ...]:
    """The network tiers best fit compares, the group's tightest constraint (its required or preferred
    tier, else the narrowest network tier) first, then the wider ones outward, then the narrower ones."""
    net = list(tiers.network_tiers())
    if not net:
        return ()
    at = net.index(constraint) if constraint in net else len(net) - 1
    return (*reversed(net[: at + 1]), *net[at + 1 :])


class _Packable(Protocol):
    @property
    def node(self) -> NodeState: ...


P = TypeVar("P", bound=_Packable)


@dataclass(frozen=True)
class Packing(Generic[P]):
    """How one planner's items pack: `room` (members the items hold between them), `score` (one item's),
    `base` (n members on items when no tier is left), `nodes_count` (fewer nodes is packing too)."""

    fabric: Fabric
    order: tuple[str, ...]  # the tiers packed, in packing order (pack_order)
    room: Callable[[Sequence[P]], int]
    score: Callable[[P], float]
    base: Callable[[Sequence[P], int], list[P]]
    nodes_count: bool = False

    def cost(self, chosen: Sequence[P]) -> tuple[int, ...]:
        """Switches spanned per tier in packing order (with the placed members'), then nodes where counted."""
        nodes = [c.node for c in chosen]
        spans = [len({domain_of(x, t) for x in (*nodes, *self.fabric.placed)}) for t in self.order]
        return (*spans, len(chosen)) if self.nodes_count else tuple(spans)

    def best(self, options: Iterable[list[P]]) -> list[P]:
        """Fewest switches; then best fit (the fullest domains that hold the group); then scores, names."""
        return min(
            options,
            key=lambda c: (
                self.cost(c),
                self.fabric.spent(c.node for c in c),
                -sum(self.score(x) for x in c),
                # Node names as ranked (one member per node) or sorted (shared nodes): each planner's order.
                sorted(x.node.name for x in c) if self.nodes_count else [x.node.name for x in c],
            ),
        )

    def note(self, items: Sequence[P], chosen: Sequence[P], n: int) -> BestFit | None:
        """The best-fit choice `chosen` made, at the first tier (in `fit` order) where it lies in one domain
        and another domain held the group too; None when best fit chose nothing there (one domain held
        it, or the chosen domain is no fuller than the next: packing cost, scores or names decided)."""
        fab = self.fabric
        if not fab.best_fit:
            return None
        nodes = [*(c.node for c in chosen), *fab.placed]
        for tier in fab.fit:
            spanned = {domain_of(x, tier) for x in nodes}
            if len(spanned) != 1:
                continue
            (domain,) = spanned
            free = fab.free.by_tier.get(tier, {})
            others = [
                k
                for k, b in _buckets(items, tier).items()
                if k != domain and self.room(b) >= n and fab.within(tier, k) and not k.startswith("?")
            ]
            if not others:
                continue
            runner = min(others, key=lambda k: (free.get(k, 0), k))
            if domain.startswith("?") or free.get(domain, 0) >= free.get(runner, 0):
                return None
            return BestFit(tier, domain, free.get(domain, 0), runner, free.get(runner, 0))
        return None

    def cover(self, items: Sequence[P], n: int, order: Sequence[str]) -> list[P]:
        """Items for n members under as few switches as possible, tier by tier in `order`."""
        if not order:
            return self.base(items, n)
        tier, rest = order[0], order[1:]
        buckets = _buckets(items, tier)
        whole = [b for k, b in buckets.items() if self.room(b) >= n and self.fabric.within(tier, k)]
        if whole:
            return self.best(self.cover(b, n, rest) for b in whole)
        for wider in self.fabric.wider(tier, rest) if self.fabric.best_fit else ():
            # No domain of the preferred tier holds the group: the smallest domain of the next wider tier
            # that does, split over the fewest domains below it.
            outer = _buckets(items, wider)
            fits = [b for k, b in outer.items() if self.room(b) >= n and self.fabric.within(wider, k)]
            if fits:
                return self.best(self.fill(b, n, tier, rest) for b in fits)
        return self.fill(items, n, tier, rest)

    def fill(self, items: Sequence[P], n: int, tier: str, rest: Sequence[str]) -> list[P]:
        """n members over as few domains of `tier` as hold them: those holding placed members first (spanned
        already), then the roomiest; the last part goes to the fullest domain that holds it (best fit)."""
        buckets = _buckets(items, tier)
        pool = sorted(
            buckets.items(),
            key=lambda kv: (
                not self.fabric.holds(tier, kv[0]),
                -min(n, self.room(kv[1])),
                -sum(self.score(x) for x in kv[1]),
                kv[0],
            ),
        )
        picked: list[P] = []
        need = n
        for i, (key, bucket) in enumerate(pool):
            if need <= 0:
                break
            room = self.room(bucket)
            if self.fabric.best_fit and room >= need and not self.fabric.holds(tier, key):
                tail = [kv for kv in pool[i:] if self.room(kv[1]) >= need]
                return picked + self._tail(picked, tail, need, tier, rest)
            picked.extend(bucket if room <= need else self.cover(bucket, need, rest))
            need -= room
        return picked

    def _tail(
        self, picked: Sequence[P], tail: Sequence[tuple[str, list[P]]], need: int, tier: str, rest: Sequence[str]
    ) -> list[P]:
        """The last `need` members, in one of the `tail` domains of `tier` (each holds them): the one that
        adds the fewest switches to `picked`, then the fullest (best fit), then the first in pool order."""
        base = {t: {domain_of(x, t) for x in (*(p.node for p in picked), *self.fabric.placed)} for t in self.order}
        free = self.fabric.free.by_tier.get(tier, {})
        best: tuple[tuple[object, ...], list[P]] | None = None
        for i, (key, bucket) in enumerate(tail):
            part = self.cover(bucket, need, rest)
            spans = tuple(len(base[t]) + len({domain_of(x.node, t) for x in part} - base[t]) for t in self.order)
            rank = (spans, free.get(key, 0), i)
            if best is None or rank < best[0]:
                best = (rank, part)
        assert best is not None  # the caller passes at least one domain
        return best[1]


def _buckets(items: Iterable[P], tier: str) -> dict[str, list[P]]:
    out: dict[str, list[P]] = {}
    for x in items:
        out.setdefault(domain_of(x.node, tier), []).append(x)
    return out
