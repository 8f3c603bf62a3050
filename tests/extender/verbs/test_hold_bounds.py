"""Holds are owned: JobSet exclusive placement holds GPUs for followers not created yet only while the JobSet
the Jobs' ownerReferences name exists with that UID (where JobSets are served)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gputopo.extender.watch.source import Informer
from tests.extender.harness import JSON, Env, two_leaves
from tests.extender.verbs.test_exclusive import KEY, NODES, jobset_obj, member, reasons, with_jobs

UNHELD = (
    "group jobset/js: JobSet exclusive placement holds GPUs only for pods a running Job of the JobSet will create: "
)


@pytest.fixture
def cluster(env: Env) -> Env:
    env.add_nodes(*two_leaves())
    return env


def _planned(cluster: Env) -> JSON:
    cluster.add_pods(member(0, 0), member(1, 0))
    return cluster.filter(member(0, 0), NODES)


# --------------------------------------------------------------------------------------------------
# JobSets watched


def _deleted(cluster: Env) -> None:
    cluster.source.delete("jobsets", "default", "js")
    cluster.cache.apply("jobsets", "DELETED", jobset_obj())


def _replaced(cluster: Env) -> None:
    _deleted(cluster)
    cluster.cache.apply("jobsets", "ADDED", cluster.source.put("jobsets", jobset_obj("uid-js-2")))


def _relisted_without_it(cluster: Env) -> None:
    cluster.source.delete("jobsets", "default", "js")
    Informer(cluster.source, "jobsets", cluster.cache).relist()


@pytest.mark.parametrize(
    ("change", "why"),
    [
        pytest.param(_deleted, "JobSet js does not exist", id="a-jobset-deleted-releases-its-hold"),
        pytest.param(
            _relisted_without_it, "JobSet js does not exist", id="a-jobset-gone-from-a-relist-releases-its-hold"
        ),
        pytest.param(
            _replaced,
            "JobSet js is not the one the Jobs' ownerReferences name (its UID differs)",
            id="a-jobset-re-made-under-the-name-releases-the-old-one-s-hold",
        ),
    ],
)
def test_a_jobset_gone_releases_its_hold_and_the_next_filter_says_why(
    cluster: Env, change: Callable[[Env], None], why: str
) -> None:
    with_jobs(cluster)
    assert len(_planned(cluster)["NodeNames"]) == 1
    assert KEY in cluster.ledger.reservations
    change(cluster)
    assert KEY not in cluster.ledger.reservations  # released at once, not at the reservation timeout
    assert reasons(cluster, member(0, 0)) == {UNHELD + why}
    assert KEY not in cluster.ledger.reservations


@pytest.mark.parametrize(
    ("jobset", "why"),
    [
        pytest.param(None, "JobSet js does not exist", id="an-ownerreference-to-no-jobset-holds-nothing"),
        pytest.param(
            jobset_obj("uid-other"),
            "JobSet js is not the one the Jobs' ownerReferences name (its UID differs)",
            id="an-ownerreference-with-a-foreign-uid-holds-nothing",
        ),
    ],
)
def test_a_forged_jobset_ownerreference_holds_nothing(cluster: Env, jobset: JSON | None, why: str) -> None:
    with_jobs(cluster)
    cluster.source.delete("jobsets", "default", "js")
    if jobset is not None:
        cluster.source.put("jobsets", jobset)
    cluster.resync()
    out = _planned(cluster)
    assert out["NodeNames"] == []
    assert set(out["FailedNodes"].values()) == {UNHELD + why}
    assert KEY not in cluster.ledger.reservations


def test_without_the_jobset_api_the_jobs_ownerreference_is_read_alone(cluster: Env) -> None:
    with_jobs(cluster)
    cluster.add_pods(member(0, 0), member(1, 0))
    cluster.source.not_served.add("jobsets")  # the JobSet put by with_jobs is no longer listed
    Informer(cluster.source, "jobsets", cluster.cache, not_served_recheck_seconds=0).relist()
    assert not cluster.cache.jobsets.served
    assert len(cluster.filter(member(0, 0), NODES)["NodeNames"]) == 1
    assert KEY in cluster.ledger.reservations


def test_before_jobsets_are_read_nothing_is_held(cluster: Env) -> None:
    with_jobs(cluster)
    cluster.add_pods(member(0, 0), member(1, 0))
    cluster.cache.jobsets.listed = False
    assert reasons(cluster, member(0, 0)) | reasons(cluster, member(1, 0)) == {UNHELD + "JobSets are not read yet"}
