"""Bind: re-evaluate the pod on the node against the ledger, then ONE API call, a Binding whose
annotations carry `gputopo.io/placement` (the API server copies a Binding's annotations onto the pod
as it sets spec.nodeName). The TopologyPlacement Event follows off the critical path. Under DRA the
placement names the GPUs the pod's claims hold; a claim the cache has not yet seen allocated is read
first (`claimed_gpus`: kube-scheduler wrote the allocation moments before this call).

The re-evaluation applies every rule the filter applied, read again now: the GPUs' fit, the ComputeDomain
rules on the node (`rules`, the service's: a tray relabelled for another ComputeDomain between filter and bind
is refused), and for a member of a planned group its plan's node, tier set and NVLink domain cap.

Safe only with one writer: the extender runs as a sidecar of the single leader kube-scheduler, and
binds to one node are serialised in this process. Between choosing the GPUs and the Binding's answer
the ledger holds them as an in-flight claim, so concurrent filters and binds already see them taken.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from gputopo.engine.cluster.explain import (
    Seat,
    packing_clause,
    placement_estimate,
    placement_sentence,
    tp_placement,
    why_lost,
)
from gputopo.engine.gang.plan import GroupPlan
from gputopo.engine.gang.rack import LABEL_DOMAIN_CAP, domain_cap
from gputopo.engine.gang.replan import Slot
from gputopo.engine.gang.tiersets import set_words
from gputopo.engine.gang.tpgroups import DOMAIN
from gputopo.engine.node.placement import NodeVerdict, Outcome, evaluate_node, outcome_on
from gputopo.engine.state.cliques import mask_of
from gputopo.engine.state.scoring import grade
from gputopo.engine.state.snapshot import NodeState
from gputopo.extender.state.ledger import Ledger
from gputopo.extender.state.locks import StripedLocks
from gputopo.extender.state.records import AskReader, ChannelReader, ClaimReader, no_asks, no_channels, no_claims
from gputopo.extender.verbs.events import EventPoster
from gputopo.extender.watch.parsers import Resolved, record_of, resolve_pod
from gputopo.extender.watch.source import JSON, ClusterSource
from gputopo.extender.wire import PodInfo, pod_info
from gputopo.kube import KubeError
from gputopo.model import (
    NO_FACTS,
    PLACEMENT_ANNOTATION,
    ControllerFacts,
    Placement,
    PodRequest,
    RunnerUp,
    is_gputopo_pod,
)
from gputopo.model.dra import ClaimInfo, DraObjectError, parse_claim
from gputopo.model.k8snames import InvalidName, check_name, check_namespace

log = logging.getLogger("gputopo.extender")


def bound_info(info: PodInfo, node: str, placement: Placement) -> PodInfo:
    """The pod as the API server holds it after our Binding: bound, with the placement annotation, and
    everything else it had (its labels, scheduler and PodGroup: a member whose group its controller's
    labels give stays a member once bound)."""
    return dataclasses.replace(
        info, node_name=node, annotations={**info.annotations, PLACEMENT_ANNOTATION: placement.to_annotation()}
    )


class Binder:
    def __init__(
        self,
        ledger: Ledger,
        source: Callable[[], ClusterSource | None],
        events: EventPoster,
        facts: Callable[[str], ControllerFacts] = lambda _namespace: NO_FACTS,
        recall: Callable[[str, str], PodInfo | None] = lambda _uid, _ref: None,
        allocated: Callable[[str, str], ClaimInfo | None] = lambda _ns, _name: None,
    ) -> None:
        self.ledger = ledger
        self.facts = facts  # a namespace's controller objects, as the cache reads pods with them
        self._source = source
        self.events = events
        self.recall = recall  # the pod as its filter carried it moments ago (by uid, else namespace/name)
        self.allocated = allocated  # a ResourceClaim as the cache last saw it allocated with our GPUs
        self.locks = StripedLocks()
        self.channels: ChannelReader = no_channels  # which ComputeDomain a pod's claims join (the cache's)
        self.asks: AskReader = no_asks  # what its hand-written claim templates ask (the cache's)
        self.claims: ClaimReader = no_claims  # what the pre-made claims it names ask (the cache's)
        # The ComputeDomain rules on one node as the filter applies them (the service's); none by default.
        self.rules: Callable[[PodRequest, str, Outcome], Outcome] = lambda _req, _node, outcome: outcome
        self._caps: tuple[int, dict[str, int | None]] = (-1, {})  # (ledger.where_version, domain -> its cap)

    def bind(self, namespace: str, name: str, uid: str, node: str) -> str:
        """Bind the pod; returns '' on success or the error text for the Error field."""
        try:  # before any request: these go into the API paths of the pod's GET and Binding
            check_namespace(namespace, "the bind's pod namespace")
            check_name(name, "the bind's pod name")
            check_name(node, "the bind's node")
        except InvalidName as e:
            return f"bind refused: {e}"
        source = self._source()
        ref = f"{namespace}/{name}"
        info = self.recall(uid, ref)
        if source is None and (info is None or not self._ours(info)):
            return ""  # snapshot mode has no API to bind through; nothing to account for
        if source is not None and info is None:
            try:
                info = pod_info(source.get_pod(namespace, name))
            except KubeError as e:
                return f"cannot read pod {ref}: {e}"
            if uid and info.uid and info.uid != uid:
                return f"pod {ref} has uid {info.uid}, the scheduler asked to bind uid {uid}"
            if info.node_name == node:
                return ""  # already bound there: a retried bind succeeds
            if info.node_name:
                return f"pod {ref} is already bound to node {info.node_name}"
        assert info is not None
        pid = info.uid or info.ref
        existing = self.ledger.pods.get(pid)
        if existing is not None and existing.node_name == node:
            return ""  # bound there already (by us, moments ago): a retried bind succeeds
        # (a recalled pod that was bound meanwhile is caught by the Binding's 409 below)
        if not self._ours(info):
            assert source is not None
            return self._post_binding(source, info, node, None)[0]
        # Under DRA kube-scheduler wrote the claims' allocation (PreBind) just before this call; the
        # placement names those GPUs, read outside the node's lock.
        held = self.claimed_gpus(source, info, node) if source is not None and info.claim_names else None
        with self.locks(node):  # choosing and claiming is atomic per node in this process
            chosen = self.placement_for(info, node, held)
            if isinstance(chosen, str):
                return chosen
            placement, req = chosen
            self.ledger.claim(pid, node, frozenset(placement.gpus))
        try:
            bound = bound_info(info, node, placement)
            if source is not None:
                err, already = self._post_binding(source, info, node, placement)
                if err:
                    return err
                if already is not None:
                    bound = pod_info(already)  # bound by an earlier try of ours: its placement holds
            self.ledger.put_pod(
                pid,
                record_of(
                    bound,
                    self.ledger.tier_names,
                    self.facts(info.namespace),
                    scheduler=self.ledger.scheduler_name,
                    channels=self.channels,
                    asks=self.asks,
                    claims=self.claims,
                ),
            )
        finally:
            self.ledger.unclaim(pid, node)
        if req.group:
            self.ledger.pin((namespace, req.group), name)
        if source is not None:
            self.events.placed(info.namespace, info.name, info.uid, placement.reason)
        log.info(
            "bound" if source is not None else "bound (snapshot mode: recorded in memory only)",
            extra={
                "pod": ref,
                "node": node,
                "gpus": list(placement.gpus),
                "score": placement.score,
                "reason": placement.reason,
            },
        )
        return ""

    def _ours(self, info: PodInfo) -> bool:
        """A gputopo pod: annotated, or a member of a group its controller's labels give; never one an
        allocated pre-made claim already holds to its node (the filter passed it through)."""
        annotated = is_gputopo_pod(info.annotations)
        resolved = self._resolve(info) if info.named_claims or not annotated else None
        if resolved is not None and resolved.pinned:
            log.info("bound where its allocated claim is", extra={"pod": info.ref, "reason": resolved.problem})
            return False
        return annotated or (resolved is not None and resolved.opted_in)

    def _resolve(self, info: PodInfo) -> Resolved:
        return resolve_pod(
            info,
            self.ledger.tier_names,
            scheduler=info.scheduler_name,
            channels=self.channels,
            asks=self.asks,
            claims=self.claims,
        )

    def claimed_gpus(self, source: ClusterSource, info: PodInfo, node: str) -> frozenset[int] | None:
        """Our GPUs on `node` that the pod's ResourceClaims hold now, or None when a claim cannot be read
        (then the cache's view stands). The cache's copy of a claim serves when it already shows the
        allocation, reserved for this pod, on this node; otherwise the claim is read from the API server:
        the watch may not yet have brought the allocation kube-scheduler wrote moments ago, and a
        placement read off such a cache named the extender's own choice instead of the pod's GPUs."""
        gpus: set[int] = set()
        for name in info.claim_names:
            claim = self.allocated(info.namespace, name)
            if claim is None or claim.pool != node or info.uid not in claim.reserved_for:
                try:
                    claim = parse_claim(source.get_resource_claim(info.namespace, name))
                except (KubeError, DraObjectError) as e:
                    log.warning("cannot read a claim at bind", extra={"pod": info.ref, "claim": name, "error": str(e)})
                    return None
            if claim.pool == node:
                gpus |= claim.gpus
        return frozenset(gpus)

    def placement_for(
        self, info: PodInfo, node: str, held: frozenset[int] | None = None
    ) -> tuple[Placement, PodRequest] | str:
        """The placement this pod gets on `node` now, or why it cannot have one. `held`: the GPUs its
        DRA claims hold there (None: as the cache reports them)."""
        # As the filter read it: a controller's labels make a group (the cache's record has the sizes its
        # Jobs give; without a record, what the labels alone give).
        rec = self.ledger.pods.get(info.uid) if info.uid else None
        if rec is not None and rec.inferred is not None and rec.request is not None:
            req = rec.request
        else:
            resolved = self._resolve(info)
            if resolved.request is None:
                return resolved.problem or f"pod {info.ref} is no gputopo pod"
            req = resolved.request
        placement, _ = self.choose(info, req, node, held)
        return placement if isinstance(placement, str) else (placement, req)

    def choose(
        self, info: PodInfo, req: PodRequest, node: str, held: frozenset[int] | None = None
    ) -> tuple[Placement | str, Outcome | None]:
        """Re-evaluate the pod on `node` against the ledger now; the Placement to write, or an error.
        `held`: the GPUs the pod's DRA claims hold on `node` (None: what the cache reports for it)."""
        ledger = self.ledger
        res = ledger.reservations.get((info.namespace, req.group)) if req.group else None
        slot_key = ((info.namespace, req.group), info.name) if req.group else None
        state = ledger.node_for(node, without_pod=info.uid or info.ref, without_slot=slot_key)
        outcome = self.rules(req, node, evaluate_node(state, req, ledger.weights))
        if not outcome.fits:
            return f"node {node} no longer fits pod {info.ref}: {outcome.message}", outcome
        slot = res.slots.get(info.name) if res is not None else None
        stale = self._plan_changed(req, node, state, res.plan if res is not None else None, slot)
        if stale:
            return f"node {node} no longer fits pod {info.ref}: {stale}", outcome
        if held is None:
            held = ledger.nodes[node].report.pods.get(info.uid) if info.uid and node in ledger.nodes else None
        allocated: tuple[int, ...] = ()
        if held:
            # The GPUs the pod already holds there: under DRA, kube-scheduler allocated its claims before
            # this bind. The placement names them always (they are what the pod got), scored and explained
            # as gputopo's own choice when they are an admissible one.
            actual = outcome_on(state, req, outcome, mask_of(sorted(held)), ledger.weights)
            if actual is not None:
                outcome = actual
            else:
                allocated = tuple(sorted(held))
        elif slot is not None and slot.node == node and slot.gpus:
            # The group plan chose this member's GPUs (rail-aligned with the other members); bind those
            # when they are still an admissible choice here, not the node's default set.
            planned = outcome_on(state, req, outcome, mask_of(slot.gpus), ledger.weights)
            if planned is not None:
                outcome = planned
        runner = self._runner_up(node, req)
        plan = res.plan if res is not None else None
        fill = packing_clause(state, outcome, runner, ledger.fabric.now().free, ledger.tiers) if plan is None else ""
        rec = ledger.pods.get(info.uid) if info.uid else None
        inferred = rec.inferred if rec is not None else None
        origin = inferred.words() if inferred is not None and inferred.group == req.group else ""
        # `at`: a member without GPUs may be bound beside its planned node, under the same switch.
        seat = Seat(plan, info.name, origin, state) if plan is not None else None
        sentence = placement_sentence(node, outcome, runner, seat, ledger.weights, ledger.tiers, packing=fill)
        stage = req.stage
        if res is not None and info.name in res.slots:
            stage = res.slots[info.name].stage
        if allocated:
            sentence = (
                f"GPUs {list(allocated)}: what kube-scheduler's DRA allocation gave the pod's claims, not "
                f"an admissible choice of gputopo's here (it would have chosen {list(outcome.gpus)}). {sentence}"
            )
        placement = Placement(
            node=node,
            gpus=allocated or tuple(outcome.gpus),
            score=grade(outcome.score),
            reason=sentence,
            runner_up=RunnerUp(
                node=runner.name,
                score=grade(runner.outcome.score),
                why=why_lost(outcome, runner.outcome, ledger.weights, packing=fill),
            )
            if runner is not None
            else None,
            group=req.group,
            stage=stage,
            estimate=placement_estimate(outcome, runner, plan, info.name, ledger.tiers),
            tp=tp_placement(plan, info.name) if plan is not None else None,
        )
        return placement, outcome

    def _plan_changed(
        self, req: PodRequest, node: str, state: NodeState, plan: GroupPlan | None, slot: Slot | None
    ) -> str:
        """Why the group's plan no longer holds for this member on `node` ('' when it does): a member with
        GPUs goes to its slot's node; the node is still in the tier set the plan was made in; its NVLink
        domain's cap, read from the trays' labels now, still covers the trays the plan takes there."""
        if slot is not None and req.gpus > 0 and slot.node != node:
            return f"the group {req.group} planned this member on node {slot.node}"
        if plan is None or not plan.assignments:
            return ""
        planned = plan.assignments[0].node.tier_set
        if state.tier_set != planned:
            return (
                f"it is now in {set_words(state.tier_set)}; the group {req.group} was planned in {set_words(planned)}"
            )
        domain = state.location.get(DOMAIN)
        if plan.split is None or domain is None:
            return ""
        cap = self._cap_of(domain)
        taken = {a.node.name for a in plan.assignments if a.node.location.get(DOMAIN) == domain}
        if cap is not None and len(taken) > cap:
            return (
                f"NVLink domain {domain}'s cap is now {cap} trays ({LABEL_DOMAIN_CAP} or the nvlink-domain "
                f"tier's groupCap); the group {req.group}'s plan takes {len(taken)} there"
            )
        return ""

    def _cap_of(self, domain: str) -> int | None:
        """The NVLink domain's cap from its trays' labels now; one pass over the nodes per change of any
        node's labels or topology, not per bind (a gang's binds read it hundreds of times)."""
        ledger = self.ledger
        version, caps = self._caps
        if version != ledger.where_version:
            version, caps = ledger.where_version, {}
            self._caps = (version, caps)
        if domain not in caps:
            trays = [s for s in ledger.states() if s.location.get(DOMAIN) == domain]
            caps[domain] = domain_cap(trays, ledger.tiers)
        return caps[domain]

    def _runner_up(self, node: str, req: PodRequest) -> NodeVerdict | None:
        """The best other feasible node over every cached node (`Ledger.runner_up`: read kind by kind, no
        pass over every node on every bind)."""
        found = self.ledger.runner_up(node, req)
        return NodeVerdict(*found) if found is not None else None

    def _post_binding(
        self, source: ClusterSource, info: PodInfo, node: str, placement: Placement | None
    ) -> tuple[str, JSON | None]:
        """'' or the error; on a 409 for a pod already bound to `node`, the pod as the API holds it."""
        annotations = {PLACEMENT_ANNOTATION: placement.to_annotation()} if placement is not None else None
        try:
            source.create_binding(info.namespace, info.name, info.uid, node, annotations=annotations)
        except KubeError as e:
            if e.status == 409:
                try:
                    pod = source.get_pod(info.namespace, info.name)
                    if pod_info(pod).node_name == node:
                        return "", pod  # someone (a retry of ours) already bound it there
                except KubeError:
                    pass
            return f"binding pod {info.ref} to node {node} failed: {e}", None
        return "", None
