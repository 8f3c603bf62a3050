"""Holds are owned: JobSet exclusive placement holds GPUs for followers not created yet only while each Job
exists, is controlled by the JobSet, is neither suspended nor finished, and its leader is its own pod; a
Job suspended or finished later frees the hold at once; re-creating a leader never renews a hold."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gputopo.model import jobs as J
from tests.extender.harness import JSON, Env, gputopo_pod
from tests.extender.test_extender_exclusive import KEY, NODES, job_obj, member, reasons, with_jobs


@pytest.fixture
def cluster(env: Env) -> Env:
    from tests.extender.harness import two_leaves

    env.add_nodes(*two_leaves())
    return env


def _suspended(job: JSON) -> None:
    job["spec"]["suspend"] = True


def _finished(job: JSON) -> None:
    job["status"] = {"conditions": [{"type": "Complete", "status": "True"}]}


def _orphaned(job: JSON) -> None:
    job["metadata"]["ownerReferences"] = []  # its JobSet deleted with orphaning, or a Job made by hand


def _owned_by_another(job: JSON) -> None:
    job["metadata"]["ownerReferences"][0]["name"] = "other"


UNHELD = (
    "group jobset/js: JobSet exclusive placement holds GPUs only for pods a running Job of the JobSet will create: "
)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        pytest.param(_suspended, "Job js-w-1 is suspended (spec.suspend)", id="a-suspended-job-holds-nothing"),
        pytest.param(_finished, "Job js-w-1 has finished", id="a-finished-job-holds-nothing"),
        pytest.param(
            _orphaned,
            "Job js-w-1 is not controlled by JobSet js (its ownerReferences)",
            id="a-deleted-jobset-holds-nothing",
        ),
        pytest.param(
            _owned_by_another,
            "Job js-w-1 is not controlled by JobSet js (its ownerReferences)",
            id="a-job-of-another-jobset-holds-nothing",
        ),
    ],
)
def test_a_job_that_will_create_no_follower_holds_nothing(
    cluster: Env, change: Callable[[JSON], None], why: str
) -> None:
    cluster.source.put("jobs", job_obj(0))
    job = job_obj(1)
    change(job)
    cluster.source.put("jobs", job)
    cluster.add_pods(member(0, 0), member(1, 0))
    assert reasons(cluster, member(0, 0)) == {UNHELD + why}
    assert KEY not in cluster.ledger.reservations
    assert cluster.passed(gputopo_pod("other", 8), NODES) == NODES  # nothing held


@pytest.mark.parametrize(
    "uid",
    [
        pytest.param(None, id="a-hand-made-leader-without-the-job-s-uid-holds-nothing"),
        pytest.param("uid-forged", id="a-hand-made-leader-with-another-uid-holds-nothing"),
    ],
)
def test_a_hand_made_leader_holds_nothing(cluster: Env, uid: str | None) -> None:
    with_jobs(cluster)
    fake = member(1, 0)
    if uid is None:
        del fake["metadata"]["labels"][J.JOB_CONTROLLER_UID]
    else:
        fake["metadata"]["labels"][J.JOB_CONTROLLER_UID] = uid
    cluster.add_pods(member(0, 0), fake)
    name = fake["metadata"]["name"]
    assert reasons(cluster, member(0, 0)) == {
        UNHELD + f"pod {name} carries Job js-w-1's labels but the Job did not create it "
        f"({J.JOB_CONTROLLER_UID} is not the Job's UID)"
    }
    assert KEY not in cluster.ledger.reservations


@pytest.mark.parametrize(
    "change",
    [pytest.param(_suspended, id="suspended-later-frees-the-hold"), pytest.param(_finished, id="finished-later")],
)
def test_a_job_suspended_or_finished_later_frees_its_hold_at_once(cluster: Env, change: Callable[[JSON], None]) -> None:
    cluster.add_pods(member(0, 0), member(1, 0))
    with_jobs(cluster)
    assert len(cluster.passed(member(0, 0), NODES)) == 1
    assert KEY in cluster.ledger.reservations
    job = job_obj(1)
    change(job)
    cluster.cache.apply("jobs", "MODIFIED", cluster.source.put("jobs", job))
    assert KEY not in cluster.ledger.reservations


def test_re_creating_a_leader_does_not_renew_the_hold(cluster: Env) -> None:
    timeout = cluster.settings.reservation_timeout_seconds
    cluster.add_pods(member(0, 0), member(1, 0))
    with_jobs(cluster)
    assert len(cluster.passed(member(0, 0), NODES)) == 1
    first = cluster.ledger.reservations[KEY]
    cluster.clock.advance(timeout - 20)
    cluster.renew_leases()
    cluster.source.delete("pods", "default", member(1, 0)["metadata"]["name"])
    again = member(1, 0)
    again["metadata"]["name"] = "js-w-1-0-again"
    again["metadata"]["uid"] = "uid-again"
    cluster.add_pods(again)
    assert len(cluster.passed(again, NODES)) == 1  # planned again, with the new leader
    renewed = cluster.ledger.reservations[KEY]
    assert renewed is not first and "js-w-1-0-again" in renewed.slots
    assert renewed.expires(timeout) == first.expires(timeout)  # the first plan's clock, not a new one
    cluster.clock.advance(21)
    cluster.renew_leases()
    cluster.ledger.expire(cluster.clock.now)
    assert KEY not in cluster.ledger.reservations
