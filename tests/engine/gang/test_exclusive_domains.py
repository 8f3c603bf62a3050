"""JobSet exclusive placement in the engine: every Job gets a domain of the exclusive label of its own,
where the whole Job fits (GPU counts, NVLink cliques), all Jobs chosen together; or a reason naming the Job."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gputopo.engine.gang.exclusive import ExclusiveJob, plan_exclusive
from gputopo.engine.gang.plan import GroupFailure, GroupPlan, Member, Placed
from gputopo.engine.state.snapshot import NodeState, node_state
from gputopo.model import NvlinkPolicy, PodRequest, Spread
from gputopo.systems import build_system

LEAF = "gputopo.io/network-leaf"
HOST = "kubernetes.io/hostname"


def nodes(
    layout: list[tuple[str, str, str]], system: str = "dgx-h100", used: frozenset[int] = frozenset()
) -> list[NodeState]:
    """(node, spine, leaf) each, all of one system."""
    return [
        node_state(
            name,
            build_system(system, name),
            labels={"gputopo.io/network-spine": spine, LEAF: leaf, HOST: name},
            in_use=used,
        )
        for name, spine, leaf in layout
    ]


def request(rank: int, size: int, gpus: int, nvlink: NvlinkPolicy = NvlinkPolicy.REQUIRED) -> PodRequest:
    return PodRequest(gpus=gpus, group="jobset/js", group_size=size, stage=rank, spread=Spread.NONE, nvlink=nvlink)


def jobs(count: int, pods: int, gpus: int) -> list[ExclusiveJob]:
    """`count` Jobs of `pods` members each, nothing bound yet."""
    size = count * pods
    return [
        ExclusiveJob(
            f"js-w-{j}",
            j * pods,
            tuple(Member(f"js-w-{j}#{i}", request(j * pods + i, size, gpus)) for i in range(pods)),
        )
        for j in range(count)
    ]


def domains_of(plan: GroupPlan | GroupFailure, key: str = LEAF) -> dict[str, set[str]]:
    """Job -> the label values its members were planned under."""
    assert isinstance(plan, GroupPlan), plan
    out: dict[str, set[str]] = {}
    for a in plan.assignments:
        out.setdefault(a.member.split("#")[0], set()).add(a.node.labels[key])
    return out


TWO_LEAVES = [("n1", "s1", "leaf-a"), ("n2", "s1", "leaf-a"), ("n3", "s1", "leaf-b"), ("n4", "s1", "leaf-b")]


@dataclass(frozen=True)
class Case:
    name: str
    jobs: int
    pods: int
    gpus: int
    layout: list[tuple[str, str, str]]
    key: str
    want: int | str  # distinct domains used, or the failure's message


CASES = [
    Case("2 Jobs x 2 whole-node pods: one leaf each", 2, 2, 8, TWO_LEAVES, LEAF, 2),
    Case("2 Jobs x 4 half-node pods: one leaf each, packed", 2, 4, 4, TWO_LEAVES, LEAF, 2),
    Case("4 Jobs x 1 pod by hostname: a node each", 4, 1, 8, TWO_LEAVES, HOST, 4),
    Case(
        "a Job that fits no leaf",
        2,
        3,
        8,
        TWO_LEAVES,
        LEAF,
        "group jobset/js: Job js-w-0 fits in no free domain: group needs room for 3 members with "
        "a free 8-GPU NVLink clique; 2 fit",
    ),
    Case(
        "more Jobs than leaves",
        3,
        1,
        8,
        TWO_LEAVES,
        LEAF,
        "group jobset/js: 3 Jobs need a domain of gputopo.io/network-leaf (tier leaf) each (JobSet exclusive "
        "placement); only 2 can have one at once",
    ),
    Case(
        "no node has the label",
        1,
        1,
        8,
        TWO_LEAVES,
        "example.com/rack",
        "group jobset/js: no node offered has the label example.com/rack (JobSet exclusive placement)",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_each_job_gets_a_domain_of_its_own_or_a_reason(case: Case) -> None:
    plan = plan_exclusive("jobset/js", jobs(case.jobs, case.pods, case.gpus), case.key, nodes(case.layout))
    if isinstance(case.want, str):
        assert isinstance(plan, GroupFailure)
        assert plan.message == case.want
        return
    assert isinstance(plan, GroupPlan)
    used = domains_of(plan, case.key)
    assert all(len(d) == 1 for d in used.values()), used  # a Job in one domain
    assert len({next(iter(d)) for d in used.values()}) == case.want  # no two Jobs share one
    assert [a.stage for a in plan.assignments] == list(range(case.jobs * case.pods))  # JobSet ranks


def test_jobs_pack_under_one_spine_when_one_holds_them() -> None:
    layout = [("a1", "s1", "leaf-a"), ("b1", "s2", "leaf-b"), ("c1", "s2", "leaf-c"), ("d1", "s3", "leaf-d")]
    plan = plan_exclusive("jobset/js", jobs(2, 1, 8), LEAF, nodes(layout))
    assert sorted(d for v in domains_of(plan).values() for d in v) == ["leaf-b", "leaf-c"]
    assert isinstance(plan, GroupPlan) and plan.switches_used["spine"] == 1


def test_nvlink_clique_needs_pick_the_leaf_with_whole_cliques() -> None:
    # a100-pcie-bridged: NVLink bridges on pairs (0,1) (2,3) ...; leaf-a's nodes have one GPU of each pair
    # busy: 4 free GPUs each, but no NVLink pair.
    broken = nodes([("n1", "s1", "leaf-a"), ("n2", "s1", "leaf-a")], "a100-pcie-bridged", frozenset({0, 2, 4, 6}))
    whole = nodes([("n3", "s1", "leaf-b"), ("n4", "s1", "leaf-b")], "a100-pcie-bridged")
    plan = plan_exclusive("jobset/js", jobs(1, 2, 2), LEAF, broken + whole)
    assert domains_of(plan) == {"js-w-0": {"leaf-b"}}
    two = plan_exclusive("jobset/js", jobs(2, 2, 2), LEAF, broken + whole)
    assert isinstance(two, GroupFailure)
    assert two.message == (
        "group jobset/js: 2 Jobs need a domain of gputopo.io/network-leaf (tier leaf) each (JobSet exclusive "
        "placement); only 1 can have one at once"
    )


def test_a_job_with_a_bound_leader_keeps_its_leaders_domain() -> None:
    states = nodes(TWO_LEAVES)
    js = jobs(2, 2, 8)
    # Job 1's leader is bound on n1 (leaf-a): Job 1 stays there, Job 0 takes leaf-b.
    bound = ExclusiveJob(js[1].name, 2, js[1].members[1:], (Placed(0, states[0], tuple(range(8))),))
    plan = plan_exclusive("jobset/js", [js[0], bound], LEAF, [s for s in states if s.name != "n1"])
    assert domains_of(plan) == {"js-w-0": {"leaf-b"}, "js-w-1": {"leaf-a"}}
    assert isinstance(plan, GroupPlan)
    assert {a.member: a.stage for a in plan.assignments}["js-w-1#1"] == 3


def test_a_job_whose_followers_no_longer_fit_its_leaders_domain_is_named() -> None:
    states = nodes(TWO_LEAVES)
    js = jobs(1, 2, 8)
    bound = ExclusiveJob(js[0].name, 0, js[0].members[1:], (Placed(0, states[0], tuple(range(8))),))
    busy = [node_state("n2", build_system("dgx-h100", "n2"), labels=dict(states[1].labels), in_use=frozenset({0}))]
    plan = plan_exclusive("jobset/js", [bound], LEAF, busy + states[2:])
    assert isinstance(plan, GroupFailure)
    assert plan.message.startswith(f"group jobset/js: Job js-w-0 does not fit in its leader's domain {LEAF}=leaf-a: ")


@settings(max_examples=40, deadline=None)
@given(
    count=st.integers(1, 4),
    pods=st.integers(1, 3),
    gpus=st.sampled_from([1, 2, 4, 8]),
    leaves=st.lists(st.integers(1, 3), min_size=1, max_size=4),
)
def test_any_plan_keeps_each_job_in_one_domain_of_its_own(count: int, pods: int, gpus: int, leaves: list[int]) -> None:
    layout = [(f"n{i}-{k}", "s1", f"leaf-{i}") for i, per in enumerate(leaves) for k in range(per)]
    plan = plan_exclusive(
        "jobset/js",
        jobs(
            count,
            pods,
            gpus,
        ),
        LEAF,
        nodes(layout),
    )
    if isinstance(plan, GroupFailure):
        return
    used = domains_of(plan)
    assert len(used) == count and all(len(d) == 1 for d in used.values())
    assert len({next(iter(d)) for d in used.values()}) == count
    assert len(plan.assignments) == count * pods
