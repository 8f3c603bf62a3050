"""A group plan under `spread: none`: members may share a node (gputopo.engine.gang.groups plans the
other spreads and calls this one). The tiers hold as for one member per node; then members go on as
few nodes as they fit, the roomiest first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

from gputopo.engine.gang.plan import (
    Assignment,
    Fabric,
    Gang,
    GroupFailure,
    GroupPlan,
    Packing,
    pack_order,
    requirement_words,
    switches_of,
    under_switches,
)
from gputopo.engine.network.rails import assess
from gputopo.engine.node.placement import evaluate_node
from gputopo.engine.state.scoring import ScoreWeights
from gputopo.engine.state.snapshot import NodeState, with_in_use
from gputopo.model import PodRequest
from gputopo.tiers import TierConfig


def plan_packed(gang: Gang, fabric: Fabric) -> GroupPlan | GroupFailure:
    """`spread: none`: members may share a node. The tiers hold as for `spread: node`: `required-tier`
    keeps every member under one switch of that tier or places none; otherwise members go under as few
    switches as possible, `preferred-tier` first, else widest tier first; then on as few nodes as they
    fit. Consecutive stages fill one node before the next, nodes in fabric order. Members sharing a node
    cannot share its rails, so rails are reported here, not steered."""
    group, staged, nodes, tiers, weights = gang.group, gang.staged, gang.nodes, gang.tiers, gang.weights
    n = len(staged)
    lead = staged[0][1].request
    demanding = max((m.request for _, m in staged), key=lambda r: (r.gpus, r.min_gpu_memory_mib or 0))
    memo: dict[int, tuple[int, float]] = {}
    holds: list[_Holds] = []
    for node in nodes:
        if node.key not in memo:
            memo[node.key] = capacity(node, demanding, n, weights, tiers)
        cap, score = memo[node.key]
        if cap > 0:
            holds.append(_Holds(node, cap, score))
    pack = Packing(fabric, tuple(pack_order(tiers, lead.preferred_tier)), _members, _score, _fewest_nodes, True)
    words = requirement_words(demanding)
    required = lead.required_tier
    if required:
        domains = under_switches(holds, required)
        options = [pack.cover(d, n, pack.order) for d in domains.values() if _room(d, n) >= n]
        if not options:
            best = max((_room(d, n) for d in domains.values()), default=0)
            return GroupFailure(
                group,
                f"group needs room for {n} members with {words} under one {required}; best {required} holds {best}",
            )
        chosen = pack.best(options)
    else:
        if _room(holds, n) < n:
            return GroupFailure(group, f"group needs room for {n} members with {words}; {_room(holds, n)} fit")
        chosen = pack.cover(holds, n, pack.order)
    # Each node's share: the roomiest (chosen first) full, the last the rest. Stages then fill the nodes
    # in fabric order, one node's share before the next, so consecutive stages share the nearest switch.
    share: dict[str, int] = {}
    left = n
    for h in chosen:
        share[h.node.name] = min(h.members, left)
        left -= share[h.node.name]
    net = tiers.network_tiers()
    path = sorted(chosen, key=lambda h: (*[(h.node.location.get(t) or "~") for t in net], h.node.name))
    current = [h.node for h in path]
    want = [share[h.node.name] for h in path]
    assignments: list[Assignment] = []
    first = 0  # the nodes before it have no share left (shares only shrink): not scanned again per member
    for stage, member in staged:
        # The first node with share left; failing that (members of different sizes: the room counted
        # for the largest did not hold) any chosen node that still fits this member.
        while first < len(current) and want[first] <= 0:
            first += 1
        tries = chain((j for j in range(first, len(current)) if want[j] > 0), range(len(current)))
        for j in tries:
            outcome = evaluate_node(current[j], member.request, weights)
            if outcome.fits:
                assignments.append(Assignment(member.name, stage, current[j], outcome))
                current[j] = with_in_use(current[j], frozenset(outcome.gpus), tiers)
                want[j] -= 1
                break
        else:
            return GroupFailure(group, f"group needs room for {n} members with {words}; {len(assignments)} fit")
    fixed, held = gang.before
    rails = assess([*((a.node, a.outcome.gpus) for a in assignments), *fixed])
    fit = pack.note(holds, chosen, n)
    return GroupPlan(group, tuple(assignments), switches_of(assignments, tiers), rails, fixed, held, fit)


@dataclass(frozen=True)
class _Holds:
    """A node and how many members (of the group's most demanding request) it holds alone."""

    node: NodeState
    members: int
    score: float  # the first member's score there


def capacity(
    node: NodeState, req: PodRequest, limit: int, weights: ScoreWeights, tiers: TierConfig
) -> tuple[int, float]:
    """How many members like `req` fit on `node` one after another (at most `limit`), and the first one's
    score. Equivalent nodes (equal keys) hold the same, so callers count once per key."""
    count, score, state = 0, 0.0, node
    while count < limit:
        outcome = evaluate_node(state, req, weights)
        if not outcome.fits:
            break
        if count == 0:
            score = outcome.score
        if not outcome.gpus:
            return limit, score  # members without GPUs: any number fit
        count += 1
        state = with_in_use(state, frozenset(outcome.gpus), tiers)
    return count, score


def _room(holds: Sequence[_Holds], n: int) -> int:
    return min(n, sum(h.members for h in holds))


def _members(holds: Sequence[_Holds]) -> int:
    return sum(h.members for h in holds)


def _score(h: _Holds) -> float:
    return h.score


def _fewest_nodes(cands: Sequence[_Holds], n: int) -> list[_Holds]:
    """As few nodes as hold n members: the roomiest first; the last one the best-scoring node that
    holds the rest (the tightest fit, as the score's packing term prefers fuller nodes)."""
    pool = sorted(cands, key=lambda h: (-h.members, -h.score, h.node.name))
    picked: list[_Holds] = []
    need = n
    while need > 0 and pool:
        enough = [h for h in pool if h.members >= need]
        if enough:
            picked.append(min(enough, key=lambda h: (-h.score, h.node.name)))
            break
        picked.append(pool.pop(0))
        need -= picked[-1].members
    return picked
