"""Kueue topology-aware scheduling through the extender: Kueue writes each member's domain into its
spec.nodeSelector (one node per member at the hostname level), kube-scheduler offers each member only that
node, and the group is planned over every member's own nodes, so no member waits for room it cannot have."""

from __future__ import annotations

import pytest

from gputopo.extender.watch.parsers import pod_record
from gputopo.extender.wire import WireError, pod_info
from gputopo.model import PLACEMENT_ANNOTATION, parse_placement
from gputopo.model import jobs as J
from gputopo.model.pod import MAX_SELECTOR_BYTES, MAX_SELECTOR_KEYS
from tests.extender.harness import JSON, Env, node_obj, pod_obj, two_leaves

HOST = "kubernetes.io/hostname"
GATE = "kueue.x-k8s.io/topology"


@pytest.fixture
def cluster(env: Env) -> Env:
    env.add_nodes(*two_leaves())
    return env


def kueue_member(
    i: int, size: int = 4, gpus: int = 8, selector: dict[str, str] | None = None, gated: bool = False
) -> JSON:
    """A Kueue pod group's member as Kueue leaves it: its rank label, and once admitted its domain."""
    pod = pod_obj(f"train-{i}", gpus, {J.KUEUE_TOTAL_COUNT: str(size), "gputopo.io/nvlink": "required"})
    pod["metadata"]["labels"] = {J.KUEUE_POD_GROUP: "train", J.KUEUE_POD_INDEX: str(i)}
    if selector is not None:
        pod["spec"]["nodeSelector"] = selector
    if gated:
        pod["spec"]["schedulingGates"] = [{"name": GATE}]
    return pod


def only(env: Env, pod: JSON, node: str) -> list[str]:
    """What filter passes when kube-scheduler offers the member only the node its selector names."""
    out = env.filter(pod, [node])
    return list(out["NodeNames"]) or sorted(
        set(out["FailedNodes"].values()) | set(out["FailedAndUnresolvableNodes"].values())
    )


@pytest.mark.parametrize("order", [(0, 1, 2, 3), (3, 1, 0, 2), (2, 3, 1, 0)])
def test_hostname_level_members_each_pass_their_own_node_in_any_order(cluster: Env, order: tuple[int, ...]) -> None:
    hosts = {i: f"gpu-{4 - i}" for i in range(4)}  # Kueue's ranks in reverse node order
    pods = {i: kueue_member(i, selector={HOST: hosts[i]}) for i in range(4)}
    cluster.add_pods(*pods.values())
    for i in order:
        assert only(cluster, pods[i], hosts[i]) == [hosts[i]]
    for i in order:
        assert cluster.bind(pods[i], hosts[i]) == ""
        stored = cluster.source.get("pods", "default", f"train-{i}")
        assert stored is not None
        placed = parse_placement(stored["metadata"]["annotations"][PLACEMENT_ANNOTATION])
        assert placed.node == hosts[i] and len(placed.gpus) == 8 and placed.stage == i


def test_two_members_per_node_share_its_gpus(cluster: Env) -> None:
    pods = [kueue_member(i, gpus=4, selector={HOST: f"gpu-{1 + i // 2}"}) for i in range(4)]
    cluster.add_pods(*pods)
    for i in (3, 0, 2, 1):
        assert only(cluster, pods[i], f"gpu-{1 + i // 2}") == [f"gpu-{1 + i // 2}"]
    res = cluster.ledger.reservations[("default", "kueue/train")]
    on_first = [res.slots[f"train-{i}"].gpus for i in (0, 1)]
    assert not on_first[0] & on_first[1] and all(len(g) == 4 for g in on_first)


def test_a_member_behind_kueues_gate_makes_the_group_wait_then_it_is_planned(cluster: Env) -> None:
    pods = [kueue_member(i, size=2, selector={HOST: f"gpu-{i + 1}"}) for i in range(2)]
    cluster.add_pods(pods[0], kueue_member(1, size=2, gated=True))
    assert only(cluster, pods[0], "gpu-1") == [
        "group kueue/train: waiting for member train-1's node assignment (" + GATE + ")"
    ]
    cluster.add_pods(pods[1])  # Kueue removes the gate and writes the selector in one patch
    assert only(cluster, pods[0], "gpu-1") == ["gpu-1"]
    assert only(cluster, pods[1], "gpu-2") == ["gpu-2"]


def test_leaf_level_selector_keeps_the_group_in_kueues_leaf(cluster: Env) -> None:
    pods = [kueue_member(i, size=2, selector={"gputopo.io/network-leaf": "leaf-b"}) for i in range(2)]
    cluster.add_pods(*pods)
    first = cluster.filter(pods[0], ["gpu-3", "gpu-4"])["NodeNames"]
    second = cluster.filter(pods[1], ["gpu-3", "gpu-4"])["NodeNames"]
    assert sorted(first + second) == ["gpu-3", "gpu-4"]


def test_an_impossible_assignment_names_the_selector_for_every_member(cluster: Env) -> None:
    cluster.add_nodes(node_obj("gpu-1", leaf="leaf-a", spine="s1", in_use=[0, 1, 2, 3, 4]))
    pods = [kueue_member(i, size=2, gpus=4, selector={HOST: "gpu-1"}) for i in range(2)]
    cluster.add_pods(*pods)
    for pod in pods:
        (why,) = only(cluster, pod, "gpu-1")
        assert why.startswith(
            "group kueue/train: members train-0, train-1 held by spec.nodeSelector kubernetes.io/hostname=gpu-1"
        )
        assert "(Kueue's topology assignment)" in why


def test_an_indexed_jobs_members_keep_their_selectors_when_the_job_arrives(cluster: Env) -> None:
    pods = []
    for i in range(2):
        pod = pod_obj(f"job-{i}", 8)
        pod["metadata"]["labels"] = {J.JOB_NAME: "job", J.JOB_COMPLETION_INDEX: str(i)}
        pod["spec"]["nodeSelector"] = {HOST: f"gpu-{4 - i}"}
        pods.append(pod)
    cluster.add_pods(*pods)
    job: JSON = {
        "metadata": {"name": "job", "namespace": "default", "uid": "uid-job"},
        "spec": {"completions": 2, "parallelism": 2, "completionMode": "Indexed"},
    }
    cluster.source.put("jobs", job)
    cluster.resync()
    assert only(cluster, pods[1], "gpu-3") == ["gpu-3"]
    assert only(cluster, pods[0], "gpu-4") == ["gpu-4"]


def test_a_selector_over_the_bounds_is_a_reason_naming_the_field(cluster: Env) -> None:
    selector = {f"example.com/k{i}": "v" for i in range(MAX_SELECTOR_KEYS + 1)}
    pods = [kueue_member(0, size=2, selector={HOST: "gpu-1"}), kueue_member(1, size=2, selector=selector)]
    cluster.add_pods(*pods)
    (why,) = only(cluster, pods[0], "gpu-1")
    assert "member train-1: Pod.spec.nodeSelector has 65 keys" in why
    (own,) = only(cluster, pods[1], "gpu-2")
    assert "Pod.spec.nodeSelector has 65 keys" in own
    rec = pod_record(pods[1], ("spine", "leaf"))
    assert rec is not None and rec.request is None and rec.node_selector == ()


BIG = "v" * (MAX_SELECTOR_BYTES + 1)


@pytest.mark.parametrize(
    ("spec", "selector", "problem", "gated"),
    [
        ({}, (), "", False),
        ({"nodeSelector": {}}, (), "", False),
        ({"nodeSelector": {"b": "2", "a": "1"}}, (("a", "1"), ("b", "2")), "", False),
        ({"nodeSelector": {"a": BIG}}, (), "Pod.spec.nodeSelector has 1 keys", False),
        ({"schedulingGates": [{"name": GATE}]}, (), "", True),
        ({"schedulingGates": [{"name": "kueue.x-k8s.io/admission"}]}, (), "", False),
        ({"schedulingGates": "odd"}, (), "", False),
    ],
    ids=["none", "empty", "sorted", "over the bytes", "kueue gate", "other gate", "gates not a list"],
)
def test_pod_info_reads_the_selector_and_kueues_gate(
    spec: JSON, selector: tuple[tuple[str, str], ...], problem: str, gated: bool
) -> None:
    pod = kueue_member(0)
    pod["spec"].update(spec)
    info = pod_info(pod)
    assert info.node_selector == selector and info.topology_gated is gated
    assert info.selector_problem.startswith(problem) and bool(info.selector_problem) is bool(problem)


def test_a_selector_that_is_not_a_map_of_strings_is_refused_naming_the_field() -> None:
    pod = kueue_member(0, selector={"a": 1})  # type: ignore[dict-item]
    with pytest.raises(WireError, match=r"Pod\.spec\.nodeSelector"):
        pod_info(pod)
