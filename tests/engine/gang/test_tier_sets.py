"""Tier sets per hardware shape (docs/configuration.md, "Tier sets per hardware shape"): a node is read by the
first set whose labels it matches, else by the top-level tiers; every set names the same tiers; a group is
planned within one set's nodes, and members placed before fix the set."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from gputopo.clusterfile import JobSpec
from gputopo.engine.gang.exclusive import domain_words
from gputopo.engine.gang.groups import plan_group
from gputopo.engine.gang.plan import GroupFailure, GroupPlan, Member, Placed, PlacedBefore
from gputopo.engine.gang.tiersets import by_tier_set
from gputopo.engine.network.cost import NVLINK_DOMAIN_BUSBW_GBPS, domain_allreduce_seconds
from gputopo.engine.network.estimate import group_allreduce_seconds, stage_transfer_seconds
from gputopo.engine.state.snapshot import NodeState, locate, node_state, taking, with_in_use
from gputopo.model import parse_pod_request
from gputopo.model.jobs import podgroup_shape
from gputopo.sim.core import simulate
from gputopo.systems import build_system
from gputopo.tiers import DEFAULT_TIERS, Tier, TierConfig, TierSet
from tests.paths import REPO

PRODUCT = "nvidia.com/gpu.product"
H100 = "NVIDIA-H100-80GB-HBM3"
GB200 = "NVIDIA-GB200"
IB_SPINE, IB_LEAF = "ib.example.com/spine", "ib.example.com/leaf"
TG_TIER1, TG_TIER2 = "fabric.topograph.run/tier-1", "fabric.topograph.run/tier-2"
TG_DOMAIN = "accelerator.topograph.run/domain"


def tiers_of(spine: str, leaf: str, domain: str) -> tuple[Tier, ...]:
    return (
        Tier(name="spine", labels=(spine,), oversubscription=2.0),
        Tier(name="leaf", labels=(leaf,)),
        Tier(name="nvlink-domain", labels=(domain,)),
    )


H100_SET = TierSet(name="h100", match={PRODUCT: H100}, tiers=tiers_of(IB_SPINE, IB_LEAF, "nvidia.com/gpu.clique"))
GB200_SET = TierSet(name="gb200", match={PRODUCT: GB200}, tiers=tiers_of(TG_TIER2, TG_TIER1, TG_DOMAIN))
MIXED = TierConfig(sets=(H100_SET, GB200_SET))


@pytest.mark.parametrize(
    ("labels", "tier_set", "location"),
    [
        pytest.param(
            {PRODUCT: H100, IB_SPINE: "s1", IB_LEAF: "l1", TG_TIER1: "tg-l", TG_TIER2: "tg-s"},
            "h100",
            {"spine": "s1", "leaf": "s1/l1", "nvlink-domain": None},
            id="h100-reads-its-infiniband-keys-not-topograph",
        ),
        pytest.param(
            {PRODUCT: GB200, IB_LEAF: "l1", TG_TIER1: "tg-l", TG_TIER2: "tg-s", TG_DOMAIN: "rack-1"},
            "gb200",
            {"spine": "tg-s", "leaf": "tg-s/tg-l", "nvlink-domain": "rack-1"},
            id="gb200-reads-topograph-keys",
        ),
        pytest.param(
            {PRODUCT: "NVIDIA-A100", "gputopo.io/network-leaf": "own", IB_LEAF: "l1"},
            "",
            {"spine": None, "leaf": "own", "nvlink-domain": None},
            id="no-match-takes-the-top-level-tiers",
        ),
        pytest.param(
            {"gputopo.io/network-leaf": "own", TG_TIER1: "tg-l"},
            "",
            {"spine": None, "leaf": "own", "nvlink-domain": None},
            id="no-product-label-takes-the-top-level-tiers",
        ),
    ],
)
def test_a_node_is_located_by_its_tier_set(
    labels: dict[str, str], tier_set: str, location: dict[str, str | None]
) -> None:
    assert MIXED.for_labels(labels)[0] == tier_set
    assert locate(labels, None, MIXED) == location
    node = node_state("n1", build_system("dgx-h100", "n1"), labels=labels, tiers=MIXED)
    assert (node.tier_set, dict(node.location)) == (tier_set, location)


def test_the_first_matching_set_wins_and_every_label_of_its_match_must_hold() -> None:
    narrow = TierSet(name="gb200-rack", match={PRODUCT: GB200, "gputopo.io/pool": "rack"}, tiers=GB200_SET.tiers)
    config = TierConfig(sets=(narrow, GB200_SET))
    assert config.for_labels({PRODUCT: GB200, "gputopo.io/pool": "rack"})[0] == "gb200-rack"
    assert config.for_labels({PRODUCT: GB200, "gputopo.io/pool": "other"})[0] == "gb200"
    assert TierConfig(sets=(GB200_SET, narrow)).for_labels({PRODUCT: GB200, "gputopo.io/pool": "rack"})[0] == "gb200"


def test_a_node_keeps_its_tier_set_when_gpus_are_taken() -> None:
    node = node_state("t1", build_system("gb200-tray", "t1"), labels={PRODUCT: GB200, TG_TIER1: "l"}, tiers=MIXED)
    assert node.tier_set == "gb200"
    assert taking(node, frozenset({0})).tier_set == "gb200"
    assert with_in_use(node, frozenset({1}), MIXED).tier_set == "gb200"
    problem = node_state("t2", None, labels={PRODUCT: GB200}, tiers=MIXED)
    assert (problem.problem is not None, problem.tier_set) == (True, "gb200")


def test_a_group_within_a_set_reads_that_sets_tiers_alone_and_its_nodes_keep_their_set() -> None:
    capped = TierSet(
        name="gb200",
        match={PRODUCT: GB200},
        tiers=(*GB200_SET.tiers[:2], Tier(name="nvlink-domain", labels=(TG_DOMAIN,), groupCap=16)),
    )
    config = TierConfig(sets=(H100_SET, capped))
    alone = config.of_set("gb200")
    assert alone.tiers == capped.tiers and alone.sets == () and alone.tiers[2].group_cap == 16
    assert config.of_set("") is config and config.of_set("gone") is config
    node = node_state("t1", build_system("gb200-tray", "t1"), labels={PRODUCT: GB200, TG_TIER1: "l"}, tiers=config)
    taken = with_in_use(node, frozenset({0}), alone)
    assert (taken.tier_set, taken.location) == ("gb200", node.location)


def test_without_sets_every_node_takes_the_top_level_tiers() -> None:
    node = node_state("n1", build_system("dgx-h100", "n1"), labels={PRODUCT: H100, "gputopo.io/network-leaf": "l"})
    assert node.tier_set == "" and DEFAULT_TIERS.sets == ()


def test_tier_sets_round_trip_through_json_and_stay_hashable() -> None:
    again = TierConfig.model_validate_json(MIXED.model_dump_json())
    assert again == MIXED and hash(again) == hash(MIXED)
    assert again != DEFAULT_TIERS
    from_setting = TierConfig.model_validate(
        {"sets": [{"name": "gb200", "match": {PRODUCT: GB200}, "tiers": [t.model_dump() for t in GB200_SET.tiers]}]}
    )
    assert from_setting.sets == (GB200_SET,) and from_setting.tiers == DEFAULT_TIERS.tiers


GB_TIERS = [{"name": t.name, "labels": list(t.labels)} for t in GB200_SET.tiers]


@pytest.mark.parametrize(
    ("sets", "words"),
    [
        pytest.param(
            [{"name": "gb200", "match": {PRODUCT: GB200}, "tiers": GB_TIERS}] * 2,
            "tier set 'gb200' is named twice",
            id="duplicate-name",
        ),
        pytest.param(
            [{"name": "gb200", "match": {PRODUCT: GB200}, "tiers": GB_TIERS[:2]}],
            "tier set 'gb200' has tiers spine, leaf; every set needs the top-level tiers' names in their order: "
            "spine, leaf, nvlink-domain",
            id="a-tier-missing",
        ),
        pytest.param(
            [{"name": "gb200", "match": {PRODUCT: GB200}, "tiers": [GB_TIERS[1], GB_TIERS[0], GB_TIERS[2]]}],
            "tier set 'gb200' has tiers leaf, spine, nvlink-domain",
            id="tiers-out-of-order",
        ),
        pytest.param(
            [{"name": "gb200", "match": {PRODUCT: GB200}, "tiers": [*GB_TIERS[:2], {"name": "rack", "labels": ["r"]}]}],
            "tier set 'gb200' has tiers spine, leaf, rack",
            id="a-tier-renamed",
        ),
        pytest.param([{"name": "", "match": {PRODUCT: GB200}, "tiers": GB_TIERS}], "sets.0.name", id="empty-name"),
        pytest.param([{"name": "gb200", "match": {}, "tiers": GB_TIERS}], "sets.0.match", id="empty-match"),
        pytest.param([{"name": "gb200", "match": {"": GB200}, "tiers": GB_TIERS}], "sets.0.match", id="empty-key"),
        pytest.param([{"name": "gb200", "tiers": GB_TIERS}], "sets.0.match", id="no-match"),
        pytest.param(
            [{"name": "gb200", "match": {PRODUCT: GB200}, "tiers": GB_TIERS, "matches": {}}],
            "sets.0.matches",
            id="unknown-field",
        ),
    ],
)
def test_a_bad_tier_set_is_refused_naming_it(sets: list[dict[str, object]], words: str) -> None:
    with pytest.raises(ValidationError) as err:
        TierConfig.model_validate({"sets": sets})
    problems = [f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in err.value.errors()]
    assert any(words in p for p in problems), problems


KEYS = (PRODUCT, "gputopo.io/pool", IB_SPINE, IB_LEAF, TG_TIER1, TG_TIER2, TG_DOMAIN, "gputopo.io/network-leaf")
VALUES = ("", "a", "b", H100, GB200)
label_maps = st.dictionaries(st.sampled_from(KEYS), st.sampled_from(VALUES), max_size=len(KEYS))
tier_sets = st.lists(
    st.builds(
        lambda name, match, labels: TierSet(name=name, match=match, tiers=tiers_of(*labels)),
        st.sampled_from(("a", "b", "c", "d")),
        st.dictionaries(st.sampled_from(KEYS), st.sampled_from(VALUES), min_size=1, max_size=3),
        st.permutations(KEYS).map(lambda keys: keys[:3]),
    ),
    max_size=4,
    unique_by=lambda s: s.name,
)


@settings(max_examples=200, deadline=None)
@given(sets=tier_sets, labels=label_maps)
def test_any_labels_are_located_by_the_first_set_they_match(sets: list[TierSet], labels: dict[str, str]) -> None:
    config = TierConfig(sets=tuple(sets))
    first = next((s for s in sets if all(labels.get(k) == v for k, v in s.match.items())), None)
    name, tiers = config.for_labels(labels)
    assert (name, tiers) == ((first.name, first.tiers) if first else ("", config.tiers))
    location = locate(labels, None, config)  # never raises, names every tier
    assert tuple(location) == config.names
    assert {t: config.switch_of(labels, t) for t in config.names} == {t.name: t.switch(labels) for t in tiers}


# ---------------------------------------------------------------- groups within one tier set


def h100(name: str, spine: str, leaf: str) -> NodeState:
    labels = {PRODUCT: H100, IB_SPINE: spine, IB_LEAF: leaf}
    return node_state(name, build_system("dgx-h100", name), labels=labels, tiers=MIXED)


def tray(name: str, spine: str, leaf: str, rack: str) -> NodeState:
    labels = {PRODUCT: GB200, TG_TIER2: spine, TG_TIER1: leaf, TG_DOMAIN: rack}
    return node_state(name, build_system("gb200-tray", name), labels=labels, tiers=MIXED)


def gang(n: int, gpus: int, **ann: str) -> list[Member]:
    base = {"gputopo.io/group": "g", "gputopo.io/group-size": str(n)}
    base.update({f"gputopo.io/{k.replace('_', '-')}": v for k, v in ann.items()})
    return [Member(f"g-{i}", parse_pod_request({**base, "gputopo.io/stage": str(i)}, gpus)) for i in range(n)]


def shapes_of(plan: GroupPlan | GroupFailure) -> set[str]:
    assert isinstance(plan, GroupPlan), plan
    return {a.node.tier_set for a in plan.assignments}


def fleet(h100_leaves: tuple[str, ...], tray_leaves: tuple[str, ...]) -> list[NodeState]:
    return [h100(f"h{i}", "s", leaf) for i, leaf in enumerate(h100_leaves)] + [
        tray(f"t{i}", "s", leaf, "rack-1") for i, leaf in enumerate(tray_leaves)
    ]


@pytest.mark.parametrize(
    ("nodes", "members", "shape"),
    [
        pytest.param(fleet(("l1",) * 2, ("l1",) * 2), gang(2, 8), "h100", id="8-gpu-members-fit-h100-only"),
        pytest.param(fleet(("l1",) * 4, ("l1",) * 4), gang(4, 4), "gb200", id="both-fit-equally-the-name-decides"),
        pytest.param(fleet(("l1", "l1", "l2", "l2"), ("l1",) * 4), gang(4, 4), "gb200", id="fewest-leaves-wins-gb200"),
        pytest.param(fleet(("l1",) * 4, ("l1", "l1", "l2", "l2")), gang(4, 4), "h100", id="fewest-leaves-wins-h100"),
        pytest.param(fleet(("l1",) * 3, ("l1",) * 3), gang(3, 2, spread="none"), "gb200", id="packed-members"),
    ],
)
def test_a_group_is_planned_within_one_tier_set(nodes: list[NodeState], members: list[Member], shape: str) -> None:
    assert shapes_of(plan_group("g", members, nodes, MIXED)) == {shape}


def test_a_group_that_fits_only_across_two_shapes_is_refused_naming_each() -> None:
    result = plan_group("g", gang(4, 4), fleet(("l1",) * 2, ("l1",) * 2), MIXED)
    assert isinstance(result, GroupFailure)
    assert result.message == (
        "group g fits in no one hardware shape: in tier set gb200, group needs 4 nodes with a free 4-GPU NVLink "
        "clique; 2 have it; in tier set h100, group needs 4 nodes with a free 4-GPU NVLink clique; 2 have it"
    )


def test_members_placed_before_fix_the_tier_set() -> None:
    nodes = fleet(("l1",) * 4, ("l1",) * 4)
    pinned = next(n for n in nodes if n.name == "h0")
    plan = plan_group("g", gang(4, 4)[1:], nodes, MIXED, before=PlacedBefore(placed=[Placed(0, pinned, (0, 1, 2, 3))]))
    assert shapes_of(plan) == {"h100"}
    alongside = plan_group("g", gang(3, 4), nodes, MIXED, before=PlacedBefore(alongside=[(pinned, (0, 1, 2, 3))]))
    assert shapes_of(alongside) == {"h100"}


def test_a_shape_of_nodes_that_take_no_pod_is_not_tried() -> None:
    nodes = [*fleet(("l1",) * 2, ()), node_state("t9", None, labels={PRODUCT: GB200}, tiers=MIXED)]
    result = plan_group("g", gang(3, 8), nodes, MIXED)
    assert isinstance(result, GroupFailure) and "tier set" not in result.message


@settings(max_examples=60, deadline=None)
@given(
    h100_leaves=st.lists(st.sampled_from(("l1", "l2")), max_size=4).map(tuple),
    tray_leaves=st.lists(st.sampled_from(("l1", "l2")), max_size=5).map(tuple),
    size=st.integers(1, 6),
    gpus=st.sampled_from((1, 2, 4, 8)),
    spread=st.sampled_from(("node", "none")),
)
def test_no_group_plan_spans_two_tier_sets(
    h100_leaves: tuple[str, ...], tray_leaves: tuple[str, ...], size: int, gpus: int, spread: str
) -> None:
    nodes = fleet(h100_leaves, tray_leaves)
    result = plan_group("g", gang(size, gpus, spread=spread), nodes, MIXED)
    if isinstance(result, GroupPlan):
        assert len(shapes_of(result)) == 1
    sets = by_tier_set(nodes)
    assert sum(len(v) for v in sets.values()) == len(nodes)


def test_the_simulator_places_each_job_within_one_tier_set() -> None:
    nodes = fleet(("l1", "l2", "l2"), ("l1", "l2", "l2"))
    jobs = [JobSpec(name="big", pods=2, gpus_per_pod=8), JobSpec(name="small", pods=2, gpus_per_pod=4)]
    result = simulate(nodes, jobs, "gputopo", MIXED)
    by_name = {n.name: n for n in nodes}
    placed = {job: {by_name[p.node] for p in result.placements if p.job == job} for job in ("big", "small")}
    assert {n.name for n in placed["big"]} == {"h1", "h2"}  # under the h100 set's one leaf that holds both
    assert {n.tier_set for n in placed["small"]} == {"gb200"} and len(placed["small"]) == 2


def test_the_documented_example_is_a_valid_setting_read_as_it_says() -> None:
    doc = (REPO / "docs" / "configuration.md").read_text()
    section = doc.split("### Tier sets per hardware shape", 1)[1].split("\n#", 1)[0]
    example = TierConfig.model_validate_json(section.split("```json", 1)[1].split("```", 1)[0])
    assert [s.name for s in example.sets] == ["h100", "gb200"]
    assert example.for_labels({PRODUCT: H100})[0] == "h100" and example.for_labels({PRODUCT: "other"})[0] == ""
    tray_labels = {PRODUCT: GB200, TG_TIER2: "s", TG_TIER1: "l", TG_DOMAIN: "rack-1"}
    assert example.locate(tray_labels) == {"spine": "s", "leaf": "l", "nvlink-domain": "rack-1"}
    assert example.of_set("gb200").tiers[2].group_cap == 16


# A GB200 set whose fabric differs from the top-level tiers' defaults: spines 4:1, a measured domain.
GB200_MEASURED = TierSet(
    name="gb200",
    match={PRODUCT: GB200},
    tiers=(
        Tier(name="spine", labels=(TG_TIER2,), oversubscription=4.0),
        Tier(name="leaf", labels=(TG_TIER1,)),
        Tier(name="nvlink-domain", labels=(TG_DOMAIN,), busbw_gbps=900.0),
    ),
)


def _tray(name: str, spine: str, leaf: str, rack: str, tiers: TierConfig) -> NodeState:
    labels = {PRODUCT: GB200, TG_TIER2: spine, TG_TIER1: leaf, TG_DOMAIN: rack}
    return node_state(name, build_system("gb200-tray", name), labels=labels, tiers=tiers)


def test_estimates_read_the_tier_set_of_the_nodes_they_are_for() -> None:
    mixed = TierConfig(sets=(GB200_MEASURED,))
    alone = TierConfig(tiers=GB200_MEASURED.tiers)
    a, b = _tray("t1", "s1", "l1", "rack-1", mixed), _tray("t2", "s1", "l1", "rack-1", mixed)
    c = _tray("t3", "s2", "l9", "rack-2", mixed)
    gib = float(1 << 30)
    # Trays of one rack: the set's measured domain bandwidth, not the default's.
    ring = group_allreduce_seconds([(a, (0, 1, 2, 3)), (b, (0, 1, 2, 3))], gib, mixed)
    assert ring == pytest.approx(domain_allreduce_seconds(gib, 2, 900.0))
    assert ring < domain_allreduce_seconds(gib, 2, NVLINK_DOMAIN_BUSBW_GBPS)
    # Across spines: the set's 4:1 uplinks, not the top-level tiers' 2:1.
    across = stage_transfer_seconds(a, (0,), c, (0,), gib, mixed)
    assert across == pytest.approx(stage_transfer_seconds(a, (0,), c, (0,), gib, alone))
    assert across > stage_transfer_seconds(a, (0,), c, (0,), gib, DEFAULT_TIERS)
    two_racks = group_allreduce_seconds([(a, (0, 1, 2, 3)), (c, (0, 1, 2, 3))], gib, mixed)
    assert two_racks == pytest.approx(group_allreduce_seconds([(a, (0, 1, 2, 3)), (c, (0, 1, 2, 3))], gib, alone))


@pytest.mark.parametrize(
    ("key", "tier"),
    [
        pytest.param(IB_LEAF, "leaf", id="a-key-only-the-h100-set-reads-names-its-tier"),
        pytest.param(TG_TIER2, "spine", id="a-key-the-top-level-tiers-read-too"),
        pytest.param(TG_DOMAIN, "nvlink-domain", id="a-domain-key-of-the-gb200-set"),
        pytest.param("example.com/rack", None, id="a-key-no-set-reads"),
    ],
)
def test_a_topology_key_of_any_tier_set_names_its_tier(key: str, tier: str | None) -> None:
    # A PodGroup's or a JobSet's topology key means the nodes of whichever shape it names.
    shape = podgroup_shape("pg", 2, [key], MIXED.labels_by_tier())
    assert (shape.required_tier, bool(shape.problem)) == (tier, tier is None)
    assert domain_words(key, MIXED) == f"domain of {key}" + (f" (tier {tier})" if tier else "")


def test_every_tier_lists_the_top_level_labels_first_then_each_sets_new_ones() -> None:
    by_tier = dict(MIXED.labels_by_tier())
    assert list(by_tier) == list(MIXED.names)
    assert by_tier["leaf"][: len(DEFAULT_TIERS.tiers[1].labels)] == DEFAULT_TIERS.tiers[1].labels
    assert by_tier["leaf"][-1] == IB_LEAF and by_tier["leaf"].count(TG_TIER1) == 1
    assert DEFAULT_TIERS.labels_by_tier() == tuple((t.name, t.labels) for t in DEFAULT_TIERS.tiers)
