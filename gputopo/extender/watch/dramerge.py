"""The DRA merge: on DRA nodes the GPUs our ResourceClaims hold (per pod they are reserved for) join the
agent's gpus-in-use report, so the ledger, the filter and the mismatch check read DRA's allocations as
they read the device plugin's.

Every Node's facts pass through here on their way to the ledger: what each Node object says is kept, so
that a claim's or slice's change re-merges its node without the Node changing.

A claim's GPUs count under a pod's UID only while the ledger holds that pod in the claim's own namespace
(`gputopo.model.dra.in_use_by_node`); otherwise under `other`. A pod may arrive after the claim reserved
for it, so the cache tells this merge of each pod event (`pod_changed`), which re-merges only the pools of
the claims reserved for that pod.

Every readable claim's `spec.devices` is also read for what it asks of gputopo's devices (`ClaimAsks`,
gputopo.extender.watch.templateasks): a pod naming a pre-made claim (`resourceClaimName`) is placed by what
it asks (`read_claims`, the cache's `ClaimReader`). A claim already allocated pins the pods naming it to its
node, unless it is reserved for that pod alone (kube-scheduler allocated it for the node gputopo chose). A
claim's event that changes what a pod naming it reads (its ask, its allocation) is told to `on_claims`,
which reads those pods again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

from gputopo.extender.state.ledger import Ledger
from gputopo.extender.state.records import NodeFacts, object_name
from gputopo.extender.watch.computedomains import Key
from gputopo.extender.watch.handlers import Bad, KindHandler, each_readable
from gputopo.extender.watch.templateasks import ClaimAsks, claim_ask
from gputopo.kube import JSON, RESOURCECLAIMS, RESOURCESLICES
from gputopo.model import GpusInUse
from gputopo.model.claimask import NO_ASK, ClaimAsk, pod_ask
from gputopo.model.dra import ClaimInfo, SliceInfo, in_use_by_node, parse_claim, parse_slice, sole_pod


class DraMerge:
    """Our ResourceSlices (by name) and the ResourceClaims holding our GPUs (by uid), merged into the
    Node facts handed to the ledger."""

    def __init__(self, ledger: Ledger, bad: Bad) -> None:
        self.ledger = ledger
        self._bad = bad
        self._slices: dict[str, SliceInfo] = {}
        self._claims: dict[str, ClaimInfo] = {}
        self._claim_uid: dict[tuple[str, str], str] = {}  # (namespace, name) -> uid, of self._claims
        self._pool_claims: dict[str, set[str]] = {}  # pool -> uids of the claims holding its GPUs
        self._pod_claims: dict[str, set[str]] = {}  # pod uid -> uids of the claims reserved for it alone
        self._pool_slice: dict[str, SliceInfo] = {}  # pool -> its slice (rebuilt on a slice's change)
        self._reports: dict[str, GpusInUse] = {}
        self._node_facts: dict[str, NodeFacts] = {}
        self.asks = ClaimAsks()  # what the pre-made claims ask of gputopo's devices
        # The claims whose event changed what a pod naming them reads (None: any claim); the cache's.
        self.on_claims: Callable[[set[Key] | None], None] = lambda _keys: None

    def handlers(self) -> dict[str, KindHandler]:
        return {
            RESOURCESLICES.name: KindHandler(self.replace_slices, self.apply_slice),
            RESOURCECLAIMS.name: KindHandler(self.replace_claims, self.apply_claim),
        }

    # ------------------------------------------------------------------ nodes

    def put_node(self, facts: NodeFacts) -> None:
        self._node_facts[facts.name] = facts
        self.ledger.put_node(self._with_dra(facts))

    def drop_nodes(self, names: Iterable[str]) -> None:
        names = list(names)
        for name in names:
            self._node_facts.pop(name, None)
        self.ledger.drop_nodes(names)

    # ------------------------------------------------------------------ slices and claims

    def replace_slices(self, items: list[JSON]) -> None:
        slices: dict[str, SliceInfo] = {}
        for obj, ours in each_readable(RESOURCESLICES.name, items, parse_slice, self._bad):
            if ours is not None:
                slices[object_name(obj)] = ours
        self._slices = slices
        self._redo()

    def apply_slice(self, event_type: str, obj: JSON) -> None:
        name = object_name(obj)
        ours = None if event_type == "DELETED" else parse_slice(obj)
        if ours is None:
            self._slices.pop(name, None)
        else:
            self._slices[name] = ours
        self._redo()

    def replace_claims(self, items: list[JSON]) -> None:
        claims: dict[str, ClaimInfo] = {}
        for _, claim in each_readable(RESOURCECLAIMS.name, items, parse_claim, self._bad):
            if claim.gpus:
                claims[claim.uid] = claim
        self._claims, self._claim_uid, self._pool_claims, self._pod_claims = {}, {}, {}, {}
        for claim in claims.values():
            self._keep(claim)
        self._redo()
        self.asks.replace_all(a for a in map(claim_ask, items) if a is not None)
        self.on_claims(None)

    def apply_claim(self, event_type: str, obj: JSON) -> None:
        found = claim_ask(obj)
        changed = found is not None and self.asks.put(found[0], NO_ASK if event_type == "DELETED" else found[1])
        try:
            claim = parse_claim(obj)
            before = self._drop(claim.uid)
            if event_type != "DELETED" and claim.gpus:
                self._keep(claim)
            after = self._claims.get(claim.uid)
            # Only a kept ask's allocation pins its pods; a write leaving it as it was reads none again.
            changed = changed or (found is not None and found[0] in self.asks.asks and _pin(before) != _pin(after))
            # One claim changes only its pools' nodes: no walk over every claim per event.
            self._redo({p for p in (before.pool if before else None, claim.pool) if p is not None})
        finally:
            if found is not None and changed:  # its ask or its allocation changed what its pods read
                self.on_claims({found[0]})

    def _keep(self, claim: ClaimInfo) -> None:
        if claim.pool is None:
            return
        self._claims[claim.uid] = claim
        self._claim_uid[(claim.namespace, claim.name)] = claim.uid
        self._pool_claims.setdefault(claim.pool, set()).add(claim.uid)
        pod = sole_pod(claim)
        if pod is not None:
            self._pod_claims.setdefault(pod, set()).add(claim.uid)

    def _drop(self, uid: str) -> ClaimInfo | None:
        before = self._claims.pop(uid, None)
        if before is None:
            return None
        self._claim_uid.pop((before.namespace, before.name), None)
        if before.pool is not None:
            _discard(self._pool_claims, before.pool, uid)
        pod = sole_pod(before)
        if pod is not None:
            _discard(self._pod_claims, pod, uid)
        return before

    # ------------------------------------------------------------------ pods

    def pod_changed(self, uid: str) -> None:
        """Pod `uid` came, went or changed in the ledger: re-merge the pools of the claims reserved for it
        (whether they count as its own depends on the ledger holding it in their namespace)."""
        claims = self._pod_claims.get(uid)
        if claims:
            self._redo({p for c in claims if (p := self._claims[c].pool) is not None})

    def pods_replaced(self) -> None:
        """The ledger's pods replaced (a relist): re-merge every pool."""
        self._redo()

    def forget_pod(self, uid: str) -> None:
        """What-if views: the claims that count as pod `uid`'s own (reserved for it alone, in the namespace the
        ledger holds it in) dropped, the cluster as if it had never run; another namespace's still hold."""
        namespace = self._pod_namespace(uid)
        own = [self._claims[c] for c in self._pod_claims.get(uid, ()) if self._claims[c].namespace == namespace]
        for claim in own:
            self._drop(claim.uid)
        self._redo({c.pool for c in own if c.pool is not None})

    def _pod_namespace(self, uid: str) -> str | None:
        with self.ledger.lock:  # the binder records its bound pods from another thread
            rec = self.ledger.pods.get(uid)
        return None if rec is None else rec.namespace

    def allocated(self, namespace: str, name: str) -> ClaimInfo | None:
        """The claim `namespace/name` when this cache has seen our GPUs allocated to it, else None (not
        seen yet, or none of ours). An allocation never changes while it stands, so a hit is current."""
        uid = self._claim_uid.get((namespace, name))
        return self._claims.get(uid) if uid is not None else None

    def read_claims(self, namespace: str, names: tuple[str, ...], uid: str) -> tuple[str, ClaimAsk, str]:
        """What the claims pod `uid` names directly in `namespace` ask of gputopo's devices: the claim that
        asks, its ask, and the node an allocation pins the pod to ("" when none: none of those that ask is
        allocated, other than for this pod alone; nor when two ask: that is refused). A pinning claim is the
        one returned."""
        named = self.asks.named(namespace, names)
        name, ask = pod_ask(named, kind=self.asks.kind)
        if not ask.asks or sum(a.asks for _, a in named) > 1:
            return name, ask, ""  # two asking are refused, allocated or not
        for each in names:
            claim = self.allocated(namespace, each) if (namespace, each) in self.asks.asks else None
            if claim is not None and claim.pool is not None and claim.reserved_for != {uid}:
                found = self._pool_slice.get(claim.pool)
                return each, self.asks.asks[(namespace, each)], found.node if found is not None else claim.pool
        return name, ask, ""

    # ------------------------------------------------------------------ the merge

    def _with_dra(self, facts: NodeFacts) -> NodeFacts:
        """The Node's facts with its DRA claims' GPUs added to what its agent reports."""
        dra = self._reports.get(facts.name)
        if dra is None or (not dra.pods and not dra.other):
            return facts
        pods = {uid: frozenset(g) for uid, g in facts.report.pods.items()}
        for uid, gpus in dra.pods.items():
            pods[uid] = pods.get(uid, frozenset()) | gpus
        return dataclasses.replace(facts, report=GpusInUse(pods=pods, other=facts.report.other | dra.other))

    def _redo(self, pools: set[str] | None = None) -> None:
        """Recompute which GPUs the claims hold per node (only `pools`' nodes when given: a pool is one
        node's, as gputopo's agent publishes it); re-put each node whose share changed."""
        if pools is not None:
            for pool in pools:
                found = self._pool_slice.get(pool)
                if found is None:
                    continue
                claims = [self._claims[u] for u in self._pool_claims.get(pool, ())]
                report = in_use_by_node(claims, [found], self._pod_namespace)[found.node]
                if report != self._reports.get(found.node):
                    self._reports[found.node] = report
                    self._reput(found.node)
            return
        self._pool_slice = {sl.pool: sl for sl in self._slices.values()}
        reports = in_use_by_node(self._claims.values(), self._slices.values(), self._pod_namespace)
        changed = {n for n in set(reports) | set(self._reports) if reports.get(n) != self._reports.get(n)}
        self._reports = reports
        for name in changed:
            self._reput(name)

    def _reput(self, name: str) -> None:
        facts = self._node_facts.get(name)
        if facts is not None:
            self.ledger.put_node(self._with_dra(facts))


def _discard(index: dict[str, set[str]], key: str, uid: str) -> None:
    """`uid` out of `index[key]`, the key gone with its last uid (an index of gone pods or pools never grows)."""
    uids = index.get(key)
    if uids is not None:
        uids.discard(uid)
        if not uids:
            del index[key]


def _pin(claim: ClaimInfo | None) -> tuple[str | None, frozenset[str]] | None:
    """What of a kept claim's allocation decides whether it pins a pod naming it (`read_claims`)."""
    return (claim.pool, claim.reserved_for) if claim is not None else None
