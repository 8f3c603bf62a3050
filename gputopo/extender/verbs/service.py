"""The extender's decisions: filter, prioritize, bind and preempt over the ledger, with the engine.

Everything here is synchronous and free of HTTP; the door (`gputopo/extender/verbs/door.py`) translates. Filter and
prioritize read only the ledger (no I/O, and the ledger's lock only for the rare node that needs building), so they can
run on worker threads side by side with each other and with the informers. What a filter leaves for the prioritize that
follows is kept in `gputopo/extender/verbs/ahead.py`. A group member's filter goes to the group desk
(`gputopo/extender/verbs/gangs.py`); bind to the binder (`gputopo/extender/verbs/binder.py`: one Binding per pod,
docs/extender.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import compress, repeat

from pydantic_core import to_json

from gputopo.engine.cluster.preempt import Victim, choose_victims
from gputopo.engine.gang.beside import beside
from gputopo.engine.gang.imex import nvlink_domain, with_compute_domains, with_driver_labels
from gputopo.engine.gang.plan import GroupFailure
from gputopo.engine.gang.replan import GroupWaiting
from gputopo.engine.node.placement import Outcome, evaluate_node, fail_invalid
from gputopo.engine.state.reasons import Code, Reason, code_for, message
from gputopo.engine.state.scoring import MAX_EXTENDER_SCORE
from gputopo.engine.state.snapshot import node_state
from gputopo.extender.metrics import Metrics
from gputopo.extender.state.mismatch import Mismatch
from gputopo.extender.state.reservations import GroupKey
from gputopo.extender.state.verdicts import ONE_OUTCOME, Decision, Kinds
from gputopo.extender.verbs.ahead import Ahead, first, ranked
from gputopo.extender.verbs.binder import Binder
from gputopo.extender.verbs.events import MISMATCH_REASON, EventPoster
from gputopo.extender.verbs.gangs import GroupDesk
from gputopo.extender.verbs.holdnotes import held_gpus, whose_holds
from gputopo.extender.verbs.recentpods import RecentPods
from gputopo.extender.verbs.repeats import ReasonMaps, RepeatedNames
from gputopo.extender.watch.cache import ClusterCache
from gputopo.extender.watch.parsers import resolve_pod
from gputopo.extender.watch.source import ClusterSource, Kind
from gputopo.extender.wire import ExtenderPreemptionArgs, MetaPod, MetaVictims, PodInfo, pod_info
from gputopo.model import AnnotationError, PodRequest, is_gputopo_pod, parse_pod_request

__all__ = ["HEALTHY", "MISMATCH_REASON", "NEUTRAL_SCORE", "Decision", "Extender", "FilterAnswer", "RecentPods"]

log = logging.getLogger("gputopo.extender")

NEUTRAL_SCORE = 5
HEALTHY = b'{"status":"ok"}'  # /healthz on every listener: the process answers
# How long a preemptor's filter waits for the victims it was answered to leave the cache (see
# `Extender._catch_up_with_preemption`); time since the preempt answer, so a pod waits once at most.
PREEMPTION_CATCH_UP_SECONDS = 0.5
MAX_PREEMPTORS_KEPT = 1024
Imex = list[Outcome] | None  # outcomes under the ComputeDomain rules; None when none applies


@dataclass(frozen=True)
class FilterAnswer:
    passed: list[str]
    failed: Mapping[str, str]  # a `repeats.SameReason` when one reason is told on every node
    unresolvable: Mapping[str, str]
    decision: Decision


def _outcome(reason: Reason, text: str = "") -> Outcome:
    return Outcome(code=code_for(reason), reason=reason, message=text or message(reason), detail=text)


_STUB = node_state("-", None)
_BESIDE = Outcome(code=Code.SUCCESS, detail="beside the node planned for this member, which asks for no GPUs")


class Extender:
    """One extender instance: a cache, optionally an API source (None in snapshot mode), metrics."""

    def __init__(self, cache: ClusterCache, source: ClusterSource | None, metrics: Metrics | None = None) -> None:
        self.cache = cache
        self.ledger = cache.ledger
        self.source = source
        self.metrics = metrics
        self.ahead = Ahead(
            self.ledger
        )  # what a filter leaves for the prioritize that follows (gputopo/extender/verbs/ahead.py)
        self.recent = RecentPods()  # filled by filter, read by bind
        # preemptor -> (until, the victims answered on each candidate node): see _catch_up_with_preemption
        self._preempted: dict[str, tuple[float, list[frozenset[str]]]] = {}
        self.events = EventPoster(lambda: self.source)
        self.groups = GroupDesk(self.ledger, cache.facts, self.serving)
        # A filter's repeated node names decoded once, one reason for every node encoded once
        # (gputopo/extender/verbs/repeats.py); None: every filter decodes and encodes in full.
        self.repeated: RepeatedNames | None = RepeatedNames(self.groups.spelled)
        self.reasons: ReasonMaps | None = ReasonMaps()
        self.groups.exclusive.quota = cache.quotas.room  # what a hold for pods not created yet may take
        self.groups.exclusive.owner = cache.jobsets.why_not_owner
        # A lone pod's filter passes only the engine's best node (--filter-best-only; the chart turns it on):
        # kube-scheduler then neither scores nor calls prioritize. False: every fitting node passes.
        self.best_only = False
        self.binder = Binder(
            self.ledger, lambda: self.source, self.events, cache.facts, self.recent.recall, cache.dra.allocated
        )
        self.binder.channels, self.binder.asks, self.binder.claims = cache.channels, cache.asks, cache.claims
        self.binder.rules = self._rules_on
        self.ledger.on_mismatch = self._on_mismatch
        cache.on_bad_object = self._on_bad_object
        if metrics is not None:
            # Computed when /metrics is scraped, throttled on the ledger's generation: never per filter.
            ledger = self.ledger
            metrics.track_fragmentation(lambda: ledger.generation, ledger.states, ledger.clock)
            metrics.track_holds(lambda: held_gpus(ledger))

    def close(self) -> None:
        """Shutdown: post the queued events, then stop their threads."""
        self.events.close()

    def flush_events(self, timeout: float = 10.0) -> None:
        """Wait until the events queued so far are posted (tests, shutdown)."""
        self.events.flush(timeout)

    def _on_mismatch(self, m: Mismatch) -> None:
        """Called by the ledger, under its lock, once per pod: count now, post the Event later."""
        if self.metrics is not None:
            self.metrics.placement_mismatches.labels(clique="true" if m.clique else "false").inc()
        self.events.mismatch(m)

    def _on_bad_object(self, kind: Kind, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.bad_objects.labels(kind=kind).inc()

    def readiness(self) -> tuple[int, bytes]:
        """/readyz on every listener: 200 once the first full list of nodes, pods and Leases is in."""
        cache = self.cache
        if cache.ready:
            return 200, to_json({"status": "ready", "nodes": len(cache.nodes)})
        return 503, to_json({"status": "syncing", "synced": sorted(cache.synced)})

    # ------------------------------------------------------------------ decisions

    def decide(self, info: PodInfo, names: Sequence[str]) -> Decision:
        ledger = self.ledger
        # kube-scheduler sends only its gputopo profile's pods: a known controller's labels make one a
        # group member without annotations (gputopo.model.jobs; annotations override).
        facts, cache = self.cache.facts(info.namespace), self.cache
        resolved = resolve_pod(
            info,
            ledger.tier_names,
            facts,
            scheduler=info.scheduler_name,
            channels=cache.channels,
            asks=cache.asks,
            claims=cache.claims,
        )
        if not resolved.opted_in:
            return Decision("pass_through")
        if resolved.waiting:
            o = _outcome(Reason.GROUP_WAITING, resolved.problem)
            return Decision("group_waiting", names, [o] * len(names))
        req = resolved.request
        if req is None:
            bad = fail_invalid([_STUB], resolved.problem)[0].outcome
            return Decision("invalid", names, [bad] * len(names))
        if req.is_group:
            return self._group_decision(info, req, names)
        # kube-scheduler calls prioritize right after filter for the same pod, with the nodes that
        # passed: answer it from the filter's outcomes while nothing in the ledger has changed.
        key, now = (info.uid or info.ref, req, ledger.generation), ledger.clock()
        recalled = self.ahead.recall(key, names, now)
        if recalled is not None:
            return Decision("evaluated", names, recalled[0], request=req, kinds=recalled[1])
        kept = names if isinstance(names, list) else list(names)  # a request's own list: no copy of thousands
        outcomes, kinds = ledger.evaluate_kinds(kept, req)
        imex = self._compute_domains(req, kept, outcomes)
        if imex is not None:  # per node, not per kind of node: the kinds no longer sort them
            outcomes, kinds = imex, None
        self.ahead.keep(key, now, info, kept, outcomes, kinds)
        return Decision("evaluated", names, outcomes, request=req, kinds=kinds)

    def _compute_domains(self, req: PodRequest, names: list[str], outs: list[Outcome], room: bool = True) -> Imex:
        """The outcomes under the ComputeDomain rules (gputopo.engine.gang.imex): which nodes serve which
        ComputeDomain's
        IMEX channel comes from the pods bound there and the nodes' driver labels. None when no ComputeDomain is
        involved."""
        ledger = self.ledger
        if req.compute_domain is None and not ledger.pods.channels and not ledger.node_states.channel_labels:
            return None  # the common case: no lock taken
        serving = self.serving()
        if req.compute_domain is None and not serving:
            return None
        served = {s.name: nvlink_domain(s) for s in ledger.states(serving)}
        needs = self.cache.compute_domain_sizes.num_nodes(req.compute_domain) if req.compute_domain and room else 0
        return with_compute_domains(req, ledger.states(names), outs, serving, served, needs)

    def _rules_on(self, req: PodRequest, node: str, outcome: Outcome) -> Outcome:
        """The ComputeDomain rules on the node a bind names, read again now (not numNodes' room: a rule over
        the filter's candidates)."""
        out = self._compute_domains(req, [node], [outcome], False) if outcome.fits else None
        return out[0] if out is not None else outcome

    def serving(self) -> dict[str, frozenset[str]]:
        """Which ComputeDomains' IMEX channels each node serves now: its bound pods' and its driver label's
        (named by the channel templates' UIDs, gputopo.extender.watch.computedomains)."""
        ledger = self.ledger
        with ledger.lock:
            pods, labelled = ledger.pods.serving(), dict(ledger.node_states.channel_labels)
        return with_driver_labels(pods, labelled, self.cache.channels.compute_domain_of) if labelled else pods

    def filter(self, info: PodInfo, names: Sequence[str], raw: bytes = b"") -> FilterAnswer:
        """Which nodes pass; `raw` is the request's body, kept with the evaluation for the prioritize
        that follows (`gputopo.extender.verbs.ahead`)."""
        if self._preempted:
            self._catch_up_with_preemption(info)
        d = self.decide(info, names)
        if d.request is not None:
            self.recent.remember(info)  # the pod as its filter carried it: its bind needs no GET
        if d.kind == "pass_through":
            return FilterAnswer(list(names), {}, {}, d)
        if d.kind in ONE_OUTCOME and d.outcomes:  # no node passes; one reason for all (a waiting gang's)
            o = d.outcomes[0]
            answer = dict.fromkeys(d.names, o.message) if self.reasons is None else self.reasons.map(d.names, o.message)
            if o.code is Code.UNRESOLVABLE or o.reason is Reason.NO_FREE_CLIQUE:
                return FilterAnswer([], {}, answer, d)
            return FilterAnswer([], answer, {}, d)
        # Nodes of one kind share one outcome: sort the kinds into passed or not once, then split the node
        # list with C-level maps (thousands of nodes per call). Kinds are the ledger's keys when the decision
        # has them (ints, and the ledger keeps which of them fit), else the outcomes' identities.
        outcomes = d.outcomes
        ids: list[int]
        verdicts: Mapping[int, Outcome]
        if d.kinds is not None:
            ids, verdicts = d.kinds
            present = set(ids)
            passing = present & d.kinds.verdicts.passing
        else:
            ids = list(map(id, outcomes))
            verdicts = dict(zip(ids, outcomes, strict=True))
            present = set(verdicts)
            passing = {k for k, o in verdicts.items() if o.code is Code.SUCCESS}
        nodes = d.names
        if len(present) == 1:  # one kind of node (often: none fits): no per-node split at all
            if passing:
                passed_all = nodes if isinstance(nodes, list) else list(nodes)
                if self.best_only and d.kind == "evaluated" and len(passed_all) > 1:
                    return self._best(d, passed_all, outcomes, d.kinds, raw)
                self.ahead.passed(outcomes, passed_all, outcomes, d.kinds, raw)
                return FilterAnswer(list(nodes), {}, {}, d)
        else:
            selected = list(map(passing.__contains__, ids))
            passed = list(compress(nodes, selected))
            if passed:  # prioritize will name exactly these nodes
                kinds = Kinds(list(compress(ids, selected)), d.kinds.verdicts) if d.kinds is not None else None
                if self.best_only and d.kind == "evaluated" and len(passed) > 1:
                    return self._best(d, passed, list(compress(outcomes, selected)), kinds, raw)
                self.ahead.passed(outcomes, passed, list(compress(outcomes, selected)), kinds, raw)
                # kube-scheduler reads why nodes failed only when none passed (to explain the pod and to pick
                # preemption candidates): thousands of reasons per call would be built, sent and decoded for
                # nothing.
                return FilterAnswer(passed, {}, {}, d)
        # Enough GPUs are free but no clique: kube-scheduler's preemption counts GPUs, finds nothing to
        # evict there, and before kubernetes#135486 fails the whole attempt ("expected at least one
        # victim"). gputopo only narrows offered victims, so no release can resolve this node by
        # preemption: keep it out of the candidates.
        distinct = {k: verdicts[k] for k in present}
        unresolvable_ids = {
            k for k, o in distinct.items() if o.code is Code.UNRESOLVABLE or o.reason is Reason.NO_FREE_CLIQUE
        }
        messages = {k: o.message for k, o in distinct.items()}
        if len(distinct) == 1:
            answer = whose_holds(self.ledger, info.namespace, dict(zip(nodes, repeat(messages[next(iter(distinct))]))))
            return FilterAnswer([], {}, answer, d) if unresolvable_ids else FilterAnswer([], answer, {}, d)
        return FilterAnswer(
            [],
            whose_holds(self.ledger, info.namespace, self._split(nodes, ids, present - unresolvable_ids, messages)),
            whose_holds(self.ledger, info.namespace, self._split(nodes, ids, unresolvable_ids, messages)),
            d,
        )

    def _best(
        self, d: Decision, passed: list[str], outcomes: list[Outcome], kinds: Kinds | None, raw: bytes
    ) -> FilterAnswer:
        """Only the node prioritize would rank first (`first`: the engine's score, then best fit above the
        node, then the name) passes: with one feasible node kube-scheduler skips its score plugins and
        the prioritize call, the cost of which is most of what a lone pod adds to its cycle."""
        i = first(passed, outcomes, kinds, self.ledger.fabric.now().order)
        i = 0 if i is None else i  # no comparable score (NaN): prioritize would rank every node 0
        one = Kinds([kinds.keys[i]], kinds.verdicts) if kinds is not None else None
        self.ahead.passed(d.outcomes, [passed[i]], [outcomes[i]], one, raw)
        return FilterAnswer([passed[i]], {}, {}, d)

    def _catch_up_with_preemption(self, info: PodInfo) -> None:
        """kube-scheduler evicts the victims this extender's preempt answer named and retries the preemptor
        at once, its cache rid of them sooner than our pod watch may be. Deciding on the lagging cache would
        fail the node on GPUs already free, and DefaultPreemption's dry run would then find the pod fits
        there with no victim, an error before kubernetes#135486. So the preemptor's filter first waits,
        bounded, until the victims of one candidate node are gone from the cache."""
        entry = self._preempted.get(info.uid or info.ref)
        if entry is None:
            return
        until, victim_sets = entry
        pods = self.ledger.pods
        # (reads the victim sets, not the live dict)
        while all(any(uid in pods for uid in s) for s in victim_sets) and time.monotonic() < until:
            time.sleep(0.002)
        self._preempted.pop(info.uid or info.ref, None)  # once: a later retry decides at once

    def _remember_preemption(self, info: PodInfo, answer: dict[str, MetaVictims]) -> None:
        victims = [frozenset(p.uid for p in v.pods) for v in answer.values() if v.pods]
        if not victims:
            return
        now = time.monotonic()
        kept = self._preempted
        for key, (until, _) in list(kept.items()):
            if until <= now or len(kept) >= MAX_PREEMPTORS_KEPT:
                kept.pop(key, None)
        kept[info.uid or info.ref] = (now + PREEMPTION_CATCH_UP_SECONDS, victims)

    @staticmethod
    def _split(nodes: Sequence[str], ids: list[int], wanted: set[int], messages: dict[int, str]) -> dict[str, str]:
        if not wanted:
            return {}
        selected = map(wanted.__contains__, ids)
        texts = {messages[k] for k in wanted}
        if len(texts) == 1:  # messages are categorical: often one text for all these kinds of node
            return dict.fromkeys(compress(nodes, selected), texts.pop())
        return dict(compress(zip(nodes, map(messages.__getitem__, ids), strict=True), selected))

    def prioritize(self, info: PodInfo, names: Sequence[str]) -> tuple[Sequence[str], list[int], Decision]:
        """The nodes and their scores (0..10, parallel lists), and the decision behind them."""
        d = self.decide(info, names)
        if d.kind == "pass_through":
            return names, [NEUTRAL_SCORE] * len(names), d
        if d.priorities is not None:
            return names, list(d.priorities), d
        return d.names, ranked(d.names, d.outcomes, d.kinds, self.ledger.fabric.now().order), d

    def _group_decision(self, info: PodInfo, req: PodRequest, names: Sequence[str]) -> Decision:
        slot = self.groups.slot_for(info, req, names)
        if isinstance(slot, GroupWaiting):
            o = _outcome(Reason.GROUP_WAITING, slot.message)
            return Decision("group_waiting", names, [o] * len(names), request=req)
        if isinstance(slot, GroupFailure):
            o = _outcome(Reason.GROUP_NO_PLAN, slot.message)
            return Decision("group_failed", names, [o] * len(names), request=req)
        here = (
            slot.assignment.outcome
            if slot.assignment is not None
            else Outcome(code=Code.SUCCESS, gpus=tuple(sorted(slot.gpus)), score=1.0)
        )
        elsewhere = _outcome(Reason.GROUP_PLANNED_ELSEWHERE)
        near: frozenset[str] = frozenset()
        if req.gpus == 0 and not slot.pinned:
            # No GPU holds a member without GPUs to its planned node, whose CPU, memory or taints only
            # kube-scheduler's own filters judge: the nodes under the same narrowest switch pass too,
            # ranked below it (the binder places it on whichever of them kube-scheduler picks).
            home, *states = self.ledger.states([slot.node, *names])
            near = frozenset(n.name for n in beside(home, states, self.ledger.tiers) if evaluate_node(n, req).fits)
        outcomes = [here if n == slot.node else _BESIDE if n in near else elsewhere for n in names]
        priorities = [MAX_EXTENDER_SCORE if n == slot.node else 0 for n in names]
        return Decision("group_planned", names, outcomes, priorities, request=req)

    # ------------------------------------------------------------------ bind

    def bind(self, namespace: str, name: str, uid: str, node: str) -> str:
        """Bind the pod; returns '' on success or the error text for the Error field."""
        return self.binder.bind(namespace, name, uid, node)

    # ------------------------------------------------------------------ preempt

    def preempt(self, args: ExtenderPreemptionArgs) -> dict[str, MetaVictims]:
        """Per candidate node, the victims that free a GPU set the pod can take (the fewest, then the
        lowest priorities, groups whole: `gputopo.engine.cluster.preempt`); nodes where none does are dropped.

        Victims' GPUs are what their node reports under their UID, else their placement; priorities
        and group membership come from the cache. Group members and plain pods get the candidates
        back unchanged: their placement is not decided node by node."""
        candidates = args.meta_victims()
        info = pod_info(args.pod)
        if not (is_gputopo_pod(info.annotations) or info.block):
            return candidates
        ledger = self.ledger
        try:
            req = parse_pod_request(info.annotations, info.gpus, ledger.tier_names, block=info.block)
        except AnnotationError:
            return {}
        if req.is_group:
            return candidates
        out: dict[str, MetaVictims] = {}
        now = ledger.clock()
        for node, offer in candidates.items():
            with ledger.lock:
                if ledger.resolve(node, now).problem is not None:
                    continue  # stale or missing topology: no victim helps
                state = ledger.node_for(node, without_pod=info.uid or info.ref)
                victims, members = self._victims(node, offer)
                unattributed = ledger.nodes[node].report.other
            choice = choose_victims(
                state,
                req,
                victims,
                pdb_violations=offer.num_pdb_violations,
                group_members=members,
                unattributed=unattributed,
                weights=ledger.weights,
            )
            if choice is None:
                continue
            if choice.unchanged:
                out[node] = offer
            else:
                out[node] = MetaVictims(
                    pods=[MetaPod(uid=u) for u in choice.victims], num_pdb_violations=choice.pdb_violations
                )
        self._remember_preemption(info, out)
        return out

    def _victims(self, node: str, offer: MetaVictims) -> tuple[list[Victim], dict[GroupKey, frozenset[str]]]:
        """The offered pods as the engine sees them, and the active members of each of their groups.
        Called under the ledger's lock."""
        ledger = self.ledger
        victims: list[Victim] = []
        members: dict[GroupKey, frozenset[str]] = {}
        for p in offer.pods:
            rec = ledger.pods.get(p.uid)
            group: GroupKey | None = (rec.namespace, rec.group) if rec is not None and rec.group else None
            if group is not None and group not in members:
                members[group] = frozenset(m.uid for m in ledger.group_members(group))
            victims.append(
                Victim(
                    uid=p.uid,
                    gpus=ledger.pod_gpus(node, p.uid),
                    priority=rec.priority if rec is not None else 0,
                    group=group,
                )
            )
        return victims, members
