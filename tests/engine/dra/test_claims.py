"""The ResourceClaimTemplate a pod's request becomes under DRA: the constraint per NVLink policy and clique
encoding, the HBM selector, the template's name, and the resource/v1 limits every spec stays within."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from gputopo.engine.dra import devices as dra
from gputopo.engine.dra.claims import (
    MAX_DEVICES_PER_CLAIM,
    MAX_NAME_LENGTH,
    MAX_SUBREQUESTS,
    MEMORY_CLASSES_MIB,
    ClaimError,
    check_spec,
    claim_template,
    memory_selector,
    template_named,
)
from gputopo.model.request import NvlinkPolicy, PodRequest
from tests.paths import REPO


def _req(gpus: int, nvlink: str = "required", mib: int | None = None) -> PodRequest:
    return PodRequest(gpus=gpus, nvlink=NvlinkPolicy(nvlink), min_gpu_memory_mib=mib)


def _exact(n: int, name: str = "", selectors: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"name": name} if name else {}
    out |= {"deviceClassName": "gpu.gputopo.io", "allocationMode": "ExactCount", "count": n}
    if selectors:
        out["selectors"] = selectors
    return out


PARTITION_CONSTRAINTS = [
    {"requests": [f"gpus/p{p}"], "matchAttribute": f"gpu.gputopo.io/nvlinkPartition{p}"} for p in range(4)
]
HBM_80GI = [{"cel": {"expression": 'device.capacity["gpu.gputopo.io"].memory.compareTo(quantity("80Gi")) >= 0'}}]

CASES = [
    pytest.param(
        _req(4),
        True,
        {
            "requests": [{"name": "gpus", "exactly": _exact(4)}],
            "constraints": [{"requests": ["gpus"], "matchAttribute": "gpu.gputopo.io/nvlinkCliques"}],
        },
        id="required, list attributes: one matchAttribute on the clique list",
    ),
    pytest.param(
        _req(4),
        False,
        {
            "requests": [{"name": "gpus", "firstAvailable": [_exact(4, f"p{p}") for p in range(4)]}],
            "constraints": PARTITION_CONSTRAINTS,
        },
        id="required, scalar partitions: one constrained subrequest per partition",
    ),
    pytest.param(
        _req(2, "preferred"),
        False,
        {
            "requests": [
                {"name": "gpus", "firstAvailable": [*(_exact(2, f"p{p}") for p in range(4)), _exact(2, "any")]}
            ],
            "constraints": PARTITION_CONSTRAINTS,
        },
        id="preferred, partitions: the partitions, then any two GPUs",
    ),
    pytest.param(
        _req(2, "preferred"),
        True,
        {
            "requests": [{"name": "gpus", "firstAvailable": [_exact(2, "clique"), _exact(2, "any")]}],
            "constraints": [{"requests": ["gpus/clique"], "matchAttribute": "gpu.gputopo.io/nvlinkCliques"}],
        },
        id="preferred, list attributes: a clique, then any two GPUs",
    ),
    pytest.param(
        _req(8, "ignore"),
        True,
        {"requests": [{"name": "gpus", "exactly": _exact(8)}]},
        id="ignore: a plain count",
    ),
    pytest.param(
        _req(1, "required", 81920),
        False,
        {"requests": [{"name": "gpus", "exactly": _exact(1, selectors=HBM_80GI)}]},
        id="one GPU needs no constraint; min HBM is a CEL selector",
    ),
    pytest.param(
        _req(2, "required", 81920),
        True,
        {
            "requests": [{"name": "gpus", "exactly": _exact(2, selectors=HBM_80GI)}],
            "constraints": [{"requests": ["gpus"], "matchAttribute": "gpu.gputopo.io/nvlinkCliques"}],
        },
        id="the HBM selector sits beside the constraint",
    ),
]


@pytest.mark.parametrize(("request_", "list_attributes", "devices"), CASES)
def test_claim_spec_per_policy_and_encoding(
    request_: PodRequest, list_attributes: bool, devices: dict[str, Any]
) -> None:
    tpl = claim_template(request_, list_attributes=list_attributes)
    assert tpl.devices == devices
    body = tpl.body("ml")
    assert body["apiVersion"] == "resource.k8s.io/v1"
    assert body["kind"] == "ResourceClaimTemplate"
    assert body["metadata"]["namespace"] == "ml"
    assert body["spec"] == {"spec": {"devices": devices}}


@pytest.mark.parametrize(
    ("request_", "list_attributes", "prefix"),
    [
        (_req(4, "required", 81920), False, "gputopo-gpus-4-nvlink-80gi-"),
        (_req(2, "preferred"), True, "gputopo-gpus-2-nvlink-preferred-"),
        (_req(8, "ignore", 40000), False, "gputopo-gpus-8-46068mi-"),  # rounded up to the L40S's class
        (_req(1, "preferred"), False, "gputopo-gpus-1-"),
    ],
)
def test_template_name_says_the_shape(request_: PodRequest, list_attributes: bool, prefix: str) -> None:
    name = claim_template(request_, list_attributes=list_attributes).name
    assert name.startswith(prefix)
    assert re.fullmatch(re.escape(prefix) + "[0-9a-f]{8}", name)


def test_same_shape_same_template_other_encoding_other_name() -> None:
    a = claim_template(_req(4), list_attributes=False)
    assert claim_template(_req(4), list_attributes=False) == a
    assert claim_template(_req(4), list_attributes=True).name != a.name


def test_one_gpu_shares_one_template_whatever_the_policy() -> None:
    names = {claim_template(_req(1, p), list_attributes=False).name for p in ("required", "preferred", "ignore")}
    assert len(names) == 1


@pytest.mark.parametrize(
    ("gpus", "words"),
    [(0, "at least 1 GPU"), (MAX_DEVICES_PER_CLAIM + 1, f"at most {MAX_DEVICES_PER_CLAIM} devices")],
)
def test_counts_no_claim_can_hold_are_refused_naming_the_resource(gpus: int, words: str) -> None:
    with pytest.raises(ClaimError, match=words) as e:
        claim_template(_req(gpus), list_attributes=False)
    assert "nvidia.com/gpu" in str(e.value)


@pytest.mark.parametrize(
    ("devices", "words"),
    [
        (
            {"requests": [{"name": "gpus", "exactly": _exact(2)}], "constraints": [{"requests": ["gpus/p0"]}]},
            "no request or subrequest",
        ),
        (
            {
                "requests": [{"name": "gpus", "exactly": _exact(2)}],
                "constraints": [{"requests": ["gpus"], "matchAttribute": "gpu.nvidia.com/cliqueId"}],
            },
            "not an attribute of gpu.gputopo.io",
        ),
        ({"requests": [{"name": "gpus", "firstAvailable": [_exact(1, f"s{i}") for i in range(9)]}]}, "subrequests"),
        ({"requests": [{"name": "Gpus", "exactly": _exact(1)}]}, "not a DNS label"),
    ],
)
def test_check_spec_refuses_what_the_api_would(devices: dict[str, Any], words: str) -> None:
    with pytest.raises(ClaimError, match=words):
        check_spec(devices)


def test_memory_selector_names_our_capacity() -> None:
    assert memory_selector(40000) == 'device.capacity["gpu.gputopo.io"].memory.compareTo(quantity("40000Mi")) >= 0'


OUR_ATTRIBUTES = {dra.qualified(dra.ATTR_CLIQUES)} | {
    dra.qualified(dra.partition_attribute(p)) for p in range(dra.PARTITIONS)
}


@given(
    gpus=st.integers(1, MAX_DEVICES_PER_CLAIM),
    nvlink=st.sampled_from(list(NvlinkPolicy)),
    mib=st.none() | st.integers(0, MEMORY_CLASSES_MIB[-1]),
    list_attributes=st.booleans(),
)
def test_every_valid_request_gives_a_spec_within_api_limits(
    gpus: int, nvlink: NvlinkPolicy, mib: int | None, list_attributes: bool
) -> None:
    tpl = claim_template(PodRequest(gpus=gpus, nvlink=nvlink, min_gpu_memory_mib=mib), list_attributes=list_attributes)
    check_spec(tpl.devices)  # raises on any limit broken
    assert len(tpl.name) <= MAX_NAME_LENGTH
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", tpl.name)
    (request,) = tpl.devices["requests"]
    subs = request.get("firstAvailable", [request.get("exactly")])
    assert 1 <= len(subs) <= MAX_SUBREQUESTS
    assert all(s["count"] == gpus and s["deviceClassName"] == dra.DEVICE_CLASS for s in subs)
    attrs = {c["matchAttribute"] for c in tpl.devices.get("constraints", [])}
    assert attrs <= OUR_ATTRIBUTES
    constrained = gpus >= 2 and nvlink is not NvlinkPolicy.IGNORE
    assert bool(attrs) == constrained
    if constrained:
        assert (dra.qualified(dra.ATTR_CLIQUES) in attrs) == list_attributes
    # `preferred` always leaves an unconstrained way out; `required` never does.
    names = {c["requests"][0] for c in tpl.devices.get("constraints", [])}
    free = [s for s in subs if f"gpus/{s.get('name')}" not in names and "gpus" not in names]
    assert bool(free) == (not constrained or nvlink is NvlinkPolicy.PREFERRED)


def test_the_claims_docs_show_what_the_builder_makes() -> None:
    """docs/annotations.md, "Claims under DRA": the hand-written templates are the webhook's own."""
    text = (REPO / "docs" / "annotations.md").read_text()
    section = text[text.index("## Claims under DRA") : text.index("## The placement annotation")]
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", section, re.S)]
    tp4 = PodRequest(gpus=4, min_gpu_memory_mib=80 * 1024)
    for doc, lists in zip(blocks[:2], (True, False), strict=True):
        assert doc["spec"]["spec"]["devices"] == claim_template(tp4, list_attributes=lists).devices


def test_a_min_gpu_memory_above_every_class_is_refused_naming_the_value_and_the_largest() -> None:
    with pytest.raises(ClaimError, match=r"gputopo.io/min-gpu-memory: 2048Gi .*287775Mi"):
        claim_template(_req(4, "required", 2 * 1024 * 1024), list_attributes=False)


@given(
    gpus=st.integers(1, MAX_DEVICES_PER_CLAIM),
    nvlink=st.sampled_from(list(NvlinkPolicy)),
    mib=st.none() | st.integers(0, MEMORY_CLASSES_MIB[-1]),
    list_attributes=st.booleans(),
)
def test_a_template_is_found_again_by_its_name_in_its_encoding_only(
    gpus: int, nvlink: NvlinkPolicy, mib: int | None, list_attributes: bool
) -> None:
    tpl = claim_template(PodRequest(gpus=gpus, nvlink=nvlink, min_gpu_memory_mib=mib), list_attributes=list_attributes)
    assert template_named(tpl.name, list_attributes=list_attributes) == tpl
    constrained = gpus >= 2 and nvlink is not NvlinkPolicy.IGNORE
    if constrained:  # the other encoding builds another spec, so another digest
        assert template_named(tpl.name, list_attributes=not list_attributes) is None


@pytest.mark.parametrize("name", ["gputopo-gpus-4-nvlink-0123abcd", "gputopo-gpus-99-x", "my-template", ""])
def test_a_name_the_builder_never_makes_finds_nothing(name: str) -> None:
    assert template_named(name, list_attributes=False) is None
