"""Clique-aware victim selection: among the victims kube-scheduler offers on a node, the fewest (then
the lowest priorities) that free a GPU set the pod can take, groups whole, or no node at all."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from gputopo.engine.cluster import preempt
from gputopo.engine.cluster.preempt import Victim, choose_victims
from gputopo.engine.state.snapshot import NodeState, node_state
from gputopo.model import parse_pod_request
from gputopo.systems import build_system


def node(system: str, in_use: set[int]) -> NodeState:
    return node_state("n", build_system(system, "n"), in_use=frozenset(in_use))


def one_gpu_pods(prios: dict[int, int], group: dict[int, str] | None = None) -> list[Victim]:
    """A 1-GPU victim per GPU index, `v<gpu>`, with that priority (and group, if named)."""
    groups = group or {}
    return [Victim(f"v{g}", frozenset({g}), p, ("ns", groups[g]) if g in groups else None) for g, p in prios.items()]


@dataclass
class Case:
    system: str
    in_use: set[int]
    victims: list[Victim]
    gpus: int = 4
    nvlink: str = "required"
    pdb: int = 0
    members: dict[tuple[str, str], set[str]] = field(default_factory=dict)
    unattributed: set[int] = field(default_factory=set)
    want: tuple[str, ...] | None = ()  # None: the node is dropped
    want_gpus: tuple[int, ...] = ()
    want_pdb: int = 0
    want_unchanged: bool = False


ALL = set(range(8))

CASES = [
    pytest.param(
        Case(
            "dgx-1v",
            {0, 1, 2, 4, 5, 6},
            one_gpu_pods({0: 5, 1: 5, 2: 5, 4: 1, 5: 1, 6: 1}),
            want=("v4", "v5", "v6"),
            want_gpus=(4, 5, 6, 7),
        ),
        id="dgx-1v scattered 1-GPU victims: three per quad, so the three of lower priority",
    ),
    pytest.param(
        Case(
            "dgx-1v",
            {0, 1, 4, 5, 6},
            one_gpu_pods({0: 5, 1: 5, 4: 1, 5: 1, 6: 1}),
            want=("v0", "v1"),
            want_gpus=(0, 1, 2, 3),
        ),
        id="dgx-1v scattered 1-GPU victims: two that complete quad 0-3 beat three of lower priority",
    ),
    pytest.param(
        Case(
            "dgx-1v",
            {0, 1, 2, 3, 4, 5, 6, 7},
            one_gpu_pods({0: 1, 1: 1, 4: 1, 5: 1, 2: 3, 3: 3, 6: 2, 7: 2}),
            want=("v4", "v5", "v6", "v7"),
            want_gpus=(4, 5, 6, 7),
        ),
        id="dgx-1v full: of two quads of four victims, the one whose highest priority is lower",
    ),
    pytest.param(
        Case(
            "dgx-1v",
            ALL,
            one_gpu_pods({0: 1, 1: 1, 4: 1, 5: 1}),
            want=None,
        ),
        id="dgx-1v impossible: the offered victims free 0,1,4,5, which hold no quad",
    ),
    pytest.param(
        Case(
            "dgx-h100",
            ALL,
            one_gpu_pods({0: 10, 1: 10, 2: 5, 3: 5, 4: 1, 5: 1, 6: 100, 7: 100}),
            want=("v2", "v3", "v4", "v5"),
            want_gpus=(2, 3, 4, 5),
        ),
        id="dgx-h100 mixed priorities: any four form a clique, so the four lowest",
    ),
    pytest.param(
        Case(
            "dgx-h100",
            {0, 1, 2, 3, 4, 5, 6, 7},
            [
                Victim("big", frozenset({0, 1, 2, 3}), 1),
                Victim("a", frozenset({4}), 5),
                Victim("b", frozenset({5}), 5),
                Victim("c", frozenset({6}), 5),
                Victim("d", frozenset({7}), 5),
            ],
            want=("big",),
            want_gpus=(0, 1, 2, 3),
        ),
        id="dgx-h100 one 4-GPU victim beats four 1-GPU ones",
    ),
    pytest.param(
        Case(
            "dgx-h100",
            {0, 1, 2, 3, 4, 5, 6, 7},
            [
                Victim("big", frozenset({0, 1, 2, 3}), 50),
                Victim("a", frozenset({4}), 1),
                Victim("b", frozenset({5}), 1),
                Victim("c", frozenset({6}), 1),
            ],
            want=("big",),
            want_gpus=(0, 1, 2, 3),
        ),
        id="dgx-h100 fewest victims first, even at a higher priority",
    ),
    pytest.param(
        Case(
            "dgx-1v",
            ALL,
            one_gpu_pods({0: 1, 1: 1, 2: 1, 3: 1, 4: 2, 5: 2, 6: 2, 7: 2}, group={0: "g"}),
            members={("ns", "g"): {"v0", "elsewhere"}},
            want=("v4", "v5", "v6", "v7"),
            want_gpus=(4, 5, 6, 7),
        ),
        id="group member among victims whose group runs elsewhere too: never taken, the other quad instead",
    ),
    pytest.param(
        Case(
            "dgx-1v",
            ALL,
            one_gpu_pods({0: 1, 1: 1, 2: 1, 3: 1}, group={0: "g"}),
            members={("ns", "g"): {"v0", "elsewhere"}},
            want=None,
        ),
        id="group member needed for the only quad: the node is dropped",
    ),
    pytest.param(
        Case(
            "dgx-1v",
            ALL,
            one_gpu_pods({0: 1, 1: 1, 2: 1, 3: 1, 4: 5, 5: 5, 6: 5, 7: 5}, group={0: "g", 1: "g"}),
            members={("ns", "g"): {"v0", "v1"}},
            want=("v0", "v1", "v2", "v3"),
            want_gpus=(0, 1, 2, 3),
        ),
        id="a group wholly among the victims is evicted whole",
    ),
    pytest.param(
        Case(
            "dgx-1v",
            ALL,
            one_gpu_pods({0: 1, 1: 1, 2: 1, 3: 1, 4: 1, 5: 1, 6: 1, 7: 1}),
            pdb=3,
            want=("v0", "v1", "v2", "v3"),
            want_gpus=(0, 1, 2, 3),
            want_pdb=3,
        ),
        id="PDB violations: a reduced offer reports at most the node's count",
    ),
    pytest.param(
        Case(
            "dgx-1v",
            ALL,
            one_gpu_pods({0: 1, 1: 1, 2: 1, 3: 1, 4: 1, 5: 1, 6: 1, 7: 1}),
            pdb=6,
            want=("v0", "v1", "v2", "v3"),
            want_gpus=(0, 1, 2, 3),
            want_pdb=4,
        ),
        id="PDB violations: never more than the chosen victims",
    ),
    pytest.param(
        Case(
            "dgx-1v",
            {4, 5, 6, 7},
            one_gpu_pods({4: 1, 5: 1, 6: 1, 7: 1}),
            pdb=2,
            want=("v4", "v5", "v6", "v7"),
            want_gpus=(0, 1, 2, 3),
            want_pdb=2,
            want_unchanged=True,
        ),
        id="the pod fits without victims: the offer stands (kube-scheduler preempts for CPU or memory)",
    ),
    pytest.param(
        Case(
            "dgx-1v",
            ALL,
            [*one_gpu_pods({0: 1, 1: 1, 2: 1}), Victim("plain", None, 0)],
            unattributed={3},
            want=("v0", "v1", "v2", "plain"),
            want_gpus=(0, 1, 2, 3),
            want_unchanged=True,
        ),
        id="an unknown victim may hold the missing GPU: the whole offer is kept",
    ),
    pytest.param(
        Case(
            "dgx-1v",
            ALL,
            [Victim("v0", frozenset({0}), 1), Victim("plain", None, 0)],
            unattributed=set(),
            want=None,
        ),
        id="an unknown victim that cannot hold the missing GPUs does not save the node",
    ),
    pytest.param(
        Case(
            "dgx-1v",
            ALL,
            one_gpu_pods({0: 1, 1: 1, 2: 1, 3: 1}),
            want=("v0", "v1", "v2", "v3"),
            want_gpus=(0, 1, 2, 3),
            want_unchanged=True,
        ),
        id="the offer is exactly a quad: unchanged",
    ),
    pytest.param(
        Case(
            "dgx-1v",
            ALL,
            one_gpu_pods({0: 1, 1: 1, 4: 1, 5: 1}),
            nvlink="ignore",
            want=("v0", "v1", "v4", "v5"),
            want_gpus=(0, 1, 4, 5),
            want_unchanged=True,
        ),
        id="nvlink ignore: any four GPUs do",
    ),
]


@pytest.mark.parametrize("case", CASES)
def test_choose_victims_frees_a_full_clique_with_the_fewest_lowest_priority_victims(case: Case) -> None:
    req = parse_pod_request({"gputopo.io/nvlink": case.nvlink}, case.gpus)
    got = choose_victims(
        node(case.system, case.in_use),
        req,
        case.victims,
        pdb_violations=case.pdb,
        group_members={k: frozenset(v) for k, v in case.members.items()},
        unattributed=frozenset(case.unattributed),
    )
    if case.want is None:
        assert got is None
        return
    assert got is not None
    assert got.victims == case.want
    assert got.outcome.gpus == case.want_gpus
    assert got.pdb_violations == case.want_pdb
    assert got.unchanged is case.want_unchanged


def test_choose_victims_drops_a_node_without_topology() -> None:
    stale = node_state("n", None)
    assert choose_victims(stale, parse_pod_request({}, 4), one_gpu_pods({0: 1})) is None


def test_choose_victims_falls_back_to_greedy_reprieve_past_the_enumeration_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Too many GPU sets to list (a 72-GPU NVLink domain): kube-scheduler's own reprieve order
    still frees a set, the lowest priorities going first."""
    monkeypatch.setattr(preempt, "MAX_TARGET_SETS", 1)
    got = choose_victims(
        node("dgx-h100", set(range(8))), parse_pod_request({}, 4), one_gpu_pods({g: g for g in range(8)})
    )
    assert got is not None
    assert got.victims == ("v0", "v1", "v2", "v3")
