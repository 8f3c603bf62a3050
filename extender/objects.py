"""API objects (Node, Pod, Lease as the informers deliver them) turned into the records the ledger keeps.

Every function here is pure and refuses what it cannot read with `BadObject`, naming the field: the
cache counts and skips such an object and moves on. A Node whose name is readable but whose contents
are not becomes a record with a problem (unschedulable for gputopo, the reason in `gputopo explain`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from extender.wire import WireError, pod_info
from gputopo.engine.reasons import Reason
from gputopo.engine.snapshot import NodeState, node_state
from gputopo.model import (
    AGENT_LEASE_PREFIX,
    ANN_GROUP,
    ANN_GROUP_SIZE,
    GPUS_IN_USE_ANNOTATION,
    PLACEMENT_ANNOTATION,
    PREFIX,
    TOPOLOGY_ANNOTATION,
    AnnotationError,
    GpusInUse,
    NodeTopology,
    Placement,
    PodRequest,
    parse_gpus_in_use_report,
    parse_placement,
    parse_pod_request,
    parse_topology,
)

log = logging.getLogger("gputopo.extender.objects")

MAX_NAME = 253  # DNS-1123 subdomain: the longest Node, Pod or Lease name the API server accepts
MAX_VALUE_BYTES = 256 * 1024  # the API server's cap on one object's annotations, all together
MAX_DETAIL = 300  # reasons quote object content: keep what is stored and logged short


class BadObject(ValueError):
    """An object (or one of its fields) the cache cannot read; the message names the field."""


def short(text: str, limit: int = MAX_DETAIL) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def parse_time(text: str) -> float | None:
    """RFC 3339 (Lease renewTime: 2026-01-01T00:00:00.000000Z) to epoch seconds."""
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except (ValueError, AttributeError):
        return None


def object_name(obj: Any) -> str:
    """metadata.name of an object, or BadObject: without a name nothing about the object can be kept."""
    meta = obj.get("metadata") if isinstance(obj, Mapping) else None
    if not isinstance(meta, Mapping):
        raise BadObject("metadata is not an object")
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        raise BadObject("metadata.name is missing or not a string")
    if len(name) > MAX_NAME:
        raise BadObject(f"metadata.name is longer than {MAX_NAME} characters")
    return name


def _string_map(value: Any, where: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise BadObject(f"{where} is not a map")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise BadObject(f"{where} has a key or value that is not a string")
    if sum(len(k) + len(v) for k, v in value.items()) > MAX_VALUE_BYTES:
        raise BadObject(f"{where} is over {MAX_VALUE_BYTES // 1024} KiB")
    return dict(value)


# ------------------------------------------------------------------------------------------- nodes


@dataclass
class NodeFacts:
    """What a Node object says, before the ledger adds deadlines and GPUs in use."""

    name: str
    labels: dict[str, str]
    topology: NodeTopology | None
    topology_text: str
    problem: Reason | None
    detail: str
    report: GpusInUse  # the agent's gputopo.io/gpus-in-use
    malformed: bool = False  # the object itself, not only its gputopo annotations, is unreadable


_UNBUILT = node_state("-", None)


@dataclass
class NodeEntry(NodeFacts):
    """A node in the ledger: its facts, its staleness deadline and its engine states."""

    deadline: float = -math.inf  # epoch seconds after which the topology is stale
    fresh: NodeState = _UNBUILT  # replaced whole, never mutated: readers take it without the ledger's lock
    stale: NodeState | None = None
    built: dict[frozenset[int], NodeState] = field(default_factory=dict)  # states by in-use set, newest last


def node_metadata(obj: Any) -> tuple[dict[str, str], dict[str, str]]:
    """A Node's labels and annotations, or BadObject naming the field that is not a map of strings."""
    object_name(obj)  # metadata must be an object with a name before its maps mean anything
    meta = obj["metadata"]
    return _string_map(meta.get("labels"), "metadata.labels"), _string_map(
        meta.get("annotations"), "metadata.annotations"
    )


def node_facts(obj: Any, prev: NodeEntry | None = None) -> NodeFacts:
    """Read a Node. BadObject only when its name is unreadable; any other problem is the node's reason."""
    name = object_name(obj)
    try:
        labels, ann = node_metadata(obj)
    except BadObject as e:
        return NodeFacts(name, {}, None, "", Reason.TOPOLOGY_INVALID, f"node object: {e}", GpusInUse(), True)
    text = ann.get(TOPOLOGY_ANNOTATION)
    topology: NodeTopology | None = None
    problem: Reason | None = None
    detail = ""
    if text is None:
        problem, detail = Reason.TOPOLOGY_MISSING, f"node has no {TOPOLOGY_ANNOTATION} annotation"
    elif prev is not None and prev.topology_text == text and prev.topology is not None:
        topology = prev.topology  # unchanged annotation: skip re-validating the document
    else:
        try:
            topology = parse_topology(text)
        except AnnotationError as e:
            problem, detail = Reason.TOPOLOGY_INVALID, short(str(e))
    report = GpusInUse()
    raw_in_use = ann.get(GPUS_IN_USE_ANNOTATION)
    if topology is not None and problem is None and raw_in_use:
        try:
            report = parse_gpus_in_use_report(raw_in_use, len(topology.gpus))
        except AnnotationError as e:
            problem, detail = Reason.TOPOLOGY_INVALID, short(f"{GPUS_IN_USE_ANNOTATION}: {e}")
    return NodeFacts(name, labels, topology, text or "", problem, detail, report)


# -------------------------------------------------------------------------------------------- pods


@dataclass(frozen=True)
class PodRecord:
    """A pod that carries gputopo annotations, as far as placement is concerned."""

    uid: str
    namespace: str
    name: str
    node_name: str
    phase: str
    gpus: int
    group: str | None
    group_size: str | None
    request: PodRequest | None
    placement: Placement | None
    priority: int = 0  # spec.priority: which victims preemption prefers

    @property
    def active(self) -> bool:
        return self.phase not in ("Succeeded", "Failed")

    @property
    def placed_node(self) -> str | None:
        """The node whose GPUs this pod holds: its placement, honoured only once the pod is bound to
        that node. Anyone who can edit a pod can write the annotation; only a bind makes it true."""
        if self.placement is None or self.node_name != self.placement.node:
            return None
        return self.placement.node

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"


def pod_key(obj: Any) -> str:
    """The key a pod is kept under (its UID, else namespace/name); BadObject when neither is readable."""
    name = object_name(obj)
    meta = obj["metadata"]
    uid, namespace = meta.get("uid"), meta.get("namespace")
    if isinstance(uid, str) and uid:
        return uid
    return f"{namespace if isinstance(namespace, str) and namespace else 'default'}/{name}"


def pod_record(obj: Any, tiers: tuple[str, ...]) -> PodRecord | None:
    """None when the pod has no gputopo annotation (plain pods are not tracked); BadObject when unreadable."""
    try:
        info = pod_info(obj)
    except WireError as e:
        raise BadObject(short(str(e))) from None
    ann = {k: v for k, v in info.annotations.items() if k.startswith(PREFIX)}
    if not ann:
        return None
    if sum(len(k) + len(v) for k, v in ann.items()) > MAX_VALUE_BYTES:
        raise BadObject(f"gputopo.io/ annotations are over {MAX_VALUE_BYTES // 1024} KiB")
    placement = None
    if PLACEMENT_ANNOTATION in ann:
        try:
            placement = parse_placement(ann[PLACEMENT_ANNOTATION])
        except AnnotationError as e:
            log.warning("ignoring unreadable placement annotation", extra={"pod": info.ref, "error": short(str(e))})
    try:
        request: PodRequest | None = parse_pod_request(ann, info.gpus, tiers)
    except AnnotationError:
        request = None
    return PodRecord(
        uid=info.uid or info.ref,
        namespace=info.namespace,
        name=info.name,
        node_name=info.node_name,
        phase=info.phase,
        gpus=info.gpus,
        group=ann.get(ANN_GROUP, "").strip() or None,
        group_size=ann.get(ANN_GROUP_SIZE),
        request=request,
        placement=placement,
        priority=info.priority,
    )


# ------------------------------------------------------------------------------------------ leases


def lease_renewal(obj: Any, namespace: str) -> tuple[str, float | None] | None:
    """(node, renew time or None when absent) for an agent's Lease in `namespace`; None for other Leases."""
    name = object_name(obj)
    meta = obj["metadata"]
    if not name.startswith(AGENT_LEASE_PREFIX) or meta.get("namespace", namespace) != namespace:
        return None
    spec = obj.get("spec")
    if spec is None:
        spec = {}
    if not isinstance(spec, Mapping):
        raise BadObject("spec is not an object")
    raw = spec.get("renewTime") or spec.get("acquireTime")
    if raw is not None and not isinstance(raw, str):
        raise BadObject("spec.renewTime is not a string")
    return name[len(AGENT_LEASE_PREFIX) :], parse_time(raw or "")
