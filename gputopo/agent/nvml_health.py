"""NVLink health: each link's data-link error counters judged between discovery cycles, DCGM's way.

Each counter is compared with its own last good reading using DCGM's thresholds; one the GPU does
not support is absent, one that cannot be compared this cycle makes the link's health unknown (the
adapter publishes that as a degraded GPU with a reason, never as healthy). Verdicts are held for
DCGM's watch window so the published topology does not flap. Pure apart from `HealthTracker`'s
memory; no NVML calls (the adapter in `gputopo.agent.nvml_backend` reads the counters).
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from dataclasses import dataclass, field

# nvmlNvLinkErrorCounter_t values, copied from the C API (stable) rather than read from the binding,
# whose set of names differs between nvidia-ml-py versions.
ERR_DL_REPLAY = 0
ERR_DL_RECOVERY = 1
ERR_DL_CRC_FLIT = 2
ERR_DL_CRC_DATA = 3

# DCGM's NVLink health rules (dcgmGpuHardwareLimits.h, DcgmHealthWatch::MonitorNVLink4Fields): every
# counter is judged on its own and one that is not supported is skipped; any replay or recovery error
# fails the link; flit CRC and data CRC each fail it at 100/s and warn below. A verdict is held for
# DCGM's 60 s watch window so one burst does not make the published topology flap every cycle.
CRC_ERRORS_PER_SECOND_LIMIT = 100.0
HEALTH_HOLD_SECONDS = 60.0

# The counters read per link: (LinkCounters field, nvmlNvLinkErrorCounter_t, words for reasons).
# Each is read on its own: Hopper and later drivers may refuse one (DCGM shows the CRC totals as N/A
# on H100) while the others still work, and replay/recovery must keep being watched there.
COUNTERS = (
    ("replay", ERR_DL_REPLAY, "replay"),
    ("recovery", ERR_DL_RECOVERY, "recovery"),
    ("crc_flit", ERR_DL_CRC_FLIT, "flit CRC"),
    ("crc_data", ERR_DL_CRC_DATA, "data CRC"),
)
FATAL_COUNTERS = ("replay", "recovery")


@dataclass(frozen=True)
class LinkCounters:
    """NVLink data-link error counters of one link at one instant.

    None: no value this time. A counter named in `failed` exists but its read failed; any other None
    is a counter this GPU does not support (absent, not a problem).
    """

    replay: int | None = 0
    recovery: int | None = 0
    crc_flit: int | None = 0
    crc_data: int | None = 0
    failed: tuple[str, ...] = ()

    def value(self, name: str) -> int | None:
        v: int | None = getattr(self, name)
        return v


# A counter's last good value and when it was read: (monotonic seconds, value).
Baseline = Mapping[str, tuple[float, int]]


@dataclass(frozen=True)
class LinkVerdict:
    """Outcome of comparing a reading with the baselines: at most one of degraded (not counted), unknown
    (cannot be checked now: reported, never taken for healthy) or a warning, with the words why."""

    degraded: bool = False
    unknown: bool = False
    warning: bool = False
    detail: str = ""


def assess_link_errors(baseline: Baseline, cur: LinkCounters, now: float) -> LinkVerdict:
    """DCGM's rule, counter by counter, on the current reading against each counter's last good one.

    Degraded: a replay or recovery rise, or flit or data CRC at 100/s or more (each on its own).
    Unknown: a counter that has a baseline but no usable value now (its read failed, it stopped being
    readable, or it went backwards because something reset it). Warning: a smaller CRC rise. A counter
    without a baseline (the first reading) or read at the same instant gives nothing yet.
    """
    degraded: list[str] = []
    unknown: list[str] = []
    warnings: list[str] = []
    for name, _, words in COUNTERS:
        value = cur.value(name)
        base = baseline.get(name)
        if name in cur.failed:
            unknown.append(f"{words} counter unreadable")
            continue
        if base is None:
            continue
        at, prev = base
        if value is None:
            unknown.append(f"{words} counter no longer readable")
            continue
        elapsed = now - at
        if elapsed <= 0:
            continue
        delta = value - prev
        if delta < 0:
            unknown.append(f"{words} counter went backwards (reset)")
        elif delta == 0:
            continue
        elif name in FATAL_COUNTERS:
            degraded.append(f"{delta} {words} errors in {elapsed:.0f} s")
        elif (rate := delta / elapsed) >= CRC_ERRORS_PER_SECOND_LIMIT:
            degraded.append(f"{words} errors at {rate:.0f}/s (limit {CRC_ERRORS_PER_SECOND_LIMIT:.0f}/s)")
        else:
            warnings.append(f"{words} errors below {CRC_ERRORS_PER_SECOND_LIMIT:.0f}/s")
    if degraded:
        return LinkVerdict(degraded=True, detail=", ".join(degraded))
    if unknown:
        return LinkVerdict(unknown=True, detail=", ".join(unknown))
    if warnings:
        return LinkVerdict(warning=True, detail=", ".join(warnings))
    return LinkVerdict()


@dataclass
class _HeldVerdict:
    verdict: LinkVerdict
    until: float


@dataclass
class HealthTracker:
    """Per-counter baselines, links ever seen active, and held verdicts, keyed by (GPU UUID, link)."""

    hold_s: float = HEALTH_HOLD_SECONDS
    baselines: dict[tuple[str, int], dict[str, tuple[float, int]]] = field(default_factory=dict)
    ever_active: set[tuple[str, int]] = field(default_factory=set)
    held: dict[tuple[str, int], _HeldVerdict] = field(default_factory=dict)

    def keep_only(self, uuids: Container[str]) -> None:
        """Forget every link of a GPU not in `uuids` (those there now), so the state stays per link present."""
        self.baselines = {k: v for k, v in self.baselines.items() if k[0] in uuids}
        self.ever_active = {k for k in self.ever_active if k[0] in uuids}
        self.held = {k: v for k, v in self.held.items() if k[0] in uuids}

    def observe(self, key: tuple[str, int], counters: LinkCounters, now: float) -> LinkVerdict:
        baseline = self.baselines.setdefault(key, {})
        verdict = assess_link_errors(baseline, counters, now)
        for name, _, _ in COUNTERS:
            value = counters.value(name)
            # A failed or vanished counter keeps its last good value, so the next good read is still
            # compared over the whole gap instead of starting again (a hole that would read healthy).
            if value is not None and (name not in baseline or now > baseline[name][0]):
                baseline[name] = (now, value)
        held = self.held.get(key)
        if held is not None and now >= held.until:
            del self.held[key]
            held = None
        if verdict.degraded:
            if held is not None and held.verdict.degraded:
                # Same verdict again: extend it but keep the first wording, so the Node is not rewritten.
                held.until = now + self.hold_s
                return held.verdict
            self.held[key] = _HeldVerdict(verdict, now + self.hold_s)
            return verdict
        if held is not None and held.verdict.degraded:
            return held.verdict  # neither a warning nor missing data clears a degraded verdict
        if verdict.unknown:
            return verdict  # not held: it ends as soon as the counters can be compared again
        if verdict.warning:
            if held is not None:
                held.until = now + self.hold_s
                return held.verdict
            self.held[key] = _HeldVerdict(verdict, now + self.hold_s)
            return verdict
        return held.verdict if held else verdict
