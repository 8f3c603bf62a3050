"""Xid errors: which ones make a GPU unfit for work, and how long the agent remembers them.

An Xid is the driver's error report (NVIDIA's Xid catalogue, "XID Errors" in the GPU deployment and
management documentation); the adapter in `gputopo.agent.nvml_backend` receives them through NVML's
event API and hands each to `XidMemory`. Pure: no NVML calls.

- fatal (the GPU needs a reset or replacing): the GPU is `failed` until the agent restarts. NVML does
  not say when a GPU was reset, so clearing it is the operator's action (reset the GPU, then restart
  the agent pod), as NVIDIA's own device plugin does;
- degrading (the GPU works, but something on it is not right): `degraded` until `quiet_s` pass
  without another degrading or unknown Xid on that GPU;
- an application's own fault (a page fault, an engine exception, a stopped channel): nothing, the GPU
  is fine; counted, never published as a reason;
- a code not in the table: `degraded`, like a degrading one, with the code named.

Memory is bounded: per GPU the last `RECENT_PER_GPU` Xids and a count, for at most `MAX_GPUS` GPUs.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from gputopo.model import Health

# NVIDIA's Xid catalogue, the codes a scheduler must act on.
FATAL_XIDS: dict[int, str] = {
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint",
    62: "internal micro-controller halt",
    64: "ECC page retirement or row remapping failed",
    79: "GPU has fallen off the bus",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
    140: "unrecovered ECC error",
}
DEGRADING_XIDS: dict[int, str] = {
    63: "ECC page retirement or row remapping recorded",
    74: "NVLink error",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
}
# Raised by an application's bad kernel or its teardown; the GPU itself is fine.
APPLICATION_XIDS: dict[int, str] = {
    13: "graphics engine exception (application fault)",
    31: "GPU memory page fault (application fault)",
    43: "GPU stopped processing (application fault)",
    45: "preemptive cleanup (application ended)",
}

# A degrading Xid clears after this long without another on the same GPU: an NVLink or ECC error that
# keeps coming back every few minutes keeps the GPU degraded.
XID_QUIET_SECONDS = 300.0
RECENT_PER_GPU = 8
# More GPUs than any node has (the model allows 64): an event for anything beyond is dropped.
MAX_GPUS = 64


class XidKind(Enum):
    FATAL = "fatal"
    DEGRADING = "degrading"
    APPLICATION = "application"
    UNKNOWN = "unknown"


def classify(code: int) -> tuple[XidKind, str]:
    """The kind of an Xid and its words."""
    if code in FATAL_XIDS:
        return XidKind.FATAL, FATAL_XIDS[code]
    if code in DEGRADING_XIDS:
        return XidKind.DEGRADING, DEGRADING_XIDS[code]
    if code in APPLICATION_XIDS:
        return XidKind.APPLICATION, APPLICATION_XIDS[code]
    return XidKind.UNKNOWN, "not in the Xid catalogue the agent knows"


@dataclass
class _GpuXids:
    recent: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=RECENT_PER_GPU))
    total: int = 0
    fatal: int | None = None  # the first fatal Xid: the GPU stays failed for it
    degrading: int | None = None  # the last degrading (or unknown) Xid
    degrading_at: float = 0.0


@dataclass
class XidMemory:
    """Xids per GPU (keyed by UUID, so a renumbered GPU keeps its history), bounded."""

    quiet_s: float = XID_QUIET_SECONDS
    gpus: dict[str, _GpuXids] = field(default_factory=dict)

    def observe(self, uuid: str, code: int, now: float) -> bool:
        """Remember one Xid; False when it was dropped (more GPUs than any node has)."""
        entry = self.gpus.get(uuid)
        if entry is None:
            if len(self.gpus) >= MAX_GPUS:
                return False
            entry = self.gpus[uuid] = _GpuXids()
        entry.recent.append((now, code))
        entry.total += 1
        kind, _ = classify(code)
        if kind is XidKind.FATAL and entry.fatal is None:
            entry.fatal = code
        elif kind in (XidKind.DEGRADING, XidKind.UNKNOWN):
            entry.degrading, entry.degrading_at = code, now
        return True

    def verdict(self, uuid: str, now: float) -> tuple[Health, str] | None:
        """What the GPU's Xids make of it now, with the reason a user reads; None when nothing."""
        entry = self.gpus.get(uuid)
        if entry is None:
            return None
        if entry.fatal is not None:
            return Health.FAILED, (
                f"Xid {entry.fatal}: {classify(entry.fatal)[1]} "
                f"({entry.total} Xids seen; reset the GPU, then restart the agent)"
            )
        if entry.degrading is not None:
            if now - entry.degrading_at < self.quiet_s:
                return Health.DEGRADED, (
                    f"Xid {entry.degrading}: {classify(entry.degrading)[1]} "
                    f"(clears after {self.quiet_s:.0f} s without another)"
                )
            entry.degrading = None
        return None
