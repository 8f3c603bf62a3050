"""The summary figures of a simulation (docs/simulator.md, "Summary figures"), defined precisely.

- Multi-GPU pods on a full NVLink clique: of the pods with 2+ GPUs that ask for NVLink (`required` or
  `preferred`; `nvlink: ignore` pods are left out), the placed ones whose GPUs are pairwise
  NVLink-connected (degraded links already removed from the node's link matrix). Also counted against
  the multi-GPU pods that *could* have had one: those for which some node of the cluster, emptied of
  its in-use GPUs but otherwise as given (failed GPUs, degraded links, HBM, NICs, stale topology),
  holds a fitting clique by the engine's own judgement.
- Groups within one switch: groups (jobs of 2+ pods) placed in full whose members all sit under the
  same switch of a network tier (`leaf`, `spine`); nodes without that tier's label count as apart.
  Groups placed only in part (possible under `default` and `random`, which know nothing of groups)
  are counted separately: their GPUs are held by pods that cannot start their job.
- Rail-aligned groups: of the groups placed in full that have a member on part of a node (fewer GPUs
  than the node has), those whose partial members all use the same fabric rails (the rails of the NICs
  nearest their GPUs; gputopo.engine.network.rails). Members on whole nodes use every rail and align with any.
- Broken requests: placed pods whose placement does not meet a request of their own annotations
  (HBM minimum, network kind, `nvlink: required`, `spread: node`, `required-tier`) or that sit on a
  node whose topology gputopo does not trust (stale). Always 0 under `gputopo`; the topology-blind
  policies cannot see annotations.
- Stranded GPUs: free, healthy GPUs, at the end, on nodes where not one pod of the remaining queue
  (the unplaced pods) fits, judged by the engine (`evaluate_node`: GPU count, HBM, NVLink clique,
  network) for every policy alike. With an empty queue nothing is stranded.
- Communication time (gputopo.sim.comm): summed over jobs placed in full, one TP allreduce per
  multi-GPU pod plus one PP transfer per stage boundary of each group.
- Exhaustive comparison: on instances of at most EXHAUSTIVE_MAX_NODES nodes and
  EXHAUSTIVE_MAX_PODS pods, the placement that places the most jobs (honouring every hard request:
  NVLink required, HBM, network, spread, required tier), then has the least communication time; the
  policy's communication time over that best one (1.00 = as good as possible).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise

from gputopo.engine.network.rails import assess
from gputopo.engine.node.placement import evaluate_node
from gputopo.engine.state.scoring import ScoreWeights
from gputopo.engine.state.snapshot import NodeState, node_state
from gputopo.model import NvlinkPolicy, PodRequest, Spread
from gputopo.sim.checks import broken_requests
from gputopo.sim.comm import node_shape, pp_seconds, tp_seconds
from gputopo.sim.exhaustive import EXHAUSTIVE_MAX_NODES, EXHAUSTIVE_MAX_PODS, best_placement
from gputopo.sim.records import MEASURES, Measures, PodPlacement, RunRecord, SimPod
from gputopo.tiers import TierConfig


@dataclass(frozen=True)
class ExhaustiveComparison:
    policy_seconds: float
    best_seconds: float
    policy_jobs_placed: int
    best_jobs_placed: int
    complete: bool  # the search ran to the end (else: best found within the budget)
    states: int

    @property
    def ratio(self) -> float | None:
        """Policy communication time over the best's, when both placed the same number of jobs."""
        if self.policy_jobs_placed != self.best_jobs_placed:
            return None
        if self.best_seconds <= 0:
            return 1.0 if self.policy_seconds <= 0 else None
        return self.policy_seconds / self.best_seconds


@dataclass(frozen=True)
class Summary:
    jobs: int
    jobs_placed: int
    pods: int
    pods_placed: int
    multi_gpu_pods: int
    multi_gpu_placed: int
    on_full_clique: int
    could_have_clique: int
    on_full_clique_of_could: int
    groups: int
    groups_placed: int
    groups_partial: int
    groups_within: dict[str, int]  # network tier -> groups placed in full under one switch of it
    broken: dict[str, int]  # request kind -> placed pods that do not meet it
    free_gpus: int
    stranded_gpus: int
    stranded_nodes: int
    tp_allreduce_seconds: float
    pp_transfer_seconds: float
    tp_message_bytes: float
    pp_message_bytes: float
    exhaustive: ExhaustiveComparison | None = None
    exhaustive_note: str = ""
    gpus_placed: int = 0
    rail_groups: int = 0  # groups placed in full with a member on part of a node
    rail_aligned: int = 0  # of those, groups whose partial members all use the same rails

    def to_json(self) -> dict[str, object]:
        def share(a: int, b: int) -> float | None:
            return round(a / b, 4) if b else None

        ex: dict[str, object] | None = None
        if self.exhaustive is not None:
            e = self.exhaustive
            ex = {
                "policySeconds": e.policy_seconds,
                "bestSeconds": e.best_seconds,
                "ratio": None if e.ratio is None else round(e.ratio, 4),
                "policyJobsPlaced": e.policy_jobs_placed,
                "bestJobsPlaced": e.best_jobs_placed,
                "complete": e.complete,
                "statesSearched": e.states,
            }
        return {
            "jobs": self.jobs,
            "jobsPlaced": self.jobs_placed,
            "pods": self.pods,
            "podsPlaced": self.pods_placed,
            "gpusPlaced": self.gpus_placed,
            "multiGpuPods": self.multi_gpu_pods,
            "multiGpuPodsPlaced": self.multi_gpu_placed,
            "onFullNvlinkClique": self.on_full_clique,
            "onFullNvlinkCliqueShare": share(self.on_full_clique, self.multi_gpu_placed),
            "couldHaveClique": self.could_have_clique,
            "onFullNvlinkCliqueOfCould": self.on_full_clique_of_could,
            "onFullNvlinkCliqueOfCouldShare": share(self.on_full_clique_of_could, self.could_have_clique),
            "groups": self.groups,
            "groupsPlaced": self.groups_placed,
            "groupsPartlyPlaced": self.groups_partial,
            "groupsWithinOne": dict(self.groups_within),
            "groupsWithinOneShare": {t: share(c, self.groups_placed) for t, c in self.groups_within.items()},
            "groupsOnPartNodes": self.rail_groups,
            "groupsRailAligned": self.rail_aligned,
            "groupsRailAlignedShare": share(self.rail_aligned, self.rail_groups),
            "podsWithBrokenRequests": dict(self.broken),
            "freeGpus": self.free_gpus,
            "strandedGpus": self.stranded_gpus,
            "strandedNodes": self.stranded_nodes,
            "tpAllreduceSeconds": self.tp_allreduce_seconds,
            "ppTransferSeconds": self.pp_transfer_seconds,
            "communicationSeconds": self.tp_allreduce_seconds + self.pp_transfer_seconds,
            "tpMessageBytes": self.tp_message_bytes,
            "ppMessageBytes": self.pp_message_bytes,
            "exhaustive": ex,
            "exhaustiveNote": self.exhaustive_note,
        }


def empty_node(node: NodeState, tiers: TierConfig) -> NodeState:
    """The node with nothing running on it (failures, degraded links, staleness kept)."""
    return node_state(
        node.name,
        node.topology,
        labels=node.labels,
        problem=node.problem,
        problem_detail=node.problem_detail,
        tiers=tiers,
    )


def _queue_key(req: PodRequest) -> PodRequest:
    return req.model_copy(update={"stage": None})


def is_group_job(pods: Sequence[SimPod]) -> bool:
    return len(pods) > 1 or (bool(pods) and pods[0].request.is_group)


def job_comm_seconds(
    pods: Sequence[SimPod],
    where: dict[str, tuple[NodeState, tuple[int, ...]]],
    tiers: TierConfig,
    tp_message_bytes: float,
    pp_message_bytes: float,
) -> tuple[float, float]:
    """(TP seconds, PP seconds) of one job whose pods are all in `where` (pod name -> node, GPUs)."""
    tp = 0.0
    for p in pods:
        node, gpus = where[p.name]
        tp += tp_seconds(node_shape(node), gpus, tp_message_bytes)
    pp = 0.0
    if is_group_job(pods):
        staged = sorted(pods, key=lambda p: (p.stage, p.name))
        kind = pods[0].request.network
        for a, b in pairwise(staged):
            na, ga = where[a.name]
            nb, gb = where[b.name]
            pp += pp_seconds(na, ga, nb, gb, kind, pp_message_bytes, tiers)
    return tp, pp


def summarize(run: RunRecord, tiers: TierConfig, weights: ScoreWeights, measures: Measures = MEASURES) -> Summary:
    """The summary figures of one run (`measures`: the message sizes they price, whether the exhaustive
    search compares)."""
    jobs, placements, unplaced, initial, final = run.jobs, run.placements, run.unplaced, run.initial, run.final
    tp_message_bytes, pp_message_bytes = measures.tp_message_bytes, measures.pp_message_bytes
    by_name = {n.name: n for n in final}
    placed = {p.pod: p for p in placements}
    all_pods = [p for pods in jobs for p in pods]
    multi = [p for p in all_pods if p.request.gpus >= 2 and p.request.nvlink is not NvlinkPolicy.IGNORE]
    broken = _broken_requests(all_pods, placed, by_name)
    on_clique, could_count, on_clique_of_could = _clique_counts(multi, placed, by_name, initial, tiers, weights)
    jf = _job_figures(jobs, placed, by_name, tiers, tp_message_bytes, pp_message_bytes, broken)
    free_total, stranded, stranded_nodes = _stranded(final, all_pods, unplaced, weights)
    comparison: ExhaustiveComparison | None = None
    note = ""
    if measures.exhaustive:
        comparison, note = _compare_exhaustive(
            jobs, initial, tiers, tp_message_bytes, pp_message_bytes, jf, sorted(broken)
        )
    return Summary(
        jobs=len(jobs),
        jobs_placed=jf.jobs_placed,
        pods=len(all_pods),
        pods_placed=len(placed),
        multi_gpu_pods=len(multi),
        multi_gpu_placed=sum(1 for p in multi if p.name in placed),
        on_full_clique=on_clique,
        could_have_clique=could_count,
        on_full_clique_of_could=on_clique_of_could,
        groups=jf.groups,
        groups_placed=jf.groups_placed,
        groups_partial=jf.groups_partial,
        groups_within=jf.within,
        broken={k: len(v) for k, v in sorted(broken.items())},
        free_gpus=free_total,
        stranded_gpus=stranded,
        stranded_nodes=stranded_nodes,
        tp_allreduce_seconds=jf.tp_seconds,
        pp_transfer_seconds=jf.pp_seconds,
        tp_message_bytes=tp_message_bytes,
        pp_message_bytes=pp_message_bytes,
        exhaustive=comparison,
        exhaustive_note=note,
        gpus_placed=sum(len(p.gpus) for p in placements),
        rail_groups=jf.rail_groups,
        rail_aligned=jf.rail_aligned,
    )


def _broken_requests(
    all_pods: Sequence[SimPod], placed: dict[str, PodPlacement], by_name: dict[str, NodeState]
) -> dict[str, set[str]]:
    """Request kind -> the placed pods whose own placement breaks it (groups' kinds are added later)."""
    broken: dict[str, set[str]] = {}
    for p in all_pods:
        pl = placed.get(p.name)
        if pl is not None and p.opted_in:  # a plain pod asked for nothing, so it breaks nothing
            for kind, _ in broken_requests(by_name[pl.node], pl.gpus, p.request):
                broken.setdefault(kind, set()).add(p.name)
    return broken


def _clique_counts(
    multi: Sequence[SimPod],
    placed: dict[str, PodPlacement],
    by_name: dict[str, NodeState],
    initial: Sequence[NodeState],
    tiers: TierConfig,
    weights: ScoreWeights,
) -> tuple[int, int, int]:
    """Multi-GPU pods on a full clique, those that could have had one on the empty cluster, and the
    first among the second."""
    empties = [empty_node(n, tiers) for n in initial]
    could_memo: dict[PodRequest, bool] = {}

    def could(req: PodRequest) -> bool:
        key = _queue_key(req).model_copy(update={"nvlink": NvlinkPolicy.REQUIRED})
        if key not in could_memo:
            seen: dict[object, bool] = {}
            ok = False
            for n in empties:
                if n.key not in seen:
                    seen[n.key] = evaluate_node(n, key, weights).fits
                if seen[n.key]:
                    ok = True
                    break
            could_memo[key] = ok
        return could_memo[key]

    on_clique = 0
    could_count = 0
    on_clique_of_could = 0
    for p in multi:
        c = could(p.request)
        could_count += c
        pl = placed.get(p.name)
        if pl is None:
            continue
        shape = node_shape(by_name[pl.node])
        g = pl.gpus
        full = shape is not None and all(shape.links[a][b] > 0 for i, a in enumerate(g) for b in g[i + 1 :])
        on_clique += full
        on_clique_of_could += full and c
    return on_clique, could_count, on_clique_of_could


@dataclass
class _JobFigures:
    jobs_placed: int = 0
    groups: int = 0
    groups_placed: int = 0
    groups_partial: int = 0
    rail_groups: int = 0
    rail_aligned: int = 0
    within: dict[str, int] = field(default_factory=dict)
    tp_seconds: float = 0.0
    pp_seconds: float = 0.0


def _job_figures(
    jobs: Sequence[Sequence[SimPod]],
    placed: dict[str, PodPlacement],
    by_name: dict[str, NodeState],
    tiers: TierConfig,
    tp_message_bytes: float,
    pp_message_bytes: float,
    broken: dict[str, set[str]],
) -> _JobFigures:
    """Jobs placed in full and their communication time; groups placed, within one switch, rail-aligned.
    Adds to `broken` the group requests (spread, required tier) that placed members break."""
    net = tiers.network_tiers()
    f = _JobFigures(within=dict.fromkeys(net, 0))
    for pods in jobs:
        n_placed = sum(1 for p in pods if p.name in placed)
        full = n_placed == len(pods) and len(pods) > 0
        if full:
            f.jobs_placed += 1
            where = {p.name: (by_name[placed[p.name].node], placed[p.name].gpus) for p in pods}
            tp, pp = job_comm_seconds(pods, where, tiers, tp_message_bytes, pp_message_bytes)
            f.tp_seconds += tp
            f.pp_seconds += pp
        if not is_group_job(pods):
            continue
        f.groups += 1
        lead = pods[0].request
        on = [(p.name, placed[p.name].node) for p in pods if p.name in placed]
        if lead.spread is Spread.NODE and len({n for _, n in on}) < len(on):
            broken.setdefault("spread", set()).update(name for name, _ in on)
        if lead.required_tier and on:
            sws = {by_name[n].location.get(lead.required_tier) for _, n in on}
            if len(sws) > 1 or None in sws:
                broken.setdefault("required-tier", set()).update(name for name, _ in on)
        if full:
            f.groups_placed += 1
            for t in net:
                sws = {by_name[placed[p.name].node].location.get(t) for p in pods}
                if len(sws) == 1 and None not in sws:
                    f.within[t] += 1
            rails = assess([(by_name[placed[p.name].node], placed[p.name].gpus) for p in pods])
            f.rail_groups += rails.applies
            f.rail_aligned += rails.applies and rails.aligned
        elif n_placed:
            f.groups_partial += 1
    return f


def _stranded(
    final: Sequence[NodeState], all_pods: Sequence[SimPod], unplaced: Sequence[str], weights: ScoreWeights
) -> tuple[int, int, int]:
    """(free GPUs, stranded GPUs, stranded nodes): free on nodes that no pod of the remaining queue fits."""
    pending = {p.name for p in all_pods} & set(unplaced)
    queue = list({_queue_key(p.request) for p in all_pods if p.name in pending})
    free_total = stranded = stranded_nodes = 0
    fit_memo: dict[object, bool] = {}
    for n in final:
        shape = node_shape(n)
        if shape is None or n.topology is None:
            continue
        failed = sum(1 for g in n.topology.gpus if g.health.value == "failed")
        free = shape.n - failed - len(n.in_use)
        free_total += free
        if not queue or free <= 0:
            continue
        if n.key not in fit_memo:
            fit_memo[n.key] = any(evaluate_node(n, r, weights).fits for r in queue)
        if not fit_memo[n.key]:
            stranded += free
            stranded_nodes += 1
    return free_total, stranded, stranded_nodes


def _compare_exhaustive(
    jobs: Sequence[Sequence[SimPod]],
    initial: Sequence[NodeState],
    tiers: TierConfig,
    tp_message_bytes: float,
    pp_message_bytes: float,
    jf: _JobFigures,
    broken_kinds: Sequence[str],
) -> tuple[ExhaustiveComparison | None, str]:
    """The policy against the exhaustive best on small instances, and a note saying why not or why
    the ratio reads as it does."""
    pods = sum(len(j) for j in jobs)
    if len(initial) > EXHAUSTIVE_MAX_NODES or pods > EXHAUSTIVE_MAX_PODS:
        return None, (
            f"not computed: exhaustive search runs on up to {EXHAUSTIVE_MAX_NODES} nodes and "
            f"{EXHAUSTIVE_MAX_PODS} pods; this instance has {len(initial)} nodes and {pods} pods"
        )
    best = best_placement(initial, jobs, tiers, tp_message_bytes, pp_message_bytes)
    comparison = ExhaustiveComparison(
        policy_seconds=jf.tp_seconds + jf.pp_seconds,
        best_seconds=best.seconds,
        policy_jobs_placed=jf.jobs_placed,
        best_jobs_placed=best.jobs_placed,
        complete=best.complete,
        states=best.states,
    )
    note = ""
    if comparison.ratio is not None and comparison.ratio < 1 - 1e-9 and broken_kinds:
        note = "below 1.00 because the policy broke requests the search honours (" + ", ".join(broken_kinds) + ")"
    elif comparison.ratio is None and jf.jobs_placed != best.jobs_placed:
        note = (
            f"the policy placed {jf.jobs_placed} of {len(jobs)} jobs; the best placement that honours every "
            f"hard request places {best.jobs_placed}, so their communication times are not comparable"
        )
    return comparison, note
