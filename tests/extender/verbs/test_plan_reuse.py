"""A group's failed plan is made once and told to every member until something it read changes
(gputopo.extender.verbs.gangs.FailedPlans): a retry round of an unplaceable gang costs one plan. Every change
the plan depends on makes the next filter plan again, and for random sequences of node and member changes
the desk that reuses answers every filter and bind exactly as one that plans every time."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gputopo.engine.gang.replan import replan
from gputopo.extender.settings import Settings
from gputopo.extender.verbs import gangs
from tests.extender.fake import FakeSource
from tests.extender.harness import JSON, NS, Env, FakeClock, gputopo_pod, lease_obj, make_env, node_obj

NODES = ["gpu-1", "gpu-2", "gpu-3", "gpu-4"]


def member(i: int, size: int = 5, gpus: int = 8, **extra: str) -> JSON:
    return gputopo_pod(f"big-{i}", gpus, group="big", group_size=str(size), stage=str(i), **extra)


def node(name: str, leaf: str = "leaf-a", in_use: list[int] | None = None) -> JSON:
    return node_obj(name, leaf=leaf, spine="s1", in_use=in_use)


@pytest.fixture
def plans(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    """Plans the group desk makes (calls of the engine's replan)."""
    made: Counter[str] = Counter()
    real = replan

    def counted(*a: Any, **kw: Any) -> Any:
        made["plans"] += 1
        return real(*a, **kw)

    monkeypatch.setattr(gangs, "replan", counted)
    yield made


@pytest.fixture
def gang(env: Env) -> Env:
    """Four 8-GPU nodes and five 8-GPU members: the gang never fits."""
    env.add_nodes(*(node(n) for n in NODES))
    env.add_pods(*(member(i) for i in range(5)))
    return env


def _round(env: Env, names: list[str] = NODES) -> set[str]:
    """Every member filtered once; the distinct reasons they were told."""
    told: set[str] = set()
    for i in range(5):
        told |= env.reasons(member(i), names)
    return told


def test_a_retry_round_of_an_unplaceable_gang_costs_one_plan(gang: Env, plans: Counter[str]) -> None:
    first = _round(gang)
    assert first == {"group needs 5 nodes with a free 8-GPU NVLink clique; 4 have it"}
    assert plans["plans"] == 1
    assert _round(gang) == first and _round(gang) == first
    assert plans["plans"] == 1


def _gpus_taken(env: Env) -> None:
    env.source.put("nodes", node("gpu-2", in_use=[0]))
    env.resync()


def _node_outside_changes(env: Env) -> None:
    env.add_nodes(node("gpu-9"))  # named by no member's filter
    env.source.put("nodes", node("gpu-9", in_use=[0, 1]))
    env.resync()


def _member_replaced(env: Env) -> None:
    env.source.delete("pods", "default", "big-4")
    env.add_pods(gputopo_pod("big-4b", 8, group="big", group_size="5", stage="4"))


def _member_rewritten_alike(env: Env) -> None:
    env.add_pods(member(3))


def _member_request_changed(env: Env) -> None:
    env.add_pods(member(3, gpus=4))


def _labels_changed(env: Env) -> None:
    env.source.put("nodes", node("gpu-9", leaf="leaf-z"))  # any node's labels: selectors may name it
    env.resync()


def _lease_went_stale(env: Env) -> None:
    env.clock.advance(121)  # no agent heartbeat: every node goes stale


def _other_gpus_request(env: Env) -> None:
    env.filter(gputopo_pod("alone", 8), ["gpu-1"])  # a lone pod's filter reserves nothing


@pytest.mark.parametrize(
    ("change", "names", "planned_again"),
    [
        pytest.param(_gpus_taken, NODES, True, id="a-candidate-node-s-gpus-taken-plans-again"),
        pytest.param(_node_outside_changes, NODES, False, id="a-node-no-member-was-offered-changing-is-reused"),
        pytest.param(_member_replaced, NODES, True, id="a-member-replaced-plans-again"),
        pytest.param(_member_rewritten_alike, NODES, False, id="a-member-written-unchanged-is-reused"),
        pytest.param(_member_request_changed, NODES, True, id="a-member-s-request-changed-plans-again"),
        pytest.param(_labels_changed, NODES, True, id="a-node-s-labels-changed-plans-again"),
        pytest.param(_lease_went_stale, NODES, True, id="a-lease-gone-stale-plans-again"),
        pytest.param(_other_gpus_request, NODES, False, id="another-pod-s-filter-is-reused"),
        pytest.param(lambda env: None, NODES[:3], True, id="other-candidates-plan-again"),
    ],
)
def test_the_failure_is_reused_only_while_what_it_read_stands(
    gang: Env, plans: Counter[str], change: Callable[[Env], None], names: list[str], planned_again: bool
) -> None:
    gang.add_nodes(node("gpu-9"))
    _round(gang)
    assert plans["plans"] == 1
    change(gang)
    mine = "big-4b" if change is _member_replaced else "big-0"
    gang.filter(gputopo_pod(mine, 8, group="big", group_size="5", stage="4" if mine == "big-4b" else "0"), names)
    assert plans["plans"] == 1 + planned_again


def test_a_hold_that_expires_lets_the_next_filter_plan_the_gang(env: Env, plans: Counter[str]) -> None:
    env.add_nodes(*(node(n) for n in NODES))
    other = [gputopo_pod(f"other-{i}", 8, group="other", group_size="2", stage=str(i)) for i in range(2)]
    env.add_pods(*other)
    assert len(env.passed(other[0], NODES)) == 1  # planned and held: two nodes reserved for 120 s
    gang = [member(i, size=3) for i in range(3)]
    env.add_pods(*gang)
    told = env.reasons(gang[0], NODES)
    assert told == {"group needs 3 nodes with a free 8-GPU NVLink clique; 2 have it"}
    made = plans["plans"]
    assert env.reasons(gang[1], NODES) == told and plans["plans"] == made  # reused while the hold stands
    env.clock.advance(121)
    env.renew_leases()
    assert len(env.passed(gang[1], NODES)) == 1  # the hold expired: planned again, and it fits


# ---------------------------------------------------------------------- reuse against planning every time

Op = tuple[str, int, int]
ops = st.lists(
    st.tuples(
        st.sampled_from(["filter", "filter", "filter", "gpus", "leaf", "replace", "drop-node", "time", "bind"]),
        st.integers(0, 4),
        st.integers(0, 8),
    ),
    min_size=1,
    max_size=25,
)


def _apply(env: Env, op: Op, names: list[str], state: dict[str, Any]) -> object:
    """One step on one desk; what it answered (compared across the two desks)."""
    kind, i, k = op
    pods: dict[int, JSON] = state["pods"]
    if kind == "filter":
        out = env.filter(pods[i], names)
        state["passed"][i] = list(out["NodeNames"])
        return (out["NodeNames"], sorted(set(out["FailedNodes"].values())))
    if kind == "gpus":
        env.source.put("nodes", node(names[i % len(names)], in_use=list(range(k))))
    elif kind == "leaf":
        env.source.put("nodes", node(names[i % len(names)], leaf=f"leaf-{k % 2}"))
    elif kind == "replace":
        env.source.delete("pods", "default", pods[i]["metadata"]["name"])
        pods[i] = gputopo_pod(f"big-{i}-{k}", 8, group="big", group_size="4", stage=str(i))
        env.source.put("pods", pods[i])
    elif kind == "drop-node":
        env.source.delete("nodes", "", names[i % len(names)])
    elif kind == "time":
        env.clock.advance(k * 20)
        for n in names[: len(names) - i % 2]:  # one node's agent may miss its heartbeat
            env.source.put("leases", lease_obj(n, env.clock.now))
    elif kind == "bind":
        passed = state["passed"].get(i) or []
        if not passed:
            return None
        error = env.bind(pods[i], passed[0])
        env.resync()
        return error
    env.resync()
    return None


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_reuse_answers_as_planning_every_time_does(steps: list[Op]) -> None:
    """Random node and member changes between filters and binds: the desk that reuses failed plans (and
    looks selectors up in the label index) answers and binds exactly as one that plans every filter."""
    names = [f"gpu-{n}" for n in range(5)]
    conf = Settings(namespace=NS, stale_after_seconds=120, reservation_timeout_seconds=120)
    answers: list[list[object]] = []
    for reuse in (True, False):
        with make_env(FakeSource(NS), FakeClock(), conf) as env:
            env.extender.groups.reuse = env.extender.groups.indexed = reuse
            env.add_nodes(*(node(n, leaf=f"leaf-{j % 2}", in_use=[0] if j == 4 else None) for j, n in enumerate(names)))
            state: dict[str, Any] = {
                "pods": {i: gputopo_pod(f"big-{i}", 8, group="big", group_size="4", stage=str(i)) for i in range(5)},
                "passed": {},
            }
            env.add_pods(*(state["pods"][i] for i in range(4)))  # the fifth is a spare no filter counts
            state["pods"][4] = state["pods"][3]
            answers.append([_apply(env, op, names, state) for op in steps])
    assert answers[0] == answers[1]


def test_members_with_selectors_that_match_nothing_are_looked_up_once_and_named(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One GPU member beside 40 that ask no GPU, each with its own selector matching no node: the members'
    selectors are looked up in the label index (no node matched per selector), the members that no node
    can take are named, and the next filter reuses that answer."""
    from gputopo.engine.gang import assigned

    env.add_nodes(*(node(n) for n in NODES))
    size = 41
    env.add_pods(gputopo_pod("gpu-pod", 8, group="sel", group_size=str(size)))
    for i in range(1, size):
        pod = gputopo_pod(f"idle-{i}", 0, group="sel", group_size=str(size))
        pod["spec"]["nodeSelector"] = {"example.com/slot": f"s-{i}"}
        env.add_pods(pod)
    matched: Counter[str] = Counter()
    real = assigned.selects

    def counted(selector: Any, name: str, labels: Any) -> bool:
        matched["nodes"] += 1
        return real(selector, name, labels)

    monkeypatch.setattr(assigned, "selects", counted)
    monkeypatch.setattr(gangs, "selects", counted)
    told = env.reasons(gputopo_pod("gpu-pod", 8, group="sel", group_size=str(size)), NODES)
    (message,) = told
    assert "example.com/slot=s-" in message and "matches none of the nodes gputopo may use" in message
    assert matched["nodes"] <= len(NODES)  # the asking pod's own selector at most: none per member
    assert env.reasons(gputopo_pod("gpu-pod", 8, group="sel", group_size=str(size)), NODES) == told


def test_a_plan_looks_each_distinct_selector_up_once(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """The nodes outside the candidates that members' selectors name, and the members' sets by the nodes
    they may use, read one lookup per distinct selector (and the ledger's lock once for them all)."""
    from gputopo.engine.gang.labelindex import LabelIndex

    env.add_nodes(*(node(n) for n in NODES))
    size = 9
    env.add_pods(gputopo_pod("gpu-pod", 8, group="sel", group_size=str(size)))
    for i in range(1, size):
        pod = gputopo_pod(f"idle-{i}", 0, group="sel", group_size=str(size))
        pod["spec"]["nodeSelector"] = {"example.com/slot": f"s-{i % 4}"}  # 4 distinct selectors
        env.add_pods(pod)
    looked: Counter[object] = Counter()
    real = LabelIndex.select

    def counted(self: LabelIndex, selector: Any) -> frozenset[str]:
        looked[selector] += 1
        return real(self, selector)

    monkeypatch.setattr(LabelIndex, "select", counted)
    told = env.reasons(gputopo_pod("gpu-pod", 8, group="sel", group_size=str(size)), NODES)
    assert "example.com/slot=s-" in next(iter(told))
    assert len(looked) == 4 and set(looked.values()) == {1}
