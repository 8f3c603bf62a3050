"""Small builders for simulator tests: nodes from named systems, jobs from short specs."""

from __future__ import annotations

from gputopo.clusterfile import JobSpec
from gputopo.engine.snapshot import NodeState, node_state
from gputopo.systems import build_system

IB = {"gputopo.io/network": "infiniband"}


def node(
    name: str, fixture: str, *, leaf: str | None = None, spine: str = "spine-a", in_use: tuple[int, ...] = ()
) -> NodeState:
    labels = {"gputopo.io/network-spine": spine, "gputopo.io/network-leaf": leaf} if leaf else {}
    return node_state(name, build_system(fixture, name), labels=labels, in_use=frozenset(in_use))


def job(name: str, gpus: int, pods: int = 1, **annotations: str) -> JobSpec:
    ann = {f"gputopo.io/{k.replace('_', '-')}": v for k, v in annotations.items()}
    return JobSpec(name=name, pods=pods, gpus_per_pod=gpus, annotations=ann)
