"""Block device names: canonical, DNS labels, read back to exactly their GPUs; anything else is not ours."""

from __future__ import annotations

import re

import pytest

from gputopo.model.dra import (
    BLOCK_SIZES,
    block_class,
    block_gpus,
    block_name,
    block_resource,
    counter_name,
    device_gpus,
)

DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


@pytest.mark.parametrize(
    ("gpus", "name"),
    [
        ((0, 1, 2, 3), "block-0-1-2-3"),
        ((4, 0), "block-0-4"),
        (tuple(range(16)), "block-0-1-2-3-4-5-6-7-8-9-10-11-12-13-14-15"),
        (tuple(range(32)), "block-xffffffff"),
        ((5, 4095), "block-5-4095"),
    ],
)
def test_block_names_are_canonical_dns_labels_that_read_back(gpus: tuple[int, ...], name: str) -> None:
    assert block_name(gpus) == name
    assert DNS_LABEL.fullmatch(name)
    assert block_gpus(name) == tuple(sorted(gpus))
    assert device_gpus(name) == tuple(sorted(gpus))


@pytest.mark.parametrize(
    "name",
    [
        "block-1-0",  # not ascending
        "block-0-0",  # repeated
        "block-0",  # one GPU is a gpu-<i> device, not a block
        "block-00-1",  # leading zero: a second name for {0, 1}
        "block-x3",  # hex for a set whose list form fits: a second name for {0, 1}
        "block-xF",  # upper case
        "block-x0f",  # leading zero in hex
        "block-0-4096",  # past the largest index
        "block-",
        "block",
        "block-٣-4",  # non-ASCII digit
        "block-0-1-",
        "blocks-0-1",
        "block-x" + "f" * 2000,
        "gpu-0-1",
    ],
)
def test_other_names_are_not_blocks(name: str) -> None:
    assert block_gpus(name) is None


@pytest.mark.parametrize("gpus", [(), (3,), (0, 4096), (-1, 2)])
def test_block_name_refuses_what_is_not_a_block(gpus: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="block covers"):
        block_name(gpus)


def test_single_devices_their_counters_and_classes() -> None:
    assert device_gpus("gpu-7") == (7,)
    assert device_gpus("nic-0") is None
    assert counter_name(7) == "gpu-7"
    assert [block_class(s) for s in BLOCK_SIZES] == [
        "clique2.gpu.gputopo.io",
        "clique4.gpu.gputopo.io",
        "clique8.gpu.gputopo.io",
        "clique16.gpu.gputopo.io",
    ]
    assert block_resource(4) == "gputopo.io/gpu-clique4"
