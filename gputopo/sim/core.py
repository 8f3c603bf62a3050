"""Place a job list on a cluster, in order, under one of three policies, and record what happened.

Policies:

- `gputopo`: the placement engine. A single pod is evaluated on every node (`evaluate_pod`), the best
  verdict wins (`rank`; equal scores by best fit above the node over every node's free GPUs, as the
  extender ranks them on the wire), and the explanation names the runner-up. A job of several pods is one group,
  planned all at once with `plan_group` and placed all-or-nothing.
- `default`: what Kubernetes does today without gputopo. kube-scheduler keeps the nodes with enough
  free `nvidia.com/gpu` and scores them with NodeResourcesFit LeastAllocated configured on
  `nvidia.com/gpu` (the fraction of the node's GPUs still free after the pod lands; the stock profile
  scores CPU and memory only, which for GPU pods is no better). Equal scores are broken at random, as
  kube-scheduler does (seeded here). Inside the node the NVIDIA device plugin picks GPUs with
  go-gpuallocator's best-effort policy (`gputopo.engine.node.besteffort`: the best partition of the free
  GPUs into sets of the pod's size by pairwise link scores, then its best set). gputopo annotations
  (HBM minimum, NVLink, network, tiers, groups) are invisible to it, so the pods of a group are placed
  one by one and a group may end up partly placed.
- `random`: a random node among those with enough free GPUs, random free GPUs on it (seeded).

Every pod of the jobs file is treated as running under the gputopo scheduler: annotations it leaves
out take their defaults (`gputopo.io/nvlink: required`).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gputopo.clusterfile import JobSpec
from gputopo.engine.cluster.explain import Seat, gpu_ranges, packing_clause, placement_sentence, runner_up
from gputopo.engine.gang.groups import plan_group
from gputopo.engine.gang.plan import GroupFailure, GroupPlan, Member, Refinements, group_waiting_message
from gputopo.engine.network.domains import FreeTracker
from gputopo.engine.node.besteffort import ScoreMatrix, best_effort_scores, pair_scores
from gputopo.engine.node.placement import evaluate_pod, rank
from gputopo.engine.state.cliques import bits, mask_of, popcount
from gputopo.engine.state.reasons import summarize_failures
from gputopo.engine.state.scoring import DEFAULT_WEIGHTS, ScoreWeights, grade
from gputopo.engine.state.snapshot import NodeState, Shape, shape_of, with_in_use
from gputopo.model import AnnotationError, Health, is_gputopo_pod, parse_pod_request
from gputopo.sim.checks import broken_requests
from gputopo.sim.metrics import Summary, summarize
from gputopo.sim.records import MEASURES, Decision, Measures, PodPlacement, RunRecord, SimPod, UnplacedPod
from gputopo.tiers import DEFAULT_TIERS, TierConfig

POLICIES = ("gputopo", "default", "random")

# What plans a group in plan_group's place (a benchmark's other domain choice), called with the group's
# name, members, the nodes now, the tiers and the weights.
GroupPlanner = Callable[
    [str, Sequence[Member], Sequence[NodeState], TierConfig, ScoreWeights], GroupPlan | GroupFailure
]


@dataclass(frozen=True, kw_only=True)
class EngineSetup:
    """How the `gputopo` policy decides: the score weights; fabric-level best fit (`best_fit=False`: ties
    by node name, groups by score, the benchmarks' before); `group_planner`, what plans groups in
    plan_group's place (None: plan_group)."""

    weights: ScoreWeights = DEFAULT_WEIGHTS
    best_fit: bool = True
    group_planner: GroupPlanner | None = None


ENGINE = EngineSetup()


# kube-scheduler's own FailedScheduling entry when a node lacks the extended resource.
INSUFFICIENT_GPU = "Insufficient nvidia.com/gpu"


class JobInputError(ValueError):
    """A job whose annotations cannot be used; names the job's index and name."""

    def __init__(self, index: int, name: str, error: AnnotationError) -> None:
        self.index = index
        self.name = name
        self.error = error
        super().__init__(f"jobs[{index}] ({name}).annotations: {error}")


@dataclass(frozen=True)
class SimResult:
    policy: str
    seed: int
    jobs: tuple[tuple[SimPod, ...], ...]  # pods per job, in job order
    placements: tuple[PodPlacement, ...]
    unplaced: tuple[UnplacedPod, ...]
    initial: tuple[NodeState, ...]
    final: tuple[NodeState, ...]
    decisions: tuple[Decision, ...]
    summary: Summary


def prepare_pods(jobs: Sequence[JobSpec], tiers: TierConfig = DEFAULT_TIERS) -> list[tuple[SimPod, ...]]:
    """Each job's pods with parsed requests; a malformed annotation raises JobInputError."""
    out = []
    for j, job in enumerate(jobs):
        pods = []
        for i in range(job.pods):
            try:
                req = parse_pod_request(job.pod_annotations(i), job.gpus_of(i), tiers.names)
            except AnnotationError as e:
                raise JobInputError(j, job.name, e) from None
            pods.append(SimPod(f"{job.name}-{i}", job.name, i, req, is_gputopo_pod(job.pod_annotations(i))))
        out.append(tuple(pods))
    return out


# --------------------------------------------------------------------------------------------------
# Hardware view for the topology-blind policies (they see GPU counts, and the device plugin sees links).


@dataclass(frozen=True)
class _Hw:
    shape: Shape | None
    usable: int  # healthy GPUs (the device plugin does not advertise failed ones)
    total: int
    scores: ScoreMatrix = ()  # go-gpuallocator's pair scores, computed once per node


def _hw(node: NodeState) -> _Hw:
    topo = node.topology
    if topo is None or not topo.gpus:
        return _Hw(None, 0, 0)
    n = len(topo.gpus)
    failed = mask_of([g.index for g in topo.gpus if g.health is Health.FAILED])
    return _Hw(shape_of(topo), ((1 << n) - 1) & ~failed, n, pair_scores(topo))


def _clique_note(shape: Shape | None, gpus: Sequence[int]) -> str:
    if len(gpus) < 2 or shape is None:
        return ""
    missing = sum(1 for i, a in enumerate(gpus) for b in gpus[i + 1 :] if shape.links[a][b] == 0)
    if missing == 0:
        return f", which form a full NVLink clique (NV{shape.min_link(tuple(gpus))})"
    if len(gpus) == 2:
        return ", which have no NVLink between them (PCIe only)"
    pairs = len(gpus) * (len(gpus) - 1) // 2
    return f", which are not one NVLink clique ({missing} of {pairs} GPU pairs talk over PCIe)"


# --------------------------------------------------------------------------------------------------


class _Run:
    def __init__(
        self,
        nodes: Sequence[NodeState],
        policy: str,
        tiers: TierConfig,
        seed: int,
        engine: EngineSetup = ENGINE,
    ) -> None:
        self.best_fit = engine.best_fit
        self.planner = engine.group_planner
        self.nodes = list(nodes)
        self.free = FreeTracker(self.nodes, tiers)  # over every node, as the extender counts them
        self.index = {n.name: i for i, n in enumerate(self.nodes)}
        self.hw = [_hw(n) for n in self.nodes]
        self.policy = policy
        self.tiers = tiers
        self.weights = engine.weights
        self.rng = random.Random(seed)
        self.placements: list[PodPlacement] = []
        self.unplaced: list[UnplacedPod] = []
        self.decisions: list[Decision] = []

    # -- state ---------------------------------------------------------------------------------------

    def take(self, node: str, gpus: Sequence[int]) -> None:
        i = self.index[node]
        if gpus:
            old, self.nodes[i] = self.nodes[i], with_in_use(self.nodes[i], frozenset(gpus), self.tiers)
            self.free.replace(old, self.nodes[i])

    def free_mask(self, i: int) -> int:
        return self.hw[i].usable & ~mask_of(self.nodes[i].in_use)

    # -- gputopo ------------------------------------------------------------------------------------

    def gputopo_single(self, pod: SimPod) -> None:
        verdicts = evaluate_pod(self.nodes, pod.request, self.weights)
        free = self.free.figures if self.best_fit else None  # without best fit, ties go by name (as before it)
        ranked = rank(verdicts, free, self.tiers)
        if not ranked:
            reasons = summarize_failures([v.outcome.message for v in verdicts], len(verdicts))
            self.unplaced.append(UnplacedPod(pod.name, pod.job, reasons))
            return
        best = ranked[0]
        runner = runner_up(best.name, ranked)
        packing = packing_clause(best.node, best.outcome, runner, free, self.tiers) if free is not None else ""
        sentence = placement_sentence(
            best.name, best.outcome, runner, weights=self.weights, tiers=self.tiers, packing=packing
        )
        if runner is None and len(verdicts) > 1:
            sentence += "; no other node fits"
        score = grade(best.outcome.score)
        self.placements.append(PodPlacement(pod.name, pod.job, best.name, best.outcome.gpus, score, sentence))
        self.take(best.name, best.outcome.gpus)

    def gputopo_group(self, pods: Sequence[SimPod]) -> None:
        lead = pods[0].request
        group = lead.group or pods[0].job
        size = lead.group_size or len(pods)
        if size != len(pods):
            msg = group_waiting_message(group, len(pods), size)
            self._fail_all(pods, msg)
            return
        members = [Member(p.name, p.request) for p in pods]
        if self.planner is not None:
            plan = self.planner(group, members, self.nodes, self.tiers, self.weights)
        else:
            plan = plan_group(
                group, members, self.nodes, self.tiers, self.weights, refine=Refinements(best_fit=self.best_fit)
            )
        if isinstance(plan, GroupFailure):
            self._fail_all(pods, plan.message)
            return
        for a in plan.assignments:
            pod = next(p for p in pods if p.name == a.member)
            sentence = placement_sentence(a.node.name, a.outcome, None, Seat(plan, a.member), self.weights, self.tiers)
            score = grade(a.outcome.score)
            self.placements.append(PodPlacement(pod.name, pod.job, a.node.name, a.outcome.gpus, score, sentence))
            self.take(a.node.name, a.outcome.gpus)

    def _fail_all(self, pods: Sequence[SimPod], message: str) -> None:
        reasons = summarize_failures([message] * len(self.nodes), len(self.nodes))
        for p in pods:
            self.unplaced.append(UnplacedPod(p.name, p.job, reasons))

    # -- default and random -------------------------------------------------------------------------

    def blind(self, pod: SimPod, group_size: int, policy: str | None = None) -> None:
        """Place like a topology-blind scheduler: `policy` overrides the run's (plain pods under
        gputopo are placed the way kube-scheduler and the device plugin would, as the extender passes
        them through)."""
        k = pod.request.gpus
        feasible = [i for i in range(len(self.nodes)) if popcount(self.free_mask(i)) >= k]
        if not feasible:
            reasons = summarize_failures([INSUFFICIENT_GPU] * len(self.nodes), len(self.nodes))
            self.unplaced.append(UnplacedPod(pod.name, pod.job, reasons))
            return
        if (policy or self.policy) == "default":
            i, score, tied = self._least_allocated(feasible, k)
            free = self.free_mask(i)
            shape = self.hw[i].shape
            # kubelet offers the free GPUs in index order, as go-gpuallocator's own allocator does.
            gpus = best_effort_scores(self.hw[i].scores, bits(free), (), k) if shape is not None and k else ()
            name = self.nodes[i].name
            total = self.hw[i].total
            left = popcount(free) - k
            why = f"kube-scheduler (LeastAllocated) chose {name}: {left} of {total} GPUs stay free"
            if tied > 1:
                why += f", tied with {tied - 1} other node{'s' if tied > 2 else ''} (broken at random)"
            if gpus:
                why += f"; the device plugin gave GPU{'s' if k > 1 else ''} {gpu_ranges(gpus)}"
        else:
            i = self.rng.choice(feasible)
            free = self.free_mask(i)
            shape = self.hw[i].shape
            gpus = tuple(sorted(self.rng.sample(bits(free), k)))
            name = self.nodes[i].name
            score = 0
            why = f"random choice among {len(feasible)} nodes with {k} free GPUs"
            if gpus:
                why += f"; random GPU{'s' if k > 1 else ''} {gpu_ranges(gpus)}"
        why += _clique_note(shape, gpus)
        broken = broken_requests(self.nodes[i], gpus, pod.request) if pod.opted_in else []
        if broken:
            why += "; blind to the pod's annotations: " + "; ".join(words for _, words in broken)
        if group_size > 1:
            why += f"; no group awareness: stage {pod.stage}/{group_size} placed on its own"
        self.placements.append(PodPlacement(pod.name, pod.job, name, gpus, score, why))
        self.take(name, gpus)

    def _least_allocated(self, feasible: Sequence[int], k: int) -> tuple[int, int, int]:
        best_key: tuple[int, int] | None = None
        tied: list[int] = []
        for i in feasible:
            total = self.hw[i].total
            left = popcount(self.free_mask(i)) - k
            # Compare left/total exactly: a/b > c/d  <=>  a*d > c*b (totals are positive or both zero).
            key = (left, total or 1)
            if best_key is None or key[0] * best_key[1] > best_key[0] * key[1]:
                best_key, tied = key, [i]
            elif key[0] * best_key[1] == best_key[0] * key[1]:
                tied.append(i)
        tied.sort(key=lambda i: self.nodes[i].name)
        chosen = self.rng.choice(tied)
        assert best_key is not None
        score = round(10 * best_key[0] / best_key[1])
        return chosen, score, len(tied)


def simulate(
    nodes: Sequence[NodeState],
    jobs: Sequence[JobSpec],
    policy: str = "gputopo",
    tiers: TierConfig = DEFAULT_TIERS,
    seed: int = 0,
    *,
    engine: EngineSetup = ENGINE,
    measures: Measures = MEASURES,
) -> SimResult:
    """Place `jobs` in order on `nodes` under `policy`; GPUs taken by earlier pods stay taken.
    `engine`: how the `gputopo` policy decides (weights, best fit, the group planner); `measures`: what
    the summary's figures assume (message sizes) and whether the exhaustive search compares.

    Raises JobInputError on a malformed annotation and ValueError on an unknown policy.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
    pods_per_job = prepare_pods(jobs, tiers)
    run = _Run(nodes, policy, tiers, seed, engine)
    for pods in pods_per_job:
        if not pods:
            continue
        is_group = len(pods) > 1 or pods[0].request.is_group
        if policy == "gputopo" and not pods[0].opted_in:
            for pod in pods:  # the extender passes plain pods through: kube-scheduler decides alone
                t0 = time.perf_counter()
                run.blind(pod, 1, "default")
                run.decisions.append(Decision(pod.job, 1, time.perf_counter() - t0))
        elif policy == "gputopo":
            t0 = time.perf_counter()
            if is_group:
                run.gputopo_group(pods)
            else:
                run.gputopo_single(pods[0])
            run.decisions.append(Decision(pods[0].job, len(pods), time.perf_counter() - t0))
        else:
            size = len(pods) if is_group else 1
            for pod in pods:
                t0 = time.perf_counter()
                run.blind(pod, size)
                run.decisions.append(Decision(pod.job, 1, time.perf_counter() - t0))
    record = RunRecord(pods_per_job, run.placements, [u.pod for u in run.unplaced], tuple(nodes), tuple(run.nodes))
    summary = summarize(record, tiers, engine.weights, measures)
    return SimResult(
        policy=policy,
        seed=seed,
        jobs=tuple(pods_per_job),
        placements=tuple(run.placements),
        unplaced=tuple(run.unplaced),
        initial=tuple(nodes),
        final=tuple(run.nodes),
        decisions=tuple(run.decisions),
        summary=summary,
    )
