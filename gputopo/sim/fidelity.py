"""The simulator's decisions against placements made elsewhere (the real kube-scheduler and extender).

`Follower` keeps the engine's view of a cluster following the placements that really happened, and at
each job says what the engine would do in that state (the simulator's own decision code: `evaluate_pod`
and `rank` for a single pod, `plan_group` for a group), then judges the real placement against it:

- a single gputopo pod agrees when both place it and the real node is the engine's best or a node the
  engine scores equal to it, or when neither places it;
- a group member agrees when it sits on the node of the engine's plan, or when the real group is as
  good by the plan's own measure (the same number of switches per network tier and the same sum of
  member scores), or when neither places it;
- a plain pod (no `gputopo.io/` request) is passed through by the extender: the engine scores every
  node alike, so it agrees when both place it (on a node with enough free GPUs) or neither does.

The real placements then become the state for the next job, so one early difference does not count
against every later pod. `Follower.summary` gives the summary figures of the real placements
(`gputopo.sim.metrics.summarize`, the same definitions as `gputopo simulate`). Pure: no I/O.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gputopo.clusterfile import JobSpec
from gputopo.engine.gang.groups import plan_group
from gputopo.engine.gang.plan import GroupFailure, GroupPlan, Member
from gputopo.engine.network.domains import domain_free
from gputopo.engine.node.besteffort import best_effort_scores, pair_scores
from gputopo.engine.node.placement import evaluate_node, evaluate_pod, rank
from gputopo.engine.state.scoring import DEFAULT_WEIGHTS, ScoreWeights
from gputopo.engine.state.snapshot import NodeState, with_in_use
from gputopo.model import Health
from gputopo.sim.core import prepare_pods
from gputopo.sim.metrics import Summary, is_group_job, summarize
from gputopo.sim.records import Measures, PodPlacement, RunRecord, SimPod
from gputopo.tiers import DEFAULT_TIERS, TierConfig

# Scores closer than this are equal: they are sums of the same float terms.
SCORE_EPS = 1e-9


@dataclass(frozen=True)
class RealPlacement:
    """Where a pod really went: its node and the GPUs it holds there (`gputopo.io/placement`)."""

    node: str
    gpus: tuple[int, ...]
    score: int = 0
    reason: str = ""


@dataclass(frozen=True)
class EngineChoice:
    """What the engine would do with one job in the followed state."""

    pods: tuple[SimPod, ...]
    # Single gputopo pod: feasible node -> score, and the best node (rank's first).
    scores: Mapping[str, float]
    best: str | None
    gpus: Mapping[str, tuple[int, ...]]  # node -> the GPUs the engine would take there
    plan: GroupPlan | None = None
    failure: str = ""  # why the engine places nothing (empty when it places the job)
    plain: bool = False

    @property
    def places(self) -> bool:
        return self.best is not None or self.plan is not None


@dataclass(frozen=True)
class PodVerdict:
    pod: str
    job: str
    real: RealPlacement | None
    engine_node: str | None  # the engine's choice for this pod (None: the engine leaves it unplaced)
    agrees: bool
    same_gpus: bool | None  # on the engine's node or an equal one: the engine's GPUs there (None: n/a)
    note: str = ""  # why it does not agree


def _device_free(node: NodeState) -> list[int]:
    """The GPUs the device plugin offers on a node: healthy and not in use. Stale or not, as kube-scheduler
    and the device plugin know nothing of gputopo's heartbeat."""
    if node.topology is None:
        return []
    return [g.index for g in node.topology.gpus if g.health is not Health.FAILED and g.index not in node.in_use]


class Follower:
    """The engine's view of a cluster that follows real placements, job by job."""

    def __init__(
        self, nodes: Sequence[NodeState], tiers: TierConfig = DEFAULT_TIERS, weights: ScoreWeights = DEFAULT_WEIGHTS
    ) -> None:
        self.initial = tuple(nodes)
        self.state = {n.name: n for n in nodes}
        self.tiers = tiers
        self.weights = weights
        self.jobs: list[tuple[SimPod, ...]] = []
        self.placements: list[PodPlacement] = []
        self.unplaced: list[str] = []
        self.verdicts: list[PodVerdict] = []

    # -- the engine's decision ------------------------------------------------------------------

    def decide(self, pods: Sequence[SimPod]) -> EngineChoice:
        """The engine's decision for one job (all pods of a group, else one pod) in the current state."""
        pods = tuple(pods)
        if not pods:
            raise ValueError("a job has at least one pod")
        nodes = list(self.state.values())
        if not pods[0].opted_in:
            k = pods[0].request.gpus
            fit = {n.name: 0.0 for n in nodes if len(_device_free(n)) >= k}
            best = min(fit) if fit else None
            return EngineChoice(pods, fit, best, {}, plain=True, failure="" if fit else f"no node has {k} free GPUs")
        if is_group_job(pods):
            lead = pods[0].request
            size = lead.group_size or len(pods)
            group = lead.group or pods[0].job
            if size != len(pods):
                return EngineChoice(pods, {}, None, {}, failure=f"group {group}: {len(pods)}/{size} pods exist")
            plan = plan_group(group, [Member(p.name, p.request) for p in pods], nodes, self.tiers, self.weights)
            if isinstance(plan, GroupFailure):
                return EngineChoice(pods, {}, None, {}, failure=plan.message)
            gpus = {a.member: a.outcome.gpus for a in plan.assignments}
            return EngineChoice(pods, {}, None, gpus, plan=plan)
        ranked = rank(evaluate_pod(nodes, pods[0].request, self.weights), domain_free(nodes, self.tiers), self.tiers)
        if not ranked:
            return EngineChoice(pods, {}, None, {}, failure="no node fits")
        scores = {v.name: v.outcome.score for v in ranked}
        gpus = {v.name: v.outcome.gpus for v in ranked}
        return EngineChoice(pods, scores, ranked[0].name, gpus)

    # -- judging and following ------------------------------------------------------------------

    def observe(self, choice: EngineChoice, real: Mapping[str, RealPlacement | None]) -> list[PodVerdict]:
        """Judge the job's real placements (pod name -> placement, None or absent: not placed) against
        `choice`, then take them into the state. Returns one verdict per pod, in job order."""
        if choice.plain:
            out = [self._judge_plain(choice, p, real.get(p.name)) for p in choice.pods]
        elif choice.plan is not None or is_group_job(choice.pods):
            out = self._judge_group(choice, real)
        else:
            out = [self._judge_single(choice, choice.pods[0], real.get(choice.pods[0].name))]
        self.jobs.append(choice.pods)
        for p in choice.pods:
            r = real.get(p.name)
            if r is None:
                self.unplaced.append(p.name)
                continue
            if r.node not in self.state:
                raise ValueError(f"pod {p.name} placed on {r.node!r}, a node this cluster does not have")
            self.placements.append(PodPlacement(p.name, p.job, r.node, r.gpus, r.score, r.reason))
            self.take(r.node, r.gpus)
        self.verdicts.extend(out)
        return out

    def take(self, node: str, gpus: Sequence[int]) -> None:
        if gpus:
            self.state[node] = with_in_use(self.state[node], frozenset(gpus), self.tiers)

    def plain_gpus(self, node: str, k: int) -> tuple[int, ...]:
        """The GPUs NVIDIA's device plugin gives a plain pod of `k` GPUs on `node` now (go-gpuallocator's
        besteffort over the free GPUs, as the simulator's `default` policy has it)."""
        n = self.state[node]
        if n.topology is None or k <= 0:
            return ()
        return best_effort_scores(pair_scores(n.topology), _device_free(n), (), k)

    def _judge_plain(self, choice: EngineChoice, pod: SimPod, real: RealPlacement | None) -> PodVerdict:
        if real is None:
            ok = not choice.scores
            return PodVerdict(
                pod.name, pod.job, None, choice.best, ok, None, "" if ok else "not placed; nodes had room"
            )
        ok = real.node in choice.scores
        return PodVerdict(pod.name, pod.job, real, real.node, ok, None, "" if ok else "placed where it had no room")

    def _judge_single(self, choice: EngineChoice, pod: SimPod, real: RealPlacement | None) -> PodVerdict:
        if real is None or choice.best is None:
            ok = real is None and choice.best is None
            note = "" if ok else ("placed, the engine places nothing" if real else f"not placed, engine: {choice.best}")
            return PodVerdict(pod.name, pod.job, real, choice.best, ok, None, note)
        best = choice.scores[choice.best]
        got = choice.scores.get(real.node)
        if got is None:
            return PodVerdict(pod.name, pod.job, real, choice.best, False, None, f"{real.node} does not fit")
        if best - got > SCORE_EPS:
            note = f"{real.node} scores {got:.4f}, the engine's {choice.best} {best:.4f}"
            return PodVerdict(pod.name, pod.job, real, choice.best, False, None, note)
        same = tuple(sorted(real.gpus)) == tuple(sorted(choice.gpus[real.node]))
        return PodVerdict(pod.name, pod.job, real, choice.best, True, same)

    def _judge_group(self, choice: EngineChoice, real: Mapping[str, RealPlacement | None]) -> list[PodVerdict]:
        pods = choice.pods
        placed = {p.name: real[p.name] for p in pods if real.get(p.name) is not None}
        plan = choice.plan
        if plan is None or len(placed) < len(pods):
            out = []
            for p in pods:
                r = placed.get(p.name)
                a = plan.for_member(p.name) if plan is not None else None
                ok = r is None and plan is None
                if ok:
                    note = ""
                elif plan is None:
                    note = f"placed, the engine places no member ({choice.failure})"
                else:
                    note = f"{len(placed)}/{len(pods)} members placed, the engine places all"
                out.append(PodVerdict(p.name, p.job, r, a.node.name if a else None, ok, None, note))
            return out
        equal = self._as_good(plan, pods, placed)
        out = []
        for p in pods:
            r = placed[p.name]
            assert r is not None
            a = plan.for_member(p.name)
            assert a is not None
            on_plan = r.node == a.node.name
            ok = on_plan or equal
            same = tuple(sorted(r.gpus)) == tuple(sorted(a.outcome.gpus)) if on_plan else None
            note = "" if ok else f"on {r.node}, the plan's {a.node.name}; the real group is not as good"
            out.append(PodVerdict(p.name, p.job, r, a.node.name, ok, same, note))
        return out

    def _as_good(self, plan: GroupPlan, pods: Sequence[SimPod], placed: Mapping[str, RealPlacement | None]) -> bool:
        """Whether the real group is as good as the plan by the plan's measure: switches per tier, then
        the members' summed scores (each scored on its real node, seeing the members before it)."""
        net = self.tiers.network_tiers()
        state = dict(self.state)
        switches: dict[str, set[str]] = {t: set() for t in net}
        total = 0.0
        for p in sorted(pods, key=lambda p: (p.stage, p.name)):
            r = placed[p.name]
            assert r is not None
            node = state[r.node]
            outcome = evaluate_node(node, p.request, self.weights)
            if not outcome.fits:
                return False
            total += outcome.score
            state[r.node] = with_in_use(node, frozenset(r.gpus), self.tiers)
            for t in net:
                switches[t].add(node.location.get(t) or f"?{node.name}")
        if any(len(switches[t]) != plan.switches_used.get(t, len(switches[t])) for t in net):
            return False
        return abs(total - sum(a.outcome.score for a in plan.assignments)) <= SCORE_EPS * max(1, len(pods))

    # -- results ----------------------------------------------------------------------------------

    @property
    def agreed(self) -> int:
        return sum(v.agrees for v in self.verdicts)

    def summary(self) -> Summary:
        """The summary figures of the real placements so far (the jobs observed, in order)."""
        record = RunRecord(self.jobs, self.placements, self.unplaced, self.initial, tuple(self.state.values()))
        return summarize(record, self.tiers, self.weights, Measures(exhaustive=False))


def follow_engine(
    nodes: Sequence[NodeState],
    jobs: Sequence[JobSpec],
    seed: int,
    tiers: TierConfig = DEFAULT_TIERS,
    weights: ScoreWeights = DEFAULT_WEIGHTS,
) -> Follower:
    """The engine's own decisions with kube-scheduler's tie-break: among the nodes the engine scores equal,
    one at random (seeded), where `gputopo simulate` takes the first name. Groups follow their plan, plain
    pods go to a random node with room. What the real run would give if only the ties differed."""
    rng = random.Random(seed)
    f = Follower(nodes, tiers, weights)
    for pods in prepare_pods(jobs, tiers):
        if not pods:
            continue
        choice = f.decide(pods)
        real: dict[str, RealPlacement | None] = {}
        if choice.plan is not None:
            real = {a.member: RealPlacement(a.node.name, a.outcome.gpus) for a in choice.plan.assignments}
        elif choice.best is not None:
            top = choice.scores[choice.best]
            node = rng.choice(sorted(n for n, sc in choice.scores.items() if top - sc <= SCORE_EPS))
            gpus = f.plain_gpus(node, pods[0].request.gpus) if choice.plain else choice.gpus[node]
            real = {pods[0].name: RealPlacement(node, gpus)}
        f.observe(choice, real)
    return f
