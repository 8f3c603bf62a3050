"""The records the ledger keeps of API objects (a Node's facts, its ledger entry, a pod's record), and the
refusal of an object that cannot be read (`BadObject`, naming the field). The parsers that turn API objects into
these records are `gputopo.extender.watch.parsers`; which ComputeDomain a pod's claims join is read through a
`ChannelReader` the cache hands them, and what their hand-written claim templates ask through an `AskReader`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gputopo.engine.state.reasons import Reason
from gputopo.engine.state.snapshot import NodeState, node_state
from gputopo.model import (
    GpusInUse,
    InferredGroup,
    NodeTopology,
    Placement,
    PodRequest,
)
from gputopo.model.claimask import NO_ASK, ClaimAsk
from gputopo.model.pod import PodInfo

log = logging.getLogger("gputopo.extender.state.records")

MAX_NAME = 253  # DNS-1123 subdomain: the longest Node, Pod or Lease name the API server accepts


MAX_VALUE_BYTES = 256 * 1024  # the API server's cap on one object's annotations, all together


MAX_DETAIL = 300  # reasons quote object content: keep what is stored and logged short


class BadObject(ValueError):
    """An object (or one of its fields) the cache cannot read; the message names the field."""


def short(text: str, limit: int = MAX_DETAIL) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


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


def string_map(value: Any, where: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise BadObject(f"{where} is not a map")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise BadObject(f"{where} has a key or value that is not a string")
    if sum(len(k) + len(v) for k, v in value.items()) > MAX_VALUE_BYTES:
        raise BadObject(f"{where} is over {MAX_VALUE_BYTES // 1024} KiB")
    return dict(value)


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
    inferred: InferredGroup | None = None  # the group its controller's labels give (gputopo.model.jobs)
    problem: str = ""  # why `request` is None: the annotation or label at fault, or what the group waits for
    job_keys: tuple[tuple[str, str], ...] = ()  # the labels and annotations inference reads, to infer again
    own: tuple[tuple[str, str], ...] = ()  # its gputopo.io/ request annotations, likewise
    scheduler_name: str = ""
    pod_group: str = ""  # spec.schedulingGroup.podGroupName, to infer again when the PodGroup arrives
    node_selector: tuple[tuple[str, str], ...] = ()  # where it may go (PodInfo's, bounded there): group planning
    selector_problem: str = ""  # why node_selector was not kept (PodInfo's)
    topology_gated: bool = False  # Kueue has not written its topology domain yet
    gates: tuple[str, ...] = ()  # PodInfo's: gputopo's gate is lifted by gputopo.extender.verbs.groupgates
    claim_templates: tuple[str, ...] = ()  # PodInfo's: its ComputeDomain is read again when a template changes
    named_claims: tuple[str, ...] = ()  # PodInfo's: read again when such a claim changes
    # PodInfo's block ask (gputopo.model.blockrequest), kept so that a record read again asks what the pod asks.
    block: int = 0
    block_problem: str = ""
    # Of `gpus`, those its hand-written claim template asks (gputopo.model.claimask); the rest are PodInfo's.
    claim_gpus: int = 0
    # metadata.creationTimestamp (epoch seconds; None: unreadable, or no gputopo gate on it): when gputopo's gate
    # was added (gputopo.model.gates.gated_since). Not compared: a record built again without the object
    # (re-inference) is the same record, and the ledger keeps the time it read.
    created: float | None = field(default=None, compare=False)

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

    def info_again(self) -> PodInfo:
        """The pod as far as this record keeps it, to be read again (new controller facts, a template or
        claim that changed, a group planned before its members' filters): what its hand-written claims ask
        is read again from them, not kept in `gpus`."""
        keys = dict(self.job_keys)
        return PodInfo(
            name=self.name,
            namespace=self.namespace,
            uid=self.uid,
            annotations={**keys, **dict(self.own)},
            labels=keys,
            gpus=self.gpus - self.claim_gpus,
            block=self.block,
            block_problem=self.block_problem,
            scheduler_name=self.scheduler_name,
            node_name=self.node_name,
            phase=self.phase,
            priority=self.priority,
            pod_group=self.pod_group,
            node_selector=self.node_selector,
            selector_problem=self.selector_problem,
            topology_gated=self.topology_gated,
            gates=self.gates,
            claim_templates=self.claim_templates,
            named_claims=self.named_claims,
        )


# Which ComputeDomain a pod's claims join: (namespace, its claims' template names) -> (ComputeDomain or None, why
# not). The cache hands the channel templates' reader (gputopo.extender.watch.computedomains); none by default.
ChannelReader = Callable[[str, tuple[str, ...]], tuple[str | None, str]]


def no_channels(_namespace: str, _templates: tuple[str, ...]) -> tuple[str | None, str]:
    """The reader where no templates are watched (snapshot mode, `gputopo explain` offline): no channels."""
    return None, ""


# What a pod's hand-written claim templates ask of gputopo's devices: (namespace, its claims' template names) ->
# (the template that asks, its ask: gputopo.model.claimask). The cache hands the templates' table
# (gputopo.extender.watch.templateasks); waiting for the first list is the ChannelReader's.
AskReader = Callable[[str, tuple[str, ...]], tuple[str, ClaimAsk]]


def no_asks(_namespace: str, _templates: tuple[str, ...]) -> tuple[str, ClaimAsk]:
    """The reader where no templates are watched: no template asks for anything."""
    return "", NO_ASK


# What the pre-made ResourceClaims a pod names directly ask of gputopo's devices: (namespace, their names, the
# pod's UID) -> (the claim that asks, its ask, the node an allocation already pins the pod to or ""). The cache
# hands the ResourceClaims informer's (gputopo.extender.watch.dramerge.DraMerge.read_claims).
ClaimReader = Callable[[str, tuple[str, ...], str], tuple[str, ClaimAsk, str]]


def no_claims(_namespace: str, _claims: tuple[str, ...], _uid: str) -> tuple[str, ClaimAsk, str]:
    """The reader where no claims are watched: no claim asks for anything."""
    return "", NO_ASK, ""
