"""The informers' side of the cache: Node, Pod and Lease objects (a full list, or one watch event) turned
into records and handed to the ledger, which holds the state (`extender/ledger.py`).

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
from collections.abc import Callable, Iterable
from typing import Any, Unpack

from extender.kube import JSON, Kind
from extender.ledger import Ledger, LedgerOptions
from extender.objects import (
    BadObject,
    NodeFacts,
    PodRecord,
    lease_renewal,
    node_facts,
    object_name,
    pod_key,
    pod_record,
    short,
)
from gputopo.engine.reasons import Reason
from gputopo.engine.snapshot import NodeState
from gputopo.model import DEFAULT_NAMESPACE, GpusInUse

log = logging.getLogger("gputopo.extender.cache")


def _freeze() -> None:
    """Move everything alive now out of the cyclic GC's reach: thousands of long-lived node states and
    topology documents otherwise make every full collection cost tens of milliseconds mid-request.
    Frozen objects are still freed by reference counting when the cache drops them."""
    gc.collect()
    gc.freeze()


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
                self.ledger.put_node(facts)
                names.add(facts.name)
            self.ledger.drop_nodes(set(self.ledger.nodes) - names)
        elif kind == "pods":
            records: dict[str, PodRecord] = {}
            for obj in items:
                try:
                    rec = pod_record(obj, self.ledger.tier_names)
                except Exception as e:
                    self._bad(kind, obj, e)
                    continue
                if rec is not None:
                    records[rec.uid] = rec
            self.ledger.replace_pods(records)
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
                    self.ledger.drop_nodes([object_name(obj)])
                else:
                    self.ledger.put_node(self._facts(obj))
            elif kind == "pods":
                self.upsert_pod(obj, deleted=event_type == "DELETED")
            else:
                found = lease_renewal(obj, self.lease_namespace)
                if found is not None:
                    self.ledger.put_lease(found[0], None if event_type == "DELETED" else found[1])
        except Exception as e:
            self._bad(kind, obj, e)

    def upsert_pod(self, obj: JSON, *, deleted: bool = False) -> PodRecord | None:
        """Apply a pod object (from a watch, or one the extender built after its own bind). A pending
        pod without a placement changes no node, so most pod events leave the generation alone."""
        uid = pod_key(obj)
        rec = None if deleted else pod_record(obj, self.ledger.tier_names)
        self.ledger.put_pod(uid, rec)
        return rec

    def forget_pod(self, obj: JSON) -> None:
        """Drop a pod and the GPUs its node reports for it: the cluster as if it had never run (what-if
        views such as `gputopo explain`; the live cache keeps reported GPUs until the node stops
        reporting them)."""
        self.upsert_pod(obj, deleted=True)
        self.ledger.forget_reported(pod_key(obj))
