"""Hostile input to what holds and plan reuse read: Jobs whose ownerReferences, conditions or UID are
malformed or forged, another tenant's pod forging a Job's UID, floods of distinct selectors and of failed
groups. Each is refused or read as "holds nothing", named where it is refused, and never corrupts state
or grows it without bound."""

from __future__ import annotations

from typing import Any

import pytest

from gputopo.engine.gang.labelindex import SELECTORS_KEPT, LabelIndex
from gputopo.engine.gang.plan import GroupFailure
from gputopo.extender.state.ledger import Ledger
from gputopo.extender.state.records import BadObject
from gputopo.extender.verbs.gangs import FAILURES_KEPT, FailedPlans, _Failed
from gputopo.extender.watch.parsers import job_shape
from gputopo.model import Spread
from gputopo.model import jobs as J
from tests.extender.harness import Env, two_leaves
from tests.extender.verbs.test_exclusive import KEY, NODES, job_obj, member, with_jobs


def _job(**meta: Any) -> dict[str, Any]:
    job = job_obj(0)
    job["metadata"].update(meta)
    return job


@pytest.mark.parametrize(
    "refs",
    [
        pytest.param("JobSet js", id="ownerreferences-not-a-list-controls-nothing"),
        pytest.param(["js"], id="an-entry-not-a-map-controls-nothing"),
        pytest.param(
            [{"kind": "JobSet", "name": "js", "controller": "true"}], id="controller-as-a-string-is-no-controller"
        ),
        pytest.param([{"kind": "JobSet", "name": "js"}], id="an-owner-that-is-not-the-controller-controls-nothing"),
        pytest.param([{"kind": "Deployment", "name": "js", "controller": True}], id="another-kind-controls-nothing"),
        pytest.param([{"kind": "JobSet", "name": 7, "controller": True}], id="a-name-not-a-string-controls-nothing"),
        pytest.param(
            [{"kind": "Pod", "name": f"p{i}", "controller": False} for i in range(100_000)]
            + [{"kind": "JobSet", "name": "js", "controller": True}],
            id="a-flood-of-references-is-read-only-so-far",
        ),
    ],
)
def test_malformed_or_forged_owner_references_control_nothing(refs: Any) -> None:
    _, shape, _ = job_shape(_job(ownerReferences=refs))
    assert shape.owner_jobset is None
    assert shape.creates("js") == "Job js-w-0 is not controlled by JobSet js (its ownerReferences)"


@pytest.mark.parametrize(
    ("status", "finished"),
    [
        pytest.param({"conditions": "Complete"}, False, id="conditions-not-a-list-is-not-finished"),
        pytest.param({"conditions": [{"type": "Complete", "status": True}]}, False, id="status-must-be-the-string"),
        pytest.param({"conditions": [{"type": "Complete", "status": "False"}]}, False, id="a-false-condition"),
        pytest.param({"conditions": [None, {"type": "Failed", "status": "True"}]}, True, id="failed-is-finished"),
        pytest.param(
            {"conditions": [{"type": "X", "status": "True"}] * 100_000 + [{"type": "Complete", "status": "True"}]},
            False,
            id="a-flood-of-conditions-is-read-only-so-far",
        ),
        pytest.param("done", False, id="status-not-a-map-is-not-finished"),
    ],
)
def test_malformed_conditions_never_finish_a_job_by_accident(status: Any, finished: bool) -> None:
    job = _job()
    job["status"] = status
    assert job_shape(job)[1].finished is finished


def test_a_uid_that_is_not_a_string_is_refused_naming_the_field() -> None:
    with pytest.raises(BadObject, match=r"metadata\.uid is not a string"):
        job_shape(_job(uid=["forged"]))


def test_another_tenants_pod_forging_a_jobs_uid_changes_nothing_of_its_holds(env: Env) -> None:
    env.add_nodes(*two_leaves())
    env.add_pods(member(0, 0), member(1, 0))
    with_jobs(env)
    assert len(env.passed(member(0, 0), NODES)) == 1
    held = dict(env.ledger.reservations[KEY].slots)
    forged = member(1, 0)
    forged["metadata"].update(namespace="team-b", uid="uid-forged", name="js-w-1-0-forged")
    env.add_pods(forged)
    assert env.reasons(forged, NODES)  # its own namespace's group: no Job there, nothing planned
    assert env.ledger.reservations[KEY].slots == held
    assert ("team-b", "jobset/js") not in env.ledger.reservations


def test_a_flood_of_distinct_selectors_keeps_a_bounded_number_of_answers() -> None:
    index = LabelIndex({f"n{i}": {"rack": f"r{i % 4}"} for i in range(8)})
    for i in range(SELECTORS_KEPT + 500):
        assert index.select((("example.com/slot", f"s-{i}"),)) == frozenset()
    assert len(index._answers) <= SELECTORS_KEPT
    assert index.select((("rack", "r1"),)) == {"n1", "n5"}  # answers stay right past the bound


def test_a_flood_of_failed_groups_keeps_a_bounded_number_of_failures() -> None:
    plans = FailedPlans(Ledger())
    for i in range(FAILURES_KEPT + 100):
        failure = GroupFailure(f"g{i}", "no room")
        plans.keep(("ns", f"g{i}"), _Failed(failure, ((), Spread.NONE, 2), 1, ["n0"], [], 0, 0))
    assert len(plans) == FAILURES_KEPT
    assert plans.reused(("ns", "g0"), ((), Spread.NONE, 2), 1, ["n0"]) is None  # the oldest went first
    last = f"g{FAILURES_KEPT + 99}"
    assert plans.reused(("ns", last), ((), Spread.NONE, 2), 1, ["n0"]) == GroupFailure(last, "no room")
    assert J.JOB_CONTROLLER_UID in J.JOB_KEYS  # the label a leader's ownership is read from is kept
