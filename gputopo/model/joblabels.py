"""The job controllers whose pods are gang members by their labels: one table, one row per controller.

Each row (`Controller`) declares the labels that name the pod's group, the other labels and annotations
it reads, and one function from the pod (its labels and annotations, the group already named) and the
controller objects the caller read (`ControllerFacts`) to the member's `InferredGroup`: its size and
rank. `gputopo.model.jobs` walks `CONTROLLERS` in order; the first row whose first identity label the
pod carries decides. Adding a controller is one function and one row here.

Bad labels are never guessed at: a label that is missing, malformed or disagrees with the controller
raises `LabelError` (or `AnnotationError` for an annotation) naming it. Pure: no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from gputopo.model.base import AnnotationError, LabelError, short_value
from gputopo.model.k8snames import ascii_int

# Label and annotation names, each from its controller's API types:
# Job: k8s.io/api batch/v1 types.go (kubernetes v1.34): JobNameLabel, ControllerUidLabel,
# JobCompletionIndexAnnotation (also a pod label since v1.28, PodIndexLabel).
JOB_NAME = "batch.kubernetes.io/job-name"
JOB_COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
JOB_CONTROLLER_UID = "batch.kubernetes.io/controller-uid"  # the Job's UID, on every pod it creates
# JobSet: kubernetes-sigs/jobset api/jobset/v1alpha2/jobset_types.go (v0.8): JobSetNameKey, JobSetUIDKey,
# ReplicatedJobNameKey, ReplicatedJobReplicas, GlobalReplicasKey, JobIndexKey, JobGlobalIndexKey.
JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"
JOBSET_REPLICATED_JOB = "jobset.sigs.k8s.io/replicatedjob-name"
JOBSET_REPLICATED_JOB_REPLICAS = "jobset.sigs.k8s.io/replicatedjob-replicas"
JOBSET_GLOBAL_REPLICAS = "jobset.sigs.k8s.io/global-replicas"
JOBSET_JOB_INDEX = "jobset.sigs.k8s.io/job-index"
JOBSET_JOB_GLOBAL_INDEX = "jobset.sigs.k8s.io/job-global-index"
# JobSet exclusive placement (v0.11.1 to v0.12.0: ExclusiveKey, NodeSelectorStrategyKey): annotations the JobSet
# controller copies from the JobSet (or a ReplicatedJob's template) onto its Jobs and their pods.
JOBSET_EXCLUSIVE = "alpha.jobset.sigs.k8s.io/exclusive-topology"
JOBSET_NODE_SELECTOR = "alpha.jobset.sigs.k8s.io/node-selector"
MAX_LABEL_KEY = 317  # a label key: a 253-character prefix, "/", a 63-character name
# LeaderWorkerSet: kubernetes-sigs/lws api/leaderworkerset/v1/leaderworkerset_types.go (v0.7):
# SetNameLabelKey, GroupIndexLabelKey, WorkerIndexLabelKey (0: the leader), SizeAnnotationKey.
LWS_NAME = "leaderworkerset.sigs.k8s.io/name"
LWS_GROUP_INDEX = "leaderworkerset.sigs.k8s.io/group-index"
LWS_WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"
LWS_SIZE = "leaderworkerset.sigs.k8s.io/size"
# Kueue pod groups: kubernetes-sigs/kueue pkg/controller/constants/constants.go and
# pkg/controller/jobs/pod/constants (v0.13): GroupNameLabel, GroupTotalCountAnnotation,
# PodGroupPodIndexLabel.
KUEUE_POD_GROUP = "kueue.x-k8s.io/pod-group-name"
KUEUE_TOTAL_COUNT = "kueue.x-k8s.io/pod-group-total-count"
KUEUE_POD_INDEX = "kueue.x-k8s.io/pod-group-pod-index"

MAX_GROUP_SIZE = 4096  # as gputopo.io/group-size
LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
INDEX = re.compile(r"^[0-9]{1,9}$")
MAX_INDEX = 999_999_999  # what INDEX admits


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
    uid: str = ""  # metadata.uid: its pods carry it (JOB_CONTROLLER_UID)
    suspended: bool = False  # spec.suspend: it creates no pods
    finished: bool = False  # a Complete or Failed condition: it creates no more pods
    owner_jobset: str | None = None  # the JobSet of its controller ownerReference (None: none)
    owner_jobset_uid: str = ""  # that ownerReference's UID ("": none, or unreadable)

    def creates(self, jobset: str) -> str | None:
        """Why this Job will not create the pods of JobSet `jobset` a hold would wait for (None: it will)."""
        if self.owner_jobset != jobset:
            return f"Job {self.name} is not controlled by JobSet {jobset} (its ownerReferences)"
        if self.suspended:
            return f"Job {self.name} is suspended (spec.suspend)"
        if self.finished:
            return f"Job {self.name} has finished"
        return None

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


@dataclass(frozen=True)
class ControllerFacts:
    """Controller objects of one namespace, as the caller read them: Jobs by name, a JobSet's Jobs by
    their global index, PodGroups by name."""

    jobs: Mapping[str, JobShape] = field(default_factory=dict)
    jobsets: Mapping[str, Mapping[int, JobShape]] = field(default_factory=dict)
    podgroups: Mapping[str, PodGroupShape] = field(default_factory=dict)


NO_FACTS = ControllerFacts()


@dataclass(frozen=True)
class ExclusiveJobs:
    """A JobSet under JobSet's exclusive placement (`JOBSET_EXCLUSIVE` without the node-selector strategy):
    each Job's pods in one domain of the node label `key`, one Job per domain. JobSet's pod webhook admits a
    Job's followers (completion index > 0) only once its leader (index 0) is scheduled, and pins them to
    the leader's domain by a nodeSelector."""

    key: str  # the node label whose values are the domains
    jobs: tuple[tuple[str, int], ...]  # (Job name, pod count) by job-global-index

    def slot(self, rank: int) -> str:
        """The name of the slot held for the pod of JobSet rank `rank` until it exists: 'job-name#index'
        ('#' is in no pod name, so a slot never takes a pod's name)."""
        for name, count in self.jobs:
            if rank < count:
                return f"{name}#{rank}"
            rank -= count
        raise IndexError(rank)


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
    exclusive: ExclusiveJobs | None = None  # a JobSet's exclusive placement, with its Jobs
    at_least: bool = False  # `size` is a minimum: a native PodGroup's minCount

    def words(self) -> str:
        """'group jobset/llama-pretrain, rank 5 of 16, from JobSet labels'."""
        of = f" of {self.size}" if self.size is not None else ""
        rank = f", rank {self.rank}{of}" if self.rank is not None else (f", {self.size} members" if of else "")
        return f"group {self.group}{rank}, from {self.source}"


class Pod(NamedTuple):
    """What inference reads of a pod."""

    labels: Mapping[str, str]
    annotations: Mapping[str, str]


# One controller's member: (the pod, its group's name, the controller objects) -> its size and rank.
Member = Callable[[Pod, str, ControllerFacts], InferredGroup]


@dataclass(frozen=True)
class Controller:
    """One row of the table: how a controller's pods are gang members."""

    prefix: str  # the group is "<prefix>/<identity value>/...": never a valid gputopo.io/group value
    identity: tuple[str, ...]  # the labels naming the group; the first marks the pod as this controller's
    reads: tuple[str, ...]  # every other label or annotation `member` reads
    member: Member
    numbered: tuple[str, ...] = ()  # identity labels whose value is an index
    # A pod is a member only when it carries one of these (labels or annotations); () for always.
    gang_when: tuple[str, ...] = ()


def label(labels: Mapping[str, str], key: str, *, required: bool = True) -> str | None:
    v = labels.get(key)
    if v is None:
        if required:
            raise LabelError(key, "", "missing; the pod's controller sets it")
        return None
    if not LABEL_VALUE.fullmatch(v):
        raise LabelError(key, v, "must be a label value (letters, digits, - _ ., at most 63)")
    return v


def index(key: str, value: str, *, annotation: bool = False) -> int:
    """A controller's index or count label (or annotation): ASCII digits only (the one parser,
    gputopo.model.k8snames.ascii_int), at most 9 of them."""
    n = ascii_int(value, 0, MAX_INDEX)
    if n is None:
        err = AnnotationError if annotation else LabelError
        raise err(key, value, "must be a non-negative integer")
    return n


def _size(key: str, value: str, *, annotation: bool) -> int:
    n = index(key, value, annotation=annotation)
    if not 1 <= n <= MAX_GROUP_SIZE:
        err = AnnotationError if annotation else LabelError
        raise err(key, value, f"must be between 1 and {MAX_GROUP_SIZE}")
    return n


def _below(key: str, value: str, rank: int, size: int | None, what: str) -> None:
    if size is not None and rank >= size:
        raise LabelError(key, value, f"rank {rank} is not below the {what} {size}")


def _completion_index(pod: Pod) -> int:
    if JOB_COMPLETION_INDEX in pod.labels:
        return index(JOB_COMPLETION_INDEX, pod.labels[JOB_COMPLETION_INDEX])
    return index(JOB_COMPLETION_INDEX, pod.annotations.get(JOB_COMPLETION_INDEX, ""), annotation=True)


def _kueue(pod: Pod, group: str, _facts: ControllerFacts) -> InferredGroup:
    lab, ann = pod
    if KUEUE_TOTAL_COUNT not in ann:
        raise LabelError(KUEUE_POD_GROUP, lab[KUEUE_POD_GROUP], f"needs the annotation {KUEUE_TOTAL_COUNT} as well")
    n = _size(KUEUE_TOTAL_COUNT, ann[KUEUE_TOTAL_COUNT], annotation=True)
    rank = None
    if KUEUE_POD_INDEX in lab:
        rank = index(KUEUE_POD_INDEX, lab[KUEUE_POD_INDEX])
        _below(KUEUE_POD_INDEX, lab[KUEUE_POD_INDEX], rank, n, KUEUE_TOTAL_COUNT)
    return InferredGroup(group, "Kueue pod group", "Kueue pod-group labels", n, rank, KUEUE_POD_INDEX)


def _lws(pod: Pod, group: str, _facts: ControllerFacts) -> InferredGroup:
    lab, ann = pod
    worker = index(LWS_WORKER_INDEX, label(lab, LWS_WORKER_INDEX) or "")
    if LWS_SIZE not in ann:
        raise LabelError(LWS_NAME, lab[LWS_NAME], f"needs the annotation {LWS_SIZE} as well")
    n = _size(LWS_SIZE, ann[LWS_SIZE], annotation=True)
    _below(LWS_WORKER_INDEX, lab[LWS_WORKER_INDEX], worker, n, LWS_SIZE)
    return InferredGroup(group, "LeaderWorkerSet", "LeaderWorkerSet labels", n, worker, LWS_WORKER_INDEX)


def _job(pod: Pod, group: str, facts: ControllerFacts) -> InferredGroup:
    name = pod.labels[JOB_NAME]
    rank = _completion_index(pod)
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


def _jobset(pod: Pod, group: str, facts: ControllerFacts) -> InferredGroup:
    """Rank: the Jobs before this one (by job-global-index) contribute their pod counts, then the pod's
    completion index within its Job. Size: every Job's pods. The Jobs come from `facts`."""
    lab = pod.labels
    name = lab[JOBSET_NAME]
    gidx_text = label(lab, JOBSET_JOB_GLOBAL_INDEX) or ""
    gidx = index(JOBSET_JOB_GLOBAL_INDEX, gidx_text)
    replicas_text = label(lab, JOBSET_GLOBAL_REPLICAS) or ""
    replicas = _size(JOBSET_GLOBAL_REPLICAS, replicas_text, annotation=False)
    _below(JOBSET_JOB_GLOBAL_INDEX, gidx_text, gidx, replicas, JOBSET_GLOBAL_REPLICAS)
    rank_in_job = _completion_index(pod)
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
        waiting = f"{len(jobs)}/{replicas} of the JobSet's Jobs are known"
        return InferredGroup(group, "JobSet", "JobSet labels", None, None, rank_label, waiting=waiting)
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
    total = sum(counts)
    if total > MAX_GROUP_SIZE:
        raise LabelError(JOBSET_NAME, name, f"the JobSet has {total} pods; a group holds at most {MAX_GROUP_SIZE}")
    _below(JOB_COMPLETION_INDEX, str(rank_in_job), rank_in_job, counts[gidx], f"pod count of its Job {jobs[gidx].name}")
    rank = sum(counts[:gidx]) + rank_in_job
    exclusive = _exclusive(pod.annotations, tuple((jobs[g].name, counts[g]) for g in range(replicas)))
    return InferredGroup(group, "JobSet", "JobSet labels and its Jobs", total, rank, rank_label, exclusive=exclusive)


def _exclusive(ann: Mapping[str, str], jobs: tuple[tuple[str, int], ...]) -> ExclusiveJobs | None:
    """The JobSet's exclusive placement as its pod's annotations give it; None without it, or under the
    node-selector strategy (nodes labelled per Job beforehand: every pod is created at once)."""
    key = ann.get(JOBSET_EXCLUSIVE)
    if key is None or JOBSET_NODE_SELECTOR in ann:
        return None
    if not 0 < len(key) <= MAX_LABEL_KEY or any(c.isspace() for c in key):
        raise AnnotationError(JOBSET_EXCLUSIVE, key, "must be a node label key")
    return ExclusiveJobs(key, jobs)


# In precedence order: the first row whose first identity label a pod carries decides (a JobSet's pods
# carry its Jobs' labels too, so JobSet comes before Job).
CONTROLLERS: tuple[Controller, ...] = (
    Controller("kueue", (KUEUE_POD_GROUP,), (KUEUE_TOTAL_COUNT, KUEUE_POD_INDEX), _kueue),
    Controller("lws", (LWS_NAME, LWS_GROUP_INDEX), (LWS_WORKER_INDEX, LWS_SIZE), _lws, numbered=(LWS_GROUP_INDEX,)),
    Controller(
        "jobset",
        (JOBSET_NAME,),
        (JOBSET_GLOBAL_REPLICAS, JOBSET_JOB_GLOBAL_INDEX, JOB_COMPLETION_INDEX, JOBSET_EXCLUSIVE, JOBSET_NODE_SELECTOR),
        _jobset,
    ),
    # A non-Indexed Job's pods are interchangeable: no ranks, no gang.
    Controller("job", (JOB_NAME,), (JOB_COMPLETION_INDEX,), _job, gang_when=(JOB_COMPLETION_INDEX,)),
)

# Every label or annotation inference reads: what a pod record keeps to infer again when the
# controller's object arrives after its pods.
JOB_KEYS = frozenset(k for c in CONTROLLERS for k in (*c.identity, *c.reads)) | {JOB_CONTROLLER_UID}
