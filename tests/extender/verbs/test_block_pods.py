"""A pod asking one clique block through its extended resource (`gputopo.io/gpu-clique<N>: 1`, KEP-5004):
a gputopo pod under gputopo-scheduler without any annotation, placed on nodes whose first free block in
the agent's order is one it may have; what it asks that no block serves fails every node, naming the
resource (gputopo/model/blockrequest.py)."""

from __future__ import annotations

from typing import Any

import pytest

from gputopo.extender.watch.parsers import resolve_pod
from gputopo.extender.wire import pod_info
from gputopo.model import PLACEMENT_ANNOTATION, parse_placement
from tests.extender.harness import JSON, Env, node_obj, pod_obj


def block_pod(name: str, resources: dict[str, Any], **ann: str) -> JSON:
    pod = pod_obj(name, 0, {f"gputopo.io/{k}": v for k, v in ann.items()})
    pod["spec"]["containers"][0]["resources"] = {"limits": resources}
    return pod


@pytest.fixture
def three(env: Env) -> Env:
    """Three DGX-1V nodes (quads 0-3 and 4-7): `whole` all free, `half` with GPU 1 busy (quad 4-7 free),
    `broken` with GPUs 1 and 5 busy (free cliques of 2 and 3 left, no free quad)."""
    env.add_nodes(
        node_obj("whole", "dgx-1v"), node_obj("half", "dgx-1v", in_use=[1]), node_obj("broken", "dgx-1v", in_use=[1, 5])
    )
    return env


NODES = ["whole", "half", "broken"]


def test_a_block_pod_passes_nodes_with_a_free_block_and_ranks_the_half_used_first(three: Env) -> None:
    pod = block_pod("tp4", {"gputopo.io/gpu-clique4": "1"})
    out = three.filter(pod, NODES)
    assert out["NodeNames"] == ["whole", "half"]
    assert three.reasons(pod, ["broken"]) == {"no free 4-GPU NVLink clique"}
    scores = three.prioritize(pod, NODES)
    assert scores["half"] > scores["whole"]  # best fit: the whole node stays whole


def test_the_bind_names_the_block_and_says_why(three: Env) -> None:
    pod = block_pod("tp4", {"gputopo.io/gpu-clique4": "1"})
    three.add_pods(pod)
    three.filter(pod, NODES)
    assert three.bind(pod, "half") == ""
    stored = three.source.get("pods", "default", "tp4")
    assert stored is not None
    placement = parse_placement(stored["metadata"]["annotations"][PLACEMENT_ANNOTATION])
    assert placement.gpus == (4, 5, 6, 7)
    assert "are block-4-5-6-7, the first free 4-GPU block" in placement.reason


@pytest.mark.parametrize(
    ("resources", "ann", "says"),
    [
        pytest.param({"gputopo.io/gpu-clique4": "2"}, {}, "gpu-clique4: 2: a pod asks for one block", id="k=2"),
        pytest.param({"gputopo.io/gpu-clique4": "1k"}, {}, "gputopo.io/gpu-clique4: 1000", id="1k"),
        pytest.param(
            {"gputopo.io/gpu-clique4": "1", "gputopo.io/gpu-clique2": "1"},
            {},
            "gputopo.io/gpu-clique2 and gputopo.io/gpu-clique4",
            id="two sizes",
        ),
        pytest.param({"gputopo.io/gpu-clique3": "1"}, {}, "no such block resource; blocks are 2, 4", id="size 3"),
        pytest.param({"gputopo.io/gpu-clique04": "1"}, {}, "'gputopo.io/gpu-clique04': no such block", id="size 04"),
        pytest.param(
            {"gputopo.io/gpu-clique4": "1", "nvidia.com/gpu": "2"}, {}, "beside 2 other GPUs", id="block and a count"
        ),
        pytest.param({"gputopo.io/gpu-clique4": "1"}, {"nvlink": "ignore"}, "is one NVLink clique", id="nvlink ignore"),
    ],
)
def test_what_no_block_serves_fails_every_node_naming_the_resource(
    three: Env, resources: dict[str, Any], ann: dict[str, str], says: str
) -> None:
    reasons = three.reasons(block_pod("bad", resources, **ann), NODES)
    assert len(reasons) == 1
    assert says in next(iter(reasons))


def test_a_zero_count_asks_for_nothing(three: Env) -> None:
    assert three.filter(block_pod("none", {"gputopo.io/gpu-clique4": "0"}), NODES)["NodeNames"] == NODES


@pytest.mark.parametrize(("scheduler", "ours"), [("gputopo-scheduler", True), ("default-scheduler", False)])
def test_the_watch_tracks_a_block_pod_only_under_our_scheduler(scheduler: str, ours: bool) -> None:
    pod = block_pod("tp4", {"gputopo.io/gpu-clique4": "1"})
    pod["spec"]["schedulerName"] = scheduler
    resolved = resolve_pod(pod_info(pod), ("spine", "leaf"))
    assert resolved.opted_in is ours
    assert (resolved.request is not None and resolved.request.block and resolved.request.gpus == 4) is ours
