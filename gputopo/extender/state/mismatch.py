"""A pod whose node reports other GPUs under its UID than its placement names."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gputopo.engine.cluster.explain import gpu_ranges
from gputopo.engine.state.cliques import connected_pairs, mask_of
from gputopo.engine.state.snapshot import shape_of
from gputopo.extender.state.records import NodeEntry, PodRecord
from gputopo.model import NodeTopology


@dataclass(frozen=True)
class Mismatch:
    uid: str
    namespace: str
    name: str
    node: str
    placed: tuple[int, ...]
    actual: tuple[int, ...]
    clique: bool  # the actual GPUs are still one fully NVLink-connected set

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def shape(self) -> str:
        if len(self.actual) == 1:
            return "a single GPU"
        return "still a full NVLink clique" if self.clique else "not a full NVLink clique"

    def sentence(self) -> str:
        """The Event text: both sets, and whether the actual one still is a clique."""
        return (
            f"the kubelet gave this pod {_gpus(self.actual)} on {self.node}, not the placed {_gpus(self.placed)}: "
            f"{self.shape}; gputopo now counts the actual GPUs as used"
        )


def _gpus(gpus: tuple[int, ...]) -> str:
    return f"GPU {gpus[0]}" if len(gpus) == 1 else f"GPUs {gpu_ranges(gpus)}"


def is_clique(topology: NodeTopology, gpus: Iterable[int]) -> bool:
    """True when every pair of `gpus` shares NVLink (one GPU, or none, trivially is)."""
    chosen = sorted(gpus)
    k = len(chosen)
    if k <= 1:
        return True
    return connected_pairs(shape_of(topology).adj, mask_of(chosen)) == k * (k - 1) // 2


def compare(rec: PodRecord | None, entry: NodeEntry | None) -> Mismatch | bool | None:
    """The pod's mismatch; False when the node reports exactly the placed GPUs; None when there is
    nothing to compare yet (not placed, or not reported)."""
    if rec is None or not rec.active or rec.placement is None or entry is None or entry.topology is None:
        return None
    if rec.placed_node != entry.name:
        return None
    actual = entry.report.pods.get(rec.uid)
    if actual is None:
        return None
    placed = frozenset(rec.placement.gpus)
    if actual == placed:
        return False
    return Mismatch(
        uid=rec.uid,
        namespace=rec.namespace,
        name=rec.name,
        node=entry.name,
        placed=tuple(sorted(placed)),
        actual=tuple(sorted(actual)),
        clique=is_clique(entry.topology, actual),
    )
