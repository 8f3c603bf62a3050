"""The shapes of what the JobSet and LeaderWorkerSet controllers create (``workloads.py``), without a
cluster: names, labels, annotations, owner references and the spec fields the sources set. Runs in
the unit suite (no ``e2e`` mark)."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import workloads as wl
from hypothesis import given
from hypothesis import strategies as st

from gputopo.localcluster import pod_manifest

UID = "0b9f3c1e-0000-4000-8000-000000000001"
JOBSET_KEYS = {
    wl.JOBSET_NAME,
    wl.JOBSET_UID,
    wl.REPLICATED_JOB_NAME,
    wl.RESTART_ATTEMPT,
    wl.REPLICATED_JOB_REPLICAS,
    wl.GLOBAL_REPLICAS,
    wl.JOB_INDEX,
    wl.JOB_KEY,
    wl.JOB_GLOBAL_INDEX,
    wl.GROUP_NAME,
    wl.GROUP_REPLICAS,
    wl.JOB_GROUP_INDEX,
}


def _tpl(**annotations: str) -> dict[str, Any]:
    pod = pod_manifest("t", scheduler_name="gputopo-scheduler", gpus=8, annotations=annotations, labels={"team": "a"})
    return wl.pod_template(pod)


def _stored(obj: dict[str, Any], uid: str = UID) -> dict[str, Any]:
    """As the API server returns it: with a UID."""
    obj["metadata"]["uid"] = uid
    return obj


def _jobset(*rjobs: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return _stored(wl.jobset("js", "ns", list(rjobs), **kw))


def test_jobset_jobs_are_named_owned_and_labelled_as_the_jobset_controller_does() -> None:
    js = _jobset(wl.replicated_job("workers", _tpl(), replicas=2, pods=4))
    jobs = wl.jobset_jobs(js)
    assert [j["metadata"]["name"] for j in jobs] == ["js-workers-0", "js-workers-1"]
    for idx, job in enumerate(jobs):
        assert job["metadata"]["ownerReferences"] == [
            {
                "apiVersion": "jobset.x-k8s.io/v1alpha2",
                "kind": "JobSet",
                "name": "js",
                "uid": UID,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        for meta in (job["metadata"], job["spec"]["template"]["metadata"]):
            assert set(meta["labels"]) >= JOBSET_KEYS and set(meta["annotations"]) >= JOBSET_KEYS
            assert {k: meta["labels"][k] for k in JOBSET_KEYS} == {k: meta["annotations"][k] for k in JOBSET_KEYS}
            assert meta["labels"][wl.JOB_INDEX] == str(idx)
            assert meta["labels"][wl.JOB_KEY] == hashlib.sha1(f"ns/js-workers-{idx}".encode()).hexdigest()
            assert meta["labels"][wl.REPLICATED_JOB_REPLICAS] == "2"
        assert job["spec"]["template"]["metadata"]["labels"]["team"] == "a"  # the template's own labels stay
        assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["suspend"] is False
        assert (job["spec"]["parallelism"], job["spec"]["completions"]) == (4, 4)
        assert job["spec"]["template"]["spec"]["subdomain"] == "js"
        assert job["spec"]["template"]["spec"]["restartPolicy"] == "OnFailure"


@pytest.mark.parametrize(
    ("rjobs", "expected"),
    [
        # (name, group, replicas) per replicated job -> (job name, global index, group index, group replicas)
        (
            [("driver", "default", 1), ("workers", "default", 3)],
            [("js-driver-0", "0", "0", "4"), ("js-workers-0", "1", "1", "4"), ("js-workers-2", "3", "3", "4")],
        ),
        (
            [("prefill", "p", 2), ("decode", "d", 2), ("prefill2", "p", 1)],
            [("js-decode-0", "2", "0", "2"), ("js-prefill2-0", "4", "2", "3"), ("js-prefill-1", "1", "1", "3")],
        ),
    ],
)
def test_jobset_global_and_group_indices_count_across_replicated_jobs_in_spec_order(
    rjobs: list[tuple[str, str, int]], expected: list[tuple[str, str, str, str]]
) -> None:
    js = _jobset(*[wl.replicated_job(n, _tpl(), replicas=r, group_name=g) for n, g, r in rjobs])
    by_name = {j["metadata"]["name"]: j["metadata"]["labels"] for j in wl.jobset_jobs(js)}
    total = str(sum(r for _, _, r in rjobs))
    for name, global_idx, group_idx, group_replicas in expected:
        labels = by_name[name]
        assert (labels[wl.JOB_GLOBAL_INDEX], labels[wl.JOB_GROUP_INDEX], labels[wl.GROUP_REPLICAS]) == (
            global_idx,
            group_idx,
            group_replicas,
        )
        assert labels[wl.GLOBAL_REPLICAS] == total


@given(st.lists(st.tuples(st.sampled_from(["a", "b"]), st.integers(1, 4)), min_size=1, max_size=5))
def test_jobset_indices_are_each_a_permutation_whatever_the_replicated_jobs(groups: list[tuple[str, int]]) -> None:
    js = _jobset(*[wl.replicated_job(f"r{i}", _tpl(), replicas=n, group_name=g) for i, (g, n) in enumerate(groups)])
    jobs = [j["metadata"]["labels"] for j in wl.jobset_jobs(js)]
    assert sorted(int(j[wl.JOB_GLOBAL_INDEX]) for j in jobs) == list(range(sum(n for _, n in groups)))
    for group in {g for g, _ in groups}:
        members = [int(j[wl.JOB_GROUP_INDEX]) for j in jobs if j[wl.GROUP_NAME] == group]
        assert sorted(members) == list(range(sum(n for g, n in groups if g == group)))


def test_jobset_exclusive_placement_is_an_annotation_only_and_the_node_selector_strategy_adds_its_selector() -> None:
    rjob = wl.replicated_job("w", _tpl())
    rjob["template"]["metadata"]["annotations"] = {wl.EXCLUSIVE_TOPOLOGY: "rack", wl.NODE_SELECTOR_STRATEGY: "true"}
    (job,) = wl.jobset_jobs(_jobset(rjob))
    assert job["metadata"]["annotations"][wl.EXCLUSIVE_TOPOLOGY] == "rack"
    assert wl.EXCLUSIVE_TOPOLOGY not in job["metadata"]["labels"]
    pod_spec = job["spec"]["template"]["spec"]
    assert pod_spec["nodeSelector"][wl.NAMESPACED_JOB] == "ns_js-w-0"
    assert {"key": wl.NO_SCHEDULE_TAINT, "operator": "Exists", "effect": "NoSchedule"} in pod_spec["tolerations"]


def test_jobset_headless_service_selects_the_jobsets_pods() -> None:
    svc = wl.jobset_service(_jobset(wl.replicated_job("w", _tpl())))
    assert svc is not None
    assert (svc["metadata"]["name"], svc["spec"]["clusterIP"]) == ("js", "None")
    assert svc["spec"]["selector"] == {wl.JOBSET_NAME: "js"} and svc["spec"]["publishNotReadyAddresses"] is True


@pytest.mark.parametrize(
    ("make", "owner"),
    [
        (wl.jobset_jobs, "'js'"),
        (wl.lws_leader_statefulset, "'lws'"),
    ],
    ids=["jobset", "lws"],
)
def test_children_of_an_owner_not_yet_created_are_refused_naming_it(make: Any, owner: str) -> None:
    unstored = {
        "'js'": wl.jobset("js", "ns", [wl.replicated_job("w", _tpl())]),
        "'lws'": wl.leaderworkerset("lws", "ns", _tpl(), size=2),
    }[owner]
    with pytest.raises(ValueError, match=f"{owner} has no metadata.uid"):
        make(unstored)


def _lws(size: int = 3, replicas: int = 2, **kw: Any) -> dict[str, Any]:
    return _stored(wl.leaderworkerset("infer", "ns", _tpl(), size=size, replicas=replicas, **kw))


def test_lws_leader_statefulset_is_the_lws_controllers() -> None:
    lws = _lws(annotations={wl.LWS_EXCLUSIVE_TOPOLOGY: "rack"})
    sts = wl.lws_leader_statefulset(lws, revision_key="rev1")
    meta, spec = sts["metadata"], sts["spec"]
    assert (meta["name"], spec["serviceName"], spec["replicas"], spec["podManagementPolicy"]) == (
        "infer",
        "infer",
        2,
        "Parallel",
    )
    assert meta["labels"] == {wl.LWS_NAME: "infer", wl.LWS_REVISION: "rev1"}
    assert meta["annotations"] == {wl.LWS_EXCLUSIVE_TOPOLOGY: "rack", wl.LWS_REPLICAS: "2"}
    assert meta["ownerReferences"][0] == {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "name": "infer",
        "uid": UID,
        "controller": True,
        "blockOwnerDeletion": True,
    }
    assert spec["selector"] == {"matchLabels": {wl.LWS_NAME: "infer", wl.LWS_WORKER_INDEX: "0"}}
    tmeta = spec["template"]["metadata"]
    assert {k: tmeta["labels"][k] for k in (wl.LWS_NAME, wl.LWS_WORKER_INDEX, wl.LWS_REVISION)} == {
        wl.LWS_NAME: "infer",
        wl.LWS_WORKER_INDEX: "0",
        wl.LWS_REVISION: "rev1",
    }
    assert tmeta["labels"]["team"] == "a"
    assert tmeta["annotations"][wl.LWS_SIZE] == "3" and tmeta["annotations"][wl.LWS_EXCLUSIVE_TOPOLOGY] == "rack"
    assert spec["updateStrategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1, "partition": 0}}


@pytest.mark.parametrize(
    ("replicas", "max_unavailable", "max_surge", "expected"),
    [(2, 1, 0, 1), (4, 1, 2, 3), (4, "50%", "25%", 3), (3, 0, 0, 1), (0, 1, 0, 1), (2, 1, 5, 3)],
)
def test_lws_leader_statefulset_max_unavailable_adds_surge_as_the_controller_does(
    replicas: int, max_unavailable: int | str, max_surge: int | str, expected: int
) -> None:
    lws = _lws(replicas=replicas)
    lws["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"].update(
        {"maxUnavailable": max_unavailable, "maxSurge": max_surge}
    )
    assert wl.lws_leader_statefulset(lws)["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"] == expected


def test_lws_revision_key_has_the_safe_alphabet_and_follows_the_template() -> None:
    a, b = _lws(size=2), _lws(size=3)
    assert wl.lws_revision_key(a) == wl.lws_revision_key(_lws(size=2))
    assert wl.lws_revision_key(a) != wl.lws_revision_key(b)
    assert set(wl.lws_revision_key(a)) <= set("bcdfghjklmnpqrstvwxz2456789")


def _pod(name: str, labels: dict[str, str], uid: str = "pod-uid") -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns", "uid": uid, "labels": labels, "annotations": {}}}


@pytest.mark.parametrize(
    ("name", "labels", "added"),
    [
        (
            "infer-1",
            {wl.LWS_NAME: "infer", wl.LWS_WORKER_INDEX: "0"},
            {wl.LWS_GROUP_INDEX: "1", wl.LWS_GROUP_KEY: hashlib.sha1(b"ns/infer-1").hexdigest()},
        ),
        ("infer-1-2", {wl.LWS_NAME: "infer", wl.LWS_GROUP_INDEX: "1"}, {wl.LWS_WORKER_INDEX: "2"}),
        ("plain-0", {"app": "x"}, {}),
        (
            "infer-0",
            {wl.LWS_NAME: "infer", wl.LWS_WORKER_INDEX: "0", wl.LWS_GROUP_INDEX: "0", wl.LWS_GROUP_KEY: "k"},
            {},
        ),
    ],
    ids=["leader", "worker", "not-lws", "leader-already-labelled"],
)
def test_lws_pod_webhook_labels(name: str, labels: dict[str, str], added: dict[str, str]) -> None:
    assert wl.lws_pod_webhook_labels(_pod(name, labels)) == added


def test_lws_pod_webhook_labels_refuses_a_name_without_an_ordinal() -> None:
    with pytest.raises(ValueError, match="'infer' has no StatefulSet ordinal"):
        wl.lws_pod_webhook_labels(_pod("infer", {wl.LWS_NAME: "infer"}))


def test_lws_worker_statefulset_is_owned_by_its_leader_pod_and_numbers_workers_from_one() -> None:
    lws = _lws(size=4)
    leader = _pod("infer-1", {wl.LWS_NAME: "infer", wl.LWS_WORKER_INDEX: "0", wl.LWS_REVISION: "rev1"}, uid="L")
    sts = wl.lws_worker_statefulset(lws, leader)
    key = hashlib.sha1(b"ns/infer-1").hexdigest()
    selector = {wl.LWS_GROUP_INDEX: "1", wl.LWS_NAME: "infer", wl.LWS_GROUP_KEY: key}
    assert sts["metadata"]["name"] == "infer-1"
    assert sts["metadata"]["ownerReferences"] == [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": "infer-1",
            "uid": "L",
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    assert sts["metadata"]["labels"] == {**selector, wl.LWS_REVISION: "rev1"}
    spec = sts["spec"]
    assert (spec["replicas"], spec["ordinals"], spec["serviceName"]) == (3, {"start": 1}, "infer")
    assert spec["selector"] == {"matchLabels": selector}
    assert spec["template"]["metadata"]["annotations"][wl.LWS_LEADER_NAME] == "infer-1"
    assert spec["template"]["metadata"]["annotations"][wl.LWS_SIZE] == "4"


def test_lws_worker_statefulset_refuses_a_pod_that_is_not_a_leader() -> None:
    with pytest.raises(ValueError, match="'infer-1-1' is not a leader"):
        wl.lws_worker_statefulset(_lws(), _pod("infer-1-1", {wl.LWS_NAME: "infer", wl.LWS_WORKER_INDEX: "1"}))


@pytest.mark.parametrize(
    ("api_version", "kind", "name", "path"),
    [
        ("batch/v1", "Job", "j", "/apis/batch/v1/namespaces/ns/jobs/j"),
        ("v1", "Service", "", "/api/v1/namespaces/ns/services"),
        (wl.JOBSET_API, "JobSet", "js", "/apis/jobset.x-k8s.io/v1alpha2/namespaces/ns/jobsets/js"),
    ],
)
def test_api_path(api_version: str, kind: str, name: str, path: str) -> None:
    assert wl.api_path(api_version, kind, "ns", name) == path


def test_api_path_names_an_unknown_kind() -> None:
    with pytest.raises(ValueError, match="kind 'CronJob'"):
        wl.api_path("batch/v1", "CronJob", "ns")


def test_leaderworkerset_refuses_a_size_below_one() -> None:
    with pytest.raises(ValueError, match="'bad': size must be >= 1"):
        wl.leaderworkerset("bad", "ns", _tpl(), size=0)


@pytest.mark.parametrize("suspend", [False, True])
def test_jobset_suspend_reaches_every_child_job(suspend: bool) -> None:
    js = _jobset(wl.replicated_job("w", _tpl(), replicas=2), suspend=suspend)
    assert ("suspend" in js["spec"]) is suspend  # omitted unless set, as the API stores it
    assert [j["spec"]["suspend"] for j in wl.jobset_jobs(js)] == [suspend, suspend]
