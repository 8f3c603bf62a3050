"""TP groups across nodes (gputopo.engine.gang.rack): each TP group in one NVLink domain, gangs split over the
fewest domains in balance on TP boundaries, per-domain caps, trays with unhealthy fabric left out."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gputopo.engine.cluster.explain import Seat, placement_sentence, tp_clause, tp_placement
from gputopo.engine.gang.assigned import Candidates, Held, plan_held
from gputopo.engine.gang.groups import plan_group
from gputopo.engine.gang.plan import GroupFailure, GroupPlan, Member, Placed, PlacedBefore
from gputopo.engine.gang.rack import LABEL_DOMAIN_CAP, balanced
from gputopo.engine.gang.tpgroups import tp_shape
from gputopo.engine.state.snapshot import NodeState, node_state
from gputopo.model import (
    HEALTHY_MASK,
    AnnotationError,
    GpuFabric,
    NvlinkPolicy,
    PodRequest,
    Spread,
    parse_pod_request,
)
from gputopo.systems import build_system, dgx_h100
from gputopo.tiers import DEFAULT_TIERS, Tier, TierConfig

DEGRADED_BW = 0xA9  # the degraded-bandwidth field reads TRUE


def tray(name: str, rack: str, *, mask: int | None = HEALTHY_MASK, leaf: str = "", cap: int | None = None) -> NodeState:
    """A GB200 tray of `rack`'s NVLink domain whose GPUs report `mask` (None: no fabric info)."""
    topo = build_system("gb200-tray", name)
    fabric = None if mask is None else GpuFabric(state="completed", health_mask=mask)
    topo = topo.model_copy(update={"gpus": tuple(g.model_copy(update={"fabric": fabric}) for g in topo.gpus)})
    labels = {"nvidia.com/gpu.clique": rack, "gputopo.io/network-leaf": leaf or f"leaf-{rack}"}
    if cap is not None:
        labels[LABEL_DOMAIN_CAP] = str(cap)
    return node_state(name, topo, labels=labels)


def rack(name: str, trays: int = 18, **kw: object) -> list[NodeState]:
    return [tray(f"{name}-tray-{i:02d}", name, **kw) for i in range(1, trays + 1)]  # type: ignore[arg-type]


def members(n: int, tp: int | None, gpus: int = 4, **kw: object) -> list[Member]:
    return [
        Member(f"m{i:02d}", PodRequest(gpus=gpus, group="g", group_size=n, stage=i, tp_size=tp, **kw)) for i in range(n)
    ]


def domains(plan: GroupPlan | GroupFailure) -> Counter[str]:
    assert isinstance(plan, GroupPlan), plan
    return Counter(a.node.location["nvlink-domain"] or "" for a in plan.assignments)


@pytest.mark.parametrize(
    ("case", "nodes", "n", "tp", "want"),
    [
        ("tp16_in_the_fullest_domain_that_holds_it", rack("a") + rack("b", 6), 4, 16, {"b": 4}),
        ("tp32_in_one_domain", rack("a") + rack("b"), 8, 32, {"a": 8}),
        ("32_trays_split_16_16_not_18_14", rack("a") + rack("b"), 32, 16, {"a": 16, "b": 16}),
        ("32_trays_cap_16_split_16_16", rack("a", cap=16) + rack("b", cap=16), 32, 16, {"a": 16, "b": 16}),
        ("24_trays_split_12_12", rack("a") + rack("b"), 24, 16, {"a": 12, "b": 12}),
        ("fewest_domains_first", rack("a") + rack("b") + rack("c"), 16, 16, {"a": 16}),
        ("as_balanced_as_capacities_allow", rack("a") + rack("b") + rack("c", 8), 36, 16, {"a": 12, "b": 16, "c": 8}),
        ("tp_size_within_a_member_is_not_rack_planning", rack("a", 2) + rack("b", 2), 4, 4, None),
    ],
)
def test_tp_groups_land_in_nvlink_domains(
    case: str, nodes: list[NodeState], n: int, tp: int, want: dict[str, int] | None
) -> None:
    plan = plan_group("g", members(n, tp), nodes)
    assert isinstance(plan, GroupPlan), plan
    if want is None:
        assert plan.split is None
        return
    assert domains(plan) == Counter(want)
    assert plan.split is not None
    per = tp // 4
    for t in range(n // per):  # a TP group never straddles two domains, and its ranks are consecutive stages
        group = [a for a in plan.assignments if a.stage // per == t]
        assert len({a.node.location["nvlink-domain"] for a in group}) == 1, (case, t)
    assert len({a.node.name for a in plan.assignments}) == n


def test_a_fill_by_trays_that_straddles_is_named_with_both_times() -> None:
    plan = plan_group("g", members(32, 16), rack("a") + rack("b"))
    assert isinstance(plan, GroupPlan) and plan.split is not None
    assert plan.split.fill == (18, 14) and plan.split.straddling == 1
    assert plan.split.across_s is not None and plan.split.across_s > 3 * plan.split.inside_s
    a = plan.assignments[20]
    text = placement_sentence(a.node.name, a.outcome, None, Seat(plan, a.member))
    assert "TP group 5/8 (16 GPUs, ranks 20-23) in NVLink domain b" in text
    assert "4+4 TP groups over 2 domains" in text
    assert "a fill by trays (18+14) would straddle 1 TP group" in text
    assert "TP all-reduce 2.8 ms in one domain vs 10.8 ms across two" in text


def test_the_annotations_tp_holds_the_sentences_split_and_times_for_every_member() -> None:
    plan = plan_group("g", members(32, 16), rack("a") + rack("b"))
    assert isinstance(plan, GroupPlan) and plan.split is not None
    for i, a in enumerate(plan.assignments):
        tp = tp_placement(plan, a.member)
        assert tp is not None
        assert (tp.group, tp.groups, tp.gpus) == (i // 4, 8, 16)
        assert [(s.domain, s.tp_groups) for s in tp.split] == [("a", 4), ("b", 4)]
        assert tp.domain == ("a" if i < 16 else "b") == a.node.location["nvlink-domain"]
        assert (tp.fill, tp.fill_straddles) == ((18, 14), 1)
        assert tp.across_all_reduce_ms is not None and tp.across_all_reduce_ms > 3 * tp.all_reduce_ms
        assert tp_clause(tp, plan.split.per_group) in placement_sentence(
            a.node.name, a.outcome, None, Seat(plan, a.member)
        )


def test_a_plan_without_a_split_has_no_tp_in_its_annotation() -> None:
    plan = plan_group("g", members(4, 4), rack("a"))  # tp-size 4 on 4-GPU members: each TP group in its pod
    assert isinstance(plan, GroupPlan) and plan.split is None
    assert all(tp_placement(plan, a.member) is None for a in plan.assignments)


@pytest.mark.parametrize(
    ("case", "nodes", "n", "tp", "needles"),
    [
        (
            "cap_keeps_spares",
            rack("a", cap=16) + rack("b", cap=16),
            36,
            16,
            ["needs 9 TP groups of 16 GPUs", "the domains hold 8", "cap of 16 trays", LABEL_DOMAIN_CAP],
        ),
        (
            "degraded_tray_named",
            [*rack("a", 3), tray("a-tray-04", "a", mask=DEGRADED_BW)],
            4,
            16,
            ["needs 1 TP group of 16 GPUs", "a-tray-04: degraded, GPU 0: healthMask 0xa9: degraded bandwidth"],
        ),
        (
            "unknown_fabric_is_not_healthy",
            [*rack("a", 3), tray("a-tray-04", "a", mask=None)],
            4,
            16,
            ["1 tray left out for their NVLink fabric (a-tray-04: unknown, GPU 0: no fabric info)"],
        ),
        ("no_domain_on_h100", [node_state(f"h{i}", dgx_h100(f"h{i}")) for i in range(4)], 2, 16, ["no node with room"]),
        ("bad_cap_label_named", rack("a", 4, cap=0), 4, 16, [f"label {LABEL_DOMAIN_CAP}='0' is not a whole number"]),
    ],
)
def test_a_group_no_domain_holds_waits_naming_why(
    case: str, nodes: list[NodeState], n: int, tp: int, needles: Sequence[str]
) -> None:
    gpus = 8 if case == "no_domain_on_h100" else 4
    plan = plan_group("g", members(n, tp, gpus), nodes)
    assert isinstance(plan, GroupFailure), case
    for needle in needles:
        assert needle in plan.message, (case, plan.message)


def test_a_degraded_tray_is_avoided_and_its_domain_comes_last() -> None:
    nodes = [*rack("a"), *rack("b")]
    nodes[2] = tray("a-tray-03", "a", mask=DEGRADED_BW)
    plan = plan_group("g", members(4, 16), nodes)
    assert domains(plan) == Counter({"b": 4})
    plan = plan_group("g", members(32, 16), nodes)  # both domains, never the degraded tray
    assert isinstance(plan, GroupPlan)
    assert "a-tray-03" not in {a.node.name for a in plan.assignments}


def test_preferred_nvlink_falls_back_to_the_ordinary_plan() -> None:
    nodes = [node_state(f"h{i}", dgx_h100(f"h{i}")) for i in range(4)]
    plan = plan_group("g", members(2, 16, 8, nvlink=NvlinkPolicy.PREFERRED), nodes)
    assert isinstance(plan, GroupPlan) and plan.split is None


def test_the_tier_group_cap_applies_where_no_label_says() -> None:
    tiers = TierConfig(
        tiers=tuple(
            t if t.name != "nvlink-domain" else t.model_copy(update={"group_cap": 8}) for t in DEFAULT_TIERS.tiers
        )
    )
    nodes = [node_state(n.name, n.topology, labels=n.labels, tiers=tiers) for n in rack("a") + rack("b")]
    plan = plan_group("g", members(16, 16), nodes, tiers)
    assert domains(plan) == Counter({"a": 8, "b": 8})
    assert isinstance(Tier(name="x", labels=("k",), groupCap=4).group_cap, int)


def test_shared_trays_count_their_room_under_spread_none() -> None:
    plan = plan_group("g", members(8, 8, 2, spread=Spread.NONE), rack("a", 2) + rack("b", 18))
    # 2 TP groups of 4 members, 2 members per tray: rack a's 2 trays hold one TP group, so b holds both
    assert domains(plan) == Counter({"b": 8})
    assert isinstance(plan, GroupPlan) and len({a.node.name for a in plan.assignments}) == 4


def test_a_compute_domain_keeps_the_whole_group_in_one_domain() -> None:
    nodes = rack("a", 5) + rack("b", 5)
    plan = plan_group("g", members(4, None, compute_domain="ns/cd-channel"), nodes)
    assert len(domains(plan)) == 1
    failure = plan_group("g", members(8, None, compute_domain="ns/cd-channel"), nodes)
    assert isinstance(failure, GroupFailure) and "all in one NVLink domain (one ComputeDomain)" in failure.message


@pytest.mark.parametrize(
    ("gpus", "tp", "want"),
    [
        ([4, 4, 4, 4], 16, (16, 4, 1)),
        ([4] * 8, 8, (8, 2, 4)),
        ([4, 4], 4, None),
        ([4, 4, 4], 8, "3 members of 4 GPUs are not a whole number of TP groups of 8 GPUs"),
        ([4, 2], 8, "needs members of one GPU count"),
        ([4, 4], 6, "not a multiple of each member's 4 GPUs"),
    ],
)
def test_tp_shape(gpus: list[int], tp: int, want: object) -> None:
    got = tp_shape(PodRequest(gpus=gpus[0], tp_size=tp), gpus)
    if isinstance(want, tuple):
        assert got is not None and not isinstance(got, str)
        assert (got.tp_gpus, got.per_group, got.groups) == want
    elif isinstance(want, str):
        assert isinstance(got, str) and want in got
    else:
        assert got is None


@pytest.mark.parametrize(
    ("value", "gpus", "error"),
    [
        ("16", 4, None),
        ("2", 4, None),
        ("6", 4, "multiple of the pod's 4 GPUs"),
        ("0", 4, "between 1 and 4096"),
        ("x", 4, "must be an integer"),
        ("3", 0, None),
    ],
)
def test_tp_size_annotation(value: str, gpus: int, error: str | None) -> None:
    ann = {"gputopo.io/tp-size": value}
    if error is None:
        assert parse_pod_request(ann, gpus).tp_size == int(value)
    else:
        with pytest.raises(AnnotationError, match=error) as e:
            parse_pod_request(ann, gpus)
        assert "gputopo.io/tp-size" in str(e.value)


@given(st.lists(st.integers(0, 6), min_size=1, max_size=5), st.integers(0, 20))
def test_balanced_shares_are_the_most_even_the_capacities_allow(caps: list[int], groups: int) -> None:
    shares = balanced(caps, groups)
    if sum(caps) < groups:
        assert shares is None
        return
    assert shares is not None and sum(shares) == groups
    assert all(0 <= s <= c for s, c in zip(shares, caps, strict=True))
    best = max(min(split) for split in itertools.product(*(range(c + 1) for c in caps)) if sum(split) == groups)
    assert min(shares) == best


@pytest.mark.parametrize(("placed_count", "n", "tp"), [(2, 4, 16), (4, 8, 16), (5, 8, 16)])
def test_a_replan_keeps_each_tp_group_with_its_placed_members(placed_count: int, n: int, tp: int) -> None:
    nodes = rack("a", 6) + rack("b", 6)
    ms = members(n, tp)
    full = plan_group("g", ms, nodes)
    assert isinstance(full, GroupPlan)
    first = full.assignments[:placed_count]
    placed = [Placed(a.stage, a.node, a.outcome.gpus) for a in first]
    rest = [x for x in nodes if x.name not in {a.node.name for a in first}]
    again = plan_group("g", ms[placed_count:], rest, before=PlacedBefore(placed=placed))
    assert isinstance(again, GroupPlan), again
    where = {a.stage: a.node.location["nvlink-domain"] for a in (*first, *again.assignments)}
    for t in range(n * 4 // tp):
        assert len({where[s] for s in range(4 * t, 4 * t + 4)}) == 1, where
    assert again.split is not None and sum(s.tp_groups for s in again.split.shares) == n * 4 // tp


def test_an_inferred_group_takes_tp_size_from_its_pod_template() -> None:
    """A JobSet's pods carry no group annotation; `gputopo.io/tp-size` on the template is enough."""
    from gputopo.model import InferredGroup

    reqs = [
        parse_pod_request(
            {"gputopo.io/tp-size": "16"},
            4,
            inferred=InferredGroup(
                "jobset/llm", "JobSet", "JobSet labels", 8, rank, "batch.kubernetes.io/job-completion-index"
            ),
        )
        for rank in range(8)
    ]
    assert {(r.group, r.group_size, r.tp_size) for r in reqs} == {("jobset/llm", 8, 16)}
    plan = plan_group("jobset/llm", [Member(f"w{r.stage}", r) for r in reqs], rack("a", 5) + rack("b", 5))
    assert domains(plan) == Counter({"a": 4, "b": 4})


CLIQUE = "nvidia.com/gpu.clique"
HOST = "kubernetes.io/hostname"


def held_by(ranks_to: Sequence[tuple[str, str]], tp: int | None = 16, **kw: object) -> list[Held]:
    """Kueue's assignment: member i held by the nodeSelector {key: value} at position i."""
    ms = members(len(ranks_to), tp, 4, **kw)
    return [Held(m, ((key, value),)) for m, (key, value) in zip(ms, ranks_to, strict=True)]


def hosts(*counts: tuple[str, int]) -> list[tuple[str, str]]:
    """`count` members on consecutive trays of each rack, hostname level."""
    return [(HOST, f"{r}-tray-{i:02d}") for r, n in counts for i in range(1, n + 1)]


RACKS = rack("a", 8) + rack("b", 8)


@pytest.mark.parametrize(
    ("held", "shares", "needle"),
    [
        pytest.param(
            held_by(hosts(("a", 4), ("b", 4))), "1+1 TP groups over 2 domains", None, id="hostname-whole-tp-groups"
        ),
        pytest.param(held_by([(CLIQUE, "a")] * 4 + [(CLIQUE, "b")] * 4), "1+1", None, id="rack-level-whole-tp-groups"),
        pytest.param(
            held_by(hosts(("a", 3), ("b", 5))),
            None,
            "puts TP group 0/2 (16 GPUs, ranks 0-3) on trays of NVLink domains a, b; gputopo.io/nvlink: required",
            id="hostname-level-straddle",
        ),
        pytest.param(
            held_by([(CLIQUE, "a")] * 5 + [(CLIQUE, "b")] * 3),
            None,
            "puts TP group 1/2 (16 GPUs, ranks 4-7) on trays of NVLink domains a, b",
            id="rack-level-straddle-is-named-not-miscounted",
        ),
        pytest.param(
            held_by(hosts(("a", 2), ("b", 2)), None, compute_domain="ns/cd-channel"),
            None,
            "puts the ComputeDomain's pods in NVLink domains a, b; one ComputeDomain's pods share one NVLink domain",
            id="compute-domain-over-two-racks",
        ),
    ],
)
def test_tp_groups_held_by_kueues_selectors_are_checked_over_the_whole_group(
    held: list[Held], shares: str | None, needle: str | None
) -> None:
    plan = plan_held("g", held, Candidates(RACKS))
    if needle is not None:
        assert isinstance(plan, GroupFailure) and needle in plan.message, plan
        return
    assert isinstance(plan, GroupPlan) and plan.split is not None, plan
    assert [(s.domain, s.tp_groups) for s in plan.split.shares] == [("a", 1), ("b", 1)]
    for a in plan.assignments:  # each member on a node its selector allows, ranks kept
        ((key, value),) = held[a.stage].selector
        assert a.node.labels.get(key, a.node.name) == value
    last = plan.assignments[-1]
    text = placement_sentence(last.node.name, last.outcome, None, Seat(plan, last.member))
    assert f"TP group 1/2 (16 GPUs, ranks 4-7) in NVLink domain b; {shares}" in text


def test_a_straddle_kueue_chose_is_placed_as_it_says_when_nvlink_is_only_preferred() -> None:
    held = held_by(hosts(("a", 3), ("b", 5)), nvlink=NvlinkPolicy.PREFERRED)
    plan = plan_held("g", held, Candidates(RACKS))
    assert isinstance(plan, GroupPlan) and plan.split is None
    assert [a.node.name for a in plan.assignments] == [value for _, value in hosts(("a", 3), ("b", 5))]


@given(on_a=st.integers(0, 8), hostname=st.booleans())
def test_a_kueue_split_is_placed_exactly_when_it_keeps_every_tp_group_in_one_domain(on_a: int, hostname: bool) -> None:
    ranks = hosts(("a", on_a), ("b", 8 - on_a)) if hostname else [(CLIQUE, "a")] * on_a + [(CLIQUE, "b")] * (8 - on_a)
    plan = plan_held("g", held_by(ranks), Candidates(RACKS))
    assert isinstance(plan, GroupPlan) == (on_a % 4 == 0), plan
    if isinstance(plan, GroupPlan):
        tp_groups = [{a.node.location["nvlink-domain"] for a in plan.assignments[t * 4 : t * 4 + 4]} for t in range(2)]
        assert all(len(d) == 1 for d in tp_groups)
