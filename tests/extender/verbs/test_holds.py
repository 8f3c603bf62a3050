"""Holds are owned: JobSet exclusive placement holds GPUs for followers not created yet only while each Job
exists, is controlled by the JobSet, is neither suspended nor finished, and its leader is its own pod; a
Job suspended or finished later frees the hold at once; re-creating a leader never renews a hold."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime

import pytest

from gputopo.engine.gang.replan import Slot
from gputopo.extender.settings import Settings
from gputopo.extender.state.reservations import Reservation
from gputopo.model import jobs as J
from tests.extender.harness import JSON, Env, gputopo_pod, node_obj, pod_obj, two_leaves
from tests.extender.verbs.test_exclusive import KEY, NODES, job_obj, jobset_obj, member, reasons, with_jobs


@pytest.fixture
def cluster(env: Env) -> Env:
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
    cluster.source.put("jobsets", jobset_obj())
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


def _held_everywhere(cluster: Env) -> None:
    """The JobSet of namespace default planned: its leaders and followers hold every node's GPUs."""
    cluster.add_pods(member(0, 0), member(1, 0))
    with_jobs(cluster)
    assert len(cluster.passed(member(0, 0), NODES)) == 1


def test_a_pod_of_another_namespace_refused_for_a_hold_is_told_whose_and_until_when(cluster: Env) -> None:
    _held_everywhere(cluster)
    res = cluster.ledger.reservations[KEY]
    until = datetime.fromtimestamp(res.expires(cluster.settings.reservation_timeout_seconds), UTC)
    victim = pod_obj("victim", 8, {"gputopo.io/nvlink": "required"}, namespace="team-b")
    out = cluster.filter(victim, NODES)
    assert out["NodeNames"] == []
    told = {**out["FailedNodes"], **out["FailedAndUnresolvableNodes"]}
    stamp = until.strftime("%Y-%m-%dT%H:%M:%SZ")
    held = {n for n, why in told.items() if f"8 GPUs here held for group default/jobset/js until {stamp}" in why}
    assert held == {s.node for s in res.slots.values() if not s.pinned}


def test_a_pod_of_the_same_namespace_is_not_told_of_its_own_groups_hold(cluster: Env) -> None:
    _held_everywhere(cluster)
    told = cluster.reasons(gputopo_pod("mine", 8), NODES)
    assert not any("held for group" in why for why in told)


def test_held_gpus_are_a_metric_per_namespace(cluster: Env) -> None:
    registry = cluster.metrics.registry
    assert registry.get_sample_value("gputopo_extender_held_gpus", {"namespace": "default"}) is None
    _held_everywhere(cluster)
    assert registry.get_sample_value("gputopo_extender_held_gpus", {"namespace": "default"}) == 32
    cluster.ledger.release(KEY)
    assert registry.get_sample_value("gputopo_extender_held_gpus", {"namespace": "default"}) is None


@pytest.mark.parametrize(
    ("bound", "held_by_others", "planned"),
    [
        pytest.param(16, False, True, id="within-the-bound-the-followers-are-held"),
        pytest.param(8, False, False, id="over-the-bound-nothing-is-held-and-the-leader-is-told"),
        pytest.param(0, False, False, id="a-bound-of-0-holds-no-follower"),
        pytest.param(16, True, False, id="another-jobset-s-holds-in-the-namespace-count-too"),
    ],
)
def test_a_namespace_holds_no_more_gpus_for_pods_not_created_than_its_bound(
    cluster: Env, bound: int, held_by_others: bool, planned: bool
) -> None:
    cluster.extender.groups.exclusive.max_promised = bound
    if held_by_others:
        _promise_elsewhere(cluster, 8)
    cluster.add_pods(member(0, 0), member(1, 0))
    with_jobs(cluster)
    out = cluster.filter(member(0, 0), NODES)
    if planned:
        assert len(out["NodeNames"]) == 1
        assert cluster.ledger.book.held_by_namespace(promised=True) == {"default": 16}
        return
    assert out["NodeNames"] == []
    (why,) = set(out["FailedNodes"].values())
    held = 8 if held_by_others else 0
    assert why == (
        f"group jobset/js: JobSet exclusive placement would hold 16 GPUs for pods not created yet; namespace "
        f"default holds {held} for such pods already and may hold at most {bound} (--max-held-gpus-per-namespace)"
    )
    assert KEY not in cluster.ledger.reservations


def _promise_elsewhere(cluster: Env, gpus: int) -> None:
    """Another group of the namespace holding `gpus` GPUs for a pod not created yet."""

    cluster.add_nodes(node_obj("gpu-9", leaf="leaf-z", spine="s1"))  # a node of its own, outside the JobSet's
    key = ("default", "jobset/other")
    slot = Slot("w#1", "gpu-9", frozenset(range(gpus)), 1, False)
    assert cluster.ledger.reserve(Reservation(key, cluster.clock.now, {"w#1": slot}))


def test_the_bound_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().max_held_gpus_per_namespace == 1024
    monkeypatch.setenv("GPUTOPO_MAX_HELD_GPUS_PER_NAMESPACE", "64")
    assert Settings().max_held_gpus_per_namespace == 64
    monkeypatch.setenv("GPUTOPO_MAX_HELD_GPUS_PER_NAMESPACE", "-1")
    with pytest.raises(ValueError, match="max_held_gpus_per_namespace"):
        Settings()
