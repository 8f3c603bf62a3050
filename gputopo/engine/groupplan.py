"""What a group plan is (its members, their assignments, the failure sentence) and the helpers both
of gputopo.engine.groups' planners share: one member per node, and members packed onto shared nodes."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from gputopo.engine.placement import Outcome
from gputopo.engine.rails import NOT_APPLICABLE, RailAlignment
from gputopo.engine.snapshot import NodeState
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
