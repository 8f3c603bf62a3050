"""Group members that ask for no GPUs (a JobSet's driver) are placed with their group: filter passes the
planned node (beside the nearest GPU-holding rank) first and the nodes under the same leaf below it, bind
writes the member's rank wherever kube-scheduler put it, and the sentence agrees with the annotation.
Pods that are no member and ask for no GPU pass straight through."""

from __future__ import annotations

import pytest

from gputopo.model import PLACEMENT_ANNOTATION, Placement, parse_placement
from gputopo.model import jobs as J
from tests.extender.harness import JSON, Env, pod_obj, two_leaves

NODES = ["gpu-1", "gpu-2", "gpu-3", "gpu-4"]
LEAF = {"gpu-1": "leaf-a", "gpu-2": "leaf-a", "gpu-3": "leaf-b", "gpu-4": "leaf-b"}


def jobset_pod(name: str, gidx: int, index: int, job: str, gpus: int) -> JSON:
    pod = pod_obj(name, gpus)
    if not gpus:  # a driver asks for CPU only
        pod["spec"]["containers"][0]["resources"] = {"requests": {"cpu": "2"}}
    pod["metadata"]["labels"] = {
        J.JOBSET_NAME: "llama",
        J.JOB_NAME: job,
        J.JOBSET_REPLICATED_JOB: job.rsplit("-", 1)[0],
        J.JOBSET_JOB_GLOBAL_INDEX: str(gidx),
        J.JOBSET_GLOBAL_REPLICAS: "2",
        J.JOB_COMPLETION_INDEX: str(index),
    }
    return pod


def job_obj(name: str, gidx: int, pods: int) -> JSON:
    labels = {J.JOBSET_NAME: "llama", J.JOBSET_JOB_GLOBAL_INDEX: str(gidx), J.JOBSET_GLOBAL_REPLICAS: "2"}
    return {
        "metadata": {"name": name, "namespace": "default", "uid": f"uid-job-{name}", "labels": labels},
        "spec": {"completions": pods, "parallelism": pods, "completionMode": "Indexed"},
    }


@pytest.fixture
def jobset(env: Env) -> list[JSON]:
    """A driver (rank 0, no GPUs) and 4 workers of 8 GPUs on 4 nodes under two leaves."""
    env.add_nodes(*two_leaves())
    env.source.put("jobs", job_obj("driver-0", 0, 1))
    env.source.put("jobs", job_obj("workers-0", 1, 4))
    pods = [jobset_pod("llama-driver-0-0", 0, 0, "driver-0", 0)]
    pods += [jobset_pod(f"llama-workers-0-{i}", 1, i, "workers-0", 8) for i in range(4)]
    env.add_pods(*pods)
    return pods


def planned(env: Env, pod: JSON, names: list[str] = NODES) -> list[str]:
    return sorted(env.filter(pod, names)["NodeNames"])


def placement(env: Env, pod: JSON) -> Placement:
    stored = env.source.get("pods", "default", pod["metadata"]["name"])
    assert stored is not None
    return parse_placement(stored["metadata"]["annotations"][PLACEMENT_ANNOTATION])


def test_every_member_bound_has_the_same_rank_stage_and_size_in_its_sentence_and_annotation(
    env: Env, jobset: list[JSON]
) -> None:
    nodes = {}
    for pod in jobset:
        first, *_ = planned(env, pod)
        nodes[pod["metadata"]["name"]] = first
    worker_nodes = [nodes[p["metadata"]["name"]] for p in jobset[1:]]
    assert sorted(worker_nodes) == NODES  # the driver took no worker's node
    for rank, pod in enumerate(jobset):
        node = env.ledger.reservations[("default", "jobset/llama")].slots[pod["metadata"]["name"]].node
        assert env.bind(pod, node) == ""
        got = placement(env, pod)
        assert (got.stage, got.group) == (rank, "jobset/llama")
        assert f"rank {rank} of 5, from JobSet labels" in got.reason
        assert f"; stage {rank}/5 " in got.reason
    driver = placement(env, jobset[0])
    assert driver.gpus == () and driver.node == placement(env, jobset[1]).node  # beside rank 1
    assert driver.reason.startswith(f"{driver.node} has room (the pod asks for no GPUs)")


def test_the_driver_passes_its_planned_node_first_and_the_nodes_under_its_leaf_below_it(
    env: Env, jobset: list[JSON]
) -> None:
    driver = jobset[0]
    (home, *beside) = env.filter(driver, NODES)["NodeNames"]
    leaf = LEAF[home]
    assert beside == [n for n in NODES if LEAF[n] == leaf and n != home]
    assert env.prioritize(driver, NODES) == {n: 10 if n == home else 0 for n in NODES}
    # kube-scheduler's own filters refused the planned node (too little CPU left there): the driver
    # still has the other node under the same leaf, and only that.
    others = [n for n in NODES if n != home]
    assert env.filter(driver, others)["NodeNames"] == beside
    assert env.prioritize(driver, others) == dict.fromkeys(others, 0)


def test_a_driver_bound_beside_its_planned_node_gets_its_rank_there_and_no_gpus(env: Env, jobset: list[JSON]) -> None:
    driver = jobset[0]
    (home, other) = env.filter(driver, NODES)["NodeNames"]
    assert env.bind(driver, other) == ""
    got = placement(env, driver)
    assert (got.node, got.gpus, got.stage) == (other, (), 0)
    assert got.reason.startswith(f"{other} has room (the pod asks for no GPUs); group jobset/llama, rank 0 of 5")
    assert f"stage 0/5 shares leaf {LEAF[other]} with stage" in got.reason
    # The workers' plan is untouched: rank 1 still goes to the node the driver was planned beside.
    assert planned(env, jobset[1])[0] == home


def test_a_pod_that_is_no_member_and_asks_for_no_gpu_passes_through_and_just_binds(env: Env) -> None:
    env.add_nodes(*two_leaves())
    pod = pod_obj("web", 0)
    pod["spec"]["containers"][0]["resources"] = {"requests": {"cpu": "1"}}
    env.add_pods(pod)
    out = env.filter(pod, NODES)
    assert out["NodeNames"] == NODES and out["FailedNodes"] == {}
    assert len(set(env.prioritize(pod, NODES).values())) == 1  # no preference
    assert env.bind(pod, "gpu-3") == ""
    assert env.source.bindings[-1] == ("default", "web", "uid-default-web", "gpu-3")
    stored = env.source.get("pods", "default", "web")
    assert stored is not None and PLACEMENT_ANNOTATION not in stored["metadata"].get("annotations", {})


def test_workers_planned_after_their_driver_was_bound_elsewhere_keep_their_ranks_of_the_whole_group(env: Env) -> None:
    """The driver was bound by kube-scheduler alone (a profile that narrows managedResources): no
    placement, no slot of a plan. The workers' sentences and annotations still say rank r, stage r/5."""
    env.add_nodes(*two_leaves())
    env.source.put("jobs", job_obj("driver-0", 0, 1))
    env.source.put("jobs", job_obj("workers-0", 1, 4))
    driver = jobset_pod("llama-driver-0-0", 0, 0, "driver-0", 0)
    driver["spec"]["nodeName"] = "gpu-4"
    workers = [jobset_pod(f"llama-workers-0-{i}", 1, i, "workers-0", 8) for i in range(4)]
    env.add_pods(driver, *workers)
    for rank, pod in enumerate(workers, start=1):
        (node,) = planned(env, pod)
        assert env.bind(pod, node) == ""
        got = placement(env, pod)
        assert got.stage == rank
        assert f"rank {rank} of 5, from JobSet labels" in got.reason and f"; stage {rank}/5 " in got.reason
