"""What a hand-written claim asks of gputopo's devices (gputopo.model.claimask): one whole block, N GPUs of
one clique, nothing (other drivers' requests), or a problem naming the template and the field."""

from __future__ import annotations

from typing import Any

import pytest

from gputopo.engine.dra.claims import claim_template
from gputopo.model.claimask import NO_ASK, ClaimAsk, pod_ask, read_claim_ask
from gputopo.model.claimtemplate import CHANNEL_DEVICE_CLASS
from gputopo.model.dra import DEVICE_CLASS, block_class
from gputopo.model.request import NvlinkPolicy, PodRequest

WHAT = "ResourceClaimTemplate team/mine"
CLIQUES = "gpu.gputopo.io/nvlinkCliques"


def exactly(device_class: Any, name: str = "gpus", **fields: Any) -> dict[str, Any]:
    return {"name": name, "exactly": {"deviceClassName": device_class, **fields}}


def first(name: str = "gpus", *alternatives: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "firstAvailable": list(alternatives)}


def alt(name: str, device_class: str, count: int = 1) -> dict[str, Any]:
    return {"name": name, "deviceClassName": device_class, "allocationMode": "ExactCount", "count": count}


def claim(*requests: dict[str, Any], constraints: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"requests": list(requests)}
    if constraints is not None:
        out["constraints"] = constraints
    return out


def webhooks(nvlink: NvlinkPolicy = NvlinkPolicy.REQUIRED, *, lists: bool = False, blocks: bool = False) -> Any:
    """The claim gputopo's webhook writes for 4 GPUs (copied by hand under another name)."""
    return claim_template(PodRequest(gpus=4, nvlink=nvlink), list_attributes=lists, blocks=blocks).devices


QUAD = exactly(block_class(4), allocationMode="ExactCount", count=1)
IMEX = exactly(CHANNEL_DEVICE_CLASS, name="imex")
BY_CLIQUE = [{"requests": ["gpus"], "matchAttribute": CLIQUES}]


@pytest.mark.parametrize(
    ("devices", "expected"),
    [
        pytest.param(claim(QUAD), ClaimAsk(4, True), id="one block of 4 by class is a whole block"),
        pytest.param(claim(exactly(block_class(8))), ClaimAsk(8, True), id="the API's defaults: count 1, ExactCount"),
        pytest.param(webhooks(blocks=True), ClaimAsk(4, True), id="gputopo's prioritized list is its block"),
        pytest.param(webhooks(blocks=True, lists=True), ClaimAsk(4, True), id="the list-attribute list too"),
        pytest.param(claim(IMEX, QUAD), ClaimAsk(4, True), id="beside an IMEX channel the block is read alone"),
        pytest.param(
            claim(first("gpus", alt("b", block_class(2)), alt("any", DEVICE_CLASS, 2))),
            ClaimAsk(2, True),
            id="a block first whatever follows: the allocator takes it where gputopo places",
        ),
        pytest.param(
            claim(exactly(DEVICE_CLASS, count=4), constraints=BY_CLIQUE), ClaimAsk(4), id="4 singles of one clique"
        ),
        pytest.param(
            claim(exactly(DEVICE_CLASS, count=4), constraints=[{"matchAttribute": CLIQUES}]),
            ClaimAsk(4),
            id="a constraint naming no request binds them all",
        ),
        pytest.param(webhooks(), ClaimAsk(4), id="gputopo's partitions list is 4 GPUs of one clique"),
        pytest.param(webhooks(lists=True), ClaimAsk(4), id="gputopo's list-attribute claim likewise"),
        pytest.param(claim(exactly(DEVICE_CLASS, count=1)), ClaimAsk(1), id="one GPU needs no constraint"),
        pytest.param(claim(IMEX), NO_ASK, id="another driver's request asks nothing of gputopo"),
        pytest.param(claim(), NO_ASK, id="no requests"),
        pytest.param(claim(exactly(7)), NO_ASK, id="a class that is no string names no class of ours"),
    ],
)
def test_a_claim_gputopo_places_exactly_is_read_as_its_shape(devices: Any, expected: ClaimAsk) -> None:
    assert read_claim_ask(devices, WHAT) == expected


@pytest.mark.parametrize(
    ("devices", "says"),
    [
        pytest.param(
            claim(exactly(block_class(4), count=2)),
            "requests[0].exactly.count: 2: a pod asks for one block",
            id="two blocks need not be linked",
        ),
        pytest.param(claim(exactly(block_class(4), allocationMode="All")), "allocationMode: 'All'", id="all devices"),
        pytest.param(
            claim(exactly(DEVICE_CLASS, allocationMode="All"), constraints=BY_CLIQUE),
            "gputopo places an exact count",
            id="all singles",
        ),
        pytest.param(
            claim(exactly(block_class(4), selectors=[{"cel": {"expression": "true"}}])),
            "exactly.selectors: gputopo does not evaluate CEL",
            id="a CEL selector on a block",
        ),
        pytest.param(
            claim(exactly(DEVICE_CLASS, count=2, selectors=[{"cel": {"expression": "true"}}]), constraints=BY_CLIQUE),
            "selectors: gputopo does not evaluate CEL",
            id="a CEL selector on singles",
        ),
        pytest.param(
            webhooks(blocks=True) | {"requests": [first("gpus", {**alt("block", block_class(4)), "selectors": [{}]})]},
            "firstAvailable[0].selectors",
            id="gputopo's list with a memory selector",
        ),
        pytest.param(
            claim(QUAD, constraints=[{"requests": ["gpus"], "matchAttribute": CLIQUES}]),
            "a constraint binds the block",
            id="a constraint on a block",
        ),
        pytest.param(claim(exactly(DEVICE_CLASS, count=4)), "need not be one NVLink clique", id="singles unbound"),
        pytest.param(
            webhooks(NvlinkPolicy.PREFERRED), "firstAvailable[4]: no matchAttribute", id="preferred: any 4 at last"
        ),
        pytest.param(
            claim(
                exactly(DEVICE_CLASS, count=2),
                constraints=[{"requests": ["gpus"], "matchAttribute": "gpu.gputopo.io/nvlinkPartition1"}],
            ),
            "nvlinkPartition1 alone, which holds only some cliques",
            id="one partition alone",
        ),
        pytest.param(
            claim(
                exactly(DEVICE_CLASS, count=2),
                constraints=[{"requests": ["gpus"], "matchAttribute": "gpu.gputopo.io/productName"}],
            ),
            "constraints[0]: gputopo reads only a matchAttribute",
            id="another attribute",
        ),
        pytest.param(
            claim(exactly(DEVICE_CLASS, count=2), constraints=[{"distinctAttribute": CLIQUES}]),
            "constraints[0]: gputopo reads only a matchAttribute",
            id="a distinct attribute",
        ),
        pytest.param(
            claim(exactly(DEVICE_CLASS, count=2), constraints=[*BY_CLIQUE, *BY_CLIQUE]),
            "2 constraints bind one request",
            id="two constraints",
        ),
        pytest.param(
            claim(QUAD, exactly(DEVICE_CLASS, name="more", count=2)),
            "requests[0] and spec.devices.requests[1] both ask",
            id="two requests",
        ),
        pytest.param(claim(exactly("clique3.gpu.gputopo.io")), "'clique3.gpu.gputopo.io': no such class", id="size 3"),
        pytest.param(
            claim(first("gpus", alt("n", "gpu.nvidia.com"), alt("b", block_class(4)))),
            "'gpu.nvidia.com' comes first, before gputopo's",
            id="another driver's class first",
        ),
        pytest.param(
            claim(first("gpus", alt("s", DEVICE_CLASS), alt("b", block_class(2)))),
            "firstAvailable[1].deviceClassName: 'clique2.gpu.gputopo.io' after single GPUs",
            id="a block after singles",
        ),
        pytest.param(
            claim(first("gpus", alt("a", DEVICE_CLASS, 2), alt("b", DEVICE_CLASS, 4)), constraints=BY_CLIQUE),
            "its alternatives ask [2, 4] GPUs",
            id="two counts",
        ),
        pytest.param(
            claim(exactly(block_class(4), adminAccess=True)), "exactly.adminAccess is not read", id="admin access"
        ),
        pytest.param(
            claim(first("gpus", *[alt(f"a{i}", block_class(4)) for i in range(9)])),
            "has 9 alternatives; resource.k8s.io/v1 allows 8",
            id="nine alternatives",
        ),
    ],
)
def test_any_other_ask_of_a_gputopo_class_is_a_problem_naming_the_template_and_field(devices: Any, says: str) -> None:
    got = read_claim_ask(devices, WHAT)
    assert (got.gpus, got.block) == (0, False)
    assert got.problem.startswith(f"{WHAT}: ") and says in got.problem, got.problem
    assert len(got.problem) <= 300


@pytest.mark.parametrize(
    ("asks", "expected"),
    [
        pytest.param([("a", NO_ASK), ("b", ClaimAsk(4, True))], ("b", ClaimAsk(4, True)), id="the one that asks"),
        pytest.param([("a", NO_ASK)], ("", NO_ASK), id="none asks"),
        pytest.param(
            [("a", ClaimAsk(4, True)), ("b", ClaimAsk(2))],
            (
                "a",
                ClaimAsk(
                    problem="ResourceClaimTemplates a and b both ask for gputopo's devices; ask for them in one claim"
                ),
            ),
            id="two claims asking are refused naming both",
        ),
    ],
)
def test_a_pods_templates_give_one_ask(asks: list[tuple[str, ClaimAsk]], expected: tuple[str, ClaimAsk]) -> None:
    assert pod_ask(asks) == expected
