"""What a pod asks through the block resources `gputopo.io/gpu-clique<N>` (gputopo.model.blockrequest), as
the one Pod reader reads it: one whole block of N GPUs, nothing, or a sentence naming the resource."""

from __future__ import annotations

from typing import Any

import pytest

from gputopo.model.blockrequest import BlockAsk, read_block_ask
from gputopo.model.pod import read_pod


def spec(*containers: dict[str, Any], init: tuple[dict[str, Any], ...] = ()) -> dict[str, Any]:
    out: dict[str, Any] = {"containers": [{"name": f"c{i}", "resources": r} for i, r in enumerate(containers)]}
    if init:
        out["initContainers"] = [{"name": f"i{i}", **r} for i, r in enumerate(init)]
    return out


LIMIT4 = {"limits": {"gputopo.io/gpu-clique4": "1"}}


@pytest.mark.parametrize(
    ("pod_spec", "other", "size", "problem"),
    [
        pytest.param(spec(LIMIT4), 0, 4, "", id="one 4-block by limit"),
        pytest.param(spec({"requests": {"gputopo.io/gpu-clique8": 1}}), 0, 8, "", id="by request, a JSON number"),
        pytest.param(spec({}, LIMIT4), 0, 4, "", id="in the second container"),
        pytest.param(spec({"limits": {"cpu": "1"}}), 0, 0, "", id="no block resource"),
        pytest.param(spec({"limits": {"gputopo.io/gpu-clique16": "0"}}), 0, 0, "", id="a count of 0"),
        pytest.param(spec(LIMIT4, LIMIT4), 0, 0, "gputopo.io/gpu-clique4: 2: a pod asks for one block", id="two"),
        pytest.param(
            spec({"limits": {"gputopo.io/gpu-clique4": "1", "gputopo.io/gpu-clique2": "1"}}),
            0,
            0,
            "gputopo.io/gpu-clique2 and gputopo.io/gpu-clique4: a pod asks for one block",
            id="two sizes",
        ),
        pytest.param(spec(LIMIT4), 2, 0, "gputopo.io/gpu-clique4 beside 2 other GPUs", id="beside a count"),
        pytest.param(
            spec({"limits": {"gputopo.io/gpu-clique32": "1"}}),
            0,
            0,
            "'gputopo.io/gpu-clique32': no such block resource; blocks are 2, 4, 8, 16 GPUs",
            id="32 is no block size",
        ),
        pytest.param(
            spec({}, init=({"restartPolicy": "Always", "resources": LIMIT4},)), 0, 4, "", id="a sidecar's block"
        ),
    ],
)
def test_a_pods_block_resources_read_as_one_block_or_a_reason(
    pod_spec: dict[str, Any], other: int, size: int, problem: str
) -> None:
    ask = read_block_ask(pod_spec, other_gpus=other)
    assert ask.size == size
    assert problem in ask.problem if problem else ask == BlockAsk(size)


def test_the_pod_reader_counts_a_block_as_its_gpus() -> None:
    info = read_pod({"metadata": {"name": "p"}, "spec": spec(LIMIT4)})
    assert (info.gpus, info.block, info.block_problem, info.request.total) == (4, 4, "", 0)
