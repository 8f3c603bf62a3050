"""The group gate's lifter against what others write: a pod's creationTimestamp (the bound's start) and a
tenant's flood of whole gangs that can never be placed. Bounds: no timestamp makes a hold longer than the bound
from when the extender first saw the pod, and none fails the pod's record; plans a sweep <= max_plans, and an
unchanged cluster costs no new plan of an unplaceable group (its failure is kept); another tenant's placeable
gang is lifted at the next sweep; a flood of gated pods costs a sweep a full read only of what changed."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from gputopo.engine.gang.replan import replan
from gputopo.extender.settings import Settings
from gputopo.extender.verbs import gangs, groupgates
from gputopo.extender.verbs.groupgates import DEFAULT_MAX_PLANS, GateLifter
from gputopo.model.gates import GROUP_GATE
from tests.extender.fake import FakeSource
from tests.extender.harness import JSON, NS, T0, Env, FakeClock, make_env, pod_obj, rfc3339, two_leaves

RELEASE = 900.0


def member(name: str, group: str, size: int, stage: int, *, ns: str = "default", created: Any = ...) -> JSON:
    ann = {"gputopo.io/nvlink": "required", "gputopo.io/group": group, "gputopo.io/group-size": str(size)}
    ann["gputopo.io/stage"] = str(stage)
    pod = pod_obj(name, 8, ann, namespace=ns)
    pod["spec"]["schedulingGates"] = [{"name": GROUP_GATE}]
    if created is not ...:
        pod["metadata"]["creationTimestamp"] = created
    return pod


@pytest.fixture
def gated_env() -> Iterator[Env]:
    settings = Settings(namespace=NS, group_gate=True, group_gate_release_seconds=RELEASE)
    with make_env(FakeSource(NS), FakeClock(), settings) as e:
        e.add_nodes(*two_leaves())  # 4 nodes of 8 GPUs
        yield e


def lifter(env: Env) -> GateLifter:
    assert env.listeners.lifter is not None
    return env.listeners.lifter


def sweep(env: Env) -> list[str]:
    done = lifter(env).sweep()
    env.resync()
    return [lf.member.ref for lf in done]


# ------------------------------------------------------------------ creationTimestamp


@pytest.mark.parametrize(
    "created",
    [
        pytest.param(rfc3339(T0 + 10 * RELEASE), id="in-the-future"),
        pytest.param("9999-12-31T23:59:59Z", id="the-last-second-of-year-9999"),
        pytest.param("", id="empty"),
        pytest.param(None, id="null"),
        pytest.param(..., id="absent"),
    ],
)
def test_a_future_or_absent_creation_time_counts_from_first_seen_and_fails_nothing(
    gated_env: Env, created: Any
) -> None:
    env = gated_env
    env.add_pods(member("m-0", "g", 3, 0, created=created))
    assert "uid-default-m-0" in env.ledger.pods  # the pod's record is read whatever the time says
    assert sweep(env) == []
    env.clock.advance(RELEASE - 1)
    assert sweep(env) == []
    env.clock.advance(1)
    assert sweep(env) == ["default/m-0"]  # the bound from first seen: never longer


@pytest.mark.parametrize(
    "created",
    [
        pytest.param("yesterday", id="not-a-time"),
        pytest.param("2026-01-01T00:00:00", id="without-its-zone"),
        pytest.param(1_000_000, id="a-number"),
        pytest.param({"seconds": 1}, id="an-object"),
        pytest.param("2" * 100_000, id="100-kb-of-digits"),
    ],
)
def test_an_unreadable_creation_time_refuses_that_pod_alone_and_lifts_nothing(gated_env: Env, created: Any) -> None:
    # The one Pod reader refuses a creationTimestamp that is not RFC 3339 (the API server never writes one):
    # the pod is a bad object, never a member, and nothing else fails.
    env = gated_env
    env.add_pods(member("m-0", "g", 3, 0, created=created), member("m-1", "g", 3, 1))
    assert "uid-default-m-0" not in env.ledger.pods and "uid-default-m-1" in env.ledger.pods
    assert sweep(env) == []


def test_an_ancient_creation_time_releases_at_once_never_holds_longer(gated_env: Env) -> None:
    env = gated_env
    env.add_pods(member("m-0", "g", 3, 0, created="0001-01-01T00:00:00Z"))
    assert sweep(env) == ["default/m-0"]


# ------------------------------------------------------------------ a flood of unplaceable gangs


def test_a_flood_of_unplaceable_gangs_is_planned_at_a_bounded_pace_and_an_unchanged_cluster_costs_no_plan(
    gated_env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = gated_env
    engine_plans = 0
    real = replan

    def counted(*a: Any, **kw: Any) -> Any:
        nonlocal engine_plans
        engine_plans += 1
        return real(*a, **kw)

    monkeypatch.setattr(gangs, "replan", counted)
    groups = 30
    env.add_pods(*(member(f"f{g}-{i}", f"f{g}", 5, i, ns="tenant") for g in range(groups) for i in range(5)))
    gl = lifter(env)
    rounds = -(-groups // DEFAULT_MAX_PLANS)
    for _ in range(rounds):
        before = gl.plans
        assert sweep(env) == []
        assert gl.plans - before <= DEFAULT_MAX_PLANS
    assert engine_plans == groups  # each once
    for _ in range(3 * rounds):
        assert sweep(env) == []
    assert engine_plans == groups  # nothing changed: each group's failure is reused, no plan made again
    assert env.source.patches == []
    # Another tenant's gang that fits is planned first (never planned before) and lifted at the next sweep.
    env.add_pods(*(member(f"ok-{i}", "ok", 2, i, ns="other") for i in range(2)))
    assert sweep(env) == ["other/ok-0", "other/ok-1"]


# ------------------------------------------------------------------ a tenant churning its gangs


def _toggle_whole(env: Env, turn: int) -> None:
    """8 unplaceable gangs, half whole each sweep: each member's group-size flips between 5 and 6."""
    for g in range(8):
        size = 5 if (g + turn) % 2 else 6
        env.add_pods(*(member(f"t{g}-{i}", f"t{g}", size, i, ns="a-tenant", created=rfc3339(T0)) for i in range(5)))


def _fresh_groups(env: Env, turn: int) -> None:
    """4 new unplaceable gangs every sweep, each whole from its creation."""
    now = rfc3339(env.clock.now)
    for g in range(4 * turn, 4 * turn + 4):
        env.add_pods(*(member(f"n{g}-{i}", f"n{g}", 5, i, ns="a-tenant", created=now) for i in range(5)))


@pytest.mark.parametrize(
    "churn",
    [
        pytest.param(_toggle_whole, id="gangs-flipping-whole-and-not-each-sweep"),
        pytest.param(_fresh_groups, id="new-gangs-every-sweep"),
    ],
)
def test_a_tenant_churning_its_gangs_never_keeps_another_tenants_gang_from_its_plan(gated_env: Env, churn: Any) -> None:
    # Groups are planned oldest first: by when each was last planned, or, never planned, by when its oldest
    # member was gated. A tenant's gangs that leave and come back whole, or new ones each sweep, wait
    # their turn: another tenant's gang that fits is planned within a round of the groups before it.
    env = gated_env
    churn(env, 0)
    sweep(env)
    env.clock.advance(0.25)
    env.add_pods(*(member(f"ok-{i}", "ok", 2, i, ns="other", created=rfc3339(env.clock.now)) for i in range(2)))
    lifted: list[str] = []
    for turn in range(1, 5):
        env.clock.advance(0.25)
        churn(env, turn)
        lifted += sweep(env)
        assert lifter(env).plans <= DEFAULT_MAX_PLANS * (turn + 1)
    assert lifted == ["other/ok-0", "other/ok-1"]


# ------------------------------------------------------------------ a flood of gated pods


def _nothing(env: Env) -> None:
    pass


def _one_member_comes(env: Env) -> None:
    env.add_pods(member("w0-1", "w0", 2, 1, ns="a-tenant"))


def _one_pod_edited(env: Env) -> None:
    pod = member("w1-0", "w1", 2, 0, ns="a-tenant")
    pod["metadata"]["labels"] = {"edited": "yes"}
    pod["metadata"]["annotations"]["gputopo.io/nvlink"] = "preferred"
    env.add_pods(pod)


@pytest.mark.parametrize(
    ("change", "read"),
    [
        pytest.param(_nothing, 0, id="nothing-changed"),
        pytest.param(_one_member_comes, 2, id="one-member-comes"),
        pytest.param(_one_pod_edited, 1, id="one-pod-edited"),
    ],
)
def test_a_flood_of_gated_pods_costs_a_sweep_only_what_changed(
    gated_env: Env, monkeypatch: pytest.MonkeyPatch, change: Any, read: int
) -> None:
    # A tenant's 2,000 gated pods, each waiting for a member that never comes: each is read (under the ledger's
    # lock, which the filters wait on) when it or its group changes, not at every sweep.
    env = gated_env
    reads = 0
    real = groupgates.gated_member

    def counted(*a: Any) -> Any:
        nonlocal reads
        reads += 1
        return real(*a)

    monkeypatch.setattr(groupgates, "gated_member", counted)
    env.add_pods(*(member(f"w{g}-0", f"w{g}", 2, 0, ns="a-tenant") for g in range(2_000)))
    assert sweep(env) == [] and reads == 2_000
    reads = 0
    change(env)
    sweep(env)
    assert reads == read
