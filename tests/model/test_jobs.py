"""Groups inferred from controllers' labels: identity, size and rank per controller; annotations override;
bad labels are named, never guessed at."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gputopo.engine.gang.groups import plan_group
from gputopo.engine.gang.plan import GroupPlan, Member
from gputopo.engine.state.snapshot import NodeState, node_state
from gputopo.model import (
    AnnotationError,
    ControllerFacts,
    InferredGroup,
    JobShape,
    Spread,
    infer_group,
    parse_pod_request,
)
from gputopo.model import jobs as J
from gputopo.systems import build_system


def jobset_pod(gidx: int, index: int, replicas: int = 2, name: str = "llama") -> dict[str, str]:
    return {
        J.JOBSET_NAME: name,
        J.JOBSET_GLOBAL_REPLICAS: str(replicas),
        J.JOBSET_JOB_GLOBAL_INDEX: str(gidx),
        J.JOB_NAME: f"{name}-w-{gidx}",
        J.JOB_COMPLETION_INDEX: str(index),
    }


def jobset_jobs(*parallelism: int, name: str = "llama") -> ControllerFacts:
    jobs = {
        g: JobShape(f"{name}-w-{g}", p, p, True, global_index=g, global_replicas=len(parallelism))
        for g, p in enumerate(parallelism)
    }
    return ControllerFacts(jobsets={name: jobs})


LWS = {J.LWS_NAME: "vllm", J.LWS_GROUP_INDEX: "1", J.LWS_WORKER_INDEX: "0"}
INDEXED = ControllerFacts(jobs={"train": JobShape("train", 4, 4, True)})


# The labels Kubeflow's training-operator (v1) puts on a PyTorchJob's or MPIJob's pods.
KUBEFLOW_JOB_NAME = "training.kubeflow.org/job-name"
KUBEFLOW_REPLICA_TYPE = "training.kubeflow.org/replica-type"
KUBEFLOW_REPLICA_INDEX = "training.kubeflow.org/replica-index"


@pytest.mark.parametrize(
    ("labels", "annotations", "facts", "expected"),
    [
        # JobSet: global rank = the pods of the Jobs before this one, then the completion index.
        (jobset_pod(1, 2), {}, jobset_jobs(4, 4), ("jobset/llama", 8, 6, "JobSet labels and its Jobs")),
        (jobset_pod(1, 0), {}, jobset_jobs(2, 8), ("jobset/llama", 10, 2, "JobSet labels and its Jobs")),
        (jobset_pod(0, 0, replicas=1), {}, jobset_jobs(1), ("jobset/llama", 1, 0, "JobSet labels and its Jobs")),
        # LeaderWorkerSet: each group is a gang; the leader (worker-index 0) is rank 0.
        (LWS, {J.LWS_SIZE: "4"}, ControllerFacts(), ("lws/vllm/1", 4, 0, "LeaderWorkerSet labels")),
        # Indexed Job: the completion index, as a label or (before v1.28) only the annotation.
        (
            {J.JOB_NAME: "train", J.JOB_COMPLETION_INDEX: "3"},
            {},
            INDEXED,
            ("job/train", 4, 3, "Job labels and the Job's spec"),
        ),
        (
            {J.JOB_NAME: "train"},
            {J.JOB_COMPLETION_INDEX: "1"},
            INDEXED,
            ("job/train", 4, 1, "Job labels and the Job's spec"),
        ),
        # Kueue pod groups: the pod index when given, else a free rank in name order.
        (
            {J.KUEUE_POD_GROUP: "pg", J.KUEUE_POD_INDEX: "2"},
            {J.KUEUE_TOTAL_COUNT: "3"},
            ControllerFacts(),
            ("kueue/pg", 3, 2, "Kueue pod-group labels"),
        ),
        (
            {J.KUEUE_POD_GROUP: "pg"},
            {J.KUEUE_TOTAL_COUNT: "3"},
            ControllerFacts(),
            ("kueue/pg", 3, None, "Kueue pod-group labels"),
        ),
    ],
)
def test_group_size_and_rank_come_from_the_controllers_labels(
    labels: dict[str, str], annotations: dict[str, str], facts: ControllerFacts, expected: tuple[object, ...]
) -> None:
    got = infer_group(labels, annotations, facts)
    assert got is not None
    assert (got.group, got.size, got.rank, got.source) == expected


@pytest.mark.parametrize(
    ("labels", "annotations"),
    [
        ({}, {}),
        ({"app": "web"}, {}),
        ({J.JOB_NAME: "batch"}, {}),  # a non-Indexed Job's pods are interchangeable: no group
        # Kubeflow v1 (training-operator) jobs: gputopo reads none of their objects; annotate them.
        ({KUBEFLOW_JOB_NAME: "pt", KUBEFLOW_REPLICA_TYPE: "worker", KUBEFLOW_REPLICA_INDEX: "0"}, {}),
    ],
)
def test_pods_without_a_known_controller_are_no_group(labels: dict[str, str], annotations: dict[str, str]) -> None:
    assert infer_group(labels, annotations) is None


@pytest.mark.parametrize(
    ("labels", "facts", "waiting"),
    [
        ({J.JOB_NAME: "train", J.JOB_COMPLETION_INDEX: "0"}, ControllerFacts(), "the Job train is not known yet"),
        (
            jobset_pod(0, 0),
            ControllerFacts(jobsets={"llama": {0: JobShape("llama-w-0", 4, 4, True, 0, 2)}}),
            "1/2 of the JobSet's Jobs are known",
        ),
    ],
)
def test_a_size_only_the_controller_object_carries_waits_for_it(
    labels: dict[str, str], facts: ControllerFacts, waiting: str
) -> None:
    got = infer_group(labels, {}, facts)
    assert got is not None and got.size is None and got.waiting == waiting


@pytest.mark.parametrize(
    ("labels", "annotations", "facts", "message"),
    [
        (
            {**LWS, J.LWS_WORKER_INDEX: "4"},
            {J.LWS_SIZE: "4"},
            ControllerFacts(),
            'invalid label leaderworkerset.sigs.k8s.io/worker-index="4": rank 4 is not below the '
            "leaderworkerset.sigs.k8s.io/size 4",
        ),
        (
            LWS,
            {},
            ControllerFacts(),
            'invalid label leaderworkerset.sigs.k8s.io/name="vllm": needs the annotation '
            "leaderworkerset.sigs.k8s.io/size as well",
        ),
        (
            {J.LWS_NAME: "vllm", J.LWS_WORKER_INDEX: "0"},
            {J.LWS_SIZE: "2"},
            ControllerFacts(),
            'invalid label leaderworkerset.sigs.k8s.io/group-index="": missing; the pod\'s controller sets it',
        ),
        (
            {J.KUEUE_POD_GROUP: "pg"},
            {J.KUEUE_TOTAL_COUNT: "many"},
            ControllerFacts(),
            'invalid annotation kueue.x-k8s.io/pod-group-total-count="many": must be a non-negative integer',
        ),
        (
            {J.KUEUE_POD_GROUP: "pg"},
            {J.KUEUE_TOTAL_COUNT: "0"},
            ControllerFacts(),
            'invalid annotation kueue.x-k8s.io/pod-group-total-count="0": must be between 1 and 4096',
        ),
        (
            {J.JOB_NAME: "train", J.JOB_COMPLETION_INDEX: "4"},
            {},
            INDEXED,
            'invalid label batch.kubernetes.io/job-completion-index="4": rank 4 is not below the '
            "Job's spec.completions 4",
        ),
        (
            jobset_pod(0, 0, replicas=3),
            {},
            jobset_jobs(4, 4),
            'invalid label jobset.sigs.k8s.io/global-replicas="3": disagrees with the JobSet\'s Job llama-w-0, '
            "which says 2",
        ),
        (
            {J.JOB_NAME: "train", J.JOB_COMPLETION_INDEX: "0"},
            {},
            ControllerFacts(jobs={"train": JobShape("train", 8, 2, True)}),
            'invalid label batch.kubernetes.io/job-name="train": Job train runs 2 of its 8 pods at once '
            "(spec.parallelism below spec.completions): no gang",
        ),
        (
            {J.JOBSET_NAME: "x y"},
            {},
            ControllerFacts(),
            'invalid label jobset.sigs.k8s.io/jobset-name="x y": must be a label value '
            "(letters, digits, - _ ., at most 63)",
        ),
    ],
)
def test_bad_labels_are_named_never_guessed(
    labels: dict[str, str], annotations: dict[str, str], facts: ControllerFacts, message: str
) -> None:
    with pytest.raises(AnnotationError) as e:
        infer_group(labels, annotations, facts)
    assert str(e.value) == message


INFERRED = InferredGroup("jobset/llama", "JobSet", "JobSet labels", 8, 5, J.JOB_COMPLETION_INDEX)


@pytest.mark.parametrize(
    ("annotations", "expected"),
    [
        ({}, ("jobset/llama", 8, 5)),
        ({"gputopo.io/stage": "2"}, ("jobset/llama", 8, 2)),
        ({"gputopo.io/group": "pp"}, ("pp", 8, 5)),
        ({"gputopo.io/group": "pp", "gputopo.io/group-size": "6", "gputopo.io/stage": "0"}, ("pp", 6, 0)),
        ({"gputopo.io/group-size": "16"}, ("jobset/llama", 16, 5)),
    ],
)
def test_annotations_override_what_is_inferred(annotations: dict[str, str], expected: tuple[object, ...]) -> None:
    req = parse_pod_request(annotations, 8, inferred=INFERRED)
    assert (req.group, req.group_size, req.stage) == expected


@pytest.mark.parametrize(
    ("annotations", "spread"),
    [
        ({}, Spread.NONE),  # an inferred gang packs members that take part of a node
        ({"gputopo.io/stage": "2"}, Spread.NONE),
        ({"gputopo.io/group-size": "16"}, Spread.NONE),
        ({"gputopo.io/spread": "node"}, Spread.NODE),  # the annotation overrides, as any other
        ({"gputopo.io/group": "pp"}, Spread.NODE),  # a gputopo group keeps gputopo's default
    ],
)
def test_an_inferred_group_packs_its_members_unless_annotated(annotations: dict[str, str], spread: Spread) -> None:
    assert parse_pod_request(annotations, 4, inferred=INFERRED).spread is spread


def _leaf_nodes(count: int, leaves: int) -> list[NodeState]:
    return [
        node_state(
            f"n{i}",
            build_system("dgx-h100", f"n{i}"),
            labels={"gputopo.io/network-spine": "s", "gputopo.io/network-leaf": f"leaf-{i % leaves}"},
        )
        for i in range(count)
    ]


@pytest.mark.parametrize("node_count", [8, 12], ids=["exactly-enough", "room-to-spare"])
def test_an_indexed_job_of_half_node_pods_pairs_ranks_on_nodes_and_fills_one_leaf_first(node_count: int) -> None:
    # 16 pods x 4 GPUs, 8-GPU nodes on two leaves: ranks 2k and 2k+1 share a node, ranks 0-7 a leaf.
    facts = ControllerFacts(jobs={"train": JobShape("train", 16, 16, True)})
    members = []
    for i in range(16):
        got = infer_group({J.JOB_NAME: "train", J.JOB_COMPLETION_INDEX: str(i)}, {}, facts)
        members.append(Member(f"train-{i}", parse_pod_request({}, 4, inferred=got)))
    plan = plan_group("job/train", members, _leaf_nodes(node_count, 2))
    assert isinstance(plan, GroupPlan), plan
    by_rank = {a.stage: a.node for a in plan.assignments}
    assert all(by_rank[2 * k].name == by_rank[2 * k + 1].name for k in range(8))
    assert len({by_rank[r].name for r in range(16)}) == 8
    assert len({by_rank[r].location["leaf"] for r in range(8)}) == 1


def test_an_overriding_size_below_the_inferred_rank_names_the_rank_label() -> None:
    with pytest.raises(AnnotationError, match=r"batch\.kubernetes\.io/job-completion-index.*rank 5 is not below"):
        parse_pod_request({"gputopo.io/group-size": "4"}, 8, inferred=INFERRED)


def test_the_sentence_names_the_group_its_rank_and_where_it_came_from() -> None:
    got = infer_group(jobset_pod(1, 1, name="llama-pretrain"), {}, jobset_jobs(8, 8, name="llama-pretrain"))
    assert got is not None
    assert got.words() == "group jobset/llama-pretrain, rank 9 of 16, from JobSet labels and its Jobs"


KEYS = [
    J.JOBSET_NAME,
    J.JOBSET_GLOBAL_REPLICAS,
    J.JOBSET_JOB_GLOBAL_INDEX,
    J.JOB_NAME,
    J.JOB_COMPLETION_INDEX,
    J.LWS_NAME,
    J.LWS_GROUP_INDEX,
    J.LWS_WORKER_INDEX,
    J.LWS_SIZE,
    KUBEFLOW_JOB_NAME,
    KUBEFLOW_REPLICA_TYPE,
    KUBEFLOW_REPLICA_INDEX,
    J.KUEUE_POD_GROUP,
    J.KUEUE_TOTAL_COUNT,
    J.KUEUE_POD_INDEX,
    "app",
]
VALUES = st.one_of(
    st.sampled_from(["0", "1", "3", "4096", "4097", "-1", "", "llama", "Master", "worker", "x" * 70, "01"]),
    st.text(max_size=12),
    st.integers(-5, 10**12).map(str),
)
MAPS = st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=8)
SHAPES = st.builds(
    JobShape,
    name=st.sampled_from(["llama-w-0", "train", "x"]),
    completions=st.one_of(st.none(), st.integers(0, 5000)),
    parallelism=st.one_of(st.none(), st.integers(0, 5000)),
    indexed=st.booleans(),
    global_index=st.one_of(st.none(), st.integers(0, 3)),
    global_replicas=st.one_of(st.none(), st.integers(0, 3)),
)
FACTS = st.builds(
    ControllerFacts,
    jobs=st.dictionaries(st.sampled_from(["train", "llama", "x"]), SHAPES, max_size=2),
    jobsets=st.dictionaries(st.sampled_from(["llama", "x"]), st.dictionaries(st.integers(-1, 4), SHAPES, max_size=4)),
)


@given(labels=MAPS, annotations=MAPS, facts=FACTS)
def test_arbitrary_labels_give_a_group_none_or_a_named_error(
    labels: dict[str, str], annotations: dict[str, str], facts: ControllerFacts
) -> None:
    try:
        got = infer_group(labels, annotations, facts)
    except AnnotationError as e:
        assert e.key in KEYS and str(e).startswith(("invalid label ", "invalid annotation "))
        return
    if got is None:
        return
    if got.size is None:
        assert got.waiting
        return
    assert 1 <= got.size <= J.MAX_GROUP_SIZE
    assert got.rank is None or 0 <= got.rank < got.size
    req = parse_pod_request({}, 1, inferred=got)
    assert (req.group, req.group_size, req.stage) == (got.group, got.size, got.rank)
