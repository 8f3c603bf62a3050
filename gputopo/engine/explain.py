"""One sentence a person understands for each decision: why this node, these GPUs, and why not the
runner-up. Built from the engine's values (outcomes and score components), never from log lines."""

from __future__ import annotations

from collections.abc import Sequence

from gputopo.engine.groups import Assignment, GroupPlan
from gputopo.engine.placement import NodeVerdict, Outcome
from gputopo.engine.scoring import DEFAULT_WEIGHTS, ScoreWeights, to_extender_priority


def gpu_ranges(gpus: Sequence[int]) -> str:
    """(0, 1, 2, 3, 6) -> '0-3,6'."""
    out: list[str] = []
    g = sorted(gpus)
    i = 0
    while i < len(g):
        j = i
        while j + 1 < len(g) and g[j + 1] == g[j] + 1:
            j += 1
        out.append(f"{g[i]}-{g[j]}" if j - i >= 1 else str(g[i]))
        i = j + 1
    return ",".join(out)


def describe_gpus(node: str, outcome: Outcome) -> str:
    """'GPUs 0-3 on gpu-07 form a full NVLink clique (NV18 via NVSwitch)' and its variants."""
    gpus = outcome.gpus
    if not gpus:
        return f"{node} has room (the pod asks for no GPUs)"
    if len(gpus) == 1:
        return f"GPU {gpus[0]} on {node} is free" + _leftover(outcome)
    choice, bw = outcome.choice, outcome.bandwidth
    label = f"GPUs {gpu_ranges(gpus)} on {node}"
    if choice is not None and choice.clique and bw is not None:
        via = "via NVSwitch" if bw.via == "nvswitch" else "direct links"
        caveat = (
            ", some with degraded links: no healthy clique was free" if outcome.components.get("health") == 0.0 else ""
        )
        return f"{label} form a full NVLink clique (NV{bw.min_links} {via}{caveat})" + _leftover(outcome)
    if outcome.components.get("clique", 0.0) >= 1.0:  # nvlink: ignore
        return f"{label} are free (NVLink not requested)" + _leftover(outcome)
    path = "PCIe only" if choice is not None and choice.linked_pairs == 0 else "PCIe between some pairs"
    return f"{label} are the best-connected free set; no full NVLink clique was free ({path})"


def _leftover(outcome: Outcome) -> str:
    c = outcome.choice
    if c is None or c.remaining_free == 0:
        return ""
    if outcome.components.get("intact", 1.0) >= 1.0 and c.remaining_clique > 1:
        return f", leaving a {c.remaining_clique}-GPU clique free"
    return ""


_LOSS = {
    "clique": "has no free full NVLink clique",
    "bandwidth": "has weaker GPU links",
    "pack": "is emptier, so it stays whole for larger jobs",
    "intact": "would split the clique",
    "memory": "has more HBM than the pod needs",
    "nic": "has its GPUs farther from the NICs",
    "health": "has degraded NVLink links or GPUs",
}


def why_lost(winner: Outcome, runner: Outcome, weights: ScoreWeights = DEFAULT_WEIGHTS) -> str:
    """The score component that cost the runner-up most, in words."""
    best_name, best_gap = "", 0.0
    for name, value in winner.components.items():
        gap = float(getattr(weights, name)) * (value - runner.components.get(name, 0.0))
        if gap > best_gap + 1e-9:
            best_name, best_gap = name, gap
    if not best_name:
        return "scored the same; the scheduler's other scores decided"
    if best_name == "pack" and runner.choice is not None and runner.choice.remaining_clique < runner.free_clique:
        return f"would split its free {runner.free_clique}-GPU clique"
    if best_name == "bandwidth" and winner.bandwidth and runner.bandwidth:
        return f"has weaker GPU links (NV{runner.bandwidth.min_links} vs NV{winner.bandwidth.min_links})"
    return _LOSS[best_name]


def runner_up(chosen: str, ranked: Sequence[NodeVerdict]) -> NodeVerdict | None:
    return next((v for v in ranked if v.name != chosen), None)


def placement_sentence(
    node: str,
    outcome: Outcome,
    runner: NodeVerdict | None,
    plan: GroupPlan | None = None,
    member: str | None = None,
    weights: ScoreWeights = DEFAULT_WEIGHTS,
) -> str:
    parts = [describe_gpus(node, outcome)]
    staged = False
    if plan is not None and member is not None:
        a = plan.for_member(member)
        if a is not None:
            parts.append(stage_clause(plan, a))
            staged = True
    if runner is not None and not staged:  # a group member's node comes from the plan, not a race
        parts.append(
            f"runner-up {runner.name} {why_lost(outcome, runner.outcome, weights)}"
            f" (score {to_extender_priority(runner.outcome.score)} vs {to_extender_priority(outcome.score)})"
        )
    return "; ".join(parts)


def stage_clause(plan: GroupPlan, a: Assignment) -> str:
    """'stage 2/4 shares leaf ib-leaf-3 with stages 0-1' (or the widest tier they share)."""
    size = len(plan.assignments)
    for tier, sw in _narrowest_first(a):
        mates = [b.stage for b in plan.assignments if b is not a and b.node.location.get(tier) == sw]
        if mates:
            switch = sw.rsplit("/", 1)[-1]
            return (
                f"stage {a.stage}/{size} shares {tier} {switch} with stage{'s' if len(mates) > 1 else ''} "
                f"{gpu_ranges(mates)}"
            )
    if size == 1:
        return f"stage {a.stage}/{size}"
    return f"stage {a.stage}/{size} shares no switch with the other stages"


def _narrowest_first(a: Assignment) -> list[tuple[str, str]]:
    loc = a.node.location
    return [(t, sw) for t, sw in reversed(list(loc.items())) if sw is not None and t != "nvlink-domain"]
