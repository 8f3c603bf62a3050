"""What a simulation records: pods, placements, unplaced pods, decisions; what its summary reads."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gputopo.engine.state.snapshot import NodeState
from gputopo.model import PodRequest

DEFAULT_TP_MESSAGE_BYTES = 64 * 2**20  # one TP allreduce (activations of one layer, order of magnitude)
DEFAULT_PP_MESSAGE_BYTES = 64 * 2**20  # one activation transfer between pipeline stages


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


@dataclass(frozen=True, kw_only=True)
class Measures:
    """What the summary's figures assume and how far they go: the message sizes (bytes) of one TP
    all-reduce and one pipeline-stage transfer, and whether an exhaustive search of the best placement
    is compared (small clusters only; gputopo.sim.exhaustive)."""

    tp_message_bytes: float = DEFAULT_TP_MESSAGE_BYTES
    pp_message_bytes: float = DEFAULT_PP_MESSAGE_BYTES
    exhaustive: bool = True


MEASURES = Measures()


@dataclass(frozen=True)
class RunRecord:
    """What one run did, as its summary reads it: each job's pods in order, where pods went, the names
    of the pods left unplaced, and the nodes before the first job and after the last."""

    jobs: Sequence[Sequence[SimPod]]
    placements: Sequence[PodPlacement]
    unplaced: Sequence[str]
    initial: Sequence[NodeState]
    final: Sequence[NodeState]
