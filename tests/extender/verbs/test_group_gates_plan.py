"""The group gate's lift waits for a plan, runs from the pod's creation and only beside the leader
(gputopo/extender/verbs/groupgates.py, gputopo.model.gates, gputopo.extender.state.leadership): a whole group is
lifted once a plan places every member, the reservation that plan made is what the members' filters then use,
a whole group no plan places keeps its gates (each member told why) until the bound, the bound counts from
creationTimestamp, and a standby replica writes nothing."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest

from gputopo.extender.settings import Settings
from gputopo.extender.verbs.groupgates import GATED_REASON, LIFTED_REASON, GateLifter
from gputopo.model.gates import GROUP_GATE, GatedMember, LiftReason, gated_since, unplaced
from tests.extender.fake import FakeSource
from tests.extender.harness import JSON, NS, T0, Env, FakeClock, make_env, node_obj, pod_obj, rfc3339, two_leaves

RELEASE = 900.0
LEASE = "gputopo-scheduler"
ME = socket.gethostname()


# ------------------------------------------------------------------ the decisions (pure)


@pytest.mark.parametrize(
    ("created", "first_seen", "since"),
    [
        pytest.param(100.0, 500.0, 100.0, id="creation-time-is-the-gates-time"),
        pytest.param(None, 500.0, 500.0, id="unreadable-creation-counts-from-first-seen"),
        pytest.param(900.0, 500.0, 500.0, id="creation-ahead-of-our-clock-never-lengthens-the-hold"),
        pytest.param(float("nan"), 500.0, 500.0, id="not-a-number-counts-from-first-seen"),
        pytest.param(500.0, 500.0, 500.0, id="seen-as-created"),
    ],
)
def test_gated_since(created: float | None, first_seen: float, since: float) -> None:
    assert gated_since(created, first_seen) == since


def _member(since: float = 1000.0) -> GatedMember:
    return GatedMember(uid="u", namespace="ns", name="p", group="jobset/t", size=4, present=4, since=since)


@pytest.mark.parametrize(
    ("waited", "lifted"),
    [
        pytest.param(0.0, False, id="unplaced-whole-group-keeps-its-gate"),
        pytest.param(RELEASE - 1, False, id="until-the-bound"),
        pytest.param(RELEASE, True, id="released-at-the-bound-naming-why"),
    ],
)
def test_unplaced(waited: float, lifted: bool) -> None:
    got = unplaced(_member(), "no room", 1000.0 + waited, RELEASE)
    assert (got is not None) == lifted
    if got is not None:
        assert got.reason is LiftReason.TIMEOUT and "could not be placed: no room" in got.message


# ------------------------------------------------------------------ against the fake API server


def settings(**kw: Any) -> Settings:
    return Settings(namespace=NS, group_gate=True, group_gate_release_seconds=RELEASE, **kw)


@pytest.fixture
def gated_env() -> Iterator[Env]:
    with make_env(FakeSource(NS), FakeClock(), settings()) as e:
        e.add_nodes(*two_leaves())  # 4 nodes of 8 GPUs
        yield e


def lifter(env: Env) -> GateLifter:
    assert env.listeners.lifter is not None
    return env.listeners.lifter


def member_pod(name: str, group: str = "g", size: int = 4, *, stage: int, created: Any = None) -> JSON:
    ann = {"gputopo.io/nvlink": "required", "gputopo.io/group": group, "gputopo.io/group-size": str(size)}
    ann["gputopo.io/stage"] = str(stage)
    pod = pod_obj(name, 8, ann)
    pod["spec"]["schedulingGates"] = [{"name": GROUP_GATE}]
    if created is not None:
        pod["metadata"]["creationTimestamp"] = created
    return pod


def group(name: str, size: int, **kw: Any) -> list[JSON]:
    return [member_pod(f"{name}-{i}", name, size, stage=i, **kw) for i in range(size)]


def sweep(env: Env) -> list[str]:
    done = lifter(env).sweep()
    env.extender.flush_events()
    env.resync()
    return [lf.member.ref for lf in done]


def events(env: Env, reason: str) -> dict[str, str]:
    return {e["involvedObject"]["name"]: e["message"] for e in env.source.events if e["reason"] == reason}


def test_a_whole_group_no_plan_places_keeps_its_gates_and_each_member_is_told_why(gated_env: Env) -> None:
    env = gated_env
    env.add_pods(*group("big", 5))  # 40 GPUs asked, 32 exist
    assert sweep(env) == [] and env.source.patches == []
    env.clock.advance(5)
    assert sweep(env) == []
    told = events(env, GATED_REASON)
    assert sorted(told) == [f"big-{i}" for i in range(5)]
    assert all("group big is whole but cannot be placed now" in t for t in told.values())
    assert sweep(env) == [] and len(env.source.events) == 5  # once each
    assert env.source.patches == []


def test_a_group_lifted_once_capacity_returns_in_rank_order_and_its_plan_serves_its_filters(gated_env: Env) -> None:
    env = gated_env
    pods = group("big", 5)
    env.add_pods(*reversed(pods))
    assert sweep(env) == []
    env.add_nodes(node_obj("gpu-5", leaf="leaf-b", spine="s1"))  # the node change: the next sweep plans again
    assert sweep(env) == [f"default/big-{i}" for i in range(5)]
    assert [p[1] for p in env.source.patches] == [f"big-{i}" for i in range(5)]
    res = env.ledger.reservations[("default", "big")]
    nodes = [f"gpu-{i}" for i in range(1, 6)]
    for i, p in enumerate(pods):
        p["spec"].pop("schedulingGates")
        assert env.passed(p, nodes) == [res.slots[f"big-{i}"].node]
    assert env.ledger.reservations[("default", "big")] is res  # the lift's plan, not a second one


def test_an_unplaced_group_is_released_at_the_bound_with_a_warning_naming_why(gated_env: Env) -> None:
    env = gated_env
    env.add_pods(*group("big", 5))
    assert sweep(env) == []
    env.clock.advance(RELEASE)
    assert sweep(env) == [f"default/big-{i}" for i in range(5)]
    told = events(env, LIFTED_REASON)
    assert "is whole but could not be placed" in told["big-0"]
    assert all(e["type"] == "Warning" for e in env.source.events if e["reason"] == LIFTED_REASON)


def test_after_a_restart_the_bound_counts_from_the_pods_creation(gated_env: Env) -> None:
    env = gated_env
    old = rfc3339(env.clock.now - RELEASE)  # created (and gated) a bound ago; this lifter never saw them
    env.add_pods(*group("late", 3, created=old)[:2])
    assert sweep(env) == ["default/late-0", "default/late-1"]
    assert "has 2 of 3 members" in events(env, LIFTED_REASON)["late-0"]


def test_a_young_pod_waits_its_bound_from_its_creation(gated_env: Env) -> None:
    env = gated_env
    env.add_pods(*group("young", 3, created=rfc3339(env.clock.now - RELEASE + 10))[:2])
    assert sweep(env) == []
    env.clock.advance(10)
    assert sweep(env) == ["default/young-0", "default/young-1"]


# ------------------------------------------------------------------ only the leader lifts


def leader_lease(holder: str, renew: float) -> JSON:
    return {
        "metadata": {"name": LEASE, "namespace": NS},
        "spec": {"holderIdentity": holder, "renewTime": rfc3339(renew), "leaseDurationSeconds": 15},
    }


@pytest.fixture
def replica_env() -> Iterator[Env]:
    with make_env(FakeSource(NS), FakeClock(), settings(leader_lease=LEASE)) as e:
        e.add_nodes(*two_leaves())
        yield e


def test_a_standby_writes_nothing_until_its_scheduler_leads(replica_env: Env) -> None:
    env = replica_env
    env.source.put("leases", leader_lease("other-replica_5f1e", env.clock.now))
    created = rfc3339(env.clock.now)
    env.add_pods(*group("g", 2, created=created), member_pod("lone-gated", "solo", 4, stage=0, created=created))
    for _ in range(3):
        env.clock.advance(RELEASE)
        env.renew_leases()
        assert sweep(env) == []
    assert env.source.patches == [] and env.source.events == []
    env.source.put("leases", leader_lease(f"{ME}_9c2d", env.clock.now))  # this pod's kube-scheduler took over
    env.resync()
    assert sweep(env) == ["default/g-0", "default/g-1", "default/lone-gated"]
    assert "has 1 of 4 members" in events(env, LIFTED_REASON)["lone-gated"]


@pytest.mark.parametrize(
    "lease",
    [
        pytest.param(None, id="no-lease-yet"),
        pytest.param(leader_lease(f"{ME}_9c2d", T0 - 60), id="ours-but-lapsed"),
    ],
)
def test_without_a_live_lease_of_ours_nothing_is_written(replica_env: Env, lease: JSON | None) -> None:
    env = replica_env
    if lease is not None:
        env.source.put("leases", lease)
    env.add_pods(*group("g", 2))
    assert sweep(env) == [] and env.source.patches == []


def test_the_leader_lease_deleted_stops_the_lifts(replica_env: Env) -> None:
    env = replica_env
    env.source.put("leases", leader_lease(f"{ME}_9c2d", env.clock.now))
    env.resync()
    assert env.cache.leadership.leading()
    env.source.delete("leases", NS, LEASE)
    env.resync()
    env.add_pods(*group("g", 2))
    assert sweep(env) == [] and env.source.patches == []


def test_a_lifted_plan_on_a_node_kube_scheduler_refuses_is_planned_again_over_its_candidates(gated_env: Env) -> None:
    env = gated_env
    pods = group("g", 2)
    env.add_pods(*pods)
    lifter(env).max_writes = 1  # the group lifted over two sweeps: the second looks at the plan again
    assert sweep(env) == ["default/g-0"]
    assert sweep(env) == ["default/g-1"]
    res = env.ledger.reservations[("default", "g")]
    refused = res.slots["g-0"].node  # say, cordoned: kube-scheduler's own filters leave it out
    candidates = [f"gpu-{i}" for i in range(1, 5) if f"gpu-{i}" != refused]
    for p in pods:
        p["spec"].pop("schedulingGates")
    [first] = env.passed(pods[0], candidates)
    again = env.ledger.reservations[("default", "g")]
    assert again is not res and refused not in {s.node for s in again.slots.values()}
    assert first == again.slots["g-0"].node
    assert env.passed(pods[1], candidates) == [again.slots["g-1"].node]
    assert env.ledger.reservations[("default", "g")] is again  # checked once: the next filter plans nothing


def test_a_members_own_filter_plan_is_never_second_guessed(gated_env: Env) -> None:
    env = gated_env
    pods = group("g", 2)
    for p in pods:
        p["spec"].pop("schedulingGates")  # not gated: the first filter plans over its candidates, as ever
    env.add_pods(*pods)
    assert len(env.passed(pods[0], ["gpu-1", "gpu-2", "gpu-3", "gpu-4"])) == 1
    res = env.ledger.reservations[("default", "g")]
    env.passed(pods[1], ["gpu-1"])  # a narrower list for the second member
    assert env.ledger.reservations[("default", "g")] is res
