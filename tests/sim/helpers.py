"""Small builders for simulator tests: nodes from named systems, jobs from short specs."""

from __future__ import annotations

from gputopo.clusterfile import JobSpec
from gputopo.engine.state.snapshot import NodeState, node_state
from gputopo.systems import build_system

IB = {"gputopo.io/network": "infiniband"}


def node(
    name: str, fixture: str, *, leaf: str | None = None, spine: str = "spine-a", in_use: tuple[int, ...] = ()
) -> NodeState:
    labels = {"gputopo.io/network-spine": spine, "gputopo.io/network-leaf": leaf} if leaf else {}
    return node_state(name, build_system(fixture, name), labels=labels, in_use=frozenset(in_use))


def job(name: str, gpus: int, pods: int = 1, *, plain: bool = False, **annotations: str) -> JobSpec:
    """A job that opts in to gputopo (nvlink: required unless given), or a `plain` one without annotations."""
    ann = {f"gputopo.io/{k.replace('_', '-')}": v for k, v in annotations.items()}
    if not plain:
        ann.setdefault("gputopo.io/nvlink", "required")
    return JobSpec(name=name, pods=pods, gpus_per_pod=gpus, annotations=ann)
