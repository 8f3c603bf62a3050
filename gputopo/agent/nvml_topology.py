"""NVLink topology: from per-GPU NVML readings to the node's `NodeTopology` (without NICs).

- NV# = direct(i, j) + min(switch(i), switch(j)), remote type GPU counted by bus id, SWITCH or an
  unresolvable remote counted as a switch link;
- a fabric clique only for state COMPLETED, status SUCCESS and a non-zero cluster UUID, decoded from
  the fabric-info struct's C layout whatever the binding declares;
- each GPU's fabric info (state, status, healthMask) published as read, except where it says the GPU is
  in no multi-node NVLink domain (`gpu_fabric`);
- each link's health verdict (`gputopo.agent.nvml_health`) becomes a degraded link and a GPU reason, one
  reason per kind so a 36-link GPU stays within the wire model's bounds.

Pure: no NVML calls; `gputopo.agent.nvml_backend` reads the hardware into `GpuReading`s.
"""

from __future__ import annotations

import ctypes
import logging
import re
import struct
import uuid
from collections import Counter
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gputopo.agent.nvml_health import LinkVerdict
from gputopo.model import (
    MAX_REASONS,
    DegradedLink,
    FabricInfo,
    FabricState,
    GpuFabric,
    GpuInfo,
    Health,
    LinkState,
    NodeTopology,
    NvlinkInfo,
)
from gputopo.systems import NVLINK_GBPS_PER_LINK

# The adapter's logger: every line of one NVML discovery carries the same logger name.
log = logging.getLogger("gputopo.agent.nvml_backend")

# NVML constants, copied from the C API (stable values) rather than read from the binding, whose
# set of names differs between nvidia-ml-py versions.
DEVICE_TYPE_GPU = 0x00
DEVICE_TYPE_IBMNPU = 0x01
DEVICE_TYPE_SWITCH = 0x02
DEVICE_TYPE_UNKNOWN = 0xFF
FABRIC_STATE_COMPLETED = 3
NVML_SUCCESS = 0
# nvmlGpuFabricState_t, in the C enum's order.
_FABRIC_STATES = (FabricState.NOT_SUPPORTED, FabricState.NOT_STARTED, FabricState.IN_PROGRESS, FabricState.COMPLETED)

# nvmlDeviceGetNvLinkVersion returns an enum, not the generation (1.0, 2.0, 2.2, 3.0, 3.1, 4.0, 5.0, 6.0).
_NVLINK_VERSION_TO_GENERATION = {1: 1, 2: 2, 3: 2, 4: 3, 5: 3, 6: 4, 7: 5, 8: 6}

# nvmlGpuFabricInfo_v2_t as libnvidia-ml writes it (nvml.h): unsigned version, unsigned char
# clusterUuid[16], nvmlReturn_t status, unsigned cliqueId, nvmlGpuFabricState_t state (an unsigned
# char, padded to 4), unsigned healthMask: 36 bytes, the size in nvmlGpuFabricInfo_v2 = 0x02000024.
_FABRIC_V2 = struct.Struct("<I16sIIB3xI")


# A normalized PCI address, domain:bus:device.function (NVML's domain is 32 bits, sysfs shows 4 digits).
BUS_ID = re.compile(r"[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")


def normalize_bus_id(raw: bytes | str) -> str:
    """NVML's `00000000:18:00.0` (bytes, 8-digit domain, upper case) → sysfs `0000:18:00.0`."""
    text = raw.decode("ascii", "replace") if isinstance(raw, bytes) else raw
    text = text.strip().strip("\x00").lower()
    parts = text.split(":")
    if len(parts) == 3:
        try:
            return f"{int(parts[0], 16):04x}:{parts[1]}:{parts[2]}"
        except ValueError:
            return text
    if len(parts) == 2:  # `18:00.0` without a domain
        return f"0000:{text}"
    return text


def nvlink_generation(version_enum: int) -> int:
    """Map nvmlDeviceGetNvLinkVersion's enum to the NVLink generation (0 when unknown)."""
    return _NVLINK_VERSION_TO_GENERATION.get(version_enum, 0)


def nvlink_matrix(direct: Sequence[Mapping[int, int]], switch: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """NV# per GPU pair: direct links (both ends must see them) plus min(switch links of i and j)."""
    n = len(switch)
    out = []
    for i in range(n):
        row = []
        for j in range(n):
            if i == j:
                row.append(0)
                continue
            both = min(direct[i].get(j, 0), direct[j].get(i, 0))
            row.append(both + min(switch[i], switch[j]))
        out.append(tuple(row))
    return tuple(out)


@dataclass(frozen=True)
class FabricReading:
    """The fields of nvmlGpuFabricInfo_v2_t the adapter uses."""

    state: int
    status: int
    cluster_uuid: bytes
    clique_id: int
    health_mask: int


def decode_fabric_info(info: Any) -> FabricReading | None:
    """Read a filled fabric-info struct from its memory in the C layout, whatever the binding declares.

    nvidia-ml-py 12.560.30 declares `clusterUuid` as `c_char * 80` where the C struct has 16 bytes, so
    its Python struct is 100 bytes while NVML fills only the 36 of the v2 layout: the binding's
    `status`, `cliqueId`, `state` and `healthMask` fields then read zeros. 12.570 and 12.575 declare
    `c_char * 16`: the right size, but a char array reads back cut at the first NUL and UTF-8 decoded
    to str (raising on most UUIDs). 13.x declares `c_uint8 * 16`, matching C. The bytes NVML wrote
    are right for all three.
    """
    if ctypes.sizeof(info) < _FABRIC_V2.size:
        return None
    raw = ctypes.string_at(ctypes.addressof(info), _FABRIC_V2.size)
    _version, cluster_uuid, status, clique_id, state, health_mask = _FABRIC_V2.unpack(raw)
    return FabricReading(
        state=state, status=status, cluster_uuid=cluster_uuid, clique_id=clique_id, health_mask=health_mask
    )


def fabric_clique(state: int, status: int, cluster_uuid: bytes, clique_id: int) -> str | None:
    """GFD's `<clusterUUID>.<cliqueId>`, or None unless registration completed successfully.

    H100 boards report COMPLETED with an all-zero UUID, which is not a multi-node NVLink domain.
    """
    if state != FABRIC_STATE_COMPLETED or status != NVML_SUCCESS:
        return None
    if len(cluster_uuid) != 16 or not any(cluster_uuid):
        return None
    return f"{uuid.UUID(bytes=bytes(cluster_uuid))}.{clique_id}"


def gpu_fabric(reading: FabricReading) -> GpuFabric | None:
    """The GPU's fabric info as published, or None where it is in no multi-node NVLink domain.

    None for state NOT_SUPPORTED (the same as NVML raising NotSupported), for a state this gputopo does
    not know (a newer driver's), and for a registration completed with an all-zero cluster UUID: an HGX
    board's own NVSwitches, not a tray. A tray still registering, or one whose registration failed,
    publishes its state: unknown, never healthy."""
    if not 0 < reading.state < len(_FABRIC_STATES):
        return None
    state = _FABRIC_STATES[reading.state]
    if state is FabricState.COMPLETED and reading.status == NVML_SUCCESS and not any(reading.cluster_uuid):
        return None
    return GpuFabric(state=state, status=reading.status, health_mask=reading.health_mask)


def _links_phrase(links: Sequence[int]) -> str:
    """`link 5`, `links 3, 5` or `links 0-17`: consecutive runs folded."""
    if len(links) == 1:
        return f"link {links[0]}"
    runs: list[list[int]] = []
    for i in sorted(links):
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return "links " + ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs)


def _bounded(reasons: Sequence[str]) -> tuple[str, ...]:
    """Distinct reasons, cut to the wire model's MAX_REASONS with a count of the rest."""
    unique = tuple(dict.fromkeys(reasons))
    if len(unique) <= MAX_REASONS:
        return unique
    return (*unique[: MAX_REASONS - 1], f"and {len(unique) - MAX_REASONS + 1} more reasons")


def worst_health(a: Health, b: Health) -> Health:
    """The worse of two health states (FAILED over DEGRADED over OK)."""
    order = (Health.OK, Health.DEGRADED, Health.FAILED)
    return a if order.index(a) >= order.index(b) else b


@dataclass
class LinkReading:
    """One NVLink of a GPU as read this cycle: state, remote end, and its health verdict."""

    index: int
    active: bool
    remote_type: int | None = None
    remote_bus: str | None = None
    verdict: LinkVerdict = field(default_factory=LinkVerdict)


@dataclass
class GpuReading:
    """One GPU as read this cycle; `health` and `reasons` start with what discovery found."""

    index: int
    uuid: str = ""
    model: str = "unknown"
    memory_mib: int = 0
    bus_id: str = ""
    numa: int | None = None
    health: Health = Health.OK
    reasons: list[str] = field(default_factory=list)
    links: list[LinkReading] = field(default_factory=list)
    generation: int = 0
    clique: str | None = None
    fabric: GpuFabric | None = None


def _fabric(gpus: Sequence[GpuReading]) -> FabricInfo | None:
    """The node's fabric clique: the most common one its GPUs report."""
    cliques = Counter(g.clique for g in gpus if g.clique)
    if not cliques:
        return None
    clique, _ = cliques.most_common(1)[0]
    if len(cliques) > 1:
        log.warning("GPUs report different fabric cliques", extra={"cliques": sorted(cliques)})
    return FabricInfo(clique=clique)


def gpu_info(g: GpuReading, *, reasons: bool = True) -> GpuInfo:
    """The GPU as it is published (`reasons=False`: without its reasons, to check the other values while
    they are still being gathered); raises ValidationError for a value the model refuses."""
    return GpuInfo(
        index=g.index,
        uuid=g.uuid,
        model=g.model,
        memory_mib=g.memory_mib,
        pci_bus_id=g.bus_id,
        numa_node=g.numa,
        health=g.health,
        reasons=_bounded(g.reasons) if reasons else (),
        fabric=g.fabric,
    )


def assemble(gpus: Sequence[GpuReading], ever_active: Container[tuple[str, int]]) -> NodeTopology:
    """The node's topology from its GPUs' readings (their health and reasons are completed here).

    `ever_active`: (GPU UUID, link) pairs seen active in any cycle, so a link that went down is told
    apart from one never wired."""
    by_bus = {g.bus_id: g.index for g in gpus if g.bus_id}
    # A GPU whose bus is unknown (it failed before one was ever read) may be the far end of its peers'
    # links; such a link then reaches a GPU that cannot be read, never an invisible NVSwitch.
    unplaced_gpus = any(not g.bus_id for g in gpus)
    n = len(gpus)
    direct: list[Counter[int]] = [Counter() for _ in range(n)]
    switch = [0] * n
    nvswitch = False
    degraded: list[DegradedLink] = []
    for g in gpus:
        any_active = any(lk.active for lk in g.links)
        down: list[int] = []
        unknown: dict[str, list[int]] = {}
        for lk in g.links:
            if not lk.active:
                # Expected when the GPU uses NVLink at all or this link was once up; an unwired
                # PCIe card reports every link inactive and is simply not NVLink-connected.
                if any_active or (g.uuid, lk.index) in ever_active:
                    degraded.append(
                        DegradedLink(gpu=g.index, link=lk.index, state=LinkState.DOWN, detail="link not active")
                    )
                    down.append(lk.index)
                continue
            if lk.verdict.degraded:
                degraded.append(
                    DegradedLink(gpu=g.index, link=lk.index, state=LinkState.DEGRADED, detail=lk.verdict.detail)
                )
                g.health = worst_health(g.health, Health.DEGRADED)
                g.reasons.append(f"NVLink link {lk.index} degraded: {lk.verdict.detail}")
                continue
            if lk.verdict.unknown:
                # Still counted: nothing says the link is bad, only that its health cannot be
                # checked now, so the GPU is reported degraded (never healthy) with the reason.
                unknown.setdefault(lk.verdict.detail, []).append(lk.index)
            if lk.verdict.warning:
                g.reasons.append(f"NVLink link {lk.index}: {lk.verdict.detail}")
            if lk.remote_type == DEVICE_TYPE_IBMNPU:
                continue  # NVLink to a POWER CPU: no GPU peer
            peer = by_bus.get(lk.remote_bus) if lk.remote_bus else None
            if peer == g.index:
                continue  # a link that names its own GPU is a driver's garbage: neither a peer nor a switch
            if lk.remote_type in (DEVICE_TYPE_GPU, None) and peer is not None:
                # Counted only where both ends see the link (nvlink_matrix), so a link to a failed GPU
                # whose own links were not read adds nothing to either.
                direct[g.index][peer] += 1
            elif peer is None and lk.remote_type in (DEVICE_TYPE_GPU, None) and unplaced_gpus:
                continue  # to the GPU that cannot be read: no link between readable GPUs
            else:
                # SWITCH, UNKNOWN, or a remote NVML cannot place (VMs, GB200 switch trays):
                # NCCL and PyTorch assume an invisible NVSwitch.
                switch[g.index] += 1
                nvswitch = True
        # One reason per kind, not per link: a 36-link GPU would otherwise overflow MAX_REASONS.
        if down:
            g.health = worst_health(g.health, Health.DEGRADED)
            g.reasons.append(f"NVLink {_links_phrase(down)} down")
        for detail, links in unknown.items():
            g.health = worst_health(g.health, Health.DEGRADED)
            g.reasons.append(f"NVLink {_links_phrase(links)} health unknown: {detail}")
    generations = [g.generation for g in gpus if g.generation]
    generation = max(generations, default=0)
    return NodeTopology(
        gpus=tuple(gpu_info(g) for g in gpus),
        nvlink=NvlinkInfo(
            generation=generation,
            gbps_per_link=NVLINK_GBPS_PER_LINK.get(generation, 0.0),
            nvswitch=nvswitch,
            links=nvlink_matrix(direct, switch) if n else (),
        ),
        degraded_links=tuple(degraded),
        fabric=_fabric(gpus),
    )


# nvmlGpuP2PStatus_t, as a user reads it.
_P2P_STATUS_WORDS = {
    1: "chipset not supported",
    2: "GPU not supported",
    3: "IOH topology not supported",
    4: "disabled by registry key",
    5: "not supported",
    6: "unknown",
}


def p2p_status_words(status: int) -> str:
    return _P2P_STATUS_WORDS.get(status, f"status {status}")


def nvlink_pairs(topology: NodeTopology) -> list[tuple[int, int]]:
    """The NVLink-connected pairs (i < j) of GPUs that were read: those a clique may be made of."""
    readable = [g.index for g in topology.gpus if g.health is not Health.FAILED]
    return [(i, j) for i in readable for j in readable if i < j and topology.link_count(i, j) > 0]


def with_p2p_faults(topology: NodeTopology, faults: Mapping[tuple[int, int], str]) -> NodeTopology:
    """`topology` with both GPUs of each pair in `faults` degraded, each naming its peer and why (one
    reason per kind of fault, the peers listed), so NVLink placement stops using them."""
    if not faults:
        return topology
    why: dict[int, dict[str, list[int]]] = {}
    for (i, j), detail in faults.items():
        why.setdefault(i, {}).setdefault(detail, []).append(j)
        why.setdefault(j, {}).setdefault(detail, []).append(i)
    gpus = []
    for g in topology.gpus:
        if g.index not in why:
            gpus.append(g)
            continue
        reasons = [
            f"NVLink peer-to-peer to GPU{'s' if len(peers) > 1 else ''} {', '.join(map(str, sorted(peers)))} {detail}"
            for detail, peers in why[g.index].items()
        ]
        update = {"health": worst_health(g.health, Health.DEGRADED), "reasons": _bounded([*g.reasons, *reasons])}
        gpus.append(g.model_copy(update=update))
    return topology.model_copy(update={"gpus": tuple(gpus)})
