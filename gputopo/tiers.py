"""The network hierarchy read from node labels (docs/annotations.md, "Network tiers")."""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field

from gputopo.model import LABEL_NETWORK_LEAF, LABEL_NETWORK_SPINE


class Tier(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    labels: tuple[str, ...] = Field(min_length=1)
    # Downlink to uplink capacity of this tier's switches (2.0 = 2:1). Only the communication-time
    # estimate reads it (docs/cost-model.md): traffic leaving a switch of this tier gets 1/ratio.
    oversubscription: float = Field(1.0, ge=1.0, le=1000.0, allow_inf_nan=False)


class TierConfig(BaseModel):
    """Tiers widest first; for each tier the first label present on a node names its switch."""

    model_config = ConfigDict(frozen=True)

    tiers: tuple[Tier, ...] = (
        Tier(
            name="spine",
            oversubscription=2.0,  # assumed: a spine's uplinks 2:1, leaves non-blocking
            labels=(
                LABEL_NETWORK_SPINE,
                "network.topology.nvidia.com/spine",
                "topology.k8s.aws/network-node-layer-2",
                "cloud.google.com/gce-topology-block",
            ),
        ),
        Tier(
            name="leaf",
            labels=(
                LABEL_NETWORK_LEAF,
                "network.topology.nvidia.com/leaf",
                "topology.k8s.aws/network-node-layer-3",
                "cloud.google.com/gce-topology-subblock",
            ),
        ),
        Tier(name="nvlink-domain", labels=("nvidia.com/gpu.clique",)),
    )

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tiers)

    def switch_of(self, labels: Mapping[str, str], tier: str) -> str | None:
        """The switch (or domain) a node sits under at `tier`, or None when no label says."""
        for t in self.tiers:
            if t.name == tier:
                for key in t.labels:
                    value = labels.get(key)
                    if value:
                        return value
                return None
        raise KeyError(tier)

    def locate(self, labels: Mapping[str, str]) -> dict[str, str | None]:
        return {t.name: self.switch_of(labels, t.name) for t in self.tiers}

    def network_tiers(self) -> tuple[str, ...]:
        """Tiers that describe the RDMA fabric (everything except the NVLink domain), widest first."""
        return tuple(n for n in self.names if n != "nvlink-domain")

    def narrow_first_oversubscription(self) -> tuple[float, ...]:
        """The network tiers' oversubscription, narrowest tier first (the order traffic climbs)."""
        return tuple(t.oversubscription for t in reversed(self.tiers) if t.name != "nvlink-domain")


DEFAULT_TIERS = TierConfig()
