"""The replay's pieces that need no cluster: the Nodes a mix becomes, pod requests, and reading a pod's state."""

from __future__ import annotations

from typing import Any

import pytest

from gputopo.engine.state.reasons import Reason
from gputopo.engine.state.snapshot import node_state
from gputopo.localcluster.podwatch import pod_state
from gputopo.localcluster.replay import MIX_LABEL, pod_requests, sim_node
from gputopo.model import GPUS_IN_USE_ANNOTATION, TOPOLOGY_ANNOTATION, parse_gpus_in_use_report, parse_topology
from gputopo.systems import build_system


def _pod(node: str | None = None, **cond: str) -> dict[str, Any]:
    pod: dict[str, Any] = {"metadata": {"name": "p"}, "spec": {"nodeName": node} if node else {}}
    if cond:
        pod["status"] = {"conditions": [{"type": "PodScheduled", **cond}]}
    return pod


@pytest.mark.parametrize(
    ("pod", "state"),
    [
        (None, "pending"),
        (_pod(), "pending"),
        (_pod("n1"), "bound"),
        (
            _pod(status="False", reason="Unschedulable", message="0/3 nodes are available: 3 fewer than 8 GPUs."),
            "refused",
        ),
        # a group member told its group is incomplete is still waiting for the others, not refused
        (
            _pod(
                status="False",
                reason="Unschedulable",
                message="0/3 nodes are available: 3 group g: 1/2 pods exist, waiting.",
            ),
            "pending",
        ),
        (_pod(status="False", reason="SchedulerError", message="extender timeout"), "pending"),
        (_pod("n1", status="True"), "bound"),
    ],
)
def test_pod_state_tells_bound_refused_and_pending_apart(pod: dict[str, Any] | None, state: str) -> None:
    assert pod_state(pod) == state


def test_a_replayed_node_carries_the_agents_annotations_and_room_in_proportion_to_its_gpus() -> None:
    topo = build_system("dgx-1v", "v")
    n = sim_node(node_state("v", topo, labels={"gputopo.io/network-leaf": "l1"}, in_use=frozenset({1})), "mix-1")
    m = n.manifest()
    ann = m["metadata"]["annotations"]
    assert parse_topology(ann[TOPOLOGY_ANNOTATION]) == topo
    assert parse_gpus_in_use_report(ann[GPUS_IN_USE_ANNOTATION]).all == {1}
    assert m["metadata"]["labels"][MIX_LABEL] == "mix-1"
    assert m["metadata"]["labels"]["gputopo.io/network-leaf"] == "l1"
    assert m["status"]["allocatable"]["nvidia.com/gpu"] == "8"
    assert (m["status"]["allocatable"]["cpu"], m["status"]["allocatable"]["memory"]) == ("128", "1024Gi")


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
def test_a_pods_cpu_and_memory_fit_wherever_its_gpus_do(gpus: int) -> None:
    cpu, memory = pod_requests(gpus)
    # every GPU of an 8-GPU node taken by such pods still leaves CPU and memory over
    assert int(cpu) * (8 // gpus) <= 128 and int(memory.removesuffix("Gi")) * (8 // gpus) <= 1024


def test_a_node_without_topology_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="node gone"):
        sim_node(node_state("gone", None, problem=Reason.TOPOLOGY_MISSING), "m")
