"""One sentence a person understands for each decision: why this node, these GPUs, and why not the
runner-up. Built from the engine's values (outcomes and score components), never from log lines."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

from gputopo.engine.gang.plan import Assignment, BestFit, GroupPlan
from gputopo.engine.network.cost import DEFAULT_MESSAGE_BYTES, format_bytes, format_ms
from gputopo.engine.network.domains import DomainFree, domain_of, narrow_first
from gputopo.engine.network.estimate import group_allreduce_seconds, member_estimate
from gputopo.engine.network.rails import RailAlignment, assess, rail_ranges, rails_of
from gputopo.engine.node.placement import NodeVerdict, Outcome
from gputopo.engine.state.scoring import DEFAULT_WEIGHTS, ScoreWeights
from gputopo.engine.state.snapshot import NodeState
from gputopo.model import CommEstimate, TpPlacement, TpShare
from gputopo.tiers import DEFAULT_TIERS, TierConfig


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
        if outcome.block:  # a whole block (gputopo.io/gpu-clique<N>): the one the allocator's first fit gives
            label += (
                f" are {outcome.block}, the first free {len(gpus)}-GPU block in the order the allocator takes them, and"
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


def why_lost(winner: Outcome, runner: Outcome, weights: ScoreWeights = DEFAULT_WEIGHTS, *, packing: str = "") -> str:
    """The score component that cost the runner-up most, in words; at an equal score, `packing` (what best
    fit above the node said, `packing_clause`) or else the name."""
    best_name, best_gap = "", 0.0
    for name, value in winner.components.items():
        gap = float(getattr(weights, name)) * (value - runner.components.get(name, 0.0))
        if gap > best_gap + 1e-9:
            best_name, best_gap = name, gap
    if not best_name:
        return f"scored the same; {packing or 'the first name wins'}"
    if best_name == "pack" and runner.choice is not None and runner.choice.remaining_clique < runner.free_clique:
        return f"would split its free {runner.free_clique}-GPU clique"
    if best_name == "bandwidth" and winner.bandwidth and runner.bandwidth:
        return f"has weaker GPU links (NV{runner.bandwidth.min_links} vs NV{winner.bandwidth.min_links})"
    return _LOSS[best_name]


def packing_clause(
    node: NodeState, outcome: Outcome, runner: NodeVerdict | None, free: DomainFree, tiers: TierConfig = DEFAULT_TIERS
) -> str:
    """Why a lone pod's node beat a runner-up of the same engine score by best fit above the node
    (`DomainFree.tie_key`), at the closest tier where their domains differ in free GPUs, e.g. 'leaf leaf-3 is
    the fullest with room (2 free GPUs): keeps leaf leaf-1's 32 free GPUs whole'. "" when the scores differ
    or only the name decided."""
    if runner is None or runner.outcome.score != outcome.score:
        return ""
    for tier in narrow_first(tiers):
        mine, theirs = free.of(node, tier), free.of(runner.node, tier)
        if mine != theirs:
            if mine > theirs:  # not the order rank gave: say nothing rather than a wrong reason
                return ""
            return (
                f"{_domain_words(node, tier)} is the fullest with room ({mine} free GPUs): keeps "
                f"{_domain_words(runner.node, tier)}'s {theirs} free GPUs whole"
            )
    return ""


def _domain_words(node: NodeState, tier: str) -> str:
    """'leaf leaf-3' (the switch's own name, not its path), or 'node gpu-7' where no label names one."""
    domain = domain_of(node, tier)
    return f"node {node.name}" if domain.startswith("?") else f"{tier} {domain.rsplit('/', 1)[-1]}"


def score_pair(a: float, b: float) -> tuple[str, str]:
    """Two engine scores as text, to as many decimals (2 to 6) as it takes to tell them apart: the
    runner-up of a sentence lost by the engine's exact order, so "0.71 vs 0.71" would misstate it."""
    if a == b:
        return f"{a:.2f}", f"{b:.2f}"
    for digits in range(2, 7):
        x, y = f"{a:.{digits}f}", f"{b:.{digits}f}"
        if x != y:
            break
    return x, y


def runner_up(chosen: str, ranked: Sequence[NodeVerdict]) -> NodeVerdict | None:
    return next((v for v in ranked if v.name != chosen), None)


@dataclass(frozen=True)
class Seat:
    """A group member's place, as its sentence tells it: the group's `plan` and the `member`'s name;
    `origin`, where a group inferred from a controller's labels came from, e.g. 'group
    jobset/llama-pretrain, rank 5 of 16, from JobSet labels' (gputopo.model.InferredGroup.words);
    `at`, the member's node when it is not the planned one (a member without GPUs may be bound to
    another node under the same switch)."""

    plan: GroupPlan
    member: str
    origin: str = ""
    at: NodeState | None = None


def placement_sentence(
    node: str,
    outcome: Outcome,
    runner: NodeVerdict | None,
    seat: Seat | None = None,
    weights: ScoreWeights = DEFAULT_WEIGHTS,
    tiers: TierConfig = DEFAULT_TIERS,
    *,
    packing: str = "",
) -> str:
    """Why the pod is on `node`: its GPUs, its place in its group (`seat`, None for a lone pod) or its
    runner-up, its predicted communication. `packing`: why a lone pod's node beat a runner-up of the
    same score (`packing_clause`)."""
    parts = [describe_gpus(node, outcome)]
    staged = False
    plan, member = (seat.plan, seat.member) if seat is not None else (None, None)
    if seat is not None:
        plan = seat.plan
        a = plan.for_member(seat.member)
        if a is not None:
            if seat.origin:
                parts.append(seat.origin)
            parts.append(stage_clause(plan, a, seat.at))
            if plan.fit is not None:
                parts.append(fit_clause(plan.fit))
            tp = tp_placement(plan, seat.member)
            if tp is not None and plan.split is not None:
                parts.append(tp_clause(tp, plan.split.per_group))
            staged = True
            rails = rail_clause(plan, a, outcome) if outcome.gpus else ""  # no GPUs: no rails of its own
            if rails:
                parts.append(rails)
    if runner is not None and not staged:  # a group member's node comes from the plan, not a race
        parts.append(
            f"runner-up {runner.name} {why_lost(outcome, runner.outcome, weights, packing=packing)}"
            " (score {} vs {})".format(*score_pair(runner.outcome.score, outcome.score))
        )
    estimate = placement_estimate(outcome, runner, plan, member, tiers)
    if estimate is not None:
        parts.append(estimate_clause(estimate, len(_ranks(plan)) if staged and plan is not None else 0))
    return "; ".join(parts)


def _ranks(plan: GroupPlan) -> list[tuple[NodeState, tuple[int, ...]]]:
    """The planned members that hold GPUs, in stage order: the ranks of the group's transfers and
    all-reduce (a member without GPUs takes part in neither)."""
    return plan.derived(
        "nodes and GPUs", lambda: [(a.node, a.outcome.gpus) for a in plan.assignments if a.outcome.gpus]
    )


def _rank(plan: GroupPlan, member: str) -> int | None:
    """The member's index among the plan's GPU-holding members (`_ranks`); None when not among them."""
    held = plan.derived(
        "GPU ranks", lambda: {a.member: i for i, a in enumerate(a for a in plan.assignments if a.outcome.gpus)}
    )
    return held.get(member)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 4)


def placement_estimate(
    outcome: Outcome,
    runner: NodeVerdict | None,
    plan: GroupPlan | None = None,
    member: str | None = None,
    tiers: TierConfig = DEFAULT_TIERS,
) -> CommEstimate | None:
    """The `estimate` of the pod's gputopo.io/placement: its all-reduce over the chosen GPUs and the
    same on the runner-up's; for a group member, its stage transfer and the group's all-reduce. None
    when there is nothing to communicate (one GPU, no group)."""
    est = outcome.estimate
    if est is None:
        return None
    tp = est.seconds if est.ranks >= 2 else None
    i = _rank(plan, member) if plan is not None and member is not None else None
    staged = i is not None
    other = runner.outcome.estimate if runner is not None and not staged else None
    runner_tp = other.seconds if tp is not None and other is not None and other.ranks >= 2 else None
    transfer = ring = None
    if plan is not None and i is not None:
        stages = _ranks(plan)
        whole = plan.derived(
            ("all-reduce", est.message_bytes, tiers), lambda: group_allreduce_seconds(stages, est.message_bytes, tiers)
        )
        g = member_estimate(stages, i, est.message_bytes, tiers, ring=whole)
        transfer, ring = g.stage_transfer_seconds, g.group_allreduce_seconds
    if tp is None and transfer is None and ring is None:
        return None
    return CommEstimate(
        message_bytes=est.message_bytes,
        all_reduce_ms=_ms(tp),
        runner_up_all_reduce_ms=_ms(runner_tp),
        stage_transfer_ms=_ms(transfer),
        group_all_reduce_ms=_ms(ring),
    )


def outcome_estimate(outcome: Outcome) -> str:
    """'; est. 1 GiB all-reduce 4.4 ms' for one node's verdict (gputopo explain's rows), or ''."""
    e = placement_estimate(outcome, None)
    return f"; {estimate_clause(e)}" if e is not None else ""


def estimate_clause(e: CommEstimate, members: int = 0) -> str:
    """'est. 1 GiB all-reduce 5.1 ms (runner-up 9.7 ms)'; a group member's adds its stage transfer and
    the all-reduce across the `members`."""
    pieces = []
    if e.all_reduce_ms is not None:
        text = f"all-reduce {format_ms(e.all_reduce_ms / 1e3)}"
        if e.runner_up_all_reduce_ms is not None:
            text += f" (runner-up {format_ms(e.runner_up_all_reduce_ms / 1e3)})"
        pieces.append(text)
    if e.stage_transfer_ms is not None:
        pieces.append(f"stage transfer {format_ms(e.stage_transfer_ms / 1e3)}")
    if e.group_all_reduce_ms is not None:
        across = f" across {members} members" if members > 1 else " across the group"
        pieces.append(f"all-reduce{across} {format_ms(e.group_all_reduce_ms / 1e3)}")
    return f"est. {format_bytes(e.message_bytes)} " + ", ".join(pieces)


def stage_clause(plan: GroupPlan, a: Assignment, at: NodeState | None = None) -> str:
    """'stage 2/4 shares leaf ib-leaf-3 with stages 0-1' (or the widest tier they share); the size is
    the whole group's, the stages those planned and those placed before. `at`: the member's node when
    not the planned one."""
    size = plan.size
    for tier, sw in _narrowest_first(at or a.node):
        under = plan.derived(("stages under", tier), partial(_stages_under, plan, tier))
        mates = [st for st in under.get(sw, ()) if st != a.stage]
        if mates:
            switch = sw.rsplit("/", 1)[-1]
            return (
                f"stage {a.stage}/{size} shares {tier} {switch} with stage{'s' if len(mates) > 1 else ''} "
                f"{gpu_ranges(mates)}"
            )
    if size == 1:
        return f"stage {a.stage}/{size}"
    return f"stage {a.stage}/{size} shares no switch with the other stages"


def tp_placement(plan: GroupPlan, member: str) -> TpPlacement | None:
    """Where the member's TP group lies under the plan's split (the annotation's `tp`, the sentence's TP
    clause); None without a split or for a member without GPUs (in no TP group)."""
    split, rank = plan.split, _rank(plan, member)
    if split is None or rank is None:
        return None
    t = rank // split.per_group
    share = split.domain_of_group(t)
    caps = [s.cap for s in split.shares if s.cap is not None]
    first = plan.assignments[0].outcome.estimate
    return TpPlacement(
        group=t,
        groups=sum(s.tp_groups for s in split.shares),
        gpus=split.tp_gpus,
        domain=share.domain if share is not None else "?",
        split=tuple(TpShare(domain=s.domain, tp_groups=s.tp_groups) for s in split.shares),
        cap_trays=min(caps) if caps else None,
        left_out_trays=sum(s.skipped for s in split.shares),
        message_bytes=first.message_bytes if first is not None else DEFAULT_MESSAGE_BYTES,
        all_reduce_ms=round(split.inside_s * 1e3, 4),
        across_all_reduce_ms=_ms(split.across_s),
        fill=split.fill,
        fill_straddles=split.straddling,
    )


def tp_clause(tp: TpPlacement, per_group: int) -> str:
    """'TP group 2/8 (16 GPUs, ranks 4-7) in NVLink domain rack-a; 4+4 TP groups over 2 domains (cap 16
    trays); est. 1 GiB TP all-reduce 2.8 ms in one domain vs 10.8 ms across two; a fill by trays (18+14)
    would straddle 1 TP group'. `per_group`: members per TP group."""
    first = tp.group * per_group
    ranks = f"rank {first}" if per_group == 1 else f"ranks {first}-{first + per_group - 1}"
    text = f"TP group {tp.group}/{tp.groups} ({tp.gpus} GPUs, {ranks}) in NVLink domain {tp.domain}"
    if len(tp.split) > 1:
        used = len({s.domain for s in tp.split})  # shares follow stage order: a domain may come twice
        text += "; " + "+".join(str(s.tp_groups) for s in tp.split) + f" TP groups over {used} domains"
        text += f" (cap {tp.cap_trays} trays)" if tp.cap_trays is not None else ""
    if tp.left_out_trays:
        plural = "s" if tp.left_out_trays > 1 else ""
        text += f"; {tp.left_out_trays} tray{plural} of these domains left out for their NVLink fabric"
    text += f"; est. {format_bytes(tp.message_bytes)} TP all-reduce {format_ms(tp.all_reduce_ms / 1e3)} in one domain"
    if tp.across_all_reduce_ms is not None:
        text += f" vs {format_ms(tp.across_all_reduce_ms / 1e3)} across two"
    if tp.fill_straddles:
        fill = "+".join(str(f) for f in tp.fill)
        plural = "s" if tp.fill_straddles > 1 else ""
        text += f"; a fill by trays ({fill}) would straddle {tp.fill_straddles} TP group{plural}"
    return text


def fit_clause(fit: BestFit) -> str:
    """'leaf leaf-3 is the fullest with room for the group: keeps leaf leaf-1's 32 free GPUs whole'."""
    here, runner = fit.domain.rsplit("/", 1)[-1], fit.runner.rsplit("/", 1)[-1]
    return (
        f"{fit.tier} {here} is the fullest with room for the group: "
        f"keeps {fit.tier} {runner}'s {fit.runner_free} free GPUs whole"
    )


def _stages_under(plan: GroupPlan, tier: str) -> dict[str, list[int]]:
    """Each switch of `tier` and the group's stages under it (planned and placed before), in order."""
    out: dict[str, list[int]] = {}
    placed = [(p.node, p.stage) for p in plan.placed if p.node is not None and p.stage is not None]
    for node, stage in sorted([*((b.node, b.stage) for b in plan.assignments), *placed], key=lambda ns: ns[1]):
        sw = node.location.get(tier)
        if sw is not None:
            out.setdefault(sw, []).append(stage)
    return out


def rail_clause(plan: GroupPlan, a: Assignment, outcome: Outcome) -> str:
    """'rails 0-3 on every member's node (rail-aligned)', or this member's rails and why the group is not
    aligned; '' when every member takes whole nodes. `outcome`: the member's GPUs as placed (the plan's
    unless the node changed since), judged together with the other members' planned GPUs."""
    if tuple(outcome.gpus) == tuple(a.outcome.gpus):
        alignment: RailAlignment = plan.rails
    else:
        members = [(b.node, b.outcome.gpus if b is not a else outcome.gpus) for b in plan.assignments]
        alignment = assess([*members, *plan.alongside])
    if not alignment.applies:
        return ""
    if alignment.aligned:
        return f"rails {rail_ranges(alignment.rails)} on every member's node (rail-aligned)"
    mine = rails_of(a.node, outcome.gpus)
    here = f"rails {rail_ranges(mine)} here" if mine else "no known rails here"
    return f"{here}, not rail-aligned: {alignment.why}"


def _narrowest_first(node: NodeState) -> list[tuple[str, str]]:
    loc = node.location
    # The NVLink domain first (trays of one NVL72 rack), then the network switches, narrowest first.
    return [(t, sw) for t, sw in reversed(list(loc.items())) if sw is not None]
