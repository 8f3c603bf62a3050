"""JobSet exclusive placement through the extender: once every Job's leader exists the whole JobSet is
planned, each Job in a leaf of its own; the followers JobSet has not let their Jobs create yet are held
(no other pod takes their GPUs) and get their held slots when they come, matched by Job and completion
index; the hold expires with the group reservation; a JobSet without the annotation is as before."""

from __future__ import annotations

import pytest

from gputopo.model import PLACEMENT_ANNOTATION, parse_placement
from gputopo.model import jobs as J
from tests.extender.harness import JSON, Env, gputopo_pod, pod_obj, two_leaves

NODES = ["gpu-1", "gpu-2", "gpu-3", "gpu-4"]
LEAF = "gputopo.io/network-leaf"
LEAVES = {"leaf-a": ["gpu-1", "gpu-2"], "leaf-b": ["gpu-3", "gpu-4"]}
KEY = ("default", "jobset/js")


@pytest.fixture
def cluster(env: Env) -> Env:
    env.add_nodes(*two_leaves())
    return env


# What the JobSet controller writes on its Jobs (its controller ownerReference).
JOBSET_OWNER = {
    "apiVersion": "jobset.x-k8s.io/v1alpha2",
    "kind": "JobSet",
    "name": "js",
    "uid": "uid-js",
    "controller": True,
}


def job_obj(index: int, pods: int = 2, replicas: int = 2) -> JSON:
    return {
        "metadata": {
            "name": f"js-w-{index}",
            "namespace": "default",
            "uid": f"uid-job-{index}",
            "labels": {
                J.JOBSET_NAME: "js",
                J.JOBSET_JOB_GLOBAL_INDEX: str(index),
                J.JOBSET_GLOBAL_REPLICAS: str(replicas),
            },
            "annotations": {J.JOBSET_EXCLUSIVE: LEAF},
            "ownerReferences": [dict(JOBSET_OWNER)],
        },
        "spec": {"completions": pods, "parallelism": pods, "completionMode": "Indexed"},
    }


EXCLUSIVE = {J.JOBSET_EXCLUSIVE: LEAF}


def member(
    job: int, index: int, ann: dict[str, str] = EXCLUSIVE, *, leaf: str | None = None, replicas: int = 2
) -> JSON:
    """A JobSet pod as the Job controller names it (a random suffix) and JobSet's webhooks leave it: a
    follower carries its leader's leaf as a nodeSelector."""
    pod = pod_obj(f"js-w-{job}-{index}-x{job}{index}q", 8, ann)
    pod["metadata"]["labels"] = {
        J.JOBSET_NAME: "js",
        J.JOBSET_GLOBAL_REPLICAS: str(replicas),
        J.JOBSET_JOB_GLOBAL_INDEX: str(job),
        J.JOB_NAME: f"js-w-{job}",
        J.JOB_COMPLETION_INDEX: str(index),
        J.JOB_CONTROLLER_UID: f"uid-job-{job}",  # the Job controller's label: its Job's UID
    }
    if leaf is not None:
        pod["spec"]["nodeSelector"] = {LEAF: leaf}
    return pod


def jobset_obj(uid: str = "uid-js") -> JSON:
    """The JobSet the Jobs' ownerReferences name (of `uid`: another is a JobSet of the same name made after)."""
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": "js", "namespace": "default", "uid": uid},
    }


def with_jobs(env: Env, pods: int = 2, replicas: int = 2) -> None:
    env.source.put("jobsets", jobset_obj())
    for i in range(replicas):
        env.source.put("jobs", job_obj(i, pods, replicas))
    env.resync()


def passed(env: Env, pod: JSON, names: list[str] = NODES) -> list[str]:
    return env.passed(pod, names)


def reasons(env: Env, pod: JSON, names: list[str] = NODES) -> set[str]:
    return env.reasons(pod, names)


def leaf_of(node: str) -> str:
    return next(leaf for leaf, nodes in LEAVES.items() if node in nodes)


def placed_leaders(env: Env) -> dict[int, str]:
    """Both leaders filtered and bound: Job -> its leaf."""
    leaders = [member(0, 0), member(1, 0)]
    env.add_pods(*leaders)
    with_jobs(env)
    out = {}
    for job, pod in enumerate(leaders):
        (node,) = passed(env, pod)
        assert env.bind(pod, node) == ""
        out[job] = leaf_of(node)
    return out


def test_the_leaders_wait_until_every_jobs_leader_exists(cluster: Env) -> None:
    with_jobs(cluster)
    cluster.add_pods(member(0, 0))
    assert reasons(cluster, member(0, 0)) == {
        f"group jobset/js: JobSet exclusive placement ({LEAF}): the leaders of 1/2 Jobs exist, waiting"
    }


def test_a_leader_is_planned_in_a_leaf_where_its_job_fits_and_its_followers_gpus_are_held(cluster: Env) -> None:
    leaders = [member(0, 0), member(1, 0)]
    cluster.add_pods(*leaders)
    with_jobs(cluster)
    (node,) = passed(cluster, leaders[0])
    res = cluster.ledger.reservations[KEY]
    assert set(res.slots) == {leaders[0]["metadata"]["name"], leaders[1]["metadata"]["name"], "js-w-0#1", "js-w-1#1"}
    assert res.slots["js-w-0#1"].node in LEAVES[leaf_of(node)]  # the follower is held beside its leader
    assert leaf_of(res.slots["js-w-1#1"].node) != leaf_of(node)  # the other Job has the other leaf
    assert len({s.node for s in res.slots.values()}) == 4
    # Every node's GPUs are held for the JobSet: another pod cannot take a follower's.
    assert reasons(cluster, gputopo_pod("other", 8))


@pytest.mark.parametrize("order", [(0, 1), (1, 0)], ids=["job 0 first", "job 1 first"])
def test_followers_get_their_held_slots_by_job_and_index_in_any_order(cluster: Env, order: tuple[int, int]) -> None:
    leaves = placed_leaders(cluster)
    held = {j: cluster.ledger.reservations[KEY].slots[f"js-w-{j}#1"].node for j in (0, 1)}
    followers = {j: member(j, 1, leaf=leaves[j]) for j in (0, 1)}
    cluster.add_pods(*followers.values())
    for j in order:
        pod = followers[j]
        assert passed(cluster, pod, LEAVES[leaves[j]]) == [held[j]]
        slots = cluster.ledger.reservations[KEY].slots
        assert f"js-w-{j}#1" not in slots and slots[pod["metadata"]["name"]].node == held[j]  # the pod's now
        assert cluster.bind(pod, held[j]) == ""
        bound = cluster.source.get("pods", "default", pod["metadata"]["name"])
        assert bound is not None
        placement = parse_placement(bound["metadata"]["annotations"][PLACEMENT_ANNOTATION])
        assert placement.stage == 2 * j + 1  # its rank in the JobSet
        assert "rank" in placement.reason
    assert KEY not in cluster.ledger.reservations  # every member bound


def test_the_hold_expires_with_the_group_reservation(cluster: Env) -> None:
    leaves = placed_leaders(cluster)
    assert reasons(cluster, gputopo_pod("other", 8))  # the followers' GPUs are held
    cluster.clock.advance(cluster.settings.reservation_timeout_seconds + 1)
    cluster.renew_leases()
    assert len(passed(cluster, gputopo_pod("other", 8))) == 2  # released: the followers' nodes are free
    # A follower that comes later is planned again, beside its bound leader.
    follower = member(0, 1, leaf=leaves[0])
    cluster.add_pods(follower)
    (node,) = passed(cluster, follower, LEAVES[leaves[0]])
    assert leaf_of(node) == leaves[0]


def test_a_follower_that_no_longer_fits_its_leaders_leaf_is_told_the_job_and_the_leaf(cluster: Env) -> None:
    leaves = placed_leaders(cluster)
    cluster.clock.advance(cluster.settings.reservation_timeout_seconds + 1)
    cluster.renew_leases()
    free = [n for n in LEAVES[leaves[0]] if cluster.ledger.pods.get(f"uid-default-{n}") is None]
    other = gputopo_pod("other", 8)
    cluster.add_pods(other)
    (taken,) = [n for n in passed(cluster, other, LEAVES[leaves[0]]) if n in free]
    assert cluster.bind(other, taken) == ""
    follower = member(0, 1, leaf=leaves[0])
    cluster.add_pods(follower)
    (why,) = reasons(cluster, follower, LEAVES[leaves[0]])
    assert why.startswith(f"group jobset/js: Job js-w-0 does not fit in its leader's domain {LEAF}={leaves[0]}: ")


@pytest.mark.parametrize(
    "ann", [{}, {**EXCLUSIVE, J.JOBSET_NODE_SELECTOR: "true"}], ids=["no annotation", "node-selector strategy"]
)
def test_a_jobset_without_exclusive_placement_waits_for_every_pod_as_before(cluster: Env, ann: dict[str, str]) -> None:
    pods = [member(0, 0, ann), member(1, 0, ann)]
    cluster.add_pods(*pods)
    with_jobs(cluster)
    assert reasons(cluster, pods[0]) == {"group jobset/js: 2/4 pods exist, waiting"}
    assert KEY not in cluster.ledger.reservations


@pytest.mark.parametrize(
    ("other", "why"),
    [
        (
            {},
            f"group jobset/js: pod js-w-1-0-x10q is not under JobSet exclusive placement ({J.JOBSET_EXCLUSIVE}) as "
            "js-w-0-0-x00q is; gputopo plans it for a JobSet all of whose Jobs use it",
        ),
        (
            {J.JOBSET_EXCLUSIVE: "kubernetes.io/hostname"},
            f"group jobset/js: pods js-w-1-0-x10q and js-w-0-0-x00q name different {J.JOBSET_EXCLUSIVE} labels "
            f"(kubernetes.io/hostname, {LEAF}); gputopo plans one label for the whole JobSet",
        ),
    ],
    ids=["one Job without it", "two labels"],
)
def test_a_jobset_whose_jobs_disagree_on_exclusive_placement_is_told_which_pod(
    cluster: Env, other: dict[str, str], why: str
) -> None:
    pods = [member(0, 0), member(1, 0, other)]
    cluster.add_pods(*pods)
    with_jobs(cluster)
    assert reasons(cluster, pods[0]) == {why}
