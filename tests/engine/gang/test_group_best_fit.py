"""Best fit above the node for groups: of the domains that hold the whole group at equal packing cost, the
fullest (fewest free GPUs), the group's tightest tier first, then outward; a preferred tier no domain meets
falls back to the smallest domain of the next wider tier that holds the group; a re-plan counts the
domains its placed members span already, so a big gang spans the fewest leaves."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gputopo.engine.cluster.explain import Seat, placement_sentence
from gputopo.engine.gang.groups import plan_group
from gputopo.engine.gang.plan import GroupFailure, GroupPlan, Member, Placed, PlacedBefore, Refinements, fit_tiers
from gputopo.engine.network.domains import domain_free, domain_of
from gputopo.engine.state.snapshot import NodeState, node_state, with_in_use
from gputopo.model import parse_pod_request
from gputopo.systems import build_system
from gputopo.tiers import DEFAULT_TIERS

# (spine, leaf, nodes, of them fully used): nodes are named <spine>.<leaf>.<i>, the used ones first.
Layout = list[tuple[str, str, int, int]]
TOPOLOGY = build_system("dgx-h100", "gpu")  # 8 GPUs, one NVSwitch clique: a node is free or not
ALL = frozenset(range(8))


def nodes_of(layout: Layout, rename: dict[str, str] | None = None) -> list[NodeState]:
    r = rename or {}
    out = []
    for spine, leaf, count, used in layout:
        for i in range(count):
            name = r.get(f"{spine}.{leaf}.{i:02d}", f"{spine}.{leaf}.{i:02d}")
            labels = {"gputopo.io/network-spine": r.get(spine, spine), "gputopo.io/network-leaf": r.get(leaf, leaf)}
            out.append(node_state(name, TOPOLOGY, labels=labels, in_use=ALL if i < used else frozenset()))
    return out


def group(n: int, gpus: int = 8, /, **ann: str) -> list[Member]:
    base = {"gputopo.io/group": "g", "gputopo.io/group-size": str(n)}
    base.update({f"gputopo.io/{k.replace('_', '-')}": v for k, v in ann.items()})
    return [Member(f"g-{i:04d}", parse_pod_request(base, gpus)) for i in range(n)]


def plan(result: GroupPlan | GroupFailure) -> GroupPlan:
    assert isinstance(result, GroupPlan), result
    return result


def spanned(p: GroupPlan, tier: str) -> set[str]:
    """The switches of `tier` the plan spans, by label (the last part of the path)."""
    return {(a.node.location.get(tier) or "?").rsplit("/", 1)[-1] for a in p.assignments}


def per_node(p: GroupPlan) -> dict[str, int]:
    out: dict[str, int] = {}
    for a in p.assignments:
        out[a.node.name] = out.get(a.node.name, 0) + 1
    return out


# l1: 32 free nodes; l2: 4 free (of 8); l3: 6 free. All under one spine.
ONE_SPINE: Layout = [("s1", "l1", 32, 0), ("s1", "l2", 8, 4), ("s1", "l3", 6, 0)]
# s1 holds l1 (4 free) and l2 (30 free); s2 holds l3 (6 free): leaf-first and spine-first disagree.
TWO_SPINES: Layout = [("s1", "l1", 4, 0), ("s1", "l2", 30, 0), ("s2", "l3", 6, 0)]

BEST_FIT = [
    pytest.param(ONE_SPINE, 4, 8, {}, ("leaf", "l2"), id="fullest-leaf-with-room"),
    pytest.param(ONE_SPINE, 5, 8, {}, ("leaf", "l3"), id="too-big-for-the-fullest-next-fullest"),
    pytest.param(ONE_SPINE, 8, 4, {"spread": "none"}, ("leaf", "l2"), id="spread-none-members-share-nodes"),
    pytest.param(ONE_SPINE, 4, 8, {"required_tier": "leaf"}, ("leaf", "l2"), id="required-leaf"),
    pytest.param(TWO_SPINES, 4, 8, {}, ("leaf", "l1"), id="leaf-first-without-a-preference"),
    pytest.param(TWO_SPINES, 4, 8, {"preferred_tier": "spine"}, ("spine", "s2"), id="preferred-spine-spine-first"),
    pytest.param(TWO_SPINES, 4, 8, {"required_tier": "spine"}, ("spine", "s2"), id="required-spine-spine-first"),
]


@pytest.mark.parametrize(("layout", "n", "gpus", "ann", "where"), BEST_FIT)
def test_a_group_goes_to_the_fullest_domain_with_room(
    layout: Layout, n: int, gpus: int, ann: dict[str, str], where: tuple[str, str]
) -> None:
    p = plan(plan_group("g", group(n, gpus, **ann), nodes_of(layout)))
    tier, domain = where
    assert spanned(p, tier) == {domain}
    assert p.switches_used == {"spine": 1, "leaf": 1}


@pytest.mark.parametrize(("layout", "n", "gpus", "ann", "where"), BEST_FIT)
def test_names_reversed_give_the_same_domain(
    layout: Layout, n: int, gpus: int, ann: dict[str, str], where: tuple[str, str]
) -> None:
    names = sorted({x for s, lf, c, _ in layout for x in (s, lf, *(f"{s}.{lf}.{i:02d}" for i in range(c)))})
    rename = {x: f"n{len(names) - i:04d}" for i, x in enumerate(names)}  # sorts in reverse
    p = plan(plan_group("g", group(n, gpus, **ann), nodes_of(layout, rename)))
    tier, domain = where
    assert spanned(p, tier) == {rename[domain]}


def test_the_sentence_names_the_domain_and_the_one_kept_whole() -> None:
    p = plan(plan_group("g", group(4), nodes_of(ONE_SPINE)))
    a = p.assignments[0]
    text = placement_sentence(a.node.name, a.outcome, None, Seat(p, a.member))
    assert "leaf l2 is the fullest with room for the group: keeps leaf l3's 48 free GPUs whole" in text


def test_a_domain_chosen_for_anything_but_best_fit_gets_no_best_fit_words() -> None:
    # Only l1 holds the group: nothing to choose between, nothing to say.
    p = plan(plan_group("g", group(10), nodes_of(ONE_SPINE)))
    assert p.fit is None


# The Kueue example: 4 pods preferring one rack; no rack has room. Block b1's one rack has 3 free
# nodes, block b2's two racks 2 each: Kueue (and now gputopo) takes 2 racks of block b2.
RACKS: Layout = [("b1", "r1", 3, 0), ("b2", "r2", 2, 0), ("b2", "r3", 2, 0)]


@pytest.mark.parametrize(
    ("layout", "n", "spread", "racks", "blocks"),
    [
        pytest.param(RACKS, 4, "node", {"r2", "r3"}, {"b2"}, id="kueue-example"),
        pytest.param(RACKS, 4, "none", {"r2", "r3"}, {"b2"}, id="kueue-example-spread-none"),
        # Both blocks hold it: the fuller one (b2, 4 free nodes) keeps b1's 6 whole.
        pytest.param([*RACKS, ("b1", "r4", 3, 0)], 4, "node", {"r2", "r3"}, {"b2"}, id="fullest-block-that-holds"),
        # No block holds 6: the fewest blocks, the roomiest first, the rest in the fullest rack that holds it.
        pytest.param(RACKS, 6, "node", {"r1", "r2", "r3"}, {"b1", "b2"}, id="no-block-holds-it"),
    ],
)
def test_a_preferred_tier_no_domain_meets_falls_back_to_the_smallest_enclosing_domain(
    layout: Layout, n: int, spread: str, racks: set[str], blocks: set[str]
) -> None:
    p = plan(plan_group("g", group(n, preferred_tier="leaf", spread=spread), nodes_of(layout)))
    assert (spanned(p, "leaf"), spanned(p, "spine")) == (racks, blocks)


def test_before_the_fallback_the_roomiest_rack_took_three_and_another_block_one() -> None:
    p = plan(plan_group("g", group(4, preferred_tier="leaf"), nodes_of(RACKS), refine=Refinements(best_fit=False)))
    assert spanned(p, "spine") == {"b1", "b2"} and len(spanned(p, "leaf")) == 2


def test_a_required_tier_no_domain_meets_still_waits_with_its_reason() -> None:
    result = plan_group("g", group(4, required_tier="leaf"), nodes_of(RACKS))
    assert isinstance(result, GroupFailure)
    assert result.message == "group needs 4 nodes with a free 8-GPU NVLink clique under one leaf; best leaf has 3"


# Deliberate differences from Kueue TAS / KAI / Volcano (docs/annotations.md, "Network tiers").
def test_an_unconstrained_spread_none_gang_is_packed_on_the_fewest_nodes_not_scattered() -> None:
    p = plan(plan_group("g", group(4, 2, spread="none"), nodes_of([("s1", "l1", 3, 0)])))
    assert list(per_node(p).values()) == [4]


def test_a_spread_none_pair_shares_one_node_even_where_a_fuller_node_holds_one() -> None:
    nodes = nodes_of([("s1", "l1", 2, 0)])
    nodes[1] = with_in_use(nodes[1], frozenset(range(7)))  # one GPU free: where a lone 1-GPU pod would go
    p = plan(plan_group("g", group(2, 1, spread="none"), nodes))
    assert per_node(p) == {nodes[0].name: 2}


def test_an_unconstrained_spread_node_gang_is_packed_on_the_fewest_leaves() -> None:
    p = plan(plan_group("g", group(4), nodes_of([("s1", "l1", 2, 0), ("s1", "l2", 4, 0), ("s2", "l3", 3, 0)])))
    assert spanned(p, "leaf") == {"l2"}


def gang_layout(count: int, per_leaf: int, per_spine: int) -> Layout:
    """As bench/gang_scale.py lays nodes out: `per_leaf` nodes a leaf in order, the last leaf partial."""
    leaves = math.ceil(count / per_leaf)
    return [(f"s{i // per_spine}", f"l{i}", min(per_leaf, count - i * per_leaf), 0) for i in range(leaves)]


def fewest_leaves(layout: Layout, members: int) -> int:
    sizes = sorted((c - used for _, _, c, used in layout), reverse=True)
    total, k = 0, 0
    while total < members:
        total, k = total + sizes[k], k + 1
    return k


@pytest.mark.parametrize(
    ("count", "per_leaf", "per_spine", "members", "placed", "spread"),
    [
        pytest.param(330, 32, 4, 256, 0, "node", id="fresh"),
        pytest.param(330, 32, 4, 256, 1, "node", id="one-placed"),
        pytest.param(330, 32, 4, 300, 40, "node", id="partial-last-leaf-needed"),
        pytest.param(330, 32, 4, 256, 1, "none", id="one-placed-spread-none"),
        pytest.param(330, 32, 4, 100, 33, "none", id="placed-over-two-leaves-spread-none"),
        pytest.param(5000, 32, 8, 4096, 1, "node", id="bench-4096-on-5000"),
    ],
)
def test_a_gang_spans_the_fewest_leaves(
    count: int, per_leaf: int, per_spine: int, members: int, placed: int, spread: str
) -> None:
    """A re-plan around members placed already (the extender's, once a member is bound) used to fill the
    roomiest leaves afresh and leave the placed members' leaf aside: 129 leaves where 128 hold the gang."""
    layout = gang_layout(count, per_leaf, per_spine)
    nodes = nodes_of(layout)
    pinned = [Placed(i, nodes[i], tuple(range(8))) for i in range(placed)]
    if spread == "node":
        rest = nodes[placed:]
    else:
        rest = [with_in_use(x, ALL) if i < placed else x for i, x in enumerate(nodes)]
    todo = group(members, spread=spread)[placed:]
    p = plan(plan_group("g", todo, rest, before=PlacedBefore(placed=pinned)))
    leaves = {domain_of(a.node, "leaf") for a in p.assignments} | {domain_of(x.node, "leaf") for x in pinned if x.node}
    assert len(leaves) == fewest_leaves(layout, members)


# Hypothesis: a random fabric, a random sequence of groups (8-GPU members, one per node). At every step,
# from the same state, best fit leaves the largest free domain (of the tier the group's smallest enclosing
# domain is at) no smaller than the choice before best fit did, where both pack equally (the preferred-tier
# fallback may choose another packing: one enclosing spine over fewer leaves).


def _largest_after(nodes: Sequence[NodeState], p: GroupPlan, tier: str) -> int:
    used = {a.node.name for a in p.assignments}
    after = [with_in_use(x, ALL) if x.name in used else x for x in nodes]
    return max(domain_free(after).by_tier[tier].values())


@st.composite
def fabrics(draw: st.DrawFn) -> tuple[Layout, list[int], dict[str, str]]:
    layout: Layout = []
    for s in range(draw(st.integers(1, 3))):
        for leaf in range(draw(st.integers(1, 3))):
            count = draw(st.integers(1, 6))
            layout.append((f"s{s}", f"s{s}l{leaf}", count, draw(st.integers(0, count))))
    sizes = draw(st.lists(st.integers(1, 8), min_size=1, max_size=6))
    ann = draw(st.sampled_from([{}, {"preferred_tier": "leaf"}, {"preferred_tier": "spine"}]))
    return layout, sizes, ann


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fabrics())
def test_best_fit_never_leaves_a_smaller_largest_free_domain(case: tuple[Layout, list[int], dict[str, str]]) -> None:
    layout, sizes, ann = case
    nodes = nodes_of(layout)
    fit = fit_tiers(DEFAULT_TIERS, ann.get("preferred_tier"))
    for n in sizes:
        members = group(n, 8, **ann)
        now = plan_group("g", members, nodes)
        before = plan_group("g", members, nodes, refine=Refinements(best_fit=False))
        assert isinstance(now, GroupFailure) == isinstance(before, GroupFailure)
        if isinstance(now, GroupFailure) or isinstance(before, GroupFailure):
            continue
        if ann.get("preferred_tier") == "leaf":  # the fallback: one enclosing spine where one holds the group
            assert now.switches_used["spine"] <= before.switches_used["spine"]
        else:  # best fit never spans more switches, fewest spines first
            assert (now.switches_used["spine"], now.switches_used["leaf"]) <= (
                before.switches_used["spine"],
                before.switches_used["leaf"],
            )
        tier = next((t for t in fit if len({domain_of(a.node, t) for a in now.assignments}) == 1), None)
        if tier is not None and now.switches_used == before.switches_used:  # equal packing cost
            assert _largest_after(nodes, now, tier) >= _largest_after(nodes, before, tier)
        used = {a.node.name for a in now.assignments}
        nodes = [with_in_use(x, ALL) if x.name in used else x for x in nodes]
