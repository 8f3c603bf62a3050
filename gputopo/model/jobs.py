"""Groups inferred from the labels the job controllers put on their pods (docs/annotations.md, "Jobs").

A pod that a controller made as one member of a job (an Indexed Job, a JobSet and so a Kubeflow
Trainer v2 TrainJob, a LeaderWorkerSet group, a Kueue pod group)
is a gputopo group member without any `gputopo.io/` annotation. `infer_group` reads the group's
identity, its size and the member's rank (its stage: placement order) from the pod's labels and
annotations, and, where the labels do not carry the size, from what the controller's objects say
(`ControllerFacts`, read by the caller). The controllers are one table, `gputopo.model.joblabels`.
The annotations `gputopo.io/group`, `group-size` and `stage`, where present, override what is inferred
(`gputopo.model.request.parse_pod_request`).

A native PodGroup (Kubernetes Workload API, `scheduling.k8s.io/v1beta1`) is one more source: a pod
whose `spec.schedulingGroup.podGroupName` names one is a member of the group `podgroup/<name>`, of the
PodGroup's `spec.schedulingPolicy.gang.minCount` members, all under one switch of the tier whose
labels hold its `spec.schedulingConstraints.topology[].key` (`PodGroupShape`, `podgroup_shape`). It
comes first: it is the gang kube-scheduler itself holds the pods to.

Bad labels are never guessed at: a label that is missing, malformed or disagrees with the controller
raises `LabelError` (or `AnnotationError` for an annotation) naming it. Pure: no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from gputopo.model.joblabels import (
    CONTROLLERS,
    INDEX,
    JOB_COMPLETION_INDEX,
    JOB_CONTROLLER_UID,
    JOB_KEYS,
    JOB_NAME,
    JOBSET_EXCLUSIVE,
    JOBSET_GLOBAL_REPLICAS,
    JOBSET_JOB_GLOBAL_INDEX,
    JOBSET_JOB_INDEX,
    JOBSET_NAME,
    JOBSET_NODE_SELECTOR,
    JOBSET_REPLICATED_JOB,
    JOBSET_REPLICATED_JOB_REPLICAS,
    KUEUE_POD_GROUP,
    KUEUE_POD_INDEX,
    KUEUE_TOTAL_COUNT,
    LABEL_VALUE,
    LWS_GROUP_INDEX,
    LWS_NAME,
    LWS_SIZE,
    LWS_WORKER_INDEX,
    MAX_GROUP_SIZE,
    NO_FACTS,
    Controller,
    ControllerFacts,
    ExclusiveJobs,
    InferredGroup,
    JobShape,
    Pod,
    PodGroupError,
    PodGroupShape,
    index,
    label,
)

# The names importers read from here since before the table had its own module.
__all__ = [
    "CONTROLLERS",
    "JOBSET_EXCLUSIVE",
    "JOBSET_GLOBAL_REPLICAS",
    "JOBSET_JOB_GLOBAL_INDEX",
    "JOBSET_JOB_INDEX",
    "JOBSET_NAME",
    "JOBSET_NODE_SELECTOR",
    "JOBSET_REPLICATED_JOB",
    "JOBSET_REPLICATED_JOB_REPLICAS",
    "JOB_COMPLETION_INDEX",
    "JOB_CONTROLLER_UID",
    "JOB_KEYS",
    "JOB_NAME",
    "KUEUE_POD_GROUP",
    "KUEUE_POD_INDEX",
    "KUEUE_TOTAL_COUNT",
    "LWS_GROUP_INDEX",
    "LWS_NAME",
    "LWS_SIZE",
    "LWS_WORKER_INDEX",
    "MAX_GROUP_SIZE",
    "NO_FACTS",
    "ControllerFacts",
    "ExclusiveJobs",
    "InferredGroup",
    "JobShape",
    "PodGroupError",
    "PodGroupShape",
    "gang_min_count",
    "group_identity",
    "infer_group",
    "podgroup_shape",
    "tier_of_label",
]

_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def tier_of_label(tiers: Sequence[tuple[str, Sequence[str]]], key: str) -> str | None:
    """The tier (name, labels; widest first) whose labels contain the node label `key`, or None. A key that
    two tiers read (EKS layer-3: the spine of 4-layer nodes, else the leaf) names the narrower: one switch
    of it is within one domain of the key on every node."""
    for name, labels in reversed(tiers):
        if key in labels:
            return name
    return None


MIN_COUNT = "spec.schedulingPolicy.gang.minCount"
MISSING = object()  # a gang policy without its minCount


def gang_min_count(name: str, value: object) -> int | PodGroupError:
    """A gang PodGroup's minCount as gputopo can use it (1..MAX_GROUP_SIZE), or the error naming the field
    and the value: a malformed PodGroup tells its pods why, rather than leaving them waiting for it."""
    if value is MISSING:
        return PodGroupError(name, MIN_COUNT, "(missing)", "a gang policy needs it")
    if isinstance(value, bool) or not isinstance(value, int):
        kind = type(value).__name__
        return PodGroupError(name, MIN_COUNT, str(value)[:60], f"must be an integer, not a {kind}")
    if not 1 <= value <= MAX_GROUP_SIZE:
        return PodGroupError(name, MIN_COUNT, str(value), f"must be between 1 and {MAX_GROUP_SIZE} for gputopo")
    return value


def podgroup_shape(
    name: str, min_count: int | None, topology_keys: Sequence[str], tiers: Sequence[tuple[str, Sequence[str]]]
) -> PodGroupShape:
    """A PodGroup's shape, its topology keys mapped to gputopo's tiers. One key is all kube-scheduler
    1.37 honours ("all pods in one domain of that label"); several must map to one tier."""
    found: list[str] = []
    for i, key in enumerate(topology_keys):
        tier = tier_of_label(tiers, key)
        where = f"spec.schedulingConstraints.topology[{i}].key"
        if tier is None:
            known = "; ".join(f"{t}: {', '.join(labels)}" for t, labels in tiers)
            return PodGroupShape(
                name,
                min_count,
                None,
                str(PodGroupError(name, where, key, f"no gputopo tier reads this label ({known})")),
            )
        found.append(tier)
    if len(set(found)) > 1:
        return PodGroupShape(
            name,
            min_count,
            None,
            str(
                PodGroupError(
                    name, "spec.schedulingConstraints.topology", ",".join(topology_keys), "keys of more than one tier"
                )
            ),
        )
    return PodGroupShape(name, min_count, found[0] if found else None)


def _controller(labels: Mapping[str, str]) -> Controller | None:
    return next((c for c in CONTROLLERS if c.identity[0] in labels), None)


def infer_group(
    labels: Mapping[str, str] | None,
    annotations: Mapping[str, str] | None,
    facts: ControllerFacts = NO_FACTS,
    *,
    pod_group: str = "",
) -> InferredGroup | None:
    """The group a controller made this pod a member of, or None when no known controller's labels are
    there. `pod_group`: the pod's `spec.schedulingGroup.podGroupName` ("" when none); a PodGroup with
    a gang policy comes before any label. Raises LabelError/AnnotationError naming the label (or the
    PodGroup field) that is missing, malformed or disagrees with the controller's object; never guesses."""
    lab = labels or {}
    ann = annotations or {}
    if pod_group:
        found = _podgroup(pod_group, facts)
        if found is not None:
            return found
    c = _controller(lab)
    if c is None or (c.gang_when and not any(k in lab or k in ann for k in c.gang_when)):
        return None
    parts = []
    for key in c.identity:
        value = label(lab, key) or ""
        parts.append(str(index(key, value)) if key in c.numbered else value)
    return c.member(Pod(lab, ann), "/".join((c.prefix, *parts)), facts)


def _podgroup(name: str, facts: ControllerFacts) -> InferredGroup | None:
    """A native PodGroup member: size minCount, a free rank in name order (a PodGroup orders no pods),
    the tier of its topology key required. None for a `basic` PodGroup (no gang: the pods are placed
    one by one, as kube-scheduler does)."""
    if len(name) > 253 or not _SUBDOMAIN.fullmatch(name):
        raise PodGroupError(name, "spec.schedulingGroup.podGroupName", name, "must be a DNS-1123 subdomain")
    group = f"podgroup/{name}"
    shape = facts.podgroups.get(name)
    if shape is None:
        return InferredGroup(group, "PodGroup", "PodGroup", None, None, waiting=f"the PodGroup {name} is not known yet")
    if shape.problem:
        raise PodGroupError.said(shape.problem)
    if shape.min_count is None:
        return None
    size = gang_min_count(name, shape.min_count)
    if isinstance(size, PodGroupError):
        raise size
    return InferredGroup(
        group, "PodGroup", "its PodGroup", size, None, required_tier=shape.required_tier, at_least=True
    )


def group_identity(labels: Mapping[str, str] | None, pod_group: str = "") -> str | None:
    """The inferred group's name from the identity labels (or the PodGroup's name) alone (None when
    they are absent or malformed): a member whose rank or size labels are bad still belongs to its
    group, so that every member learns why the group cannot be placed."""
    lab = labels or {}
    if pod_group:
        return f"podgroup/{pod_group}" if len(pod_group) <= 253 and _SUBDOMAIN.fullmatch(pod_group) else None
    c = _controller(lab)
    if c is None:
        return None
    parts = []
    for key in c.identity:
        value = lab.get(key)
        if value is None or not LABEL_VALUE.fullmatch(value):
            return None
        if key in c.numbered:
            if not INDEX.fullmatch(value):
                return None
            value = str(int(value))
        parts.append(value)
    return "/".join((c.prefix, *parts))
