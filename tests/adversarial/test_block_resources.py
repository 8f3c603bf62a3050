"""Hostile block resources on a pod (`gputopo.io/gpu-clique<N>`, gputopo/model/blockrequest.py): counts that
are no whole quantity (-1, "٤", "1.5", NaN), counts of 0, 1k and 10^9, names under the prefix with a size
no class serves (3, 04, 2^64, a 10,000-character suffix), thousands of such names. Bounds: a bad count is
refused naming the field, as nvidia.com/gpu is; every other case is one reason naming the resource on
every node, never a placement, and the names read per pod stop at MAX_RESOURCE_NAMES."""

from __future__ import annotations

from itertools import combinations
from typing import Any

import orjson
import pytest

from gputopo.engine.gang.groups import plan_group
from gputopo.engine.gang.plan import GroupPlan, Member
from gputopo.engine.node.placement import evaluate_node, outcome_on
from gputopo.engine.state.cliques import bits, mask_of
from gputopo.engine.state.snapshot import node_state
from gputopo.extender.wire import WireError, pod_info
from gputopo.model import parse_pod_request
from gputopo.model.blockrequest import MAX_RESOURCE_NAMES, read_block_ask
from gputopo.systems import build_system
from tests.extender.harness import JSON, Env, node_obj, pod_obj

NODES = ["a", "b"]


def block_pod(resources: dict[str, Any], key: str = "limits", init: bool = False) -> JSON:
    pod = pod_obj("hostile", 0, {})
    c = pod["spec"]["containers"][0]
    c["resources"] = {key: resources}
    if init:
        pod["spec"]["initContainers"] = [{"name": "init", "resources": {key: resources}}]
        c["resources"] = {}
    return pod


@pytest.mark.parametrize(
    "count",
    [
        pytest.param("-1", id="negative"),
        pytest.param("٤", id="Arabic-Indic four"),
        pytest.param("１", id="full-width one"),
        pytest.param("1.5", id="fraction"),
        pytest.param(float("nan"), id="NaN"),
        pytest.param([1], id="a list"),
        pytest.param(True, id="a bool"),
        pytest.param("9" * 400, id="400 digits"),
    ],
)
def test_a_count_that_is_no_whole_quantity_is_refused_naming_the_field(count: Any) -> None:
    with pytest.raises(WireError, match=r"Pod\.spec\.containers\[0\]\.resources\.limits\.gputopo\.io/gpu-clique4"):
        pod_info(block_pod({"gputopo.io/gpu-clique4": count}))


@pytest.mark.parametrize(
    "digits",
    [
        pytest.param(str(2**64 + 1), id="2^64+1"),
        pytest.param("1" + "0" * 30, id="10^30"),
    ],
)
@pytest.mark.parametrize("resource", ["gputopo.io/gpu-clique4", "nvidia.com/gpu"])
def test_a_count_past_64_bits_in_the_body_is_refused_with_its_own_digits(env: Env, resource: str, digits: str) -> None:
    """A JSON integer past 64 bits decodes as a float on the fast path and as an int on the validating one:
    the refusal quotes the count as written, for a block as for nvidia.com/gpu."""
    env.add_nodes(node_obj("a", "dgx-h100"))
    raw = orjson.dumps({"Pod": block_pod({resource: 1}), "Nodes": None, "NodeNames": ["a"]})
    raw = raw.replace(f'"{resource}":1'.encode(), f'"{resource}":{digits}'.encode())
    r = env.call("filter", content=raw)
    assert r.status == 400
    assert f"resources.limits.{resource}: {digits}: out of range" in r.text


@pytest.mark.parametrize(
    ("resources", "says"),
    [
        pytest.param({"gputopo.io/gpu-clique4": "1k"}, "gputopo.io/gpu-clique4: 1000: a pod asks for one", id="1k"),
        pytest.param({"gputopo.io/gpu-clique4": str(10**9)}, f"gputopo.io/gpu-clique4: {10**9}:", id="10^9"),
        pytest.param({"gputopo.io/gpu-clique16": 2**62}, "gputopo.io/gpu-clique16: 4611686018427387904", id="2^62"),
        pytest.param({"gputopo.io/gpu-clique3": "1"}, "'gputopo.io/gpu-clique3': no such block resource", id="3"),
        pytest.param({"gputopo.io/gpu-clique04": "1"}, "'gputopo.io/gpu-clique04': no such block", id="04"),
        pytest.param({"gputopo.io/gpu-clique" + "4" * 10_000: "1"}, "no such block resource", id="10,000 digits"),
        pytest.param({"gputopo.io/gpu-clique18446744073709551616": "1"}, "no such block", id="2^64"),
        pytest.param({"gputopo.io/gpu-clique": "1"}, "'gputopo.io/gpu-clique': no such block", id="no size"),
        pytest.param({"gputopo.io/gpu-clique٤": "1"}, "no such block resource", id="Arabic-Indic size"),
    ],
)
def test_what_no_block_serves_fails_every_node_with_one_reason_naming_it(
    env: Env, resources: dict[str, Any], says: str
) -> None:
    env.add_nodes(node_obj("a", "dgx-h100"), node_obj("b", "dgx-1v"))
    out = env.filter(block_pod(resources), NODES)
    assert out["NodeNames"] == []
    reasons = set(out["FailedNodes"].values()) | set(out["FailedAndUnresolvableNodes"].values())
    assert len(reasons) == 1
    [reason] = reasons
    assert says in reason
    assert len(reason) < 300  # a 10,000-character name is quoted short


@pytest.mark.parametrize(
    "pod",
    [
        pytest.param(block_pod({"gputopo.io/gpu-clique4": "0"}), id="limit 0"),
        pytest.param(block_pod({"gputopo.io/gpu-clique4": 0}, "requests"), id="request 0 as a number"),
        pytest.param(block_pod({"gputopo.io/gpu-clique4": "0", "gputopo.io/gpu-clique2": "0"}), id="two zeros"),
    ],
)
def test_a_count_of_zero_asks_for_nothing(pod: JSON) -> None:
    info = pod_info(pod)
    assert (info.gpus, info.block, info.block_problem) == (0, 0, "")


def test_an_init_container_block_counts_as_kubernetes_counts_it() -> None:
    info = pod_info(block_pod({"gputopo.io/gpu-clique8": "1"}, init=True))
    assert (info.gpus, info.block) == (8, 8)


def test_thousands_of_names_under_the_prefix_stop_at_the_bound() -> None:
    resources = {f"gputopo.io/gpu-clique{i}x": "1" for i in range(5_000)}
    spec = {"containers": [{"name": "c", "resources": {"limits": resources}}]}
    ask = read_block_ask(spec)
    assert ask.size == 0
    assert "no such block resource" in ask.problem
    assert MAX_RESOURCE_NAMES < 5_000


# --------------------------------------------------------------------------------------------------
# a block pod's GPUs are the allocator's first fit, never re-chosen


@pytest.mark.parametrize(
    ("system", "size", "in_use"),
    [
        pytest.param("dgx-h100", 2, (), id="NVSwitch-pairs"),
        pytest.param("dgx-h100", 4, (0,), id="NVSwitch-quads-one-busy"),
        pytest.param("dgx-1v", 2, (0, 2), id="DGX-1V-pairs-two-busy"),
        pytest.param("dgx-1v", 4, (), id="DGX-1V-quads"),
    ],
)
def test_a_block_pods_gpus_are_never_swapped_for_another_set(system: str, size: int, in_use: tuple[int, ...]) -> None:
    """A group plan re-picks members' GPU sets (common rails) and a bind re-checks a reservation's set
    through `outcome_on`: for a block pod any set but the allocator's first-fit block is one it will
    never get, so the plan's or the placement's GPUs would not be the claim's."""
    state = node_state("n", build_system(system, "n"), in_use=frozenset(in_use))
    req = parse_pod_request({}, size, block=size)
    outcome = evaluate_node(state, req)
    assert outcome.fits and outcome.search is not None
    first = mask_of(list(outcome.gpus))
    assert outcome_on(state, req, outcome, first) is not None
    free = [g for g in range(len(state.memory_mib)) if g not in in_use]
    others = [mask_of(list(s)) for s in combinations(free, size) if mask_of(list(s)) != first]
    swapped = [bits(m) for m in others if outcome_on(state, req, outcome, m) is not None]
    assert swapped == []


@pytest.mark.parametrize(
    ("in_use_a", "in_use_b"),
    [
        pytest.param((0, 1), (), id="first-fits-on-different-rails"),
        pytest.param((0, 1, 2, 3), (4, 5), id="first-fits-on-different-quads"),
    ],
)
def test_a_group_of_block_pods_is_planned_on_the_blocks_the_allocator_gives(
    in_use_a: tuple[int, ...], in_use_b: tuple[int, ...]
) -> None:
    """Two members of 2 on two DGX H100 nodes whose first free pairs sit on different rails: aligning the
    members' rails must not plan (and reserve) a pair the allocator will not hand out."""
    labels = {"gputopo.io/network-spine": "s", "gputopo.io/network-leaf": "l"}
    nodes = [
        node_state(name, build_system("dgx-h100", name), in_use=frozenset(busy), labels=labels)
        for name, busy in (("a", in_use_a), ("b", in_use_b))
    ]
    ann = {"gputopo.io/group": "pp", "gputopo.io/group-size": "2"}
    members = [Member(f"pp-{i}", parse_pod_request({**ann, "gputopo.io/stage": str(i)}, 2, block=2)) for i in range(2)]
    plan = plan_group("pp", members, nodes)
    assert isinstance(plan, GroupPlan), plan
    for a in plan.assignments:
        assert a.outcome.gpus == evaluate_node(a.node, members[0].request).gpus, a.node.name
