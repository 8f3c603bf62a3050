"""Groups inferred from the labels the job controllers put on their pods (docs/annotations.md, "Jobs").

A pod that a controller made as one member of a job (an Indexed Job, a JobSet and so a Kubeflow
Trainer v2 TrainJob, a LeaderWorkerSet group, a Kubeflow v1 PyTorchJob or MPIJob, a Kueue pod group)
is a gputopo group member without any `gputopo.io/` annotation. `infer_group` reads the group's
identity, its size and the member's rank (its stage: placement order) from the pod's labels and
annotations, and, where the labels do not carry the size, from what the controller's objects say
(`ControllerFacts`, read by the caller). The annotations `gputopo.io/group`, `group-size` and `stage`,
where present, override what is inferred (`gputopo.model.request.parse_pod_request`).

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
from dataclasses import dataclass, field

from gputopo.model.base import AnnotationError, LabelError, short_value

# Label and annotation names, each from its controller's API types:
# Job: k8s.io/api batch/v1 types.go (kubernetes v1.34): JobNameLabel, ControllerUidLabel,
# JobCompletionIndexAnnotation (also a pod label since v1.28, PodIndexLabel).
JOB_NAME = "batch.kubernetes.io/job-name"
JOB_COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
# JobSet: kubernetes-sigs/jobset api/jobset/v1alpha2/jobset_types.go (v0.8): JobSetNameKey, JobSetUIDKey,
# ReplicatedJobNameKey, ReplicatedJobReplicas, GlobalReplicasKey, JobIndexKey, JobGlobalIndexKey.
JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"
JOBSET_REPLICATED_JOB = "jobset.sigs.k8s.io/replicatedjob-name"
JOBSET_REPLICATED_JOB_REPLICAS = "jobset.sigs.k8s.io/replicatedjob-replicas"
JOBSET_GLOBAL_REPLICAS = "jobset.sigs.k8s.io/global-replicas"
JOBSET_JOB_INDEX = "jobset.sigs.k8s.io/job-index"
JOBSET_JOB_GLOBAL_INDEX = "jobset.sigs.k8s.io/job-global-index"
# LeaderWorkerSet: kubernetes-sigs/lws api/leaderworkerset/v1/leaderworkerset_types.go (v0.7):
# SetNameLabelKey, GroupIndexLabelKey, WorkerIndexLabelKey (0: the leader), SizeAnnotationKey.
LWS_NAME = "leaderworkerset.sigs.k8s.io/name"
LWS_GROUP_INDEX = "leaderworkerset.sigs.k8s.io/group-index"
LWS_WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"
LWS_SIZE = "leaderworkerset.sigs.k8s.io/size"
# Kubeflow v1 (training-operator): kubeflow/training-operator pkg/apis/kubeflow.org/v1/common_types.go
# (v1.8): JobNameLabel, ReplicaTypeLabel (lower case: master, launcher, worker), ReplicaIndexLabel.
KUBEFLOW_JOB_NAME = "training.kubeflow.org/job-name"
KUBEFLOW_REPLICA_TYPE = "training.kubeflow.org/replica-type"
KUBEFLOW_REPLICA_INDEX = "training.kubeflow.org/replica-index"
# Kueue pod groups: kubernetes-sigs/kueue pkg/controller/constants/constants.go and
# pkg/controller/jobs/pod/constants (v0.13): GroupNameLabel, GroupTotalCountAnnotation,
# PodGroupPodIndexLabel.
KUEUE_POD_GROUP = "kueue.x-k8s.io/pod-group-name"
KUEUE_TOTAL_COUNT = "kueue.x-k8s.io/pod-group-total-count"
KUEUE_POD_INDEX = "kueue.x-k8s.io/pod-group-pod-index"

# The replica types of a Kubeflow v1 job in rank order: the coordinator first (PyTorchJob's Master,
# MPIJob's Launcher), then the workers.
KUBEFLOW_TYPE_ORDER = ("master", "launcher", "worker")

MAX_GROUP_SIZE = 4096  # as gputopo.io/group-size
_LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_INDEX = re.compile(r"^[0-9]{1,9}$")
_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


@dataclass(frozen=True)
class JobShape:
    """What a batch/v1 Job object says: its pod count when run as one gang (spec.completions of an
    Indexed Job whose spec.parallelism runs them all at once), or why it is no gang."""

    name: str
    completions: int | None
    parallelism: int | None
    indexed: bool
    global_index: int | None = None  # jobset.sigs.k8s.io/job-global-index on a JobSet's Job
    global_replicas: int | None = None  # jobset.sigs.k8s.io/global-replicas on a JobSet's Job

    def gang(self) -> int | str:
        """The Job's pod count, or why its pods cannot run as one group."""
        if not self.indexed:
            return f"Job {self.name} is not Indexed (spec.completionMode)"
        if self.completions is None:
            return f"Job {self.name} has no spec.completions"
        if self.parallelism is not None and self.parallelism < self.completions:
            return (
                f"Job {self.name} runs {self.parallelism} of its {self.completions} pods at once "
                "(spec.parallelism below spec.completions): no gang"
            )
        return self.completions


class PodGroupError(AnnotationError):
    """A PodGroup field that gputopo cannot use; the message names the PodGroup, the field and the value."""

    def __init__(self, podgroup: str, fld: str, value: str, why: str) -> None:
        super().__init__(fld, value, why)
        self.args = (f"invalid PodGroup {podgroup}: {fld}={short_value(value)}: {why}",)

    def __str__(self) -> str:
        return str(self.args[0])

    @classmethod
    def said(cls, message: str) -> PodGroupError:
        """The error again from its message (a PodGroupShape keeps only the text)."""
        err = cls("", "", "", "")
        err.args = (message,)
        return err


@dataclass(frozen=True)
class PodGroupShape:
    """What a scheduling.k8s.io PodGroup says: its gang size (`spec.schedulingPolicy.gang.minCount`;
    None for a `basic` policy, which is no gang), and the tier its topology constraint requires
    (None when it has none), or why that constraint cannot be used (`problem`)."""

    name: str
    min_count: int | None
    required_tier: str | None = None
    problem: str = ""


def tier_of_label(tiers: Sequence[tuple[str, Sequence[str]]], key: str) -> str | None:
    """The tier (name, labels; widest first) whose labels contain the node label `key`, or None."""
    for name, labels in tiers:
        if key in labels:
            return name
    return None


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


@dataclass(frozen=True)
class ControllerFacts:
    """Controller objects of one namespace, as the caller read them: Jobs by name, a JobSet's Jobs by
    their global index, a Kubeflow v1 job's replicas by replica type (lower case), PodGroups by name."""

    jobs: Mapping[str, JobShape] = field(default_factory=dict)
    jobsets: Mapping[str, Mapping[int, JobShape]] = field(default_factory=dict)
    kubeflow: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    podgroups: Mapping[str, PodGroupShape] = field(default_factory=dict)


NO_FACTS = ControllerFacts()


@dataclass(frozen=True)
class InferredGroup:
    """A pod's group as its controller's labels give it."""

    group: str  # e.g. "jobset/llama-pretrain": never a valid gputopo.io/group value, so never the same
    controller: str  # "JobSet", "LeaderWorkerSet", "Job", "PyTorchJob", "MPIJob", "Kueue pod group"
    source: str  # where it came from, for the placement sentence: "JobSet labels"
    size: int | None  # None: the controller's object has not been seen yet (`waiting` says which)
    rank: int | None  # None: the member takes a free rank in name order (Kueue without a pod index)
    rank_label: str = ""  # the label(s) the rank comes from, for messages
    waiting: str = ""
    required_tier: str | None = None  # a PodGroup's topology constraint, as a gputopo tier

    def words(self) -> str:
        """'group jobset/llama-pretrain, rank 5 of 16, from JobSet labels'."""
        of = f" of {self.size}" if self.size is not None else ""
        rank = f", rank {self.rank}{of}" if self.rank is not None else (f", {self.size} members" if of else "")
        return f"group {self.group}{rank}, from {self.source}"


def _label(labels: Mapping[str, str], key: str, *, required: bool = True) -> str | None:
    v = labels.get(key)
    if v is None:
        if required:
            raise LabelError(key, "", "missing; the pod's controller sets it")
        return None
    if not _LABEL_VALUE.fullmatch(v):
        raise LabelError(key, v, "must be a label value (letters, digits, - _ ., at most 63)")
    return v


def _index(key: str, value: str, *, annotation: bool = False) -> int:
    if not _INDEX.fullmatch(value):
        err = AnnotationError if annotation else LabelError
        raise err(key, value, "must be a non-negative integer")
    return int(value)


def _size(key: str, value: str, *, annotation: bool) -> int:
    n = _index(key, value, annotation=annotation)
    if not 1 <= n <= MAX_GROUP_SIZE:
        err = AnnotationError if annotation else LabelError
        raise err(key, value, f"must be between 1 and {MAX_GROUP_SIZE}")
    return n


def _below(key: str, value: str, rank: int, size: int | None, what: str) -> None:
    if size is not None and rank >= size:
        raise LabelError(key, value, f"rank {rank} is not below the {what} {size}")


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
    if KUEUE_POD_GROUP in lab:
        return _kueue(lab, ann)
    if LWS_NAME in lab:
        return _lws(lab, ann)
    if JOBSET_NAME in lab:
        return _jobset(lab, ann, facts)
    if KUBEFLOW_JOB_NAME in lab:
        return _kubeflow(lab, facts)
    if JOB_NAME in lab and (JOB_COMPLETION_INDEX in lab or JOB_COMPLETION_INDEX in ann):
        return _job(lab, ann, facts)
    return None  # a non-Indexed Job's pods are interchangeable: no ranks, no gang


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
    if not 1 <= shape.min_count <= MAX_GROUP_SIZE:
        raise PodGroupError(
            name,
            "spec.schedulingPolicy.gang.minCount",
            str(shape.min_count),
            f"must be between 1 and {MAX_GROUP_SIZE} for gputopo",
        )
    return InferredGroup(group, "PodGroup", "its PodGroup", shape.min_count, None, required_tier=shape.required_tier)


def _completion_index(lab: Mapping[str, str], ann: Mapping[str, str]) -> int:
    if JOB_COMPLETION_INDEX in lab:
        return _index(JOB_COMPLETION_INDEX, lab[JOB_COMPLETION_INDEX])
    return _index(JOB_COMPLETION_INDEX, ann.get(JOB_COMPLETION_INDEX, ""), annotation=True)


def _kueue(lab: Mapping[str, str], ann: Mapping[str, str]) -> InferredGroup:
    name = _label(lab, KUEUE_POD_GROUP)
    if KUEUE_TOTAL_COUNT not in ann:
        raise LabelError(KUEUE_POD_GROUP, name or "", f"needs the annotation {KUEUE_TOTAL_COUNT} as well")
    size = _size(KUEUE_TOTAL_COUNT, ann[KUEUE_TOTAL_COUNT], annotation=True)
    rank = None
    if KUEUE_POD_INDEX in lab:
        rank = _index(KUEUE_POD_INDEX, lab[KUEUE_POD_INDEX])
        _below(KUEUE_POD_INDEX, lab[KUEUE_POD_INDEX], rank, size, KUEUE_TOTAL_COUNT)
    return InferredGroup(f"kueue/{name}", "Kueue pod group", "Kueue pod-group labels", size, rank, KUEUE_POD_INDEX)


def _lws(lab: Mapping[str, str], ann: Mapping[str, str]) -> InferredGroup:
    name = _label(lab, LWS_NAME)
    group = _index(LWS_GROUP_INDEX, _label(lab, LWS_GROUP_INDEX) or "")
    worker = _index(LWS_WORKER_INDEX, _label(lab, LWS_WORKER_INDEX) or "")
    if LWS_SIZE not in ann:
        raise LabelError(LWS_NAME, name or "", f"needs the annotation {LWS_SIZE} as well")
    size = _size(LWS_SIZE, ann[LWS_SIZE], annotation=True)
    _below(LWS_WORKER_INDEX, lab[LWS_WORKER_INDEX], worker, size, LWS_SIZE)
    return InferredGroup(
        f"lws/{name}/{group}", "LeaderWorkerSet", "LeaderWorkerSet labels", size, worker, LWS_WORKER_INDEX
    )


def _job(lab: Mapping[str, str], ann: Mapping[str, str], facts: ControllerFacts) -> InferredGroup:
    name = _label(lab, JOB_NAME) or ""
    rank = _completion_index(lab, ann)
    group = f"job/{name}"
    shape = facts.jobs.get(name)
    if shape is None:
        return InferredGroup(
            group, "Job", "Job labels", None, rank, JOB_COMPLETION_INDEX, waiting=f"the Job {name} is not known yet"
        )
    gang = shape.gang()
    if isinstance(gang, str):
        raise LabelError(JOB_NAME, name, gang)
    _below(JOB_COMPLETION_INDEX, str(rank), rank, gang, "Job's spec.completions")
    return InferredGroup(group, "Job", "Job labels and the Job's spec", gang, rank, JOB_COMPLETION_INDEX)


def _jobset(lab: Mapping[str, str], ann: Mapping[str, str], facts: ControllerFacts) -> InferredGroup:
    """Rank: the Jobs before this one (by job-global-index) contribute their pod counts, then the pod's
    completion index within its Job. Size: every Job's pods. The Jobs come from `facts`."""
    name = _label(lab, JOBSET_NAME) or ""
    gidx_text = _label(lab, JOBSET_JOB_GLOBAL_INDEX) or ""
    gidx = _index(JOBSET_JOB_GLOBAL_INDEX, gidx_text)
    replicas_text = _label(lab, JOBSET_GLOBAL_REPLICAS) or ""
    replicas = _size(JOBSET_GLOBAL_REPLICAS, replicas_text, annotation=False)
    _below(JOBSET_JOB_GLOBAL_INDEX, gidx_text, gidx, replicas, JOBSET_GLOBAL_REPLICAS)
    index = _completion_index(lab, ann)
    group = f"jobset/{name}"
    rank_label = f"{JOBSET_JOB_GLOBAL_INDEX} and {JOB_COMPLETION_INDEX}"
    jobs = facts.jobsets.get(name, {})
    for j in jobs.values():
        if j.global_replicas is not None and j.global_replicas != replicas:
            raise LabelError(
                JOBSET_GLOBAL_REPLICAS,
                replicas_text,
                f"disagrees with the JobSet's Job {j.name}, which says {j.global_replicas}",
            )
    if len(jobs) < replicas:
        return InferredGroup(
            group,
            "JobSet",
            "JobSet labels",
            None,
            None,
            rank_label,
            waiting=f"{len(jobs)}/{replicas} of the JobSet's Jobs are known",
        )
    if len(jobs) > replicas or set(jobs) != set(range(replicas)):
        raise LabelError(
            JOBSET_GLOBAL_REPLICAS,
            replicas_text,
            f"disagrees with the JobSet's Jobs: global indices {sorted(jobs)[:8]}",
        )
    counts: list[int] = []
    for g in range(replicas):
        gang = jobs[g].gang()
        if isinstance(gang, str):
            raise LabelError(JOBSET_NAME, name, gang)
        counts.append(gang)
    size = sum(counts)
    if size > MAX_GROUP_SIZE:
        raise LabelError(JOBSET_NAME, name, f"the JobSet has {size} pods; a group holds at most {MAX_GROUP_SIZE}")
    _below(JOB_COMPLETION_INDEX, str(index), index, counts[gidx], f"pod count of its Job {jobs[gidx].name}")
    return InferredGroup(group, "JobSet", "JobSet labels and its Jobs", size, sum(counts[:gidx]) + index, rank_label)


def _kubeflow(lab: Mapping[str, str], facts: ControllerFacts) -> InferredGroup:
    """Rank: the replica types in KUBEFLOW_TYPE_ORDER, each type's replicas before the next, then the
    replica index. Size and the counts per type come from the job object (`facts.kubeflow`)."""
    name = _label(lab, KUBEFLOW_JOB_NAME) or ""
    rtype_text = _label(lab, KUBEFLOW_REPLICA_TYPE) or ""
    rtype = rtype_text.lower()
    if rtype not in KUBEFLOW_TYPE_ORDER:
        raise LabelError(KUBEFLOW_REPLICA_TYPE, rtype_text, "must be one of " + ", ".join(KUBEFLOW_TYPE_ORDER))
    index = _index(KUBEFLOW_REPLICA_INDEX, _label(lab, KUBEFLOW_REPLICA_INDEX) or "")
    controller = "MPIJob" if rtype == "launcher" else "PyTorchJob"
    group = f"kubeflow/{name}"
    rank_label = f"{KUBEFLOW_REPLICA_TYPE} and {KUBEFLOW_REPLICA_INDEX}"
    counts = facts.kubeflow.get(name)
    if counts is None:
        return InferredGroup(
            group, controller, "Kubeflow labels", None, None, rank_label, waiting=f"the job {name} is not known yet"
        )
    if "launcher" in counts:
        controller = "MPIJob"
    if counts.get(rtype, 0) <= index:
        raise LabelError(
            KUBEFLOW_REPLICA_INDEX, str(index), f"is not below the job's {rtype} replicas {counts.get(rtype, 0)}"
        )
    size = sum(counts.get(t, 0) for t in KUBEFLOW_TYPE_ORDER)
    if not 1 <= size <= MAX_GROUP_SIZE:
        raise LabelError(KUBEFLOW_JOB_NAME, name, f"the job has {size} replicas; a group holds 1 to {MAX_GROUP_SIZE}")
    offset = sum(counts.get(t, 0) for t in KUBEFLOW_TYPE_ORDER[: KUBEFLOW_TYPE_ORDER.index(rtype)])
    return InferredGroup(
        group, controller, f"{controller} labels and its replicaSpecs", size, offset + index, rank_label
    )


# Every label or annotation `infer_group` reads: what a pod record keeps to infer again when the
# controller's object arrives after its pods.
JOB_KEYS = frozenset(
    {
        JOB_NAME,
        JOB_COMPLETION_INDEX,
        JOBSET_NAME,
        JOBSET_GLOBAL_REPLICAS,
        JOBSET_JOB_GLOBAL_INDEX,
        LWS_NAME,
        LWS_GROUP_INDEX,
        LWS_WORKER_INDEX,
        LWS_SIZE,
        KUBEFLOW_JOB_NAME,
        KUBEFLOW_REPLICA_TYPE,
        KUBEFLOW_REPLICA_INDEX,
        KUEUE_POD_GROUP,
        KUEUE_TOTAL_COUNT,
        KUEUE_POD_INDEX,
    }
)


def group_identity(labels: Mapping[str, str] | None, pod_group: str = "") -> str | None:
    """The inferred group's name from the identity labels (or the PodGroup's name) alone (None when
    they are absent or malformed): a member whose rank or size labels are bad still belongs to its
    group, so that every member learns why the group cannot be placed."""
    lab = labels or {}
    if pod_group:
        return f"podgroup/{pod_group}" if len(pod_group) <= 253 and _SUBDOMAIN.fullmatch(pod_group) else None

    def ok(key: str) -> str | None:
        v = lab.get(key)
        return v if v is not None and _LABEL_VALUE.fullmatch(v) else None

    if KUEUE_POD_GROUP in lab:
        return f"kueue/{ok(KUEUE_POD_GROUP)}" if ok(KUEUE_POD_GROUP) else None
    if LWS_NAME in lab:
        name, group = ok(LWS_NAME), ok(LWS_GROUP_INDEX)
        return f"lws/{name}/{group}" if name and group and _INDEX.fullmatch(group) else None
    if JOBSET_NAME in lab:
        return f"jobset/{ok(JOBSET_NAME)}" if ok(JOBSET_NAME) else None
    if KUBEFLOW_JOB_NAME in lab:
        return f"kubeflow/{ok(KUBEFLOW_JOB_NAME)}" if ok(KUBEFLOW_JOB_NAME) else None
    if JOB_NAME in lab:
        return f"job/{ok(JOB_NAME)}" if ok(JOB_NAME) else None
    return None
