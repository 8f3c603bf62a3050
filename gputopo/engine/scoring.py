"""Score components and their weights, the link-type score table, and the one mapping to 0..10."""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field

from gputopo.model import LinkType, PcieDistance

# One score table for how well two GPUs talk (go-gpuallocator's ordering: PCIe tiers, then NVLink
# scaled by link count). Used to rank sets that are not full NVLink cliques.
LINK_SCORE: Mapping[LinkType, int] = {
    LinkType.CROSS_CPU: 10,
    LinkType.SAME_CPU: 20,
    LinkType.HOST_BRIDGE: 30,
    LinkType.MULTI_SWITCH: 40,
    LinkType.SINGLE_SWITCH: 50,
    LinkType.NVLINK: 100,  # per NVLink link
}

# A GPU counts as "close to a NIC" at these PCIe distances (GPUDirect RDMA without a host bridge).
NEAR_NIC = frozenset({PcieDistance.PIX, PcieDistance.PXB})


class ScoreWeights(BaseModel):
    """Relative weight of each score component; components are each in [0, 1]."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    clique: float = Field(3.0, ge=0, description="the GPUs form one fully NVLink-connected set")
    bandwidth: float = Field(4.0, ge=0, description="estimated collective bandwidth of the set vs NVLink 4 NV18")
    pack: float = Field(1.5, ge=0, description="the node ends up fuller (keeps other nodes whole)")
    intact: float = Field(2.0, ge=0, description="the GPUs left free still form a clique")
    memory: float = Field(1.0, ge=0, description="HBM just above the pod's minimum (no waste)")
    nic: float = Field(1.0, ge=0, description="chosen GPUs sit at PIX/PXB from an accepted NIC")
    health: float = Field(1.0, ge=0, description="no degraded links or GPUs on the node")

    def combine(self, components: Mapping[str, float]) -> float:
        total = 0.0
        weight = 0.0
        for name, value in components.items():
            w = float(getattr(self, name))
            total += w * value
            weight += w
        return total / weight if weight else 0.0


DEFAULT_WEIGHTS = ScoreWeights()


def to_extender_priority(score: float) -> int:
    """The one place an internal score in [0, 1] becomes kube-scheduler's extender score 0..10."""
    if score != score:  # NaN
        return 0
    return max(0, min(10, round(score * 10)))
