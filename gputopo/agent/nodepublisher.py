"""Publish a node's topology to its own Node, and heartbeat through a Lease.

The Node is written only when the content of `gputopo.io/topology`, `gputopo.io/gpus-in-use` or a
`gputopo.io/*` label differs from what the Node carries (nothing time-varying is published), so a
steady node causes no Node writes at all; a label the agent owns but no longer publishes is removed.
Liveness is the Lease `gputopo-agent-<node>`, renewed every heartbeatSeconds; heartbeats never touch
the Node. A stopping agent deletes its Lease (`release_lease`) unless another agent of the node
renewed it since: a node whose agent is gone is stale at once (its device plugin is gone too), and
`helm uninstall` leaves no Lease behind.

The Kubernetes client sits behind the small `NodeApi` protocol so unit tests use a fake. API errors
are retried with `gputopo.kube`'s capped exponential backoff and then reported as a result: nothing
here raises into the agent loop.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol

from gputopo.agent.confirmedwrite import Confirmed, PublishResult
from gputopo.agent.labels import node_labels
from gputopo.kube import Backoff, Kube, KubeError, lease_path, micro_time, node_path, retry, short_error
from gputopo.model import (
    AGENT_COMPONENT,
    GPUS_IN_USE_ANNOTATION,
    NODE_LABEL_KEYS,
    TOPOLOGY_ANNOTATION,
    GpusInUse,
    NodeTopology,
    agent_lease_name,
)

log = logging.getLogger(__name__)

DEFAULT_BACKOFF = Backoff()  # 0.5 s, 1 s, 2 s between four tries


@dataclass(frozen=True)
class NodeMeta:
    """The parts of a Node the agent reads: its annotations and labels."""

    annotations: Mapping[str, str]
    labels: Mapping[str, str]


@dataclass(frozen=True)
class LeaseSpec:
    holder: str
    renew_time: datetime
    duration_s: int


class NodeApi(Protocol):
    """The API calls the agent makes; raise `gputopo.kube.KubeError` on failure."""

    def read_node_meta(self, name: str) -> NodeMeta: ...

    def patch_node_meta(self, name: str, annotations: Mapping[str, str], labels: Mapping[str, str | None]) -> None: ...

    def renew_lease(self, namespace: str, name: str, spec: LeaseSpec) -> None:
        """Update an existing Lease; KubeError(status=404) when it does not exist."""
        ...

    def create_lease(self, namespace: str, name: str, spec: LeaseSpec) -> None: ...

    def delete_lease(self, namespace: str, name: str, renewed_at: datetime) -> None:
        """Delete the Lease if its renewTime is still ``renewed_at`` (nobody renewed it since);
        KubeError(status=404) when it is gone, KubeError(status=409) when someone renewed it."""
        ...


# --------------------------------------------------------------------------------------------------
# Pure: what the Node should carry, and what differs


def desired_metadata(topology: NodeTopology, gpus_in_use: GpusInUse | None) -> tuple[dict[str, str], dict[str, str]]:
    """(annotations, labels) for this topology; the in-use annotation only when it is known."""
    annotations = {TOPOLOGY_ANNOTATION: topology.to_annotation()}
    if gpus_in_use is not None:
        annotations[GPUS_IN_USE_ANNOTATION] = gpus_in_use.to_annotation()
    return annotations, node_labels(topology)


Metadata = tuple[dict[str, str], dict[str, str]]  # (annotations, labels)
# As compared and patched: every label the agent owns, None where it publishes none (the patch removes it).
Owned = tuple[dict[str, str], dict[str, str | None]]


def _same_json(a: str | None, b: str) -> bool:
    """Whether the Node's annotation `a` says what `b` says: the same text, or the same JSON value."""
    if a is None:
        return False
    if a == b:
        return True
    try:
        return bool(json.loads(a) == json.loads(b))
    except ValueError:
        return False


def metadata_changes(current: NodeMeta, annotations: Mapping[str, str], labels: Mapping[str, str | None]) -> Owned:
    """The annotations and labels whose content differs from the Node (JSON compared as values)."""
    ann = {k: v for k, v in annotations.items() if not _same_json(current.annotations.get(k), v)}
    lab = {k: v for k, v in labels.items() if k in NODE_LABEL_KEYS and current.labels.get(k) != v}
    return ann, lab


class NodeMetaTarget:
    """The Node's gputopo annotations and labels as a publish target: a merge patch of what differs.

    Compared as the texts we would write, so an unchanged round costs no JSON parsing; an annotation the
    Node holds with the same JSON value in another spelling counts as held (`holds`)."""

    what = "the Node"

    def __init__(self, api: NodeApi, node: str, sleep: Callable[[float], bool], backoff: Backoff) -> None:
        self._api = api
        self._node = node
        self._sleep = sleep
        self._backoff = backoff
        self._diff: tuple[NodeMeta, Owned] | None = None  # what `holds` found differing, for `write`

    def comparable(self, desired: Metadata) -> Owned:
        annotations, labels = desired
        return dict(annotations), {k: labels.get(k) for k in NODE_LABEL_KEYS}

    def read(self) -> NodeMeta:
        return retry(lambda: self._api.read_node_meta(self._node), self._backoff, self._sleep, "get node")

    def holds(self, current: NodeMeta, want: Owned) -> Owned:
        ann, lab = metadata_changes(current, *want)
        self._diff = (current, (ann, lab))
        return {k: v for k, v in want[0].items() if k not in ann}, {k: v for k, v in want[1].items() if k not in lab}

    def write(self, current: NodeMeta, desired: Metadata) -> Owned:
        found = self._diff
        ann, lab = (
            found[1]
            if found is not None and found[0] is current
            else metadata_changes(current, *self.comparable(desired))
        )
        retry(lambda: self._api.patch_node_meta(self._node, ann, lab), self._backoff, self._sleep, "patch node")
        log.info("published topology", extra={"node": self._node, "annotations": sorted(ann), "labels": sorted(lab)})
        return self.comparable(desired)  # a merge patch is kept as sent


# --------------------------------------------------------------------------------------------------
# Publisher


def _utc_now() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True)
class LeaseTerms:
    """How this node's Lease is renewed: in `namespace`, lasting `duration_s`, stamped with `now()` (the
    wall clock; tests pass their own)."""

    namespace: str
    duration_s: int
    now: Callable[[], datetime] = _utc_now


class Publisher:
    """Writes this node's annotations and labels on change and renews its Lease."""

    def __init__(
        self,
        api: NodeApi,
        node: str,
        lease: LeaseTerms,
        sleep: Callable[[float], bool],
        backoff: Backoff = DEFAULT_BACKOFF,
        reverify_s: float = 300.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._api = api
        # An unchanged discovery costs no API call at all until `reverify_s` passes (then a read repairs
        # external edits).
        self._meta = Confirmed(NodeMetaTarget(api, node, sleep, backoff), reverify_s, monotonic)
        self._node = node
        self._namespace = lease.namespace
        self._lease = agent_lease_name(node)
        self._duration = lease.duration_s
        self._sleep = sleep
        self._backoff = backoff
        self._now = lease.now
        self._renewed_at: datetime | None = None  # the renewTime this agent last wrote

    def publish(self, topology: NodeTopology, gpus_in_use: GpusInUse | None) -> PublishResult:
        return self._meta.publish(desired_metadata(topology, gpus_in_use))

    def heartbeat(self) -> bool:
        """Renew (or create) the Lease; False when that failed after retries."""
        spec = LeaseSpec(holder=self._node, renew_time=self._now(), duration_s=self._duration)

        def renew_or_create() -> None:
            try:
                self._api.renew_lease(self._namespace, self._lease, spec)
            except Exception as e:
                if getattr(e, "status", None) != 404:
                    raise
                self._api.create_lease(self._namespace, self._lease, spec)

        try:
            retry(renew_or_create, self._backoff, self._sleep, "renew lease")
        except Exception as e:
            log.error("renewing the Lease failed", extra={"lease": self._lease, "error": short_error(e)})
            return False
        self._renewed_at = spec.renew_time
        return True

    def release_lease(self) -> bool:
        """Delete the Lease on the way out, unless another agent renewed it since this one last did
        (a successor started first). One try when the stop signal is already set (``sleep``
        returns at once); a Lease left by a failure expires as usual. False when the delete failed."""
        if self._renewed_at is None:
            return True
        renewed_at = self._renewed_at

        def delete() -> bool:
            try:
                self._api.delete_lease(self._namespace, self._lease, renewed_at)
            except Exception as e:
                if getattr(e, "status", None) in (404, 409):
                    return False  # gone already, or another agent's now: not retried
                raise
            return True

        try:
            deleted = retry(delete, self._backoff, self._sleep, "delete lease")
        except Exception as e:
            log.error("deleting the Lease failed", extra={"lease": self._lease, "error": short_error(e)})
            return False
        self._renewed_at = None
        if deleted:
            log.info("deleted the Lease", extra={"lease": self._lease})
        return True


# --------------------------------------------------------------------------------------------------
# The real API


class KubeNodeApi:
    """NodeApi on the agent's one Kubernetes client (`gputopo.kube.Kube`, shared with the rest of the agent)."""

    def __init__(self, kube: Kube) -> None:
        self._api = kube

    def read_node_meta(self, name: str) -> NodeMeta:
        meta = self._api.get(node_path(name)).get("metadata") or {}
        return NodeMeta(annotations=dict(meta.get("annotations") or {}), labels=dict(meta.get("labels") or {}))

    def patch_node_meta(self, name: str, annotations: Mapping[str, str], labels: Mapping[str, str | None]) -> None:
        self._api.patch_node_metadata(name, annotations=annotations, labels=labels)

    def renew_lease(self, namespace: str, name: str, spec: LeaseSpec) -> None:
        self._api.renew_lease(
            namespace, name, holder=spec.holder, renew_time=spec.renew_time, duration_s=spec.duration_s
        )

    def create_lease(self, namespace: str, name: str, spec: LeaseSpec) -> None:
        self._api.create_lease(
            namespace,
            name,
            holder=spec.holder,
            renew_time=spec.renew_time,
            duration_s=spec.duration_s,
            labels={"app.kubernetes.io/name": AGENT_COMPONENT},
        )

    def delete_lease(self, namespace: str, name: str, renewed_at: datetime) -> None:
        lease = self._api.get(lease_path(namespace, name))
        if (lease.get("spec") or {}).get("renewTime") != micro_time(renewed_at):
            raise KubeError(409, f"Lease {namespace}/{name} was renewed by another agent", "Conflict")
        # The precondition makes a renewal between the read and the delete a 409 as well.
        rv = (lease.get("metadata") or {}).get("resourceVersion")
        self._api.delete(lease_path(namespace, name), {"preconditions": {"resourceVersion": rv}})
