"""A GPU's multi-node NVLink fabric health, decoded from NVML's `healthMask` (nvml.h,
NVML_GPU_FABRIC_HEALTH_MASK_*): 2-bit fields for degraded bandwidth (bits 0-1), route recovery (2-3),
route unhealthy (4-5) and access-timeout recovery (6-7), each 0 = not supported, 1 = TRUE (a problem),
2 = FALSE; then 4 bits of incorrect configuration (8-11): 0 = not supported, 1 = none, more = a fault.

Unknown is not healthy: a GPU with no fabric info, a registration not completed or failed, or no field
that says FALSE reads UNKNOWN, and multi-node NVLink placement treats it like a degraded one."""

from __future__ import annotations

from collections.abc import Sequence

from gputopo.model.topology import FabricHealth, FabricState, GpuFabric, GpuInfo

# Every 2-bit field FALSE, configuration not reported: what a healthy GB200 GPU shows (0b10101010).
HEALTHY_MASK = 0xAA

_FIELDS = (
    (0, "degraded bandwidth"),
    (2, "route recovery in progress"),
    (4, "route unhealthy"),
    (6, "access-timeout recovery"),
)
_CONFIG = {
    2: "incorrect system GUID",
    3: "incorrect chassis serial number",
    4: "no NVLink partition",
    5: "insufficient NVLinks",
    6: "incompatible GPU firmware",
    7: "invalid location",
    8: "invalid GPU state",
}


def decode_health(fabric: GpuFabric | None) -> tuple[FabricHealth, str]:
    """The GPU's fabric health and, unless healthy, why (names the mask in hex)."""
    if fabric is None:
        return FabricHealth.UNKNOWN, "no fabric info"
    if fabric.state is not FabricState.COMPLETED:
        return FabricHealth.UNKNOWN, f"fabric registration {fabric.state.value}"
    if fabric.status != 0:
        return FabricHealth.UNKNOWN, f"fabric registration failed (NVML status {fabric.status})"
    mask = fabric.health_mask
    problems = [what for shift, what in _FIELDS if (mask >> shift) & 0x3 == 1]
    config = (mask >> 8) & 0xF
    if config > 1:
        problems.append(_CONFIG.get(config, f"configuration fault {config}"))
    if problems:
        return FabricHealth.DEGRADED, f"healthMask {mask:#x}: " + ", ".join(problems)
    if not any((mask >> shift) & 0x3 == 2 for shift, _ in _FIELDS):
        return FabricHealth.UNKNOWN, f"healthMask {mask:#x} reports no field"
    return FabricHealth.HEALTHY, ""


def on_fabric(gpus: Sequence[GpuInfo]) -> bool:
    """Whether any GPU reports multi-node NVLink fabric info: the node is a tray (an NVL72 rack's)."""
    return any(g.fabric is not None for g in gpus)


def degraded_reason(why: str) -> str:
    """The GPU reason a degraded fabric gives (`why`: decode_health's detail), as the agent publishes it."""
    return f"NVLink fabric degraded: {why}"


def tray_health(gpus: Sequence[GpuInfo]) -> tuple[FabricHealth, str]:
    """A node's (a tray's) fabric health: degraded if any GPU is, else unknown if any GPU is, else
    healthy; the detail names the first GPU that decided it."""
    worst: tuple[FabricHealth, str] = (FabricHealth.HEALTHY, "")
    if not gpus:
        return FabricHealth.UNKNOWN, "no GPUs"
    for g in gpus:
        health, why = decode_health(g.fabric)
        if health is FabricHealth.DEGRADED:
            return health, f"GPU {g.index}: {why}"
        if health is FabricHealth.UNKNOWN and worst[0] is FabricHealth.HEALTHY:
            worst = (health, f"GPU {g.index}: {why}")
    return worst
