"""Groups: waiting until all members exist, then one plan reserved for all of them, released after the
reservation timeout, and rebuilt from the API (bound members keep their nodes) after a restart."""

from __future__ import annotations

import pytest

from gputopo.model import PLACEMENT_ANNOTATION, parse_placement
from tests.extender.harness import JSON, NS, Env, gputopo_pod, make_env, node_obj, pod_obj, two_leaves

NODES = ["gpu-1", "gpu-2", "gpu-3", "gpu-4"]
ELSEWHERE = "reserved for other members of the pod's group"


def member(name: str, stage: int, size: int = 2, gpus: int = 8) -> JSON:
    return gputopo_pod(name, gpus, group="llama", group_size=str(size), stage=str(stage))


@pytest.fixture
def cluster(env: Env) -> Env:
    env.add_nodes(*two_leaves())
    return env


def planned_node(env: Env, pod: JSON) -> str:
    out = env.filter(pod, NODES)
    (node,) = out["NodeNames"]
    # The other nodes are reserved for other members; a node passed, so kube-scheduler needs no reasons.
    assert out["FailedNodes"] == {} and out["FailedAndUnresolvableNodes"] == {}
    return str(node)


def test_an_incomplete_group_waits_on_every_node(cluster: Env) -> None:
    first = member("llama-0", 0)
    cluster.add_pods(first)
    out = cluster.filter(first, NODES)
    assert out["NodeNames"] == []
    assert out["FailedNodes"] == dict.fromkeys(NODES, "group llama: 1/2 pods exist, waiting")


def test_a_pod_not_yet_in_the_cache_still_counts_itself(cluster: Env) -> None:
    out = cluster.filter(member("llama-0", 0, size=3), NODES)  # the watch has not delivered it yet
    assert set(out["FailedNodes"].values()) == {"group llama: 1/3 pods exist, waiting"}


def test_a_complete_group_is_planned_reserved_and_each_member_gets_its_node(cluster: Env) -> None:
    a, b = member("llama-0", 0), member("llama-1", 1)
    cluster.add_pods(a, b)
    node_a = planned_node(cluster, a)
    node_b = planned_node(cluster, b)
    assert node_a != node_b
    assert {node_a, node_b} in ({"gpu-1", "gpu-2"}, {"gpu-3", "gpu-4"})  # both under one leaf
    assert planned_node(cluster, a) == node_a  # stable while reserved
    scores = cluster.prioritize(a, NODES)
    assert scores == {n: 10 if n == node_a else 0 for n in NODES}
    # Other pods see the reserved GPUs as taken.
    out = cluster.filter(gputopo_pod("other", 8), NODES)
    assert sorted(out["NodeNames"]) == sorted(set(NODES) - {node_a, node_b})
    held = cluster.filter(gputopo_pod("other", 8), [node_a, node_b])
    assert held["FailedNodes"] == {node_a: "fewer than 8 free GPUs", node_b: "fewer than 8 free GPUs"}


def test_binding_a_member_records_group_and_stage(cluster: Env) -> None:
    a, b = member("llama-0", 0), member("llama-1", 1)
    cluster.add_pods(a, b)
    node_a = planned_node(cluster, a)
    node_b = planned_node(cluster, b)
    assert cluster.bind(a, node_a) == ""
    stored = cluster.source.get("pods", "default", "llama-0")
    assert stored is not None
    placement = parse_placement(stored["metadata"]["annotations"][PLACEMENT_ANNOTATION])
    assert (placement.node, placement.group, placement.stage) == (node_a, "llama", 0)
    assert "stage 0/2 shares leaf" in placement.reason
    assert cluster.bind(b, node_b) == ""
    assert cluster.ledger.reservations == {}  # every member bound: the placements carry the GPUs


def test_unbound_reservations_are_released_after_the_timeout(cluster: Env) -> None:
    a, b = member("llama-0", 0), member("llama-1", 1)
    cluster.add_pods(a, b)
    node_a = planned_node(cluster, a)
    node_b = planned_node(cluster, b)
    assert cluster.bind(a, node_a) == ""
    cluster.clock.advance(121)
    cluster.renew_leases()
    out = cluster.filter(gputopo_pod("other", 8), NODES)
    assert node_b in out["NodeNames"]  # released
    assert node_a not in out["NodeNames"]
    held = cluster.filter(gputopo_pod("other", 8), [node_a])
    assert held["FailedNodes"] == {node_a: "fewer than 8 free GPUs"}  # bound: still held by its placement
    assert ("default", "llama") not in cluster.ledger.reservations


def test_a_restarted_extender_rebuilds_the_plan_around_bound_members(cluster: Env) -> None:
    a, b = member("llama-0", 0), member("llama-1", 1)
    cluster.add_pods(a, b)
    node_a = planned_node(cluster, a)
    assert cluster.bind(a, node_a) == ""
    with make_env(cluster.source, cluster.clock, cluster.settings) as restarted:
        assert restarted.ledger.node_for(node_a).in_use == frozenset(range(8))
        node_b = planned_node(restarted, b)
        assert node_b != node_a
        res = restarted.ledger.reservations[("default", "llama")]
        assert res.slots["llama-0"].pinned and res.slots["llama-0"].node == node_a
        assert res.slots["llama-1"].node == node_b and not res.slots["llama-1"].pinned
        assert restarted.bind(b, node_b) == ""
        stored = restarted.source.get("pods", "default", "llama-1")
        assert stored is not None
        assert parse_placement(stored["metadata"]["annotations"][PLACEMENT_ANNOTATION]).stage == 1


def test_a_group_that_cannot_be_placed_fails_every_node_with_one_reason(cluster: Env) -> None:
    pods = [member(f"big-{i}", i, size=5) for i in range(5)]
    for p in pods:
        p["metadata"]["annotations"]["gputopo.io/group"] = "big"
    cluster.add_pods(*pods)
    out = cluster.filter(pods[0], NODES)
    assert out["NodeNames"] == []
    (message,) = set(out["FailedNodes"].values())
    assert set(out["FailedNodes"]) == set(NODES)
    assert message == "group needs 5 nodes with a free 8-GPU NVLink clique; 4 have it"


def test_a_replaced_member_triggers_a_new_plan(cluster: Env) -> None:
    a, b = member("llama-0", 0), member("llama-1", 1)
    cluster.add_pods(a, b)
    planned_node(cluster, a)
    first = cluster.ledger.reservations[("default", "llama")]
    cluster.source.delete("pods", "default", "llama-1")
    c = member("llama-1b", 1)
    cluster.add_pods(c)
    planned_node(cluster, c)
    again = cluster.ledger.reservations[("default", "llama")]
    assert again is not first and again.members == {"llama-0", "llama-1b"}


def test_members_in_other_namespaces_are_other_groups(cluster: Env) -> None:
    a = member("llama-0", 0)
    b = member("llama-1", 1)
    b["metadata"]["namespace"] = "team-b"
    b["metadata"]["uid"] = "uid-team-b-llama-1"
    cluster.add_pods(a, b)
    assert set(cluster.filter(a, NODES)["FailedNodes"].values()) == {"group llama: 1/2 pods exist, waiting"}


def test_too_many_members_is_reported(cluster: Env) -> None:
    pods = [member(f"llama-{i}", 0) for i in range(3)]
    for p in pods:
        del p["metadata"]["annotations"]["gputopo.io/stage"]
    cluster.add_pods(*pods)
    (message,) = set(cluster.filter(pods[0], NODES)["FailedNodes"].values())
    assert message == "group llama: 3/2 pods exist, more than gputopo.io/group-size"


def test_plain_pods_in_the_namespace_do_not_count_as_members(cluster: Env) -> None:
    cluster.add_pods(member("llama-0", 0), pod_obj("plain", 8))
    assert NS  # the lease namespace is unrelated to pod namespaces
    out = cluster.filter(member("llama-0", 0), NODES)
    assert set(out["FailedNodes"].values()) == {"group llama: 1/2 pods exist, waiting"}


def test_members_are_bound_to_the_plans_rail_aligned_gpus_not_the_nodes_default_sets(env: Env) -> None:
    # GPUs 0-1 busy on one node, 4-5 on the other: alone each node would give a 4-GPU member the other
    # half. On dgx-h100 GPU g sits next to NIC g (rail g), so aligned members hold the same indices.
    env.add_nodes(
        node_obj("rail-a", in_use=[0, 1], leaf="leaf-a", spine="s1"),
        node_obj("rail-b", in_use=[4, 5], leaf="leaf-a", spine="s1"),
    )
    pods = [gputopo_pod(f"tp4-{i}", 4, group="tp", group_size="2") for i in range(2)]
    env.add_pods(*pods)
    gpus: dict[str, tuple[int, ...]] = {}
    for pod in pods:
        (node,) = env.filter(pod, ["rail-a", "rail-b"])["NodeNames"]
        assert env.bind(pod, node) == ""
        stored = env.source.get("pods", pod["metadata"]["namespace"], pod["metadata"]["name"])
        assert stored is not None
        placement = parse_placement(stored["metadata"]["annotations"][PLACEMENT_ANNOTATION])
        gpus[placement.node] = placement.gpus
        assert "(rail-aligned)" in placement.reason
    assert set(gpus) == {"rail-a", "rail-b"}
    assert gpus["rail-a"] == gpus["rail-b"]
    assert not {0, 1} & set(gpus["rail-a"]) and not {4, 5} & set(gpus["rail-b"])
