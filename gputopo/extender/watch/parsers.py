"""API objects (Node, Pod, Lease, Job, PodGroup as the informers deliver them) turned into the records the ledger
keeps (`gputopo.extender.state.records`).

Every function here is pure and refuses what it cannot read with `BadObject`, naming the field: the
cache counts and skips such an object and moves on. A Node whose name is readable but whose contents
are not becomes a record with a problem (unschedulable for gputopo, the reason in `gputopo explain`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypedDict, Unpack

from gputopo.engine.state.reasons import Reason
from gputopo.extender.state.leadership import MAX_HOLDER, MAX_LEASE_SECONDS, LeaseHold
from gputopo.extender.state.records import (
    MAX_VALUE_BYTES,
    AskReader,
    BadObject,
    ChannelReader,
    ClaimReader,
    NodeEntry,
    NodeFacts,
    PodRecord,
    no_asks,
    no_channels,
    no_claims,
    object_name,
    short,
    string_map,
)
from gputopo.extender.watch.jobstate import job_state
from gputopo.extender.wire import PodInfo, WireError, pod_info
from gputopo.kube import parse_time
from gputopo.model import (
    AGENT_LEASE_PREFIX,
    ANN_GROUP,
    ANN_GROUP_SIZE,
    ANN_NVLINK,
    GPU_RESOURCE,
    GPUS_IN_USE_ANNOTATION,
    NO_FACTS,
    PLACEMENT_ANNOTATION,
    PREFIX,
    SCHEDULER_NAME,
    TOPOLOGY_ANNOTATION,
    AnnotationError,
    ControllerFacts,
    GpusInUse,
    InferredGroup,
    JobShape,
    NodeTopology,
    NvlinkPolicy,
    PodRequest,
    infer_group,
    parse_gpus_in_use_report,
    parse_placement,
    parse_pod_request,
    parse_topology,
)
from gputopo.model.claimask import NO_ASK, ClaimAsk, template_or_claim
from gputopo.model.dra import BLOCK_RESOURCE_PREFIX, TEMPLATE_PREFIX, block_resource
from gputopo.model.gates import GROUP_GATE
from gputopo.model.jobs import (
    JOB_KEYS,
    JOBSET_GLOBAL_REPLICAS,
    JOBSET_JOB_GLOBAL_INDEX,
    JOBSET_NAME,
    MISSING,
    PodGroupError,
    PodGroupShape,
    gang_min_count,
    group_identity,
    podgroup_shape,
)
from gputopo.tiers import TierConfig

log = logging.getLogger("gputopo.extender.state.records")


def node_metadata(obj: Any) -> tuple[dict[str, str], dict[str, str]]:
    """A Node's labels and annotations, or BadObject naming the field that is not a map of strings."""
    object_name(obj)  # metadata must be an object with a name before its maps mean anything
    meta = obj["metadata"]
    return string_map(meta.get("labels"), "metadata.labels"), string_map(
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


def pod_key(obj: Any) -> str:
    """The key a pod is kept under (its UID, else namespace/name); BadObject when neither is readable."""
    name = object_name(obj)
    meta = obj["metadata"]
    uid, namespace = meta.get("uid"), meta.get("namespace")
    if isinstance(uid, str) and uid:
        return uid
    return f"{namespace if isinstance(namespace, str) and namespace else 'default'}/{name}"


@dataclass(frozen=True)
class Resolved:
    """A pod's request as gputopo reads it: from its annotations, with the group its controller's
    labels give where they do (annotations override). `request` None: `problem` says why."""

    opted_in: bool  # a gputopo pod: an annotation, or a known controller's labels under gputopo-scheduler
    request: PodRequest | None
    inferred: InferredGroup | None = None
    problem: str = ""
    waiting: bool = False  # the group's size is in a controller object not seen yet
    group: str | None = None  # the group, even when `request` is None
    claim_gpus: int = 0  # the GPUs its hand-written claim (template) asks (gputopo.model.claimask)
    pinned: str = ""  # the node an allocated pre-made claim it names already holds it to (then passed through)


class How(TypedDict, total=False):
    scheduler: str  # the scheduler whose pods opt in by their controller's labels (SCHEDULER_NAME)
    channels: ChannelReader  # which ComputeDomain a pod's claims join (none)
    asks: AskReader  # what its hand-written claim templates ask of gputopo's devices (nothing)
    claims: ClaimReader  # what the pre-made claims it names ask, and where an allocation pins it (nothing)


def _other_way(info: PodInfo) -> str:
    """How else a pod asks for GPUs, in words ("" for no other way)."""
    if info.block:
        return block_resource(info.block)
    if info.block_problem:
        return f"{BLOCK_RESOURCE_PREFIX}<N>"
    own = [n for n in info.claim_templates if n.startswith(TEMPLATE_PREFIX + "-")]
    if own:
        return f"gputopo's ResourceClaimTemplate {own[0]}"
    return f"{GPU_RESOURCE}: {info.gpus}" if info.gpus else ""


def _claim_problem(info: PodInfo, what: str, ask: ClaimAsk) -> str:
    """Why what the pod's hand-written claim (`what`, in words) asks cannot be placed ("" when it can, or
    asks nothing)."""
    if not ask.asks:
        return ""
    other = _other_way(info)
    if other:
        return f"{what} beside {other}: a pod asks for GPUs one way; drop one"
    if ask.problem:
        return ask.problem
    nvlink = info.annotations.get(ANN_NVLINK)
    if not ask.block and ask.gpus > 1 and nvlink is not None and nvlink.strip() != NvlinkPolicy.REQUIRED.value:
        why = f"{what} asks {ask.gpus} GPUs of one NVLink clique"
        return str(AnnotationError(ANN_NVLINK, nvlink, why))
    return ""


def resolve_pod(
    info: PodInfo, tiers: tuple[str, ...], facts: ControllerFacts = NO_FACTS, **how: Unpack[How]
) -> Resolved:
    """Read a pod's request: its `gputopo.io/` annotations and, for a pod under `scheduler`, its
    controller's labels with `facts` (the controller objects of its namespace), the ComputeDomain whose
    IMEX channel its claims name (`channels`) and what its hand-written claim templates (`asks`) and the
    pre-made claims it names (`claims`) ask of gputopo's devices; such a claim alone opts a pod under
    `scheduler` in. A pre-made claim already allocated elsewhere than for this pod alone holds the pod to its
    node: the pod is passed through (`pinned`), the allocation is kube-scheduler's to honour, unless it asks
    for GPUs another way too (refused, as unallocated)."""
    ann, scheduler, channels = info.annotations, how.get("scheduler", SCHEDULER_NAME), how.get("channels", no_channels)
    annotated = any(k.startswith(PREFIX) and k != PLACEMENT_ANNOTATION for k in ann)
    cd, wait = channels(info.namespace, info.claim_templates) if info.claim_templates else (None, "")
    template, by_template = (
        how.get("asks", no_asks)(info.namespace, info.claim_templates) if info.claim_templates else ("", NO_ASK)
    )
    claim, by_claim, pinned = (
        how.get("claims", no_claims)(info.namespace, info.named_claims, info.uid)
        if info.named_claims
        else ("", NO_ASK, "")
    )
    if pinned and not (by_template.asks or _other_way(info)):  # asked another way too: refused below
        why = (
            f"ResourceClaim {short(claim, 80)} is allocated on node {short(pinned, 80)} already: the pod goes "
            "where its claim is; gputopo passes it through"
        )
        return Resolved(False, None, problem=why, claim_gpus=by_claim.gpus, pinned=pinned)
    what, ask = template_or_claim(template, by_template, claim, by_claim)
    inferred: InferredGroup | None = None
    if annotated or info.scheduler_name == scheduler:
        try:
            inferred = infer_group(info.labels, ann, facts, pod_group=info.pod_group)
        except AnnotationError as e:
            group = ann.get(ANN_GROUP, "").strip() or group_identity(info.labels, info.pod_group)
            return Resolved(True, None, None, str(e), group=group)
    # A block resource (gputopo.model.blockrequest) or a claim asking gputopo's devices opts a pod under
    # `scheduler` in, as an IMEX channel does.
    blocks = info.block or info.block_problem or ask.asks
    if not annotated and inferred is None and not (info.scheduler_name == scheduler and (cd or wait or blocks)):
        return Resolved(False, None)
    named_group = ann.get(ANN_GROUP, "").strip() or None
    if info.block_problem:
        return Resolved(True, None, inferred, info.block_problem, group=named_group)
    if wait:
        return Resolved(True, None, inferred, wait, waiting=True, group=named_group)
    if problem := _claim_problem(info, what, ask):
        return Resolved(True, None, inferred, problem, group=named_group or (inferred.group if inferred else None))
    if inferred is not None and inferred.size is None and ANN_GROUP_SIZE not in ann:
        why = f"group {inferred.group}: waiting: {inferred.waiting}"
        return Resolved(True, None, inferred, why, waiting=True, group=named_group or inferred.group)
    gpus, block = (ask.gpus, ask.gpus if ask.block else 0) if ask.gpus else (info.gpus, info.block)
    try:
        request = parse_pod_request(ann, gpus, tiers, inferred, block)
    except AnnotationError as e:
        group = named_group or (inferred.group if inferred else None)
        return Resolved(True, None, inferred, str(e), group=group)
    if info.selector_problem and request.is_group:  # its nodeSelector cannot be planned with: say which field
        return Resolved(True, None, inferred, info.selector_problem, group=request.group)
    if ask.gpus > 1 and not ask.block:  # N GPUs of one clique: the claim's constraint, whatever else it says
        request = request.model_copy(update={"nvlink": NvlinkPolicy.REQUIRED})
    request = request.model_copy(update={"compute_domain": cd}) if cd else request
    return Resolved(True, request, inferred, group=request.group, claim_gpus=ask.gpus)


def pod_record(
    obj: Any, tiers: tuple[str, ...], facts: ControllerFacts = NO_FACTS, **how: Unpack[How]
) -> PodRecord | None:
    """None when the pod is no gputopo pod (plain pods are not tracked); BadObject when unreadable."""
    try:
        info = pod_info(obj)
    except WireError as e:
        raise BadObject(short(str(e))) from None
    rec = record_of(info, tiers, facts, **how)
    if rec is None or GROUP_GATE not in rec.gates:
        return rec
    # Kept only while gputopo's gate holds the pod: the lift's bound runs from it. The one Pod reader refused a
    # time it cannot read; an absent one is None (the lifter counts from when it first saw the gate).
    return dataclasses.replace(rec, created=info.created or None)


def record_of(
    info: PodInfo, tiers: tuple[str, ...], facts: ControllerFacts = NO_FACTS, **how: Unpack[How]
) -> PodRecord | None:
    ann = {k: v for k, v in info.annotations.items() if k.startswith(PREFIX)}
    if sum(len(k) + len(v) for k, v in ann.items()) > MAX_VALUE_BYTES:
        raise BadObject(f"gputopo.io/ annotations are over {MAX_VALUE_BYTES // 1024} KiB")
    resolved = resolve_pod(info, tiers, facts, **how)
    if not resolved.opted_in and not ann:
        return None
    if not resolved.opted_in and not resolved.pinned:  # a pinned pod keeps its claim's GPUs and why it is pinned
        # Only gputopo's own placement: a pod bound by gputopo holds GPUs whatever else it says.
        try:
            resolved = Resolved(False, parse_pod_request(ann, info.gpus, tiers, block=info.block))
        except AnnotationError as e:
            resolved = Resolved(False, None, problem=str(e))
    placement = None
    if PLACEMENT_ANNOTATION in ann:
        try:
            placement = parse_placement(ann[PLACEMENT_ANNOTATION])
        except AnnotationError as e:
            log.warning("ignoring unreadable placement annotation", extra={"pod": info.ref, "error": short(str(e))})
    gpus = info.gpus + resolved.claim_gpus
    if placement is not None and len(placement.gpus) > gpus:  # holds no more than it asks, whatever it lists
        log.warning("placement lists more GPUs than the pod asks; holding none by it", extra={"pod": info.ref})
        placement = placement.model_copy(update={"gpus": ()})
    keys = tuple(
        sorted(
            {(k, v) for k, v in info.labels.items() if k in JOB_KEYS}
            | {(k, v) for k, v in info.annotations.items() if k in JOB_KEYS}
        )
    )
    size = ann.get(ANN_GROUP_SIZE)
    if size is None and resolved.request is not None and resolved.request.group_size is not None:
        size = str(resolved.request.group_size)
    return PodRecord(
        uid=info.uid or info.ref,
        namespace=info.namespace,
        name=info.name,
        node_name=info.node_name,
        phase=info.phase,
        gpus=gpus,
        group=resolved.group,
        group_size=size,
        request=resolved.request,
        placement=placement,
        priority=info.priority,
        inferred=resolved.inferred,
        problem=short(resolved.problem),
        job_keys=keys,
        own=tuple(sorted((k, v) for k, v in ann.items() if k != PLACEMENT_ANNOTATION))
        if keys or info.pod_group or info.claim_templates or info.named_claims
        else (),
        scheduler_name=info.scheduler_name,
        pod_group=info.pod_group,
        node_selector=info.node_selector,
        selector_problem=info.selector_problem,
        topology_gated=info.topology_gated,
        gates=info.gates,
        claim_templates=info.claim_templates,
        named_claims=info.named_claims,
        block=info.block,
        block_problem=info.block_problem,
        claim_gpus=resolved.claim_gpus,
    )


def job_shape(obj: Any) -> tuple[str, JobShape, str | None]:
    """A batch/v1 Job: its namespace, shape and JobSet (None: none); BadObject naming the unreadable field."""
    name = object_name(obj)
    meta = obj["metadata"]
    namespace = meta.get("namespace") or "default"
    if not isinstance(namespace, str):
        raise BadObject("metadata.namespace is not a string")
    labels = string_map(meta.get("labels"), "metadata.labels")
    spec = obj.get("spec") or {}
    if not isinstance(spec, Mapping):
        raise BadObject("spec is not an object")

    def count(key: str) -> int | None:
        v = spec.get(key)
        if v is None:
            return None
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 2**31:
            raise BadObject(f"spec.{key} is not a non-negative int32")
        return v

    def index(key: str) -> int | None:
        v = labels.get(key)
        return int(v) if v is not None and v.isascii() and v.isdigit() and len(v) <= 9 else None

    if (state := job_state(obj)) is None:
        raise BadObject("metadata.uid is not a string")
    shape = JobShape(
        name,
        count("completions"),
        count("parallelism"),
        spec.get("completionMode") == "Indexed",
        index(JOBSET_JOB_GLOBAL_INDEX),
        index(JOBSET_GLOBAL_REPLICAS),
        **state,
    )
    return namespace, shape, labels.get(JOBSET_NAME)


def podgroup_of(obj: Any, tiers: TierConfig) -> tuple[str, PodGroupShape]:
    """A scheduling.k8s.io/v1beta1 PodGroup: its namespace and shape (gang size, required tier);
    BadObject naming the field that is unreadable. A topology key no tier reads is the shape's
    problem, told to every member, not a reason to skip the object."""
    name = object_name(obj)
    meta = obj["metadata"]
    namespace = meta.get("namespace") or "default"
    if not isinstance(namespace, str):
        raise BadObject("metadata.namespace is not a string")
    spec = obj.get("spec") or {}
    if not isinstance(spec, Mapping):
        raise BadObject("spec is not an object")
    policy = spec.get("schedulingPolicy")
    policy = {} if policy is None else policy
    if not isinstance(policy, Mapping):
        raise BadObject("spec.schedulingPolicy is not an object")
    gang = policy.get("gang")
    min_count: int | None = None
    if gang is not None:
        if not isinstance(gang, Mapping):
            raise BadObject("spec.schedulingPolicy.gang is not an object")
        # A malformed minCount is the shape's problem, told to every member (not a skipped object, whose
        # members would wait for it for ever).
        counted = gang_min_count(name, gang.get("minCount", MISSING))
        if isinstance(counted, PodGroupError):
            return namespace, PodGroupShape(name, None, None, str(counted))
        min_count = counted
    constraints = spec.get("schedulingConstraints")
    constraints = {} if constraints is None else constraints
    if not isinstance(constraints, Mapping):
        raise BadObject("spec.schedulingConstraints is not an object")
    topology = constraints.get("topology")
    topology = [] if topology is None else topology
    if not isinstance(topology, list) or len(topology) > 16:
        raise BadObject("spec.schedulingConstraints.topology is not a list of at most 16 entries")
    keys: list[str] = []
    for i, entry in enumerate(topology):
        key = entry.get("key") if isinstance(entry, Mapping) else None
        if not isinstance(key, str) or not 0 < len(key) <= 317:  # a label key: prefix 253 + "/" + name 63
            raise BadObject(f"spec.schedulingConstraints.topology[{i}].key is not a label key")
        keys.append(key)
    return namespace, podgroup_shape(name, min_count, keys, tiers.labels_by_tier())


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


def leader_lease(obj: Any, name: str, namespace: str) -> LeaseHold | None:
    """kube-scheduler's leader election Lease `name` in `namespace` (None for any other Lease). Read leniently: a
    field that is not what kube-scheduler writes reads as no holder, never renewed or a zero duration, so
    an unreadable Lease leads no one (it is never the reason a standby lifts)."""
    if not name or object_name(obj) != name or obj["metadata"].get("namespace", namespace) != namespace:
        return None
    spec = obj.get("spec")
    spec = spec if isinstance(spec, Mapping) else {}
    holder = spec.get("holderIdentity")
    duration = spec.get("leaseDurationSeconds")
    return LeaseHold(
        holder=holder if isinstance(holder, str) and len(holder) <= MAX_HOLDER else "",
        renewed=parse_time(spec.get("renewTime") or spec.get("acquireTime")),
        duration=float(min(duration, MAX_LEASE_SECONDS))
        if isinstance(duration, int) and not isinstance(duration, bool) and duration > 0
        else 0.0,
    )
