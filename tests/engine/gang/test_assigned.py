"""Groups whose members carry a nodeSelector (Kueue TAS at any level, hostname included): each member is
planned only onto nodes its selector allows, over the union of the members' nodes, ranks kept."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gputopo.engine.gang.assigned import HOSTNAME, Candidates, Held, plan_held, selects
from gputopo.engine.gang.groups import plan_group
from gputopo.engine.gang.plan import GroupFailure, Member
from gputopo.engine.gang.replan import GroupWaiting, MemberView, Replan, replan
from gputopo.engine.state.snapshot import NodeState, node_state
from gputopo.model import PodRequest, parse_pod_request
from gputopo.systems import build_system

LEAF = "gputopo.io/network-leaf"


def node(name: str, leaf: str = "leaf-a", system: str = "dgx-h100", in_use: Sequence[int] = ()) -> NodeState:
    labels = {HOSTNAME: name, LEAF: leaf, "gputopo.io/network-spine": "s1"}
    return node_state(name, build_system(system, name), labels=labels, in_use=frozenset(in_use))


def request(rank: int, size: int, gpus: int = 8, **ann: str) -> PodRequest:
    base = {"gputopo.io/group": "g", "gputopo.io/group-size": str(size), "gputopo.io/nvlink": "required"}
    base.update({f"gputopo.io/{k.replace('_', '-')}": v for k, v in ann.items()})
    return parse_pod_request({**base, "gputopo.io/stage": str(rank)}, gpus)


def on_host(host: str) -> tuple[tuple[str, str], ...]:
    return ((HOSTNAME, host),)


FOUR = [node(f"n{i}", leaf="leaf-a" if i < 4 else "leaf-b") for i in range(6)]
BY_NAME = {n.name: n for n in FOUR}


def plan_as(
    me: str, members: dict[str, MemberView], names: Sequence[str], size: int | None = None
) -> Replan | GroupWaiting | GroupFailure:
    """replan as the group desk calls it: the asking pod's candidates, and the other nodes selectors name."""
    selected = {n for m in members.values() if m.selector for n in BY_NAME if selects(m.selector, n, BY_NAME[n].labels)}
    extra = [BY_NAME[n] for n in sorted(selected - set(names))]
    return replan("g", size or len(members), me, members, Candidates([BY_NAME[n] for n in names], extra))


def slots(out: Replan | GroupWaiting | GroupFailure) -> dict[str, tuple[str, int, int | None]]:
    """member -> (node, GPU count, stage)."""
    assert isinstance(out, Replan), out
    return {s.member: (s.node, len(s.gpus), s.stage) for s in out.slots.values()}


# Kueue's assignments (member rank -> selector) and what each member gets: its node, its GPUs, its rank.
Selector = tuple[tuple[str, str], ...]
Case = tuple[dict[str, tuple[PodRequest, Selector]], str, list[str], dict[str, tuple[str, int, int | None]]]
CASES: dict[str, Case] = {
    "hostname level, 4 pods on 4 nodes, reversed ranks": (
        {f"w-{i}": (request(i, 4), on_host(f"n{3 - i}")) for i in range(4)},
        "w-1",
        ["n2"],
        {f"w-{i}": (f"n{3 - i}", 8, i) for i in range(4)},
    ),
    "hostname level, 2 pods per node share its GPUs": (
        {f"w-{i}": (request(i, 4, gpus=4), on_host(f"n{i // 2}")) for i in range(4)},
        "w-3",
        ["n1"],
        {f"w-{i}": (f"n{i // 2}", 4, i) for i in range(4)},
    ),
    "leaf level: one selector, one member per node of the leaf": (
        {f"w-{i}": (request(i, 2), ((LEAF, "leaf-b"),)) for i in range(2)},
        "w-0",
        ["n4", "n5"],
        {"w-0": ("n4", 8, 0), "w-1": ("n5", 8, 1)},
    ),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_each_member_is_planned_on_the_nodes_its_selector_allows(case: str) -> None:
    assignment, me, names, want = CASES[case]
    members = {name: MemberView(name, req, selector=sel) for name, (req, sel) in assignment.items()}
    got = slots(plan_as(me, members, names))
    assert got == want
    out = plan_as(me, members, names)
    assert isinstance(out, Replan) and out.plan is not None
    by_node: dict[str, set[int]] = {}
    for s in out.slots.values():  # members sharing a node took different GPUs, one after the other
        assert not by_node.setdefault(s.node, set()) & s.gpus
        by_node[s.node] |= s.gpus


def test_every_member_asks_in_turn_and_gets_the_same_plan() -> None:
    members = {f"w-{i}": MemberView(f"w-{i}", request(i, 4), selector=on_host(f"n{i}")) for i in range(4)}
    plans = [slots(plan_as(f"w-{i}", members, [f"n{i}"])) for i in (2, 0, 3, 1)]
    assert all(p == plans[0] for p in plans)
    assert {m: s[0] for m, s in plans[0].items()} == {f"w-{i}": f"n{i}" for i in range(4)}


@pytest.mark.parametrize(
    ("selector", "words"),
    [
        (on_host("gone"), "member w-1 held by spec.nodeSelector kubernetes.io/hostname=gone"),
        (((LEAF, "leaf-z"),), "member w-1 held by spec.nodeSelector gputopo.io/network-leaf=leaf-z"),
    ],
)
def test_a_selector_that_matches_no_node_is_the_groups_reason(selector: Selector, words: str) -> None:
    members = {
        "w-0": MemberView("w-0", request(0, 2), selector=on_host("n0")),
        "w-1": MemberView("w-1", request(1, 2), selector=selector),
    }
    out = plan_as("w-0", members, ["n0"])
    assert isinstance(out, GroupFailure)
    assert words in out.message and out.message.endswith("matches none of the nodes gputopo may use")


def test_a_required_clique_the_assignment_makes_impossible_names_the_assignment() -> None:
    # DGX-1 V100's hybrid cube mesh: {0,1,2,3} and {4,5,6,7} are its 4-GPU cliques; GPU 0 is taken.
    v100 = node("v0", system="dgx-1v", in_use=[0])
    members = {f"w-{i}": MemberView(f"w-{i}", request(i, 2, gpus=4), selector=on_host("v0")) for i in range(2)}
    for me in members:
        out = replan("g", 2, me, members, Candidates([v100]))
        assert isinstance(out, GroupFailure)
        assert out.message == (
            "group g: members w-0, w-1 held by spec.nodeSelector kubernetes.io/hostname=v0 (Kueue's topology "
            "assignment): group needs room for 2 members with a free 4-GPU NVLink clique; 1 fit"
        )


def test_required_tier_across_the_assignment_fails_naming_the_selectors() -> None:
    members = {
        "w-0": MemberView("w-0", request(0, 2, required_tier="leaf"), selector=on_host("n0")),
        "w-1": MemberView("w-1", request(1, 2, required_tier="leaf"), selector=on_host("n4")),
    }
    out = plan_as("w-0", members, ["n0"])
    assert isinstance(out, GroupFailure)
    assert "spans 2 leaf switches; gputopo.io/required-tier asks one" in out.message
    assert "w-1: kubernetes.io/hostname=n4" in out.message


def test_a_member_still_behind_kueues_topology_gate_makes_the_group_wait() -> None:
    members = {
        "w-0": MemberView("w-0", request(0, 2), selector=on_host("n0")),
        "w-1": MemberView("w-1", request(1, 2), gated="kueue.x-k8s.io/topology"),
    }
    out = plan_as("w-0", members, ["n0"])
    assert isinstance(out, GroupWaiting)
    assert out.message == "group g: waiting for member w-1's node assignment (kueue.x-k8s.io/topology)"


def test_a_bound_member_keeps_its_node_and_the_rest_follow_their_selectors() -> None:
    members = {
        "w-0": MemberView("w-0", request(0, 3), node="n0", gpus=frozenset(range(8)), stage=0, selector=on_host("n0")),
        "w-1": MemberView("w-1", request(1, 3), selector=on_host("n1")),
        "w-2": MemberView("w-2", request(2, 3), selector=on_host("n2")),
    }
    out = plan_as("w-2", members, ["n2"])
    assert slots(out) == {"w-0": ("n0", 8, 0), "w-1": ("n1", 8, 1), "w-2": ("n2", 8, 2)}
    assert isinstance(out, Replan) and out.slots["w-0"].pinned


def test_a_member_joins_a_bound_member_on_the_node_kueue_gave_both() -> None:
    shared = node("n0", in_use=range(4))  # w-0 is bound there with GPUs 0-3
    members = {
        "w-0": MemberView("w-0", request(0, 2, gpus=4), node="n0", gpus=frozenset(range(4)), selector=on_host("n0")),
        "w-1": MemberView("w-1", request(1, 2, gpus=4), selector=on_host("n0")),
    }
    out = replan("g", 2, "w-1", members, Candidates([shared]))
    assert isinstance(out, Replan)
    assert (out.slots["w-1"].node, sorted(out.slots["w-1"].gpus), out.slots["w-1"].stage) == ("n0", [4, 5, 6, 7], 1)


def test_without_selectors_the_plan_is_plan_groups() -> None:
    reqs = [request(i, 3) for i in range(3)]
    members = {f"w-{i}": MemberView(f"w-{i}", r) for i, r in enumerate(reqs)}
    out = replan("g", 3, "w-0", members, Candidates(FOUR))
    plan = plan_group("g", [Member(f"w-{i}", r) for i, r in enumerate(reqs)], FOUR)
    assert isinstance(out, Replan) and out.plan == plan


@settings(max_examples=40, deadline=None)
@given(
    hosts=st.lists(st.integers(0, 5), min_size=1, max_size=8),
    gpus=st.sampled_from([1, 2, 4, 8]),
    leaf_level=st.booleans(),
)
def test_every_planned_slot_satisfies_its_members_selector(hosts: list[int], gpus: int, leaf_level: bool) -> None:
    """Random assignments (a node or a leaf per member): a plan, when there is one, keeps every member on a
    node its selector selects, and no two members share a GPU."""
    n = len(hosts)
    held = [
        Held(
            Member(f"w-{i}", request(i, n, gpus=gpus)),
            ((LEAF, BY_NAME[f"n{h}"].labels[LEAF]),) if leaf_level else on_host(f"n{h}"),
        )
        for i, h in enumerate(hosts)
    ]
    plan = plan_held("g", held, Candidates([BY_NAME[f"n{hosts[0]}"]], [n for n in FOUR if n.name != f"n{hosts[0]}"]))
    if isinstance(plan, GroupFailure):
        assert "(Kueue's topology assignment)" in plan.message
        return
    want = {h.member.name: h.selector for h in held}
    taken: set[tuple[str, int]] = set()
    for a in plan.assignments:
        assert selects(want[a.member], a.node.name, a.node.labels)
        assert len(a.outcome.gpus) == gpus
        assert not taken & {(a.node.name, g) for g in a.outcome.gpus}
        taken |= {(a.node.name, g) for g in a.outcome.gpus}
    assert sorted(a.stage for a in plan.assignments) == list(range(n))


@pytest.mark.parametrize("selector", [(), (("gputopo.io/network-spine", "s1"),)])
def test_one_selector_shared_by_every_member_plans_as_no_selector_does(selector: Selector) -> None:
    """An Indexed Job whose template has a nodeSelector (every member the same one): ranks pair up on
    nodes and fill the fullest switch first, exactly as without a selector, whatever the order of the
    pods' names (train-10 sorts before train-2)."""
    nodes = [node(f"h{i}", leaf=f"leaf-{'ab'[i % 2]}") for i in range(8)]  # names alternate between leaves
    inferred = {"gputopo.io/group": "g", "gputopo.io/group-size": "16", "gputopo.io/spread": "none"}
    members = {
        f"train-{r}": MemberView(
            f"train-{r}", parse_pod_request({**inferred, "gputopo.io/stage": str(r)}, 4), selector=selector
        )
        for r in range(16)
    }
    bare = {k: MemberView(k, m.request) for k, m in members.items()}
    allowed = [n for n in nodes if selects(selector, n.name, n.labels)]
    with_sel, without = (
        replan("g", 16, "train-0", members, Candidates(allowed)),
        replan("g", 16, "train-0", bare, Candidates(allowed)),
    )
    assert slots(with_sel) == slots(without)
    by_stage = {stage: host for host, _, stage in slots(with_sel).values()}
    assert all(by_stage[2 * k] == by_stage[2 * k + 1] for k in range(8)), by_stage
    leaf = {n.name: n.labels[LEAF] for n in nodes}
    assert len({leaf[by_stage[r]] for r in range(8)}) == 1 and len({leaf[by_stage[r]] for r in range(8, 16)}) == 1
