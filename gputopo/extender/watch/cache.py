"""The informers' side of the cache: each watched kind's objects (a full list, or one watch event) handed to
the handler the cache registered for that kind (one per kind of `gputopo.kube.kinds.WATCHED`, refused for
any other), which turns them into records for the ledger, which holds the state (`gputopo/extender/state/ledger.py`).
Nodes, Pods and Leases are read here; Jobs and PodGroups (the facts inference reads, and re-inference) in
`controllerfacts`; ResourceSlices and ResourceClaims, merged into the nodes' in-use GPUs, in `dramerge`;
JobSets (which exist, by UID) in `jobsets` and ResourceQuotas (each namespace's room for GPUs) in `quotas`,
what a hold for pods not created yet reads; which kinds have listed (readiness) in `Readiness`.

An error while handling one object is contained to that object: a Node whose name is readable but
whose contents are not stays in the cache as unschedulable for gputopo, with the reason; any other
unreadable object is skipped with a log line and counted by kind (`on_bad_object`, the
`gputopo_extender_bad_objects_total` counter), and the informer moves on. After bulk loads the cache
calls `gc.freeze()` so the cyclic GC does not walk thousands of long-lived node objects mid-request.
"""

from __future__ import annotations

import gc
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol, Unpack

from gputopo.engine.state.reasons import Reason
from gputopo.engine.state.snapshot import NodeState
from gputopo.extender.state.leadership import Leadership, LeaseHold
from gputopo.extender.state.ledger import Ledger, LedgerOptions
from gputopo.extender.state.records import BadObject, NodeFacts, PodRecord, object_name, short
from gputopo.extender.watch.computedomains import ChannelTemplates, ComputeDomainSizes, Key
from gputopo.extender.watch.controllerfacts import Controllers
from gputopo.extender.watch.dramerge import DraMerge
from gputopo.extender.watch.handlers import KindHandler, each_readable
from gputopo.extender.watch.jobsets import JobSets
from gputopo.extender.watch.parsers import leader_lease, lease_renewal, node_facts, pod_key, pod_record
from gputopo.extender.watch.quotas import Quotas
from gputopo.extender.watch.source import JSON, Kind
from gputopo.extender.watch.templateasks import TemplateAsks
from gputopo.kube import KIND_NAMES, LEASES, NODES, PODS, watched
from gputopo.model import DEFAULT_NAMESPACE, ControllerFacts, GpusInUse

log = logging.getLogger("gputopo.extender.watch.cache")


def _freeze() -> None:
    """Move everything alive now out of the cyclic GC's reach: thousands of long-lived node states and
    topology documents otherwise make every full collection cost tens of milliseconds mid-request.
    Frozen objects are still freed by reference counting when the cache drops them."""
    gc.collect()
    gc.freeze()


class PodHook(Protocol):
    """Told of every pod the informer hands over (the claim templates' keeper,
    gputopo/extender/webhook/claimtemplates.py)."""

    def pods_replaced(self, items: Iterable[Any]) -> None: ...

    def pod_changed(self, obj: Any, *, deleted: bool = False) -> None: ...


def check_handlers(handlers: Mapping[Kind, KindHandler]) -> dict[Kind, KindHandler]:
    """`handlers` when they are exactly one per watched kind; ValueError naming what is undeclared or missing."""
    undeclared = sorted(set(handlers) - set(KIND_NAMES))
    missing = [k for k in KIND_NAMES if k not in handlers]
    if undeclared or missing:
        raise ValueError(f"cache handlers: undeclared kinds {undeclared}, watched kinds without one {missing}")
    return dict(handlers)


class Readiness:
    """Which kinds have listed, and when the API server was last heard from (or a static cluster)."""

    NEEDED = frozenset({NODES.name, PODS.name, LEASES.name})  # what a filter cannot answer without

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.static = False
        self.listed: set[Kind] = set()
        self.last_heard = 0.0

    @property
    def ready(self) -> bool:
        return self.static or self.listed >= self.NEEDED

    def age_seconds(self) -> float:
        if self.static:
            return 0.0
        return max(0.0, self.clock() - self.last_heard) if self.last_heard else math.inf

    def heard(self) -> None:
        self.last_heard = self.clock()


class ClusterCache:
    """The informers' handler (`replace`/`apply`, dispatched to the kind's registered `KindHandler`), or a
    static cluster (`load_static`), over one ledger."""

    def __init__(
        self,
        *,
        lease_namespace: str = DEFAULT_NAMESPACE,
        leader_lease: str = "",
        leader_identity: str = "",
        **options: Unpack[LedgerOptions],
    ) -> None:
        self.ledger = Ledger(**options)
        self.clock = self.ledger.clock
        self.lease_namespace = lease_namespace
        # kube-scheduler's leader election Lease (in lease_namespace, beside the agents'): whether this replica leads
        self.leadership = Leadership(leader_lease, leader_identity, self.clock)
        self.readiness = Readiness(self.clock)
        self.on_bad_object: Callable[[Kind, str], None] | None = None
        self.pod_hook: PodHook | None = None  # sees the pods as the API server holds them, nothing else
        self.controllers = Controllers(self.ledger, self._bad)
        self.dra = DraMerge(self.ledger, self._bad)
        self.compute_domain_sizes = ComputeDomainSizes(self._bad)
        self.jobsets = JobSets(self.ledger, self._bad)
        self.quotas = Quotas(self._bad)
        self.asks = self.controllers.asks = TemplateAsks()
        self.claims = self.controllers.claims = self.dra.read_claims
        self.dra.on_claims = self._claims_changed
        self.channels = self.controllers.channels = ChannelTemplates(
            self._bad, self._templates_changed, owners=self.compute_domain_sizes, asks=self.asks
        )
        self.handlers = check_handlers(
            {
                NODES.name: KindHandler(self._replace_nodes, self._apply_node),
                PODS.name: KindHandler(self._replace_pods, self._apply_pod),
                LEASES.name: KindHandler(self._replace_leases, self._apply_lease),
                **self.controllers.handlers(),
                **self.dra.handlers(),
                **self.channels.handlers(),
                **self.compute_domain_sizes.handlers(),
                **self.jobsets.handlers(),
                **self.quotas.handlers(),
            }
        )

    @property
    def nodes(self) -> dict[str, Any]:
        return self.ledger.nodes

    # ------------------------------------------------------------------ readiness

    @property
    def synced(self) -> set[Kind]:
        """The kinds listed at least once."""
        return self.readiness.listed

    @property
    def ready(self) -> bool:
        return self.readiness.ready

    def age_seconds(self) -> float:
        return self.readiness.age_seconds()

    def heard_from_api(self) -> None:
        self.readiness.heard()

    def load_static(self, states: Iterable[NodeState]) -> None:
        self.readiness.static = True
        self.channels.listed = True  # a static cluster has no templates to wait for
        self.jobsets.listed = self.quotas.listed = True  # nor JobSets nor quotas
        for st in states:
            self.ledger.put_static(st)
        _freeze()

    # ------------------------------------------------------------------ informer handler

    def facts(self, namespace: str) -> ControllerFacts:
        """The controller objects of `namespace` that inference reads (sizes of Jobs, JobSets, PodGroups)."""
        return self.controllers.facts(namespace)

    def not_served(self, kind: Kind) -> None:
        self.handlers[watched(kind).name].not_served()

    def replace(self, kind: Kind, items: list[JSON]) -> None:
        self.handlers[watched(kind).name].replace(items)
        self.readiness.listed.add(kind)
        _freeze()

    def apply(self, kind: Kind, event_type: str, obj: JSON) -> None:
        handler = self.handlers[watched(kind).name]
        try:
            handler.apply(event_type, obj)
        except Exception as e:
            self._bad(kind, obj, e)

    def _bad(self, kind: Kind, obj: Any, error: Exception) -> None:
        """One object could not be handled: log it, count it, move on."""
        try:
            name = object_name(obj)
        except BadObject:
            name = "?"
        reason = short(str(error) if isinstance(error, BadObject) else f"{type(error).__name__}: {error}")
        log.warning("skipped an unreadable object", extra={"kind": kind, "object": short(name, 80), "error": reason})
        if self.on_bad_object is not None:
            self.on_bad_object(kind, reason)

    # ------------------------------------------------------------------ nodes

    def _facts(self, obj: Any) -> NodeFacts:
        """A Node's facts; an unexpected failure past its name still keeps the node, as unreadable."""
        name = object_name(obj)
        try:
            facts = node_facts(obj, self.ledger.nodes.get(name))
        except Exception as e:
            detail = short(f"node object: {type(e).__name__}: {e}")
            facts = NodeFacts(name, {}, None, "", Reason.TOPOLOGY_INVALID, detail, GpusInUse(), True)
        if facts.malformed:
            self._bad(NODES.name, obj, BadObject(facts.detail))
        return facts

    def _replace_nodes(self, items: list[JSON]) -> None:
        names = set()
        for _, facts in each_readable(NODES.name, items, self._facts, self._bad):
            self.dra.put_node(facts)
            names.add(facts.name)
        self.dra.drop_nodes(set(self.ledger.nodes) - names)

    def _apply_node(self, event_type: str, obj: JSON) -> None:
        if event_type == "DELETED":
            self.dra.drop_nodes([object_name(obj)])
        else:
            self.dra.put_node(self._facts(obj))

    # ------------------------------------------------------------------ pods

    def _replace_pods(self, items: list[JSON]) -> None:
        records: dict[str, PodRecord] = {}
        for _, rec in each_readable(PODS.name, items, self._pod_record, self._bad):
            if rec is not None:
                records[rec.uid] = rec
        self.ledger.replace_pods(records)
        self.dra.pods_replaced()
        if self.pod_hook is not None:
            self.pod_hook.pods_replaced(items)

    def _apply_pod(self, event_type: str, obj: JSON) -> None:
        self.upsert_pod(obj, deleted=event_type == "DELETED")
        if self.pod_hook is not None:
            self.pod_hook.pod_changed(obj, deleted=event_type == "DELETED")

    def _pod_record(self, obj: JSON) -> PodRecord | None:
        facts, scheduler = self.controllers.facts_for(obj), self.ledger.scheduler_name
        return pod_record(
            obj,
            self.ledger.tier_names,
            facts,
            scheduler=scheduler,
            channels=self.channels,
            asks=self.asks,
            claims=self.claims,
        )

    def _templates_changed(self, keys: set[Key] | None) -> None:
        """Read again the pods that name a template whose answer changed (None: every one naming one)."""
        self._read_again_naming(keys, lambda r: r.claim_templates)

    def _claims_changed(self, keys: set[Key] | None) -> None:
        """Read again the pods that name a pre-made claim whose ask or allocation changed (None: any)."""
        self._read_again_naming(keys, lambda r: r.named_claims)

    def _read_again_naming(self, keys: set[Key] | None, names: Callable[[PodRecord], tuple[str, ...]]) -> None:
        """Read again the pods whose `names` include one of `keys` in their namespace (None: any name)."""
        with self.ledger.lock:
            stale = [
                r
                for r in self.ledger.pods.values()
                if (named := names(r)) and (keys is None or any((r.namespace, n) in keys for n in named))
            ]
        self.controllers.read_again(stale)

    def upsert_pod(self, obj: JSON, *, deleted: bool = False) -> PodRecord | None:
        """Apply a pod object (from a watch, or one the extender built after its own bind). A pending
        pod without a placement changes no node, so most pod events leave the generation alone."""
        uid = pod_key(obj)
        rec = None if deleted else self._pod_record(obj)
        self.ledger.put_pod(uid, rec)
        self.dra.pod_changed(uid)  # its claims count as its own only while the ledger holds it
        return rec

    def forget_pod(self, obj: JSON) -> None:
        """Drop a pod, the claims reserved for it and the GPUs its node reports for it: the cluster as if
        it had never run (what-if views such as `gputopo explain`; the live cache keeps reported GPUs
        until the node stops reporting them)."""
        uid = pod_key(obj)
        self.dra.forget_pod(uid)  # first: once the pod is gone its claims' GPUs count under `other`
        self.upsert_pod(obj, deleted=True)
        self.ledger.forget_reported(uid)

    # ------------------------------------------------------------------ leases

    def _replace_leases(self, items: list[JSON]) -> None:
        held = (self._leader(obj) for obj in items)
        self.leadership.put(next((h for h in held if h is not None), None))
        leases: dict[str, float] = {}
        for _, found in each_readable(LEASES.name, items, self._lease, self._bad):
            if found is not None and found[1] is not None:
                leases[found[0]] = found[1]
        self.ledger.replace_leases(leases)

    def _apply_lease(self, event_type: str, obj: JSON) -> None:
        hold = self._leader(obj)
        if hold is not None:
            self.leadership.put(None if event_type == "DELETED" else hold)
            return
        found = self._lease(obj)
        if found is not None:
            self.ledger.put_lease(found[0], None if event_type == "DELETED" else found[1])

    def _lease(self, obj: JSON) -> tuple[str, float | None] | None:
        return lease_renewal(obj, self.lease_namespace)

    def _leader(self, obj: JSON) -> LeaseHold | None:
        """The leader Lease's hold, None for any other Lease (or one without a readable name: the agents'
        reading counts it)."""
        try:
            return leader_lease(obj, self.leadership.lease, self.lease_namespace)
        except BadObject:
            return None
