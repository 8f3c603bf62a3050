"""The informers' side of the cache: Node, Pod and Lease objects (a full list, or one watch event) turned
into records and handed to the ledger, which holds the state (`gputopo/extender/ledger.py`). On DRA nodes the
GPUs our ResourceClaims hold (per pod they are reserved for) join the agent's gpus-in-use report, so
the ledger, the filter and the mismatch check read DRA's allocations as they read the device plugin's.

An error while handling one object is contained to that object: a Node whose name is readable but
whose contents are not stays in the cache as unschedulable for gputopo, with the reason; any other
unreadable object is skipped with a log line and counted by kind (`on_bad_object`, the
`gputopo_extender_bad_objects_total` counter), and the informer moves on. After bulk loads the cache
calls `gc.freeze()` so the cyclic GC does not walk thousands of long-lived node objects mid-request.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import math
from collections.abc import Callable, Iterable
from typing import Any, Protocol, Unpack

from gputopo.engine.reasons import Reason
from gputopo.engine.snapshot import NodeState
from gputopo.extender.kube import JSON, Kind
from gputopo.extender.ledger import Ledger, LedgerOptions
from gputopo.extender.objects import (
    BadObject,
    NodeFacts,
    PodRecord,
    job_shape,
    lease_renewal,
    node_facts,
    object_name,
    pod_key,
    pod_record,
    podgroup_of,
    record_of,
    short,
)
from gputopo.extender.wire import PodInfo
from gputopo.model import DEFAULT_NAMESPACE, ControllerFacts, GpusInUse, JobShape
from gputopo.model.dra import ClaimInfo, SliceInfo, in_use_by_node, parse_claim, parse_slice
from gputopo.model.jobs import PodGroupShape

log = logging.getLogger("gputopo.extender.cache")


def _freeze() -> None:
    """Move everything alive now out of the cyclic GC's reach: thousands of long-lived node states and
    topology documents otherwise make every full collection cost tens of milliseconds mid-request.
    Frozen objects are still freed by reference counting when the cache drops them."""
    gc.collect()
    gc.freeze()


class PodHook(Protocol):
    """Told of every pod the informer hands over (the claim templates' keeper, gputopo/extender/claimtemplates.py)."""

    def pods_replaced(self, items: Iterable[Any]) -> None: ...

    def pod_changed(self, obj: Any, *, deleted: bool = False) -> None: ...


class ClusterCache:
    """The informers' handler (`replace`/`apply`), or a static cluster (`load_static`), over one ledger."""

    def __init__(self, *, lease_namespace: str = DEFAULT_NAMESPACE, **options: Unpack[LedgerOptions]) -> None:
        self.ledger = Ledger(**options)
        self.clock = self.ledger.clock
        self.lease_namespace = lease_namespace
        self.static = False
        self.synced: set[Kind] = set()
        self.last_heard = 0.0
        self.on_bad_object: Callable[[Kind, str], None] | None = None
        self.pod_hook: PodHook | None = None  # sees the pods as the API server holds them, nothing else
        # batch/v1 Jobs by namespace and name (with the JobSet each belongs to): the sizes that pod
        # labels do not carry (gputopo.model.jobs). Replaced whole per namespace, never mutated.
        self._jobs: dict[str, dict[str, tuple[JobShape, str | None]]] = {}
        # scheduling.k8s.io PodGroups by namespace and name: native gangs (size, required tier).
        self._podgroups: dict[str, dict[str, PodGroupShape]] = {}
        self._controller_facts: dict[str, ControllerFacts] = {}
        # DRA: our ResourceSlices (by name) and the ResourceClaims holding our GPUs (by uid). On a DRA
        # node they, not the agent's gpus-in-use, say which GPUs are taken; `_node_facts` keeps what
        # each Node object says, so that a claim's change re-merges without the Node changing.
        self._slices: dict[str, SliceInfo] = {}
        self._claims: dict[str, ClaimInfo] = {}
        self._pool_claims: dict[str, set[str]] = {}  # pool -> uids of the claims holding its GPUs
        self._pool_slice: dict[str, SliceInfo] = {}  # pool -> its slice (rebuilt on a slice's change)
        self._dra_reports: dict[str, GpusInUse] = {}
        self._node_facts: dict[str, NodeFacts] = {}

    @property
    def nodes(self) -> dict[str, Any]:
        return self.ledger.nodes

    # ------------------------------------------------------------------ readiness

    @property
    def ready(self) -> bool:
        return self.static or self.synced >= {"nodes", "pods", "leases"}

    def age_seconds(self) -> float:
        if self.static:
            return 0.0
        return max(0.0, self.clock() - self.last_heard) if self.last_heard else math.inf

    def heard_from_api(self) -> None:
        self.last_heard = self.clock()

    def load_static(self, states: Iterable[NodeState]) -> None:
        self.static = True
        for st in states:
            self.ledger.put_static(st)
        _freeze()

    # ------------------------------------------------------------------ controller objects

    def facts(self, namespace: str) -> ControllerFacts:
        """The controller objects of `namespace` that inference reads (sizes of Jobs, JobSets, PodGroups)."""
        found = self._controller_facts.get(namespace)
        if found is None:
            found = self._controller_facts[namespace] = dataclasses.replace(
                _facts_of(self._jobs.get(namespace, {})), podgroups=self._podgroups.get(namespace, {})
            )
        return found

    def _put_jobs(self, namespace: str, jobs: dict[str, tuple[JobShape, str | None]]) -> None:
        if jobs:
            self._jobs[namespace] = jobs
        else:
            self._jobs.pop(namespace, None)
        self._controller_facts.pop(namespace, None)

    def _reinfer(self, namespaces: Iterable[str]) -> None:
        """Infer again the groups of pods whose controller's labels were read before their Job was: a
        waiting member becomes a member with a size, a Job that changed changes its members."""
        spaces = set(namespaces)
        if not spaces:
            return
        with self.ledger.lock:
            stale = [r for r in self.ledger.pods.values() if (r.job_keys or r.pod_group) and r.namespace in spaces]
        for rec in stale:
            fresh = self._record_again(rec)
            if fresh != rec:
                self.ledger.put_pod(rec.uid, fresh)

    def _record_again(self, rec: PodRecord) -> PodRecord | None:
        keys = dict(rec.job_keys)
        info = PodInfo(
            name=rec.name,
            namespace=rec.namespace,
            uid=rec.uid,
            annotations={**keys, **dict(rec.own)},
            labels=keys,
            gpus=rec.gpus,
            scheduler_name=rec.scheduler_name,
            node_name=rec.node_name,
            phase=rec.phase,
            priority=rec.priority,
            pod_group=rec.pod_group,
        )
        again = record_of(info, self.ledger.tier_names, self.facts(rec.namespace))
        return again if again is None or rec.placement is None else dataclasses.replace(again, placement=rec.placement)

    def _apply_job(self, event_type: str, obj: JSON) -> None:
        namespace, shape, jobset = job_shape(obj)
        jobs = dict(self._jobs.get(namespace, {}))
        if event_type == "DELETED":
            jobs.pop(shape.name, None)
        elif jobs.get(shape.name) == (shape, jobset):
            # A status update (the Job controller's counts, many per big Job): nothing inference reads
            # changed, so no pod of the namespace is inferred again.
            return
        else:
            jobs[shape.name] = (shape, jobset)
        self._put_jobs(namespace, jobs)
        if event_type == "DELETED":
            # The controller is gone: its group's reservation holds GPUs for pods that will not come.
            self.ledger.release((namespace, f"job/{shape.name}"))
            if jobset is not None:
                self.ledger.release((namespace, f"jobset/{jobset}"))
        self._reinfer([namespace])

    def _put_podgroups(self, namespace: str, groups: dict[str, PodGroupShape]) -> None:
        if groups:
            self._podgroups[namespace] = groups
        else:
            self._podgroups.pop(namespace, None)
        self._controller_facts.pop(namespace, None)

    def _apply_podgroup(self, event_type: str, obj: JSON) -> None:
        namespace, shape = podgroup_of(obj, self.ledger.tiers)
        groups = dict(self._podgroups.get(namespace, {}))
        if event_type == "DELETED":
            groups.pop(shape.name, None)
        elif groups.get(shape.name) == shape:
            return  # a status update (kube-scheduler's conditions): nothing inference reads changed
        else:
            groups[shape.name] = shape
        self._put_podgroups(namespace, groups)
        if event_type == "DELETED":
            # Its pods will not be scheduled as this gang any more: free what the plan held for them.
            self.ledger.release((namespace, f"podgroup/{shape.name}"))
        self._reinfer([namespace])

    # ------------------------------------------------------------------ informer handler

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

    def _facts(self, obj: Any) -> NodeFacts:
        """A Node's facts; an unexpected failure past its name still keeps the node, as unreadable."""
        name = object_name(obj)
        try:
            facts = node_facts(obj, self.ledger.nodes.get(name))
        except Exception as e:
            detail = short(f"node object: {type(e).__name__}: {e}")
            facts = NodeFacts(name, {}, None, "", Reason.TOPOLOGY_INVALID, detail, GpusInUse(), True)
        if facts.malformed:
            self._bad("nodes", obj, BadObject(facts.detail))
        return facts

    def replace(self, kind: Kind, items: list[JSON]) -> None:
        if kind == "nodes":
            names = set()
            for obj in items:
                try:
                    facts = self._facts(obj)
                except Exception as e:
                    self._bad(kind, obj, e)
                    continue
                self._put_node(facts)
                names.add(facts.name)
            self._drop_nodes(set(self.ledger.nodes) - names)
        elif kind == "pods":
            records: dict[str, PodRecord] = {}
            for obj in items:
                try:
                    rec = pod_record(obj, self.ledger.tier_names, self._facts_for(obj))
                except Exception as e:
                    self._bad(kind, obj, e)
                    continue
                if rec is not None:
                    records[rec.uid] = rec
            self.ledger.replace_pods(records)
            if self.pod_hook is not None:
                self.pod_hook.pods_replaced(items)
        elif kind == "jobs":
            by_ns: dict[str, dict[str, tuple[JobShape, str | None]]] = {}
            for obj in items:
                try:
                    namespace, shape, jobset = job_shape(obj)
                except Exception as e:
                    self._bad(kind, obj, e)
                    continue
                by_ns.setdefault(namespace, {})[shape.name] = (shape, jobset)
            touched = {ns for ns in set(self._jobs) | set(by_ns) if self._jobs.get(ns) != by_ns.get(ns)}
            for namespace in touched:
                self._put_jobs(namespace, by_ns.get(namespace, {}))
            self._reinfer(touched)
        elif kind == "podgroups":
            groups_by_ns: dict[str, dict[str, PodGroupShape]] = {}
            for obj in items:
                try:
                    namespace, pg = podgroup_of(obj, self.ledger.tiers)
                except Exception as e:
                    self._bad(kind, obj, e)
                    continue
                groups_by_ns.setdefault(namespace, {})[pg.name] = pg
            changed = {
                ns for ns in set(self._podgroups) | set(groups_by_ns) if self._podgroups.get(ns) != groups_by_ns.get(ns)
            }
            for namespace in changed:
                gone = set(self._podgroups.get(namespace, {})) - set(groups_by_ns.get(namespace, {}))
                self._put_podgroups(namespace, groups_by_ns.get(namespace, {}))
                for name in gone:
                    self.ledger.release((namespace, f"podgroup/{name}"))
            self._reinfer(changed)
        elif kind == "resourceslices":
            slices: dict[str, SliceInfo] = {}
            for obj in items:
                try:
                    ours = parse_slice(obj)
                except Exception as e:
                    self._bad(kind, obj, e)
                    continue
                if ours is not None:
                    slices[object_name(obj)] = ours
            self._slices = slices
            self._redo_dra()
        elif kind == "resourceclaims":
            claims: dict[str, ClaimInfo] = {}
            for obj in items:
                try:
                    claim = parse_claim(obj)
                except Exception as e:
                    self._bad(kind, obj, e)
                    continue
                if claim.gpus:
                    claims[claim.uid] = claim
            self._claims = claims
            self._pool_claims = {}
            for claim in claims.values():
                if claim.pool is not None:
                    self._pool_claims.setdefault(claim.pool, set()).add(claim.uid)
            self._redo_dra()
        else:
            leases: dict[str, float] = {}
            for obj in items:
                try:
                    found = lease_renewal(obj, self.lease_namespace)
                except Exception as e:
                    self._bad(kind, obj, e)
                    continue
                if found is not None and found[1] is not None:
                    leases[found[0]] = found[1]
            self.ledger.replace_leases(leases)
        self.synced.add(kind)
        _freeze()

    def apply(self, kind: Kind, event_type: str, obj: JSON) -> None:
        try:
            if kind == "nodes":
                if event_type == "DELETED":
                    self._drop_nodes([object_name(obj)])
                else:
                    self._put_node(self._facts(obj))
            elif kind == "pods":
                self.upsert_pod(obj, deleted=event_type == "DELETED")
                if self.pod_hook is not None:
                    self.pod_hook.pod_changed(obj, deleted=event_type == "DELETED")
            elif kind == "jobs":
                self._apply_job(event_type, obj)
            elif kind == "podgroups":
                self._apply_podgroup(event_type, obj)
            elif kind == "resourceslices":
                name = object_name(obj)
                ours = None if event_type == "DELETED" else parse_slice(obj)
                if ours is None:
                    self._slices.pop(name, None)
                else:
                    self._slices[name] = ours
                self._redo_dra()
            elif kind == "resourceclaims":
                claim = parse_claim(obj)
                before = self._claims.pop(claim.uid, None)
                if before is not None and before.pool is not None:
                    self._pool_claims.get(before.pool, set()).discard(claim.uid)
                if event_type != "DELETED" and claim.gpus and claim.pool is not None:
                    self._claims[claim.uid] = claim
                    self._pool_claims.setdefault(claim.pool, set()).add(claim.uid)
                # One claim changes only its pools' nodes: no walk over every claim per event.
                self._redo_dra({p for p in (before.pool if before else None, claim.pool) if p is not None})
            else:
                found = lease_renewal(obj, self.lease_namespace)
                if found is not None:
                    self.ledger.put_lease(found[0], None if event_type == "DELETED" else found[1])
        except Exception as e:
            self._bad(kind, obj, e)

    def _put_node(self, facts: NodeFacts) -> None:
        self._node_facts[facts.name] = facts
        self.ledger.put_node(self._with_dra(facts))

    def _drop_nodes(self, names: Iterable[str]) -> None:
        names = list(names)
        for name in names:
            self._node_facts.pop(name, None)
        self.ledger.drop_nodes(names)

    def _with_dra(self, facts: NodeFacts) -> NodeFacts:
        """The Node's facts with its DRA claims' GPUs added to what its agent reports."""
        dra = self._dra_reports.get(facts.name)
        if dra is None or (not dra.pods and not dra.other):
            return facts
        pods = {uid: frozenset(g) for uid, g in facts.report.pods.items()}
        for uid, gpus in dra.pods.items():
            pods[uid] = pods.get(uid, frozenset()) | gpus
        return dataclasses.replace(facts, report=GpusInUse(pods=pods, other=facts.report.other | dra.other))

    def _redo_dra(self, pools: set[str] | None = None) -> None:
        """Recompute which GPUs the claims hold per node (only `pools`' nodes when given: a pool is one
        node's, as gputopo's agent publishes it); re-put each node whose share changed."""
        if pools is not None:
            for pool in pools:
                found = self._pool_slice.get(pool)
                if found is None:
                    continue
                claims = [self._claims[u] for u in self._pool_claims.get(pool, ())]
                report = in_use_by_node(claims, [found])[found.node]
                if report != self._dra_reports.get(found.node):
                    self._dra_reports[found.node] = report
                    facts = self._node_facts.get(found.node)
                    if facts is not None:
                        self.ledger.put_node(self._with_dra(facts))
            return
        self._pool_slice = {sl.pool: sl for sl in self._slices.values()}
        reports = in_use_by_node(self._claims.values(), self._slices.values())
        changed = {n for n in set(reports) | set(self._dra_reports) if reports.get(n) != self._dra_reports.get(n)}
        self._dra_reports = reports
        for name in changed:
            facts = self._node_facts.get(name)
            if facts is not None:
                self.ledger.put_node(self._with_dra(facts))

    def upsert_pod(self, obj: JSON, *, deleted: bool = False) -> PodRecord | None:
        """Apply a pod object (from a watch, or one the extender built after its own bind). A pending
        pod without a placement changes no node, so most pod events leave the generation alone."""
        uid = pod_key(obj)
        rec = None if deleted else pod_record(obj, self.ledger.tier_names, self._facts_for(obj))
        self.ledger.put_pod(uid, rec)
        return rec

    def _facts_for(self, obj: JSON) -> ControllerFacts:
        meta = obj.get("metadata") if isinstance(obj, dict) else None
        namespace = meta.get("namespace") if isinstance(meta, dict) else None
        return self.facts(namespace if isinstance(namespace, str) and namespace else "default")

    def forget_pod(self, obj: JSON) -> None:
        """Drop a pod and the GPUs its node reports for it: the cluster as if it had never run (what-if
        views such as `gputopo explain`; the live cache keeps reported GPUs until the node stops
        reporting them)."""
        self.upsert_pod(obj, deleted=True)
        self.ledger.forget_reported(pod_key(obj))


def _facts_of(jobs: dict[str, tuple[JobShape, str | None]]) -> ControllerFacts:
    """One namespace's Jobs as inference reads them: by name, and each JobSet's by global index."""
    jobsets: dict[str, dict[int, JobShape]] = {}
    for shape, jobset in jobs.values():
        if jobset is not None and shape.global_index is not None:
            jobsets.setdefault(jobset, {})[shape.global_index] = shape
    return ControllerFacts(jobs={n: sh for n, (sh, _) in jobs.items()}, jobsets=jobsets)
