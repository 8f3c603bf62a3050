"""The webhook's claims where the agents publish clique blocks (`blocks`, the extender's --dra-blocks): a
clique of a block size asks for one whole block first (class clique<N>.gpu.gputopo.io), then for N single
GPUs of one clique as without blocks; everything else is the claim it was."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gputopo.engine.dra.claims import (
    MAX_DEVICES_PER_CLAIM,
    MAX_SUBREQUESTS,
    ClaimError,
    check_spec,
    claim_template,
    template_named,
)
from gputopo.model.dra import BLOCK_SIZES, block_class
from gputopo.model.request import NvlinkPolicy, PodRequest

BLOCK_4 = {"name": "block", "deviceClassName": "clique4.gpu.gputopo.io", "allocationMode": "ExactCount", "count": 1}


def _req(gpus: int, nvlink: str = "required", mib: int | None = None) -> PodRequest:
    return PodRequest(gpus=gpus, nvlink=NvlinkPolicy(nvlink), min_gpu_memory_mib=mib)


def _single(n: int, name: str) -> dict[str, Any]:
    return {"name": name, "deviceClassName": "gpu.gputopo.io", "allocationMode": "ExactCount", "count": n}


@pytest.mark.parametrize(
    ("request_", "list_attributes", "subrequests", "constraints"),
    [
        pytest.param(
            _req(4),
            True,
            [BLOCK_4, _single(4, "clique")],
            [{"requests": ["gpus/clique"], "matchAttribute": "gpu.gputopo.io/nvlinkCliques"}],
            id="required, list attributes: a whole block, else 4 singles sharing a clique",
        ),
        pytest.param(
            _req(4),
            False,
            [BLOCK_4, *(_single(4, f"p{p}") for p in range(4))],
            [{"requests": [f"gpus/p{p}"], "matchAttribute": f"gpu.gputopo.io/nvlinkPartition{p}"} for p in range(4)],
            id="required, scalar partitions: a whole block, else 4 singles of one partition",
        ),
        pytest.param(
            _req(4, "preferred"),
            True,
            [BLOCK_4, _single(4, "clique"), _single(4, "any")],
            [{"requests": ["gpus/clique"], "matchAttribute": "gpu.gputopo.io/nvlinkCliques"}],
            id="preferred: a whole block, else a clique, else any 4",
        ),
    ],
)
def test_a_clique_of_a_block_size_asks_for_a_whole_block_first(
    request_: PodRequest, list_attributes: bool, subrequests: list[dict[str, Any]], constraints: list[dict[str, Any]]
) -> None:
    devices = claim_template(request_, list_attributes=list_attributes, blocks=True).devices
    assert devices == {"requests": [{"name": "gpus", "firstAvailable": subrequests}], "constraints": constraints}


@pytest.mark.parametrize(
    "request_",
    [
        pytest.param(_req(3), id="3 is no block size"),
        pytest.param(_req(4, "ignore"), id="nvlink ignore: no clique asked"),
        pytest.param(_req(1), id="one GPU"),
        pytest.param(_req(32), id="32: over the largest block"),
    ],
)
def test_what_no_block_serves_gets_the_claim_it_had(request_: PodRequest) -> None:
    for lists in (True, False):
        assert (
            claim_template(request_, list_attributes=lists, blocks=True).devices
            == claim_template(request_, list_attributes=lists).devices
        )


def test_a_minimum_hbm_is_the_blocks_sum_on_the_block() -> None:
    devices = claim_template(_req(4, mib=80 * 1024), list_attributes=True, blocks=True).devices
    block = devices["requests"][0]["firstAvailable"][0]
    assert block["selectors"][0]["cel"]["expression"].endswith('compareTo(quantity("320Gi")) >= 0')


def test_blocks_make_another_template_found_again_only_with_blocks() -> None:
    with_blocks = claim_template(_req(8), list_attributes=False, blocks=True)
    without = claim_template(_req(8), list_attributes=False)
    assert with_blocks.name != without.name
    assert template_named(with_blocks.name, list_attributes=False, blocks=True) == with_blocks
    assert template_named(with_blocks.name, list_attributes=False) is None


def test_check_spec_refuses_a_class_that_is_not_ours() -> None:
    devices = claim_template(_req(4), list_attributes=True, blocks=True).devices
    devices["requests"][0]["firstAvailable"][0]["deviceClassName"] = "clique4.gpu.nvidia.com"
    with pytest.raises(ClaimError, match=r"clique4\.gpu\.nvidia\.com"):
        check_spec(devices)


@given(
    gpus=st.integers(1, MAX_DEVICES_PER_CLAIM),
    nvlink=st.sampled_from(list(NvlinkPolicy)),
    list_attributes=st.booleans(),
    mib=st.none() | st.integers(1, 200_000),
)
def test_every_block_claim_stays_within_the_api_limits(
    gpus: int, nvlink: NvlinkPolicy, list_attributes: bool, mib: int | None
) -> None:
    devices = claim_template(
        PodRequest(gpus=gpus, nvlink=nvlink, min_gpu_memory_mib=mib), list_attributes=list_attributes, blocks=True
    ).devices
    check_spec(devices)
    subs = devices["requests"][0].get("firstAvailable", [])
    assert len(subs) <= MAX_SUBREQUESTS
    classes = {s["deviceClassName"] for s in subs}
    block = gpus in BLOCK_SIZES and gpus >= 2 and nvlink is not NvlinkPolicy.IGNORE
    assert (block_class(gpus) in classes) is block
