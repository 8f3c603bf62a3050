"""NVML adapter: the only module that imports `pynvml` (package nvidia-ml-py).

Everything NVML-specific lives here and ends as a `gputopo.model.NodeTopology` (without NICs; those
come from sysfs). The library is reached through the `NvmlLib` protocol so tests pass a fake module.

- links are enumerated by `nvmlDeviceGetNvLinkState` until it raises InvalidArgument/NotSupported;
  never by capability (TRUE for every index on B200), never up to the binding's NVML_NVLINK_MAX_LINKS;
- NV# = direct(i, j) + min(switch(i), switch(j)), remote type GPU counted by bus id, SWITCH or an
  unresolvable remote counted as a switch link;
- a fabric clique only for state COMPLETED, status SUCCESS and a non-zero cluster UUID;
- each NVLink error counter is compared between cycles on its own with DCGM's thresholds; one the
  GPU does not support is absent, one that cannot be compared this cycle makes the link's health
  unknown, which is published as a degraded GPU with a reason, never as healthy;
- NotSupported / FunctionNotFound / InvalidArgument mean "absent".
"""

from __future__ import annotations

import ctypes
import logging
import struct
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast

from agent.sysfs import pci_numa_node
from gputopo.model import (
    MAX_REASONS,
    DegradedLink,
    FabricInfo,
    GpuInfo,
    Health,
    LinkState,
    NodeTopology,
    NvlinkInfo,
)
from gputopo.systems import NVLINK_GBPS_PER_LINK

log = logging.getLogger(__name__)

T = TypeVar("T")

# NVML constants, copied from the C API (stable values) rather than read from the binding, whose
# set of names differs between nvidia-ml-py versions.
FEATURE_ENABLED = 1
DEVICE_TYPE_GPU = 0x00
DEVICE_TYPE_IBMNPU = 0x01
DEVICE_TYPE_SWITCH = 0x02
DEVICE_TYPE_UNKNOWN = 0xFF
ERR_DL_REPLAY = 0
ERR_DL_RECOVERY = 1
ERR_DL_CRC_FLIT = 2
ERR_DL_CRC_DATA = 3
FABRIC_STATE_COMPLETED = 3
NVML_SUCCESS = 0
AFFINITY_SCOPE_NODE = 0
MIG_ENABLE = 1
# The health reason that marks a GPU in MIG mode; the device plugin refuses such a node by it.
MIG_REASON = "MIG mode enabled: the GPU is partitioned and has no NVLink peer-to-peer"
MIB = 1024 * 1024

# Not a link count: only stops a faulty library that never rejects a link index from looping forever.
_LINK_SCAN_GUARD = 128

# nvmlDeviceGetNvLinkVersion returns an enum, not the generation (1.0, 2.0, 2.2, 3.0, 3.1, 4.0, 5.0, 6.0).
_NVLINK_VERSION_TO_GENERATION = {1: 1, 2: 2, 3: 2, 4: 3, 5: 3, 6: 4, 7: 5, 8: 6}

# DCGM's NVLink health rules (dcgmGpuHardwareLimits.h, DcgmHealthWatch::MonitorNVLink4Fields): every
# counter is judged on its own and one that is not supported is skipped; any replay or recovery error
# fails the link; flit CRC and data CRC each fail it at 100/s and warn below. A verdict is held for
# DCGM's 60 s watch window so one burst does not make the published topology flap every cycle.
CRC_ERRORS_PER_SECOND_LIMIT = 100.0
HEALTH_HOLD_SECONDS = 60.0

# The counters read per link: (LinkCounters field, nvmlNvLinkErrorCounter_t, words for reasons).
# Each is read on its own: Hopper and later drivers may refuse one (DCGM shows the CRC totals as N/A
# on H100) while the others still work, and replay/recovery must keep being watched there.
_COUNTERS = (
    ("replay", ERR_DL_REPLAY, "replay"),
    ("recovery", ERR_DL_RECOVERY, "recovery"),
    ("crc_flit", ERR_DL_CRC_FLIT, "flit CRC"),
    ("crc_data", ERR_DL_CRC_DATA, "data CRC"),
)
_FATAL_COUNTERS = ("replay", "recovery")
_COUNTER_WORDS = {name: words for name, _, words in _COUNTERS}

# nvmlGpuFabricInfo_v2_t as libnvidia-ml writes it (nvml.h): unsigned version, unsigned char
# clusterUuid[16], nvmlReturn_t status, unsigned cliqueId, nvmlGpuFabricState_t state (an unsigned
# char, padded to 4), unsigned healthMask: 36 bytes, the size in nvmlGpuFabricInfo_v2 = 0x02000024.
_FABRIC_V2 = struct.Struct("<I16sIIB3xI")


class NvmlUnavailableError(RuntimeError):
    """NVML cannot be used on this machine (no driver, no library, no permission)."""


class NvmlLib(Protocol):
    """The part of the `pynvml` module the adapter uses; read-only, so a module or a fake object fits."""

    @property
    def NVMLError(self) -> type[Exception]: ...
    @property
    def NVMLError_GpuIsLost(self) -> type[Exception]: ...
    @property
    def NVMLError_NotSupported(self) -> type[Exception]: ...
    @property
    def NVMLError_InvalidArgument(self) -> type[Exception]: ...
    @property
    def NVMLError_FunctionNotFound(self) -> type[Exception]: ...
    @property
    def NVMLError_LibraryNotFound(self) -> type[Exception]: ...
    @property
    def NVMLError_DriverNotLoaded(self) -> type[Exception]: ...

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlDeviceGetCount(self) -> int: ...
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any: ...
    def nvmlDeviceGetUUID(self, handle: Any) -> str: ...
    def nvmlDeviceGetName(self, handle: Any) -> str: ...
    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any: ...
    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any: ...
    def nvmlDeviceGetMemoryAffinity(self, handle: Any, node_set_size: int, scope: int) -> Any: ...
    def nvmlDeviceGetNvLinkState(self, handle: Any, link: int) -> int: ...
    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: Any, link: int) -> int: ...
    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle: Any, link: int) -> Any: ...
    def nvmlDeviceGetNvLinkVersion(self, handle: Any, link: int) -> int: ...
    def nvmlDeviceGetNvLinkErrorCounter(self, handle: Any, link: int, counter: int) -> int: ...
    def nvmlDeviceGetMigMode(self, handle: Any) -> Sequence[int]: ...
    def nvmlDeviceGetRemappedRows(self, handle: Any) -> tuple[int, int, int, int]: ...
    def nvmlDeviceGetGpuFabricInfoV(self, handle: Any, info: Any) -> int: ...
    def c_nvmlGpuFabricInfoV_t(self) -> Any: ...


def load_pynvml() -> NvmlLib:
    """Import the real binding; the only `import pynvml` in gputopo."""
    try:
        import pynvml
    except ImportError as e:
        raise NvmlUnavailableError(f"the nvidia-ml-py package is not installed ({e})") from None
    return cast(NvmlLib, pynvml)


# --------------------------------------------------------------------------------------------------
# Pure pieces


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
    for name, _, words in _COUNTERS:
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
        elif name in _FATAL_COUNTERS:
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


def _worst(a: Health, b: Health) -> Health:
    order = (Health.OK, Health.DEGRADED, Health.FAILED)
    return a if order.index(a) >= order.index(b) else b


# --------------------------------------------------------------------------------------------------
# Stateful pieces: what is remembered between discovery cycles


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

    def observe(self, key: tuple[str, int], counters: LinkCounters, now: float) -> LinkVerdict:
        baseline = self.baselines.setdefault(key, {})
        verdict = assess_link_errors(baseline, counters, now)
        for name, _, _ in _COUNTERS:
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


# --------------------------------------------------------------------------------------------------
# Discovery


@dataclass
class _Link:
    index: int
    active: bool
    remote_type: int | None = None
    remote_bus: str | None = None
    verdict: LinkVerdict = field(default_factory=LinkVerdict)


@dataclass
class _Gpu:
    index: int
    uuid: str = ""
    model: str = "unknown"
    memory_mib: int = 0
    bus_id: str = ""
    numa: int | None = None
    health: Health = Health.OK
    reasons: list[str] = field(default_factory=list)
    links: list[_Link] = field(default_factory=list)
    generation: int = 0
    clique: str | None = None


@dataclass(frozen=True)
class NvmlDiscovery:
    """One discovery result: the topology (no NICs) plus notes on calls the hardware does not support."""

    topology: NodeTopology
    notes: tuple[str, ...] = ()


class NvmlAdapter:
    """Reads GPUs, NVLink, fabric and health through NVML. Keep one instance for the agent's life:
    error counters and link history are compared across calls of `discover`."""

    def __init__(
        self,
        lib: NvmlLib,
        sysfs_root: Path = Path("/sys"),
        clock: Callable[[], float] = time.monotonic,
        tracker: HealthTracker | None = None,
    ) -> None:
        self._lib = lib
        self._sysfs = sysfs_root
        self._clock = clock
        self._tracker = tracker or HealthTracker()
        self._absent = (lib.NVMLError_NotSupported, lib.NVMLError_InvalidArgument, lib.NVMLError_FunctionNotFound)
        self._open = False
        self._notes: list[str] = []

    def open(self) -> None:
        """nvmlInit; a missing driver becomes one NvmlUnavailableError with a clear message."""
        try:
            self._lib.nvmlInit()
        except self._lib.NVMLError as e:
            if isinstance(e, (self._lib.NVMLError_LibraryNotFound, self._lib.NVMLError_DriverNotLoaded)):
                raise NvmlUnavailableError(
                    f"NVIDIA driver not available ({e}): libnvidia-ml.so.1 could not be loaded or the kernel "
                    "driver is not running. Run on a GPU node with the NVIDIA driver (and the container "
                    "toolkit), or use --backend fixture:NAME / file:PATH."
                ) from None
            raise NvmlUnavailableError(f"NVML initialisation failed: {e}") from None
        self._open = True

    def close(self) -> None:
        if self._open:
            self._open = False
            try:
                self._lib.nvmlShutdown()
            except self._lib.NVMLError as e:
                log.warning("nvmlShutdown failed", extra={"error": str(e)})

    def _try(self, what: str, fn: Callable[..., T], *args: Any) -> T | None:
        """Call NVML; None (and a note) for the errors that mean 'this GPU does not have that'."""
        try:
            return fn(*args)
        except self._absent as e:
            self._notes.append(f"{what}: {type(e).__name__.removeprefix('NVMLError_')}")
            return None

    def discover(self) -> NvmlDiscovery:
        if not self._open:
            self.open()
        self._notes = []
        now = self._clock()
        gpus = [self._read_gpu(i, now) for i in range(self._lib.nvmlDeviceGetCount())]
        return NvmlDiscovery(topology=self._assemble(gpus), notes=tuple(dict.fromkeys(self._notes)))

    def _read_gpu(self, index: int, now: float) -> _Gpu:
        gpu = _Gpu(index=index)
        lib = self._lib
        try:
            h = lib.nvmlDeviceGetHandleByIndex(index)
            gpu.uuid = str(lib.nvmlDeviceGetUUID(h))
            gpu.model = str(lib.nvmlDeviceGetName(h))
            gpu.memory_mib = int(lib.nvmlDeviceGetMemoryInfo(h).total) // MIB
            gpu.bus_id = normalize_bus_id(lib.nvmlDeviceGetPciInfo(h).busId)
            gpu.numa = self._numa(h, gpu.bus_id)
            self._read_links(h, gpu, now)
            self._read_health(h, gpu)
            self._read_fabric(h, gpu)
        except lib.NVMLError as e:
            # GpuIsLost, Unknown and the like: the GPU must not get work; say why.
            gpu.health = Health.FAILED
            gpu.reasons.append(f"NVML error: {e} ({type(e).__name__})")
            log.error("GPU discovery failed", extra={"gpu": index, "error": str(e)})
        return gpu

    def _numa(self, h: Any, bus_id: str) -> int | None:
        # nvmlDeviceGetNumaNodeId is the GPU-memory node on Grace only; the CPU side comes from sysfs
        # or the memory affinity mask.
        node = pci_numa_node(self._sysfs, bus_id)
        if node is not None:
            return node
        mask = self._try("memory affinity", self._lib.nvmlDeviceGetMemoryAffinity, h, 1, AFFINITY_SCOPE_NODE)
        if mask is None:
            return None
        bitsset = int(mask[0])
        return bitsset.bit_length() - 1 if bitsset and bitsset & (bitsset - 1) == 0 else None

    def _read_links(self, h: Any, gpu: _Gpu, now: float) -> None:
        lib = self._lib
        for link in range(_LINK_SCAN_GUARD):
            try:
                state = lib.nvmlDeviceGetNvLinkState(h, link)
            except self._absent as e:
                if link == 0:
                    self._notes.append(f"NVLink: {type(e).__name__.removeprefix('NVMLError_')}")
                break  # past the last link (InvalidArgument) or no NVLink at all (NotSupported)
            entry = _Link(index=link, active=state == FEATURE_ENABLED)
            gpu.links.append(entry)
            if not entry.active:
                continue
            self._tracker.ever_active.add((gpu.uuid, link))
            entry.remote_type = self._try("NVLink remote type", lib.nvmlDeviceGetNvLinkRemoteDeviceType, h, link)
            if entry.remote_type in (None, DEVICE_TYPE_GPU):
                info = self._try("NVLink remote PCI", lib.nvmlDeviceGetNvLinkRemotePciInfo, h, link)
                entry.remote_bus = normalize_bus_id(info.busId) if info is not None else None
            if gpu.generation == 0:
                version = self._try("NVLink version", lib.nvmlDeviceGetNvLinkVersion, h, link)
                gpu.generation = nvlink_generation(int(version)) if version is not None else 0
            entry.verdict = self._tracker.observe((gpu.uuid, link), self._counters(h, gpu, link), now)

    def _counters(self, h: Any, gpu: _Gpu, link: int) -> LinkCounters:
        """Each counter on its own: NotSupported leaves that one absent, any other error marks it failed."""
        values: dict[str, int | None] = {}
        failed: list[str] = []
        for name, ctr, words in _COUNTERS:
            try:
                values[name] = int(self._lib.nvmlDeviceGetNvLinkErrorCounter(h, link, ctr))
            except self._absent as e:
                values[name] = None
                self._notes.append(f"NVLink {words} error counter: {type(e).__name__.removeprefix('NVMLError_')}")
            except self._lib.NVMLError as e:
                if isinstance(e, self._lib.NVMLError_GpuIsLost):
                    raise  # the whole GPU is gone, not one counter
                values[name] = None
                failed.append(name)
                log.warning(
                    "NVLink error counter read failed",
                    extra={"gpu": gpu.index, "link": link, "counter": name, "error": str(e)},
                )
        return LinkCounters(**values, failed=tuple(failed))

    def _read_health(self, h: Any, gpu: _Gpu) -> None:
        rows = self._try("remapped rows", self._lib.nvmlDeviceGetRemappedRows, h)
        if rows is not None:
            _corr, _unc, pending, failure = (int(x) for x in rows)
            if failure:
                gpu.health = _worst(gpu.health, Health.FAILED)
                gpu.reasons.append("HBM row remapping failed: replace the GPU (RMA candidate)")
            elif pending:
                gpu.health = _worst(gpu.health, Health.DEGRADED)
                gpu.reasons.append("HBM row remapping pending: the GPU needs a reset")
        mig = self._try("MIG mode", self._lib.nvmlDeviceGetMigMode, h)
        if mig is not None and int(mig[0]) == MIG_ENABLE:
            gpu.reasons.append(MIG_REASON)

    def _read_fabric(self, h: Any, gpu: _Gpu) -> None:
        try:
            info = self._lib.c_nvmlGpuFabricInfoV_t()
        except AttributeError:  # a binding older than 12.560
            self._notes.append("GPU fabric: binding lacks nvmlDeviceGetGpuFabricInfoV")
            return
        if self._try("GPU fabric", self._lib.nvmlDeviceGetGpuFabricInfoV, h, ctypes.byref(info)) is None:
            return
        fabric = decode_fabric_info(info)
        if fabric is None:
            self._notes.append("GPU fabric: the binding's fabric-info struct is smaller than NVML's v2")
            return
        gpu.clique = fabric_clique(fabric.state, fabric.status, fabric.cluster_uuid, fabric.clique_id)
        if gpu.clique is not None and fabric.health_mask & 0x3 == 1:
            # healthMask bits 0-1 are DEGRADED_BW: 1 = TRUE, 2 = FALSE, 0 = not supported.
            gpu.health = _worst(gpu.health, Health.DEGRADED)
            gpu.reasons.append("NVLink fabric reports degraded bandwidth")

    def _assemble(self, gpus: list[_Gpu]) -> NodeTopology:
        by_bus = {g.bus_id: g.index for g in gpus if g.bus_id}
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
                    if any_active or (g.uuid, lk.index) in self._tracker.ever_active:
                        degraded.append(
                            DegradedLink(gpu=g.index, link=lk.index, state=LinkState.DOWN, detail="link not active")
                        )
                        down.append(lk.index)
                    continue
                if lk.verdict.degraded:
                    degraded.append(
                        DegradedLink(gpu=g.index, link=lk.index, state=LinkState.DEGRADED, detail=lk.verdict.detail)
                    )
                    g.health = _worst(g.health, Health.DEGRADED)
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
                if lk.remote_type in (DEVICE_TYPE_GPU, None) and peer is not None and peer != g.index:
                    direct[g.index][peer] += 1
                else:
                    # SWITCH, UNKNOWN, or a remote NVML cannot place (VMs, GB200 switch trays):
                    # NCCL and PyTorch assume an invisible NVSwitch.
                    switch[g.index] += 1
                    nvswitch = True
            # One reason per kind, not per link: a 36-link GPU would otherwise overflow MAX_REASONS.
            if down:
                g.health = _worst(g.health, Health.DEGRADED)
                g.reasons.append(f"NVLink {_links_phrase(down)} down")
            for detail, links in unknown.items():
                g.health = _worst(g.health, Health.DEGRADED)
                g.reasons.append(f"NVLink {_links_phrase(links)} health unknown: {detail}")
        generations = [g.generation for g in gpus if g.generation]
        generation = max(generations, default=0)
        cliques = Counter(g.clique for g in gpus if g.clique)
        fabric = None
        if cliques:
            clique, _ = cliques.most_common(1)[0]
            if len(cliques) > 1:
                log.warning("GPUs report different fabric cliques", extra={"cliques": sorted(cliques)})
            fabric = FabricInfo(clique=clique)
        return NodeTopology(
            gpus=tuple(
                GpuInfo(
                    index=g.index,
                    uuid=g.uuid,
                    model=g.model,
                    memory_mib=g.memory_mib,
                    pci_bus_id=g.bus_id,
                    numa_node=g.numa,
                    health=g.health,
                    reasons=_bounded(g.reasons),
                )
                for g in gpus
            ),
            nvlink=NvlinkInfo(
                generation=generation,
                gbps_per_link=NVLINK_GBPS_PER_LINK.get(generation, 0.0),
                nvswitch=nvswitch,
                links=nvlink_matrix(direct, switch) if n else (),
            ),
            degraded_links=tuple(degraded),
            fabric=fabric,
        )
