"""A JobSet pod's exclusive placement as inference reads it: the exclusive-topology annotation JobSet copies
onto its pods gives the label and the JobSet's Jobs (names, pod counts); the node-selector strategy and its
absence give none; a key that is no label key is named; held slots are named by Job and completion index."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gputopo.model import AnnotationError, ControllerFacts, JobShape, infer_group
from gputopo.model import jobs as J
from gputopo.model.joblabels import ExclusiveJobs

LEAF = "gputopo.io/network-leaf"


def labels(gidx: int, index: int) -> dict[str, str]:
    return {
        J.JOBSET_NAME: "js",
        J.JOBSET_GLOBAL_REPLICAS: "2",
        J.JOBSET_JOB_GLOBAL_INDEX: str(gidx),
        J.JOB_NAME: f"js-w-{gidx}",
        J.JOB_COMPLETION_INDEX: str(index),
    }


FACTS = ControllerFacts(jobsets={"js": {g: JobShape(f"js-w-{g}", 3, 3, True, g, 2) for g in range(2)}})


@pytest.mark.parametrize(
    ("annotations", "want"),
    [
        ({J.JOBSET_EXCLUSIVE: LEAF}, ExclusiveJobs(LEAF, (("js-w-0", 3), ("js-w-1", 3)))),
        (
            {J.JOBSET_EXCLUSIVE: "kubernetes.io/hostname"},
            ExclusiveJobs("kubernetes.io/hostname", (("js-w-0", 3), ("js-w-1", 3))),
        ),
        ({J.JOBSET_EXCLUSIVE: LEAF, J.JOBSET_NODE_SELECTOR: "true"}, None),  # nodes labelled per Job beforehand
        ({}, None),
    ],
    ids=["leaf", "hostname", "node-selector strategy", "none"],
)
def test_the_exclusive_annotation_gives_the_label_and_the_jobs(
    annotations: dict[str, str], want: ExclusiveJobs | None
) -> None:
    inferred = infer_group(labels(1, 2), annotations, FACTS)
    assert inferred is not None and inferred.rank == 5 and inferred.size == 6
    assert inferred.exclusive == want


def test_a_key_that_is_no_label_key_is_named() -> None:
    with pytest.raises(AnnotationError) as err:
        infer_group(labels(0, 0), {J.JOBSET_EXCLUSIVE: "a b"}, FACTS)
    assert str(err.value) == f'invalid annotation {J.JOBSET_EXCLUSIVE}="a b": must be a node label key'


def test_held_slots_are_named_by_job_and_completion_index() -> None:
    ex = ExclusiveJobs(LEAF, (("js-w-0", 2), ("js-w-1", 3)))
    assert [ex.slot(r) for r in range(5)] == ["js-w-0#0", "js-w-0#1", "js-w-1#0", "js-w-1#1", "js-w-1#2"]
    with pytest.raises(IndexError):
        ex.slot(5)


def test_inference_keeps_the_annotations_to_infer_again() -> None:
    assert {J.JOBSET_EXCLUSIVE, J.JOBSET_NODE_SELECTOR} <= J.JOB_KEYS


@given(st.text(max_size=400))
def test_any_annotation_value_is_a_key_or_a_named_error(value: str) -> None:
    try:
        inferred = infer_group(labels(0, 1), {J.JOBSET_EXCLUSIVE: value}, FACTS)
    except AnnotationError as e:
        assert J.JOBSET_EXCLUSIVE in str(e)
        return
    assert inferred is not None and inferred.exclusive is not None and inferred.exclusive.key == value
