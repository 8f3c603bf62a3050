"""A group never spans two tier sets (hardware shapes: docs/configuration.md, "Tier sets per hardware shape").

Where the nodes given hold more than one set, the group is planned within each set's nodes and the best
plan is taken: of the sets that hold the group, the one whose plan spans the fewest switches, widest tier
first, then the set's name. Members placed before (a re-plan's pinned members, GPUs placed alongside) fix
the set. A set whose every node has a problem takes no pod and is not tried. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from gputopo.engine.gang.plan import GroupFailure, GroupPlan
from gputopo.engine.state.snapshot import NodeState
from gputopo.tiers import TierConfig

# Plans the group over the nodes given, of the tier set named (its tiers: TierConfig.of_set).
Planner = Callable[[str, Sequence[NodeState]], GroupPlan | GroupFailure]


def by_tier_set(nodes: Iterable[NodeState]) -> dict[str, list[NodeState]]:
    """`nodes` by their tier set's name ("" for the top-level tiers), each in the order given."""
    out: dict[str, list[NodeState]] = {}
    for node in nodes:
        out.setdefault(node.tier_set, []).append(node)
    return out


def set_words(name: str) -> str:
    """A tier set as a failure sentence names it."""
    return f"tier set {name}" if name else "the default tiers"


def plan_in_one_tier_set(
    group: str,
    nodes: Sequence[NodeState],
    fixed: Iterable[NodeState],
    tiers: TierConfig,
    plan: Planner,
) -> GroupPlan | GroupFailure:
    """`plan` over one tier set's nodes: the best set's plan (module docstring), or a failure that names
    what each set tried said. `fixed`: the nodes of members placed before, whose sets alone are tried."""
    if not tiers.sets:  # one set, the top-level tiers: no pass over the nodes
        return plan("", nodes)
    sets = by_tier_set(nodes)
    pinned = sorted({n.tier_set for n in fixed})
    if pinned:
        tried = {name: sets.get(name, []) for name in pinned}
    elif len(sets) <= 1:
        return plan(next(iter(sets), ""), nodes)
    else:
        tried = {name: part for name, part in sorted(sets.items()) if any(n.problem is None for n in part)}
    if len(tried) == 1:
        return plan(*next(iter(tried.items())))
    if not tried:  # no set usable: every node, each then saying its problem
        return plan("", nodes)
    best: tuple[tuple[tuple[int, ...], str], GroupPlan] | None = None
    failures: list[str] = []
    for name, part in tried.items():
        out = plan(name, part)
        if isinstance(out, GroupFailure):
            failures.append(f"in {set_words(name)}, {out.message}")
            continue
        key = (tuple(out.switches_used.get(t, 0) for t in tiers.network_tiers()), name)
        if best is None or key < best[0]:
            best = (key, out)
    if best is not None:
        return best[1]
    return GroupFailure(group, f"group {group} fits in no one hardware shape: " + "; ".join(failures))
