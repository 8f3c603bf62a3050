"""The demo's rack part: a small NVL72-style rack beside the H100 nodes, 4 GB200 trays of 4 GPUs, one
multi-node NVLink domain (each tray's agent publishes the rack's fabric clique and every GPU's fabric
health, as on real trays), and a second rack of 4 trays with one tray's fabric degraded. A TP-16 group
of 4 pods x 4 GPUs asks for one domain with `gputopo.io/tp-size: 16`; the demo prints where each pod
went and the sentence that names its TP group, its domain and the predicted TP all-reduce."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from gputopo.model import SCHEDULER_NAME

RACK_SYSTEM = "gb200-nvl72"
RACKS = (("nvl-a", ()), ("nvl-b", (2,)))  # (rack, degraded tray numbers)
TRAYS = 4
GROUP = "tp16"
MEMBERS = 4


def rack_nodes() -> list[tuple[str, str]]:
    """(node, tray system) of the demo's trays: racks of `TRAYS` trays, nvl-b's tray 2 degraded."""
    from gputopo.systems import rack_trays

    return [tray for rack, degraded in RACKS for tray in rack_trays(RACK_SYSTEM, rack, TRAYS, degraded)]


def _pod(namespace: str, i: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{GROUP}-{i}",
            "namespace": namespace,
            "annotations": {
                "gputopo.io/group": GROUP,
                "gputopo.io/group-size": str(MEMBERS),
                "gputopo.io/stage": str(i),
                "gputopo.io/tp-size": "16",
            },
        },
        "spec": {
            "schedulerName": SCHEDULER_NAME,
            "terminationGracePeriodSeconds": 0,
            "containers": [
                {
                    "name": "main",
                    "image": "registry.invalid/trainer:demo",
                    "resources": {"limits": {"nvidia.com/gpu": "4"}},
                }
            ],
        },
    }


def rack_part(
    stack: Any,
    kube: Any,
    namespace: str,
    timeout: float,
    say: Callable[[str], None],
    report: Callable[[Any, str, str], bool],
) -> None:
    """Add the trays, submit the TP-16 group, report its pods in stage order."""
    from gputopo.localcluster.stack import GpuNode

    trays = rack_nodes()
    say(
        f"\n== two small NVL72-style racks beside the H100 nodes: {len(trays)} GB200 trays of 4 GPUs, each rack "
        "one NVLink domain (tray nvl-b-tray-02's fabric degraded); a TP-16 group of 4 pods x 4 GPUs"
    )
    stack.add_nodes([GpuNode(node, system) for node, system in trays])
    stack.wait_published([node for node, _ in trays])
    for i in range(MEMBERS):
        kube.create_pod(_pod(namespace, i))
    names = [f"{GROUP}-{i}" for i in range(MEMBERS)]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(kube.get_pod(namespace, n)["spec"].get("nodeName") for n in names):
        time.sleep(0.5)
    placed = sum(report(kube, namespace, name) for name in names)
    say(f"\n{placed}/{MEMBERS} pods of TP group {GROUP} placed in one NVLink domain.")
