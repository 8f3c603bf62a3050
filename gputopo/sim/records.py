"""What a simulation records: pods, placements, unplaced pods, decisions."""

from __future__ import annotations

from dataclasses import dataclass

from gputopo.model import PodRequest


@dataclass(frozen=True)
class SimPod:
    name: str  # <job>-<i>
    job: str
    index: int
    request: PodRequest
    opted_in: bool = True  # carries a gputopo.io/ request annotation (docs/annotations.md); else a plain pod

    @property
    def stage(self) -> int:
        return self.request.stage if self.request.stage is not None else self.index


@dataclass(frozen=True)
class PodPlacement:
    pod: str
    job: str
    node: str
    gpus: tuple[int, ...]
    score: int  # 0..10 (gputopo: the extender priority; default: LeastAllocated; random: 0)
    reason: str


@dataclass(frozen=True)
class UnplacedPod:
    pod: str
    job: str
    reasons: str  # kube-scheduler FailedScheduling text: "0/N nodes are available: ..."


@dataclass(frozen=True)
class Decision:
    """One scheduling decision: a single pod, or a whole group under `gputopo`."""

    job: str
    pods: int
    seconds: float
