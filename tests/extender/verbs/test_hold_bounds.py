"""Holds are owned and bounded: JobSet exclusive placement holds GPUs for followers not created yet only while
the JobSet the Jobs' ownerReferences name exists with that UID (where JobSets are served), and a namespace's
holds stay within the room its ResourceQuotas on GPUs have left, or the chart's bound where none has one."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gputopo.extender.watch.source import Informer
from tests.extender.harness import JSON, Env, two_leaves
from tests.extender.verbs.test_exclusive import KEY, NODES, jobset_obj, member, reasons, with_jobs

UNHELD = (
    "group jobset/js: JobSet exclusive placement holds GPUs only for pods a running Job of the JobSet will create: "
)
PROMISED = 16  # the followers of the test JobSet not created yet: 2 Jobs x 1 follower x 8 GPUs


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


# --------------------------------------------------------------------------------------------------
# ResourceQuotas bound the holds


def quota(
    name: str,
    hard: str | None,
    used: str | None = "0",
    *,
    namespace: str = "default",
    resource: str = "requests.nvidia.com/gpu",
    scopes: list[str] | None = None,
) -> JSON:
    spec: JSON = {"hard": {"pods": "100", **({resource: hard} if hard is not None else {})}}
    if scopes is not None:
        spec["scopes"] = scopes
    status: JSON = {"used": {"pods": "3", **({resource: used} if used is not None else {})}}
    return {"metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}"}, "spec": spec, "status": status}


def _told(bound: int, quota_words: str) -> str:
    return (
        f"group jobset/js: JobSet exclusive placement would hold {PROMISED} GPUs for pods not created yet; "
        f"namespace default holds 0 for such pods already and may hold at most {bound} ({quota_words})"
    )


@pytest.mark.parametrize(
    ("quotas", "told"),
    [
        pytest.param([quota("gpus", "16")], None, id="a-quota-with-room-for-the-followers-lets-them-be-held"),
        pytest.param(
            [quota("gpus", "32", "24")],
            _told(8, "ResourceQuota gpus: requests.nvidia.com/gpu hard 32, used 24, free 8"),
            id="a-quota-with-too-little-room-holds-nothing-and-names-the-quota",
        ),
        pytest.param(
            [quota("wide", "64"), quota("tight", "8")],
            _told(8, "ResourceQuota tight: requests.nvidia.com/gpu hard 8, used 0, free 8"),
            id="the-tightest-of-several-quotas-bounds",
        ),
        pytest.param(
            [quota("gpus", "8", "12")],
            _told(0, "ResourceQuota gpus: requests.nvidia.com/gpu hard 8, used 12, free 0"),
            id="a-quota-used-past-its-hard-leaves-no-room-never-less",
        ),
        pytest.param([quota("gpus", "64")], None, id="a-quota-replaces-the-chart-bound-where-it-has-more-room"),
        pytest.param(
            [quota("gpus", "0", scopes=["NotTerminating"])],
            _told(8, "--max-held-gpus-per-namespace"),
            id="a-scoped-quota-is-not-read-the-chart-bound-applies",
        ),
        pytest.param(
            [quota("gpus", "0", namespace="team-b")],
            _told(8, "--max-held-gpus-per-namespace"),
            id="another-namespace-s-quota-never-bounds-this-one",
        ),
        pytest.param(
            [quota("gpus", "64", resource="limits.nvidia.com/gpu")],
            _told(8, "--max-held-gpus-per-namespace"),
            id="only-the-requests-prefix-bounds-an-extended-resource",
        ),
        pytest.param(
            [quota("gpus", "64", None)],
            _told(0, "ResourceQuota gpus: status.used[requests.nvidia.com/gpu] is not counted yet"),
            id="a-quota-not-counted-yet-leaves-no-room",
        ),
    ],
)
def test_a_namespaces_holds_stay_within_its_quotas_room(cluster: Env, quotas: list[JSON], told: str | None) -> None:
    cluster.extender.groups.exclusive.max_promised = 8  # the chart's bound: too little for the followers
    for q in quotas:
        cluster.source.put("resourcequotas", q)
    with_jobs(cluster)
    out = _planned(cluster)
    if told is None:
        assert len(out["NodeNames"]) == 1
        assert cluster.ledger.book.held_by_namespace(promised=True) == {"default": PROMISED}
        return
    assert out["NodeNames"] == []
    assert set(out["FailedNodes"].values()) == {told}
    assert KEY not in cluster.ledger.reservations


def test_a_quota_changed_by_a_watch_event_bounds_the_next_filter(cluster: Env) -> None:
    with_jobs(cluster)
    cluster.add_pods(member(0, 0), member(1, 0))
    cluster.cache.apply("resourcequotas", "ADDED", quota("gpus", "8"))
    assert cluster.filter(member(0, 0), NODES)["NodeNames"] == []
    cluster.cache.apply("resourcequotas", "MODIFIED", quota("gpus", "16"))
    assert len(cluster.filter(member(0, 0), NODES)["NodeNames"]) == 1
    cluster.ledger.release(KEY)
    cluster.cache.apply("resourcequotas", "MODIFIED", quota("gpus", "16", "16"))
    assert cluster.filter(member(0, 0), NODES)["NodeNames"] == []
    cluster.cache.apply("resourcequotas", "DELETED", quota("gpus", "16", "16"))
    assert len(cluster.filter(member(0, 0), NODES)["NodeNames"]) == 1  # the chart's 1,024 again


def test_before_quotas_are_read_nothing_is_held(cluster: Env) -> None:
    with_jobs(cluster)
    cluster.add_pods(member(0, 0), member(1, 0))
    cluster.cache.quotas.listed = False
    (why,) = set(cluster.filter(member(0, 0), NODES)["FailedNodes"].values())
    assert why.endswith("may hold at most 0 (ResourceQuota (not read yet): ResourceQuotas are not read yet)")
