"""Native PodGroups in the extender: members of a PodGroup are one gputopo group planned and reserved
at the first member's filter (so two members never pass on the same GPUs), sizes wait for the PodGroup
object, a deleted PodGroup releases its plan, and an API server that does not serve PodGroups is
neither waited for nor asked again at once."""

from __future__ import annotations

import json
import threading

import pytest

from gputopo.extender.watch.cache import ClusterCache
from gputopo.extender.watch.source import Informer
from gputopo.model import PLACEMENT_ANNOTATION
from tests.extender.fake import FakeSource
from tests.extender.harness import JSON, Env, node_obj, pod_obj

NODES = ["gpu-1", "gpu-2"]


def podgroup(name: str, min_count: int | None, *keys: str, namespace: str = "default") -> JSON:
    policy: JSON = {"gang": {"minCount": min_count}} if min_count is not None else {"basic": {}}
    spec: JSON = {"schedulingPolicy": policy}
    if keys:
        spec["schedulingConstraints"] = {"topology": [{"key": k} for k in keys]}
    return {"metadata": {"name": name, "namespace": namespace, "uid": f"uid-pg-{name}"}, "spec": spec}


def member(name: str, group: str, gpus: int = 2, annotations: dict[str, str] | None = None) -> JSON:
    pod = pod_obj(name, gpus, annotations)
    pod["spec"]["schedulingGroup"] = {"podGroupName": group}
    return pod


def passed(env: Env, pod: JSON, names: list[str] = NODES) -> list[str]:
    return env.passed(pod, names)


def reasons(env: Env, pod: JSON, names: list[str] = NODES) -> set[str]:
    return env.reasons(pod, names)


def with_podgroup(env: Env, pg: JSON) -> None:
    env.source.put("podgroups", pg)
    env.resync()


@pytest.mark.parametrize(
    ("free", "annotations", "both"),
    [
        # The torn gang: one free NVLink pair, two 2-GPU members. Neither may pass.
        pytest.param({"gpu-1": [6, 7]}, {}, False, id="one free pair: neither member passes"),
        pytest.param(
            {"gpu-1": [6, 7]}, {"gputopo.io/spread": "none"}, False, id="one free pair, members may share: neither"
        ),
        pytest.param({"gpu-1": [6, 7], "gpu-2": [6, 7]}, {}, True, id="a free pair per node: each member its own"),
        pytest.param({"gpu-1": [4, 5, 6, 7]}, {"gputopo.io/spread": "none"}, True, id="two free pairs on one node"),
    ],
)
def test_a_podgroups_members_pass_all_together_or_none(
    env: Env, free: dict[str, list[int]], annotations: dict[str, str], both: bool
) -> None:
    env.add_nodes(*(node_obj(n, in_use=[g for g in range(8) if g not in free.get(n, [])]) for n in NODES))
    a, b = member("train-0", "train", annotations=annotations), member("train-1", "train", annotations=annotations)
    env.add_pods(a, b)
    with_podgroup(env, podgroup("train", 2))
    first, second = passed(env, a), passed(env, b)
    if not both:
        assert first == second == []
        assert env.ledger.reservations.get(("default", "podgroup/train")) is None
        return
    assert len(first) == len(second) == 1
    res = env.ledger.reservations.get(("default", "podgroup/train"))
    assert res is not None
    slots = {s.member: (s.node, s.gpus) for s in res.slots.values()}
    (n0, g0), (n1, g1) = slots["train-0"], slots["train-1"]
    assert n0 != n1 or not g0 & g1
    assert env.bind(a, first[0]) == "" and env.bind(b, second[0]) == ""


def test_members_wait_for_the_podgroup_and_for_min_count_pods(env: Env) -> None:
    env.add_nodes(*(node_obj(n) for n in NODES))
    a = member("train-0", "train")
    env.add_pods(a)
    assert reasons(env, a) == {"group podgroup/train: waiting: the PodGroup train is not known yet"}
    with_podgroup(env, podgroup("train", 2))
    assert reasons(env, a) == {"group podgroup/train: 1/2 pods exist, waiting"}
    b = member("train-1", "train")
    env.add_pods(b)
    assert len(passed(env, a)) == 1


def test_the_topology_key_is_a_required_tier(env: Env) -> None:
    env.add_nodes(
        node_obj("gpu-1", leaf="leaf-a", spine="s1"),
        node_obj("gpu-2", leaf="leaf-b", spine="s1"),
        node_obj("gpu-3", leaf="leaf-b", spine="s1"),
    )
    pods = [member(f"train-{i}", "train", gpus=8) for i in range(2)]
    env.add_pods(*pods)
    with_podgroup(env, podgroup("train", 2, "gputopo.io/network-leaf"))
    names = ["gpu-1", "gpu-2", "gpu-3"]
    assert {passed(env, p, names)[0] for p in pods} == {"gpu-2", "gpu-3"}


def test_a_topology_key_no_tier_reads_fails_every_member_naming_it(env: Env) -> None:
    env.add_nodes(*(node_obj(n) for n in NODES))
    pods = [member(f"train-{i}", "train") for i in range(2)]
    env.add_pods(*pods)
    with_podgroup(env, podgroup("train", 2, "kubernetes.io/hostname"))
    (why,) = reasons(env, pods[0])
    assert why.startswith(
        'invalid PodGroup train: spec.schedulingConstraints.topology[0].key="kubernetes.io/hostname": '
        "no gputopo tier reads this label"
    )


def test_a_basic_podgroup_leaves_its_pods_single(env: Env) -> None:
    env.add_nodes(*(node_obj(n) for n in NODES))
    a = member("web-0", "web")
    env.add_pods(a)
    with_podgroup(env, podgroup("web", None))
    assert passed(env, a) == NODES  # a plain pod under gputopo-scheduler without annotations: passed through


def test_a_deleted_podgroup_releases_its_reservation(env: Env) -> None:
    env.add_nodes(*(node_obj(n) for n in NODES))
    pods = [member(f"train-{i}", "train") for i in range(2)]
    env.add_pods(*pods)
    pg = podgroup("train", 2)
    with_podgroup(env, pg)
    passed(env, pods[0])
    assert env.ledger.reservations.get(("default", "podgroup/train")) is not None
    env.source.delete("podgroups", "default", "train")
    env.cache.apply("podgroups", "DELETED", pg)
    assert env.ledger.reservations.get(("default", "podgroup/train")) is None


def test_a_podgroup_status_update_keeps_the_reservation(env: Env) -> None:
    env.add_nodes(*(node_obj(n) for n in NODES))
    pods = [member(f"train-{i}", "train") for i in range(2)]
    env.add_pods(*pods)
    pg = podgroup("train", 2)
    with_podgroup(env, pg)
    passed(env, pods[0])
    env.cache.apply("podgroups", "MODIFIED", {**pg, "status": {"conditions": [{"type": "PodGroupScheduled"}]}})
    assert env.ledger.reservations.get(("default", "podgroup/train")) is not None


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"schedulingPolicy": []}, "spec.schedulingPolicy is not an object"),
        (
            {"schedulingPolicy": {"gang": {"minCount": 2}}, "schedulingConstraints": {"topology": [{"key": 3}]}},
            "spec.schedulingConstraints.topology[0].key",
        ),
    ],
)
def test_an_unreadable_podgroup_is_skipped_and_counted(env: Env, spec: JSON, field: str) -> None:
    seen: list[str] = []
    env.cache.on_bad_object = lambda kind, reason: seen.append(f"{kind}: {reason}")
    env.cache.apply("podgroups", "ADDED", {"metadata": {"name": "bad", "namespace": "default"}, "spec": spec})
    assert len(seen) == 1 and seen[0].startswith("podgroups: ") and field in seen[0]
    assert env.cache.facts("default").podgroups == {}


def test_podgroups_not_served_are_not_waited_for_nor_asked_again_at_once() -> None:
    source = FakeSource()
    source.not_served.add("podgroups")
    cache = ClusterCache()
    inf = Informer(source, "podgroups", cache, not_served_recheck_seconds=3600)
    thread = threading.Thread(target=inf.run, daemon=True)
    thread.start()
    try:
        assert inf.synced.wait(5)
        assert not inf.served and "podgroups" in cache.synced
        for kind in ("nodes", "pods", "leases"):
            Informer(source, kind, cache).relist()
        assert cache.ready
        # One list, then the informer sleeps on its recheck: no watch, no second list.
        assert inf.stop.wait(0.3) is False
        assert [c for c in source.calls if "podgroups" in c] == ["list podgroups"]
    finally:
        inf.stop.set()
        thread.join(5)
    assert not thread.is_alive()


def test_podgroups_served_later_are_listed_after_the_recheck() -> None:
    source = FakeSource()
    source.not_served.add("podgroups")
    cache = ClusterCache()
    inf = Informer(source, "podgroups", cache, not_served_recheck_seconds=0)
    inf.relist()
    assert not inf.served
    source.not_served.clear()
    source.put("podgroups", podgroup("train", 2))
    inf.relist()
    assert inf.served and set(cache.facts("default").podgroups) == {"train"}


def holder(name: str, node: str, priority: int, gpus: int = 8) -> JSON:
    """A pod bound to `node` holding its first `gpus` GPUs, of `priority`."""
    placement = json.dumps({"node": node, "gpus": list(range(gpus)), "score": 9, "reason": "r"})
    pod = pod_obj(name, gpus, {"gputopo.io/nvlink": "required", PLACEMENT_ANNOTATION: placement}, node=node)
    pod["spec"]["priority"] = priority
    return pod


@pytest.mark.parametrize(
    ("member_priority", "native", "passes"),
    [
        pytest.param(1000, True, True, id="a higher-priority PodGroup is planned over the lower-priority pods"),
        pytest.param(10, True, False, id="a PodGroup of the holders' priority is not"),
        pytest.param(1000, False, False, id="an annotated group is not: kube-scheduler calls preempt for it"),
    ],
)
def test_the_gang_preemption_dry_run_is_planned_as_if_lower_priority_pods_were_gone(
    env: Env, member_priority: int, native: bool, passes: bool
) -> None:
    # Every node is full by kube-scheduler's own count: filter sees them only in the dry run of
    # PodGroupPostFilter DefaultPreemption, which removed the lower-priority pods first.
    env.add_nodes(*(node_obj(n) for n in NODES))
    env.add_pods(*(holder(f"low-{n}", n, 10) for n in NODES))
    ann = {} if native else {"gputopo.io/group": "train", "gputopo.io/group-size": "2"}
    pods = [member(f"train-{i}", "train", gpus=8, annotations=ann) for i in range(2)]
    for p in pods:
        p["spec"]["priority"] = member_priority
        if not native:
            del p["spec"]["schedulingGroup"]
    env.add_pods(*pods)
    with_podgroup(env, podgroup("train", 2))
    got = [passed(env, p) for p in pods]
    key = ("default", "podgroup/train" if native else "train")
    assert env.ledger.reservations.get(key) is None  # a dry run holds nothing
    if passes:
        assert sorted(n for (n,) in got) == NODES
    else:
        assert got == [[], []]


@pytest.mark.parametrize(
    ("second_sees", "passes"),
    [
        pytest.param("the other node", True, id="the node the plan left it: passes, as planned"),
        pytest.param("the first's node", False, id="only the first member's planned node: fails"),
    ],
)
def test_the_dry_runs_later_members_are_answered_from_its_plan_on_the_nodes_left_to_them(
    env: Env, second_sees: str, passes: bool
) -> None:
    # kube-scheduler assumes the first member before it asks about the second, so the second's request
    # names only the nodes with room left by its own count: too few for a plan of its own.
    env.add_nodes(*(node_obj(n) for n in NODES))
    env.add_pods(*(holder(f"low-{n}", n, 10) for n in NODES))
    pods = [member(f"train-{i}", "train", gpus=8) for i in range(2)]
    for p in pods:
        p["spec"]["priority"] = 1000
    env.add_pods(*pods)
    with_podgroup(env, podgroup("train", 2))
    (first,) = passed(env, pods[0])
    (other,) = set(NODES) - {first}
    sees = [other] if second_sees == "the other node" else [first]
    assert passed(env, pods[1], sees) == (sees if passes else [])
    assert env.ledger.reservations.get(("default", "podgroup/train")) is None


def test_a_real_cycle_is_not_taken_for_the_dry_run(env: Env) -> None:
    # GPUs 0-5 used by something kube-scheduler does not count (the agent's report): its count fits
    # the member, so this is the real cycle, and the lower-priority pod's GPUs are not given away.
    env.add_nodes(node_obj("gpu-1", in_use=[2, 3, 4, 5, 6, 7]), node_obj("gpu-2", in_use=[2, 3, 4, 5, 6, 7]))
    env.add_pods(*(holder(f"low-{n}", n, 10, gpus=2) for n in NODES))
    pods = [member(f"train-{i}", "train", gpus=2) for i in range(2)]
    for p in pods:
        p["spec"]["priority"] = 1000
    env.add_pods(*pods)
    with_podgroup(env, podgroup("train", 2))
    assert [passed(env, p) for p in pods] == [[], []]


# minCount is a minimum and, on 1.37, mutable: members beyond it join the gang, a grown PodGroup waits
# for its new members, and members already bound keep their nodes and GPUs when it is planned again.
@pytest.mark.parametrize(
    ("min_count", "pods", "all_pass"),
    [
        pytest.param(2, 3, True, id="more members than minCount: all planned together"),
        pytest.param(3, 3, True, id="exactly minCount"),
        pytest.param(4, 3, False, id="fewer than minCount: waiting"),
    ],
)
def test_min_count_is_a_minimum_not_an_exact_size(env: Env, min_count: int, pods: int, all_pass: bool) -> None:
    env.add_nodes(*(node_obj(n) for n in NODES))
    members = [member(f"train-{i}", "train", gpus=4) for i in range(pods)]
    env.add_pods(*members)
    with_podgroup(env, podgroup("train", min_count))
    if not all_pass:
        assert reasons(env, members[0]) == {f"group podgroup/train: {pods}/{min_count} pods exist, waiting"}
        return
    slots = {}
    for p in members:
        (node,) = passed(env, p)
        slots[p["metadata"]["name"]] = node
    res = env.ledger.reservations.get(("default", "podgroup/train"))
    assert res is not None and len(res.slots) == pods
    taken = [(s.node, g) for s in res.slots.values() for g in s.gpus]
    assert len(taken) == len(set(taken)) == 4 * pods


def test_a_grown_podgroup_plans_its_new_members_around_the_bound_ones(env: Env) -> None:
    env.add_nodes(*(node_obj(n) for n in NODES))
    first = [member(f"train-{i}", "train", gpus=4) for i in range(2)]
    env.add_pods(*first)
    with_podgroup(env, podgroup("train", 2))
    bound = {}
    for p in first:
        (node,) = passed(env, p)
        assert env.bind(p, node) == ""
        stored = env.source.get("pods", "default", p["metadata"]["name"])
        assert stored is not None
        bound[p["metadata"]["name"]] = json.loads(stored["metadata"]["annotations"][PLACEMENT_ANNOTATION])
    env.resync()
    # minCount raised to 4 (mutable on 1.37) and two more pods: the third alone waits, then both plan.
    with_podgroup(env, podgroup("train", 4))
    grown = [member(f"train-{i}", "train", gpus=4) for i in (2, 3)]
    env.add_pods(grown[0])
    assert reasons(env, grown[0]) == {"group podgroup/train: 3/4 pods exist, waiting"}
    env.add_pods(grown[1])
    new = {}
    for p in grown:
        (node,) = passed(env, p)
        new[p["metadata"]["name"]] = node
    res = env.ledger.reservations.get(("default", "podgroup/train"))
    assert res is not None
    for name, placement in bound.items():
        slot = res.slots[name]
        assert slot.pinned and slot.node == placement["node"] and sorted(slot.gpus) == placement["gpus"]
    taken = [(s.node, g) for s in res.slots.values() for g in s.gpus]
    assert len(taken) == len(set(taken)) == 16


def test_a_shrunk_podgroup_keeps_its_members_and_plans_a_newcomer_beside_them(env: Env) -> None:
    env.add_nodes(*(node_obj(n) for n in NODES))
    first = [member(f"train-{i}", "train", gpus=2) for i in range(3)]
    env.add_pods(*first)
    with_podgroup(env, podgroup("train", 3))
    for p in first:
        (node,) = passed(env, p)
        assert env.bind(p, node) == ""
    env.resync()
    with_podgroup(env, podgroup("train", 1))
    late = member("train-3", "train", gpus=2)
    env.add_pods(late)
    (node,) = passed(env, late)
    res = env.ledger.reservations.get(("default", "podgroup/train"))
    assert res is not None and len(res.slots) == 4
    assert sum(s.pinned for s in res.slots.values()) == 3
