"""Groups inferred from controllers' labels in the extender: pods without gputopo annotations become
members, sizes wait for the Job objects, bad labels reach every member, a deleted Job releases its plan."""

from __future__ import annotations

from typing import Any

import pytest

from gputopo.extender.watch.parsers import pod_record
from gputopo.model import PLACEMENT_ANNOTATION, parse_placement
from gputopo.model import jobs as J
from tests.extender.harness import JSON, Env, pod_obj, two_leaves

NODES = ["gpu-1", "gpu-2", "gpu-3", "gpu-4"]


@pytest.fixture
def cluster(env: Env) -> Env:
    env.add_nodes(*two_leaves())
    return env


def labelled(name: str, labels: dict[str, str], annotations: dict[str, str] | None = None, gpus: int = 8) -> JSON:
    pod = pod_obj(name, gpus, annotations)
    pod["metadata"]["labels"] = labels
    return pod


def lws(worker: int, size: int = 2, **extra: str) -> JSON:
    labels = {J.LWS_NAME: "vllm", J.LWS_GROUP_INDEX: "0", J.LWS_WORKER_INDEX: str(worker), **extra}
    return labelled(f"vllm-0-{worker}", labels, {J.LWS_SIZE: str(size)})


def indexed(index: int, job: str = "train") -> JSON:
    return labelled(f"{job}-{index}", {J.JOB_NAME: job, J.JOB_COMPLETION_INDEX: str(index)})


def job_obj(name: str, pods: int) -> JSON:
    return {
        "metadata": {"name": name, "namespace": "default", "uid": f"uid-job-{name}"},
        "spec": {"completions": pods, "parallelism": pods, "completionMode": "Indexed"},
    }


def reasons(env: Env, pod: JSON) -> set[str]:
    out = env.filter(pod, NODES)
    assert out["NodeNames"] == []
    return set(out["FailedNodes"].values()) | set(out["FailedAndUnresolvableNodes"].values())


def planned(env: Env, pod: JSON) -> str:
    (node,) = env.filter(pod, NODES)["NodeNames"]
    return str(node)


def test_lws_group_without_annotations_is_planned_and_the_sentence_names_it(cluster: Env) -> None:
    leader, worker = lws(0), lws(1)
    cluster.add_pods(leader)
    assert reasons(cluster, leader) == {"group lws/vllm/0: 1/2 pods exist, waiting"}
    cluster.add_pods(worker)
    a, b = planned(cluster, leader), planned(cluster, worker)
    assert a != b and {a, b} in ({"gpu-1", "gpu-2"}, {"gpu-3", "gpu-4"})
    assert cluster.bind(leader, a) == ""
    bound = cluster.source.get("pods", "default", "vllm-0-0")
    assert bound is not None
    placement = parse_placement(bound["metadata"]["annotations"][PLACEMENT_ANNOTATION])
    assert placement.stage == 0
    assert "group lws/vllm/0, rank 0 of 2, from LeaderWorkerSet labels" in placement.reason


def test_an_indexed_jobs_members_wait_for_the_job_then_are_planned(cluster: Env) -> None:
    pods = [indexed(0), indexed(1)]
    cluster.add_pods(*pods)
    assert reasons(cluster, pods[0]) == {"group job/train: waiting: the Job train is not known yet"}
    cluster.source.put("jobs", job_obj("train", 2))
    cluster.resync()
    assert planned(cluster, pods[0]) != planned(cluster, pods[1])


def test_a_bound_member_stays_in_its_inferred_group_before_the_watch_sees_the_bind(cluster: Env) -> None:
    """The binder records the pod it bound at once, before the pod watch's event: that record must keep the
    labels that make it a member, or the group counts one member fewer and the rest wait for ever."""
    pods = [indexed(i) for i in range(3)]
    cluster.add_pods(*pods)
    cluster.source.put("jobs", job_obj("train", 3))
    cluster.resync()
    key = ("default", "job/train")
    for pod in pods:
        node = planned(cluster, pod)
        assert cluster.call(
            "bind",
            {
                "PodName": pod["metadata"]["name"],
                "PodNamespace": "default",
                "PodUID": pod["metadata"]["uid"],
                "Node": node,
            },
        ).json() == {"Error": ""}
        assert {r.name for r in cluster.ledger.group_members(key)} == {p["metadata"]["name"] for p in pods}


def test_a_member_with_a_bad_label_gives_every_member_a_reason_naming_it(cluster: Env) -> None:
    good = lws(0)
    bad = labelled(
        "vllm-0-1", {J.LWS_NAME: "vllm", J.LWS_GROUP_INDEX: "0", J.LWS_WORKER_INDEX: "one"}, {J.LWS_SIZE: "2"}
    )
    cluster.add_pods(good, bad)
    (why,) = reasons(cluster, good)
    assert why.startswith("group lws/vllm/0: member vllm-0-1: invalid label leaderworkerset.sigs.k8s.io/worker-index=")
    (own,) = reasons(cluster, bad)
    assert own == 'invalid label leaderworkerset.sigs.k8s.io/worker-index="one": must be a non-negative integer'


def test_two_members_with_one_rank_are_refused_naming_the_label(cluster: Env) -> None:
    a = labelled("pg-a", {J.KUEUE_POD_GROUP: "pg", J.KUEUE_POD_INDEX: "0"}, {J.KUEUE_TOTAL_COUNT: "2"})
    b = labelled("pg-b", {J.KUEUE_POD_GROUP: "pg", J.KUEUE_POD_INDEX: "0"}, {J.KUEUE_TOTAL_COUNT: "2"})
    cluster.add_pods(a, b)
    assert reasons(cluster, a) == {
        "group kueue/pg: rank 0 (kueue.x-k8s.io/pod-group-pod-index) is claimed by more than one pod: pg-a, pg-b"
    }


def test_annotations_override_the_inferred_rank(cluster: Env) -> None:
    a, b = lws(0), lws(1)
    a["metadata"]["annotations"]["gputopo.io/stage"] = "1"
    b["metadata"]["annotations"]["gputopo.io/stage"] = "0"
    cluster.add_pods(a, b)
    planned(cluster, a)
    res = cluster.ledger.reservations.get(("default", "lws/vllm/0"))
    assert res is not None and res.slots["vllm-0-0"].stage == 1 and res.slots["vllm-0-1"].stage == 0


def test_a_deleted_job_releases_its_groups_reservation(cluster: Env) -> None:
    pods = [indexed(0), indexed(1)]
    cluster.add_pods(*pods)
    cluster.source.put("jobs", job_obj("train", 2))
    cluster.resync()
    planned(cluster, pods[0])
    assert cluster.ledger.reservations.get(("default", "job/train")) is not None
    cluster.source.delete("jobs", "default", "train")
    cluster.cache.apply("jobs", "DELETED", job_obj("train", 2))
    assert cluster.ledger.reservations.get(("default", "job/train")) is None


@pytest.mark.parametrize(
    ("scheduler", "tracked"),
    [("gputopo-scheduler", True), ("default-scheduler", False)],
)
def test_only_pods_under_gputopo_scheduler_are_inferred_members(scheduler: str, tracked: bool) -> None:
    pod = lws(0)
    pod["spec"]["schedulerName"] = scheduler
    rec = pod_record(pod, ("spine", "leaf"))
    assert (rec is not None) == tracked
    if rec is not None:
        assert rec.group == "lws/vllm/0" and rec.request is not None and rec.request.group_size == 2


def test_a_jobs_status_update_infers_no_pod_again(cluster: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Job controller updates a big Job's status counts many times: only a change of what inference
    reads (completions, parallelism, mode, JobSet labels) may re-read the namespace's pods."""
    pods = [indexed(0), indexed(1)]
    cluster.add_pods(*pods)
    job = job_obj("train", 2)
    cluster.cache.apply("jobs", "ADDED", job)
    calls: list[str] = []
    original = cluster.cache.controllers._record_again

    def counting(rec: Any) -> Any:
        calls.append(rec.name)
        return original(rec)

    monkeypatch.setattr(cluster.cache.controllers, "_record_again", counting)
    cluster.cache.apply("jobs", "MODIFIED", {**job, "status": {"active": 2, "ready": 1}})
    assert calls == []
    cluster.cache.apply("jobs", "MODIFIED", {**job, "spec": {**job["spec"], "completions": 3, "parallelism": 3}})
    assert sorted(calls) == ["train-0", "train-1"]
