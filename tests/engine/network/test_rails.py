"""Fabric rails: a NIC's rail from NIC order or the gputopo.io/rails label, a GPU's from its nearest NIC,
and groups whose members take part of a node lined up on the same rails on every node."""

from __future__ import annotations

import random

import pytest

from gputopo.engine.cluster.explain import Seat, placement_sentence
from gputopo.engine.gang.assigned import Candidates
from gputopo.engine.gang.groups import plan_group
from gputopo.engine.gang.plan import GroupPlan, Member, Refinements
from gputopo.engine.gang.replan import MemberView, Replan, replan
from gputopo.engine.network.rails import assess, rail_ranges
from gputopo.engine.node.gpusets import RAIL_AFTER, Kind, exhaustive_set, rail_options, rank_key
from gputopo.engine.node.placement import evaluate_node, outcome_on
from gputopo.engine.state.cliques import all_subsets, bits, k_cliques, mask_of, popcount
from gputopo.engine.state.reasons import Reason
from gputopo.engine.state.snapshot import NodeState, node_state
from gputopo.model import LABEL_RAILS, LabelError, NicInfo, parse_pod_request, parse_rails_label
from gputopo.systems import SYSTEMS, build_system

GROUP = {"gputopo.io/group": "g", "gputopo.io/group-size": "2"}


def h100(name: str, in_use: tuple[int, ...] = (), rails: str | None = None) -> NodeState:
    labels = {LABEL_RAILS: rails} if rails is not None else {}
    return node_state(name, build_system("dgx-h100", name), labels=labels, in_use=frozenset(in_use))


def pair(gpus: int = 4, **ann: str) -> list[Member]:
    extra = {f"gputopo.io/{k}": v for k, v in ann.items()}
    return [Member(f"m-{i}", parse_pod_request({**GROUP, **extra}, gpus)) for i in range(2)]


def plan(nodes: list[NodeState], members: list[Member], *, align_rails: bool = True) -> GroupPlan:
    result = plan_group("g", members, nodes, refine=Refinements(align_rails=align_rails))
    assert isinstance(result, GroupPlan), result
    return result


def gpus_of(result: GroupPlan) -> dict[str, tuple[int, ...]]:
    return {a.node.name: a.outcome.gpus for a in result.assignments}


# --- the rails of NICs and GPUs ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("system", "rails"),
    [
        # One NIC at PIX per GPU: GPU g on rail g.
        ("dgx-h100", ("0", "1", "2", "3", "4", "5", "6", "7")),
        # Two NICs behind each GPU pair's PCIe switch (PXB): the pair uses both rails.
        ("dgx-a100", ("0-1", "0-1", "2-3", "2-3", "4-5", "4-5", "6-7", "6-7")),
        # mlx5_0 (rail 0) is PIX to GPUs 2-3, mlx5_1 (rail 1) to GPUs 0-1: NIC order, not GPU order.
        ("dgx-1v", ("1", "1", "0", "0", "3", "3", "2", "2")),
        # NICs only at NODE/SYS distance: no GPU has a rail.
        ("l40s-4", ("", "", "", "")),
        ("rtx4090-8", ("",) * 8),
    ],
    ids=["one-nic-per-gpu", "two-nics-per-gpu-pair", "nic-order-not-gpu-order", "no-near-nic", "no-nics"],
)
def test_gpu_rails_come_from_the_nearest_nics_in_nic_order(system: str, rails: tuple[str, ...]) -> None:
    state = node_state(system, build_system(system))
    assert tuple(rail_ranges(m) for m in state.gpu_rails) == rails


def test_rails_label_overrides_nic_order() -> None:
    state = h100("n", rails="4.5.6.7.0.1.2.3")
    assert tuple(rail_ranges(m) for m in state.gpu_rails) == ("4", "5", "6", "7", "0", "1", "2", "3")


def test_a_down_nic_gives_its_gpu_no_rail() -> None:
    topo = build_system("dgx-h100")
    nics = list(topo.nics)
    nics[3] = NicInfo.model_validate({**nics[3].model_dump(by_alias=True), "state": "DOWN"})
    state = node_state("n", topo.model_copy(update={"nics": tuple(nics)}))
    assert state.gpu_rails[3] == 0 and state.gpu_rails[2] == 1 << 2


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            "",
            'invalid label gputopo.io/rails="": empty; give each NIC\'s rail in NIC order, dot-separated, e.g. 0.1.2.3',
        ),
        (
            "0.1.2.3",
            'invalid label gputopo.io/rails="0.1.2.3": lists 4 rails; the node has 8 NICs '
            "(mlx5_0, mlx5_3, mlx5_4, mlx5_5, mlx5_6, mlx5_9, mlx5_10, mlx5_11), one rail each in this order",
        ),
        (
            "0.1.2.x.4.5.6.7",
            "invalid label gputopo.io/rails=\"0.1.2.x.4.5.6.7\": NIC mlx5_5: 'x' is not a rail number 0..63",
        ),
        (
            "0.1.2.3.4.5.6.64",
            "invalid label gputopo.io/rails=\"0.1.2.3.4.5.6.64\": NIC mlx5_11: '64' is not a rail number 0..63",
        ),
        (
            "0,1,2,3,4,5,6,7",
            'invalid label gputopo.io/rails="0,1,2,3,4,5,6,7": '
            "NIC mlx5_0: '0,1,2,3,4,5,6,7' is not a rail number 0..63",
        ),
        (
            "0..2.3.4.5.6.7",
            "invalid label gputopo.io/rails=\"0..2.3.4.5.6.7\": NIC mlx5_3: '' is not a rail number 0..63",
        ),
        (
            "-1.1.2.3.4.5.6.7",
            "invalid label gputopo.io/rails=\"-1.1.2.3.4.5.6.7\": NIC mlx5_0: '-1' is not a rail number 0..63",
        ),
    ],
    ids=["empty", "too-few", "not-a-number", "out-of-range", "commas", "empty-entry", "negative"],
)
def test_a_bad_rails_label_makes_the_node_unreadable_and_says_why(value: str, message: str) -> None:
    with pytest.raises(LabelError) as err:
        parse_rails_label(value, [n.name for n in build_system("dgx-h100").nics])
    assert str(err.value) == message
    state = h100("n", rails=value)
    assert state.problem is Reason.TOPOLOGY_INVALID and state.problem_detail == message
    assert not evaluate_node(state, parse_pod_request({}, 1)).fits


def test_two_nics_may_share_a_rail() -> None:
    assert parse_rails_label("0.0.1.1", ["a", "b", "c", "d"]) == (0, 0, 1, 1)


def test_the_rails_label_never_changes_a_single_pod_decision() -> None:
    req = parse_pod_request({"gputopo.io/network": "infiniband"}, 4)
    for in_use in [(), (0, 1), (4, 5), (0, 7), (1, 2, 3)]:
        plain = evaluate_node(h100("n", in_use), req)
        relabelled = evaluate_node(h100("n", in_use, rails="7.6.5.4.3.2.1.0"), req)
        assert (plain.gpus, plain.score) == (relabelled.gpus, relabelled.score)


# --- rail_options: an explicit extension of the pinned GPU-set ranking -------------------------------


def _reference(kind: Kind, shape_node: NodeState, candidates: int, k: int, near: int) -> dict[int, int]:
    """Brute force: per rail set, the best set among those tying the best on the terms above rails."""
    shape = shape_node.shape
    assert shape is not None
    sets = list(k_cliques(shape.adj, candidates, k) if kind == "clique" else all_subsets(candidates, k))
    cut = RAIL_AFTER[kind]
    ranks = {s: rank_key(kind, shape, candidates, s, near) for s in sets}
    if not ranks:
        return {}
    top = max(r[:cut] for r in ranks.values())
    out: dict[int, int] = {}
    for s in sets:  # ascending index order: the first of equals stays
        if ranks[s][:cut] != top:
            continue
        rails = 0
        for g in bits(s):
            rails |= shape_node.gpu_rails[g]
        if rails not in out or ranks[s][cut:] > ranks[out[rails]][cut:]:
            out[rails] = s
    return out


@pytest.mark.parametrize("system", sorted(SYSTEMS))
@pytest.mark.parametrize("kind", ["clique", "connected", "any"])
def test_rail_options_match_brute_force_and_keep_the_engines_own_choice(system: str, kind: Kind) -> None:
    rng = random.Random(f"{system}/{kind}")
    state = node_state(system, build_system(system))
    assert state.shape is not None
    n = state.shape.n
    near = mask_of([g for g in range(n) if state.gpu_rails[g]])
    for _ in range(12):
        free = mask_of(sorted(rng.sample(range(n), rng.randint(2, n))))
        k = rng.randint(1, popcount(free))
        found = rail_options(kind, state.shape, free, k, near, state.gpu_rails)
        assert found is not None
        assert {o.rails: o.mask for o in found} == _reference(kind, state, free, k, near)
        own = exhaustive_set(kind, state.shape, free, k, near)
        if own is not None:  # the rail set of the pinned search's choice maps back to that very choice
            rails = 0
            for g in bits(own):
                rails |= state.gpu_rails[g]
            assert {o.rails: o.mask for o in found}[rails] == own


# --- groups -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("in_use_a", "in_use_b", "expected"),
    [
        # Left alone: GPUs 4-7 on a (one NUMA node) and 0-3 on b, rails 4-7 and 0-3.
        ((0, 1), (4, 5), (2, 3, 6, 7)),
        ((0,), (7,), (1, 2, 3, 4)),
        # Already aligned: the engine's own quads stand.
        ((4, 5, 6, 7), (4, 5, 6, 7), (0, 1, 2, 3)),
        ((), (), (0, 1, 2, 3)),
    ],
    ids=["two-taken-each", "one-taken-each", "same-in-use", "both-empty"],
)
def test_partial_members_get_the_same_rails_on_both_nodes(
    in_use_a: tuple[int, ...], in_use_b: tuple[int, ...], expected: tuple[int, ...]
) -> None:
    result = plan([h100("a", in_use_a), h100("b", in_use_b)], pair())
    assert gpus_of(result) == {"a": expected, "b": expected}
    assert result.rails.applies and result.rails.aligned
    for a in result.assignments:
        text = placement_sentence(a.node.name, a.outcome, None, Seat(result, a.member))
        assert f"rails {rail_ranges(result.rails.rails)} on every member's node (rail-aligned)" in text


def test_alignment_keeps_nvlink_and_only_trades_what_ranks_below_rails() -> None:
    nodes = [h100("a", (0, 1)), h100("b", (4, 5))]
    before = plan(nodes, pair(), align_rails=False)
    after = plan(nodes, pair())
    assert gpus_of(before) == {"a": (4, 5, 6, 7), "b": (0, 1, 2, 3)}
    assert not before.rails.aligned
    for x, y in zip(before.assignments, after.assignments, strict=True):
        assert y.outcome.choice is not None and y.outcome.choice.clique
        assert x.outcome.score == y.outcome.score  # NVSwitch: NUMA span is not scored


def test_no_common_rails_places_the_group_anyway_and_says_why() -> None:
    result = plan([h100("a", (0, 1, 2, 3)), h100("b", (4, 5, 6, 7))], pair())
    assert gpus_of(result) == {"a": (4, 5, 6, 7), "b": (0, 1, 2, 3)}
    assert not result.rails.aligned
    a = result.for_member("m-0")
    assert a is not None
    text = placement_sentence(a.node.name, a.outcome, None, Seat(result, a.member))
    assert (
        "rails 4-7 here, not rail-aligned: no equally good GPU sets on one rail set were free on every member's "
        "node (rails 4-7 on a, 0-3 on b)"
    ) in text


def test_the_rails_label_lets_differently_cabled_nodes_align() -> None:
    # b's NICs are cabled the other way round: its free GPUs 0-3 sit on rails 4-7, as a's GPUs 4-7 do.
    result = plan([h100("a", (0, 1, 2, 3)), h100("b", (4, 5, 6, 7), rails="4.5.6.7.0.1.2.3")], pair())
    assert gpus_of(result) == {"a": (4, 5, 6, 7), "b": (0, 1, 2, 3)}
    assert result.rails.aligned and rail_ranges(result.rails.rails) == "4-7"


def test_whole_node_members_are_aligned_and_not_mentioned() -> None:
    result = plan([h100("a"), h100("b")], pair(8))
    assert not result.rails.applies
    a = result.assignments[0]
    assert "rail" not in placement_sentence(a.node.name, a.outcome, None, Seat(result, a.member))


def test_members_of_different_sizes_are_explained() -> None:
    members = [
        Member("m-0", parse_pod_request(GROUP, 4)),
        Member("m-1", parse_pod_request(GROUP, 2)),
    ]
    result = plan([h100("a"), h100("b")], members)
    assert result.rails.why == "members take different GPU counts (2 and 4) of their nodes"


def test_a_replan_lines_up_with_the_rails_of_members_already_placed() -> None:
    req = parse_pod_request(GROUP, 4)
    members = {
        "m-0": MemberView("m-0", req, node="a", gpus=frozenset({2, 3, 6, 7}), stage=0),
        "m-1": MemberView("m-1", req),
    }
    nodes = [h100("a", (2, 3, 6, 7)), h100("b")]
    result = replan("g", 2, "m-1", members, Candidates(nodes))
    assert isinstance(result, Replan) and result.plan is not None
    assert result.slots["m-1"].gpus == frozenset({2, 3, 6, 7})  # alone, b would take 0-3 (one NUMA node)
    assert result.plan.rails.aligned


def test_assess_names_a_gpu_without_a_rail() -> None:
    l40s = node_state("l", build_system("l40s-4"))
    assert assess([(l40s, (0, 1)), (l40s, (2, 3))]).why == "GPU 0 on l has no active NIC at PIX/PXB, so no known rail"


@pytest.mark.parametrize(
    ("system", "in_use", "gpus", "admissible"),
    [
        ("dgx-h100", (0, 1), (2, 3, 6, 7), True),
        ("dgx-h100", (0, 1), (1, 2, 3, 4), False),  # GPU 1 is taken
        ("dgx-h100", (0, 1), (2, 3, 6), False),  # another size
        ("dgx-1v", (), (0, 1, 4, 5), False),  # not an NVLink clique, which the pod requires
        ("dgx-1v", (), (4, 5, 6, 7), True),
    ],
    ids=["free-clique", "taken-gpu", "wrong-size", "not-a-clique", "other-clique"],
)
def test_outcome_on_rescores_a_given_set_only_where_the_engine_could_have_chosen_it(
    system: str, in_use: tuple[int, ...], gpus: tuple[int, ...], admissible: bool
) -> None:
    state = node_state(system, build_system(system), in_use=frozenset(in_use))
    req = parse_pod_request(GROUP, 4)
    own = evaluate_node(state, req)
    other = outcome_on(state, req, own, mask_of(list(gpus)))
    assert (other is not None) is admissible
    if other is not None:
        assert other.gpus == gpus and other.fits and other.search == own.search


def leafed(name: str, leaf: str, in_use: tuple[int, ...]) -> NodeState:
    labels = {"gputopo.io/network-spine": "s", "gputopo.io/network-leaf": leaf}
    return node_state(name, build_system("dgx-h100", name), labels=labels, in_use=frozenset(in_use))


@pytest.mark.parametrize(
    ("leaves", "expected", "aligned"),
    [
        # a and b would be chosen (equal scores, name order) on rails 4-7 and 0-3; c offers a's rails.
        (("leaf-1", "leaf-1", "leaf-1"), {"a": (4, 5, 6, 7), "c": (4, 5, 6, 7)}, True),
        # c sits on another leaf: rails never spread the group over more switches.
        (("leaf-1", "leaf-1", "leaf-2"), {"a": (4, 5, 6, 7), "b": (0, 1, 2, 3)}, False),
    ],
    ids=["same-leaf", "other-leaf"],
)
def test_other_nodes_are_chosen_for_common_rails_only_within_the_same_switches(
    leaves: tuple[str, str, str], expected: dict[str, tuple[int, ...]], aligned: bool
) -> None:
    nodes = [
        leafed("a", leaves[0], (0, 1, 2, 3)),
        leafed("b", leaves[1], (4, 5, 6, 7)),
        leafed("c", leaves[2], (0, 1, 2, 3)),
    ]
    result = plan(nodes, pair())
    assert gpus_of(result) == expected and result.rails.aligned is aligned
    assert gpus_of(plan(nodes, pair(), align_rails=False)) == {"a": (4, 5, 6, 7), "b": (0, 1, 2, 3)}
