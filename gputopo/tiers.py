"""The network hierarchy read from node labels (docs/annotations.md, "Network tiers"; the labelers whose
keys the defaults read: docs/configuration.md, "Topology labelers"), and the tier sets that read it differently
per hardware shape (docs/configuration.md, "Tier sets per hardware shape")."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gputopo.model import LABEL_NETWORK_LEAF, LABEL_NETWORK_SPINE

# EKS numbers its layers from the top and only some instance types have a fourth: the bottom layer is the
# leaf, so layer-3 is the spine only where layer-4 exists (Tier.only_with) and the leaf otherwise.
EKS_LAYER = "topology.k8s.aws/network-node-layer-"


class Tier(BaseModel):
    model_config = ConfigDict(frozen=True, populate_by_name=True)

    name: str
    labels: tuple[str, ...] = Field(min_length=1)
    # label -> another label: the first counts for this tier only on a node that carries the second too.
    only_with: dict[str, str] = Field(default_factory=dict)
    # Downlink to uplink capacity of this tier's switches (2.0 = 2:1). Only the communication-time
    # estimate reads it (docs/cost-model.md): traffic leaving a switch of this tier gets 1/ratio.
    oversubscription: float = Field(1.0, ge=1.0, le=1000.0, allow_inf_nan=False)
    # The most nodes of one domain of this tier that one group may take (the nvlink-domain tier: trays of
    # a rack, the rest kept as spares); a node label `gputopo.io/nvlink-domain-cap` overrides it per domain.
    group_cap: int | None = Field(None, alias="groupCap", ge=1, le=4096)
    # All-reduce bus bandwidth (GB/s) inside one domain of this tier where it is a multi-node NVLink domain;
    # None: the calibrated NVL72 default (gputopo.engine.network.cost); `gputopo calibrate --domain` fits it.
    busbw_gbps: float | None = Field(None, alias="busbwGbps", gt=0, le=100_000.0, allow_inf_nan=False)

    def __hash__(self) -> int:  # frozen, so hashable like before only_with (a dict) was added
        return hash(
            (
                self.name,
                self.labels,
                tuple(sorted(self.only_with.items())),
                self.oversubscription,
                self.group_cap,
                self.busbw_gbps,
            )
        )

    def switch(self, labels: Mapping[str, str]) -> str | None:
        """The value of the first of this tier's labels present (and non-empty) on a node, or None."""
        for key in self.labels:
            value = labels.get(key)
            if value and (key not in self.only_with or labels.get(self.only_with[key])):
                return value
        return None


class TierSet(BaseModel):
    """The tiers of one hardware shape: they read the nodes whose labels hold every pair of `match`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1, max_length=63)
    match: dict[Annotated[str, Field(min_length=1)], str] = Field(min_length=1)  # label key -> value
    tiers: tuple[Tier, ...] = Field(min_length=1)

    def __hash__(self) -> int:  # frozen; `match` is a dict
        return hash((self.name, tuple(sorted(self.match.items())), self.tiers))

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(labels.get(key) == value for key, value in self.match.items())


class TierConfig(BaseModel):
    """Tiers widest first; for each tier the first label present on a node names its switch. A node that
    matches one of `sets` is read by the first such set's tiers instead (same names, other labels)."""

    model_config = ConfigDict(frozen=True)

    # Per tier: gputopo's own key, then topograph before 1.0 and from 1.0 (switch tiers closest first),
    # EKS, GKE, Nebius, CoreWeave. Keys above the spine (topograph tier-3, EKS layer-1 of four, Nebius
    # gpu-cluster-id) are not read: a third network tier would count every node without its label as a
    # domain of its own, so groups on two-tier fabrics would be packed by node count first.
    tiers: tuple[Tier, ...] = (
        Tier(
            name="spine",
            oversubscription=2.0,  # assumed: a spine's uplinks 2:1, leaves non-blocking
            labels=(
                LABEL_NETWORK_SPINE,
                "network.topology.nvidia.com/spine",
                "fabric.topograph.run/tier-2",
                f"{EKS_LAYER}3",
                f"{EKS_LAYER}2",
                "cloud.google.com/gce-topology-block",
                "topology.nebius.com/tier-2",
            ),
            only_with={f"{EKS_LAYER}3": f"{EKS_LAYER}4"},
        ),
        Tier(
            name="leaf",
            labels=(
                LABEL_NETWORK_LEAF,
                "network.topology.nvidia.com/leaf",
                "fabric.topograph.run/tier-1",
                f"{EKS_LAYER}4",
                f"{EKS_LAYER}3",
                "cloud.google.com/gce-topology-subblock",
                "topology.nebius.com/tier-1",
            ),
        ),
        Tier(
            name="nvlink-domain",
            labels=(
                "nvidia.com/gpu.clique",
                "network.topology.nvidia.com/accelerator",
                "accelerator.topograph.run/sub-domain",  # an NVLink partition of the domain: the narrower
                "accelerator.topograph.run/domain",
                "topology.nebius.com/tier-0",
                "ds.coreweave.com/nvlink.domain",
            ),
        ),
    )

    # Tier sets per hardware shape, first match wins; a node matching none takes `tiers` (the set "").
    sets: tuple[TierSet, ...] = ()

    @model_validator(mode="after")
    def _sets_name_the_same_tiers(self) -> TierConfig:
        seen: set[str] = set()
        for s in self.sets:
            if s.name in seen:
                raise ValueError(f"tier set {s.name!r} is named twice: each tier set needs a name of its own")
            seen.add(s.name)
            names = tuple(t.name for t in s.tiers)
            if names != self.names:
                # Annotations (required-tier, preferred-tier) name tiers: a set may change what labels
                # mean a tier, not which tiers there are.
                raise ValueError(
                    f"tier set {s.name!r} has tiers {', '.join(names)}; every set needs the top-level tiers' "
                    f"names in their order: {', '.join(self.names)}"
                )
        return self

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tiers)

    def for_labels(self, labels: Mapping[str, str]) -> tuple[str, tuple[Tier, ...]]:
        """The tier set that reads a node with these labels (its name, "" for the top-level tiers) and its tiers."""
        for s in self.sets:
            if s.matches(labels):
                return s.name, s.tiers
        return "", self.tiers

    def of_set(self, name: str) -> TierConfig:
        """The tiers of the set `name` alone: what a group planned within that set reads, its group caps and
        oversubscription among them. These tiers for "" and for a name no set has (a node state built under
        another configuration)."""
        for s in self.sets:
            if s.name == name:
                return TierConfig.model_construct(tiers=s.tiers)  # valid: a set's tiers, no sets of its own
        return self

    def labels_by_tier(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """Each tier's name (widest first) and every label any set reads for it, the top-level tiers' first:
        what a topology key written by another component (a PodGroup, JobSet exclusive placement) may
        name, whichever hardware shape the nodes it means are."""
        out: dict[str, list[str]] = {t.name: list(t.labels) for t in self.tiers}
        for s in self.sets:
            for t in s.tiers:
                out[t.name].extend(key for key in t.labels if key not in out[t.name])
        return tuple((name, tuple(keys)) for name, keys in out.items())

    def switch_of(self, labels: Mapping[str, str], tier: str) -> str | None:
        """The switch (or domain) a node sits under at `tier`, or None when no label says."""
        for t in self.for_labels(labels)[1]:
            if t.name == tier:
                return t.switch(labels)
        raise KeyError(tier)

    def locate(self, labels: Mapping[str, str]) -> dict[str, str | None]:
        return {t.name: t.switch(labels) for t in self.for_labels(labels)[1]}

    def network_tiers(self) -> tuple[str, ...]:
        """Tiers that describe the RDMA fabric (everything except the NVLink domain), widest first."""
        return tuple(n for n in self.names if n != "nvlink-domain")

    def narrow_first_oversubscription(self) -> tuple[float, ...]:
        """The network tiers' oversubscription, narrowest tier first (the order traffic climbs)."""
        return tuple(t.oversubscription for t in reversed(self.tiers) if t.name != "nvlink-domain")


DEFAULT_TIERS = TierConfig()
