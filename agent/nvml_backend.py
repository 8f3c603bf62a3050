"""NVML adapter: the only module that imports `pynvml` (package nvidia-ml-py).

Everything NVML-specific lives here and ends as a `gputopo.model.NodeTopology` (without NICs; those
come from sysfs). The library is reached through the `NvmlLib` protocol so tests pass a fake module.
Facts and rules follow `nvml-and-nodes.md`:

- links are enumerated by `nvmlDeviceGetNvLinkState` until it raises InvalidArgument/NotSupported;
  never by capability, never up to the binding's NVML_NVLINK_MAX_LINKS (§0.3);
- NV# = direct(i, j) + min(switch(i), switch(j)), remote type GPU counted by bus id, SWITCH or an
  unresolvable remote counted as a switch link (§3.1, §3.2);
- a fabric clique only for state COMPLETED, status SUCCESS and a non-zero cluster UUID (§4);
- NVLink error counters are compared between cycles with DCGM's thresholds (§5.2, §5.4);
- NotSupported / FunctionNotFound / InvalidArgument mean "absent" (§2.6).
"""

from __future__ import annotations

import ctypes
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast

from agent.sysfs import pci_numa_node
from gputopo.model import DegradedLink, FabricInfo, GpuInfo, Health, LinkState, NodeTopology, NvlinkInfo
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
MIB = 1024 * 1024

# Not a link count: only stops a faulty library that never rejects a link index from looping forever.
_LINK_SCAN_GUARD = 128

# nvmlDeviceGetNvLinkVersion returns an enum, not the generation (1.0, 2.0, 2.2, 3.0, 3.1, 4.0, 5.0, 6.0).
_NVLINK_VERSION_TO_GENERATION = {1: 1, 2: 2, 3: 2, 4: 3, 5: 3, 6: 4, 7: 5, 8: 6}

# DCGM's NVLink health rules (dcgmGpuHardwareLimits.h): CRC matters at 100/s and above; any replay
# or recovery error fails the link. A verdict is held for DCGM's 60 s watch window so one burst does
# not make the published topology flap every cycle.
CRC_ERRORS_PER_SECOND_LIMIT = 100.0
HEALTH_HOLD_SECONDS = 60.0


class NvmlUnavailableError(RuntimeError):
    """NVML cannot be used on this machine (no driver, no library, no permission)."""


class NvmlLib(Protocol):
    """The part of the `pynvml` module the adapter uses; read-only, so a module or a fake object fits."""

    @property
    def NVMLError(self) -> type[Exception]: ...
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
    """NVLink data-link error counters of one link at one instant."""

    replay: int = 0
    recovery: int = 0
    crc_flit: int = 0
    crc_data: int = 0


@dataclass(frozen=True)
class LinkVerdict:
    """Outcome of comparing two counter readings: degraded (not counted), a warning, or nothing."""

    degraded: bool = False
    warning: bool = False
    detail: str = ""


def assess_link_errors(prev: LinkCounters | None, cur: LinkCounters, elapsed_s: float) -> LinkVerdict:
    """DCGM's rule on two successive readings: replay/recovery rise or CRC ≥ 100/s → degraded;
    a smaller CRC rise → warning only. A counter that went down was reset: start again."""
    if prev is None or elapsed_s <= 0:
        return LinkVerdict()
    d_replay = cur.replay - prev.replay
    d_recovery = cur.recovery - prev.recovery
    d_crc = (cur.crc_flit - prev.crc_flit) + (cur.crc_data - prev.crc_data)
    if min(d_replay, d_recovery, cur.crc_flit - prev.crc_flit, cur.crc_data - prev.crc_data) < 0:
        return LinkVerdict()
    window = f"{elapsed_s:.0f} s"
    if d_replay > 0 or d_recovery > 0:
        what = []
        if d_replay:
            what.append(f"{d_replay} replay")
        if d_recovery:
            what.append(f"{d_recovery} recovery")
        return LinkVerdict(degraded=True, detail=" and ".join(what) + f" errors in {window}")
    rate = d_crc / elapsed_s
    if rate >= CRC_ERRORS_PER_SECOND_LIMIT:
        return LinkVerdict(
            degraded=True, detail=f"CRC errors at {rate:.0f}/s (limit {CRC_ERRORS_PER_SECOND_LIMIT:.0f}/s)"
        )
    if d_crc > 0:
        return LinkVerdict(warning=True, detail=f"CRC errors below {CRC_ERRORS_PER_SECOND_LIMIT:.0f}/s")
    return LinkVerdict()


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
    """Counter readings, links ever seen active, and held verdicts, keyed by (GPU UUID, link)."""

    hold_s: float = HEALTH_HOLD_SECONDS
    readings: dict[tuple[str, int], tuple[float, LinkCounters]] = field(default_factory=dict)
    ever_active: set[tuple[str, int]] = field(default_factory=set)
    held: dict[tuple[str, int], _HeldVerdict] = field(default_factory=dict)

    def observe(self, key: tuple[str, int], counters: LinkCounters, now: float) -> LinkVerdict:
        prev = self.readings.get(key)
        self.readings[key] = (now, counters)
        verdict = assess_link_errors(prev[1] if prev else None, counters, now - prev[0] if prev else 0.0)
        held = self.held.get(key)
        if held is not None and now >= held.until:
            del self.held[key]
            held = None
        if not (verdict.degraded or verdict.warning):
            return held.verdict if held else verdict
        if held is not None and held.verdict.degraded and not verdict.degraded:
            return held.verdict  # a warning neither clears nor extends a degraded verdict
        if held is not None and held.verdict.degraded == verdict.degraded:
            # Same verdict again: extend it but keep the first wording, so the Node is not rewritten.
            held.until = now + self.hold_s
            return held.verdict
        self.held[key] = _HeldVerdict(verdict, now + self.hold_s)
        return verdict


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
            counters = self._counters(h, link)
            if counters is not None:
                entry.verdict = self._tracker.observe((gpu.uuid, link), counters, now)

    def _counters(self, h: Any, link: int) -> LinkCounters | None:
        values = []
        for ctr in (ERR_DL_REPLAY, ERR_DL_RECOVERY, ERR_DL_CRC_FLIT, ERR_DL_CRC_DATA):
            v = self._try("NVLink error counters", self._lib.nvmlDeviceGetNvLinkErrorCounter, h, link, ctr)
            if v is None:
                return None
            values.append(int(v))
        return LinkCounters(*values)

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
            gpu.reasons.append("MIG mode enabled: the GPU is partitioned and has no NVLink peer-to-peer")

    def _read_fabric(self, h: Any, gpu: _Gpu) -> None:
        try:
            info = self._lib.c_nvmlGpuFabricInfoV_t()
        except AttributeError:  # a binding older than 12.560
            self._notes.append("GPU fabric: binding lacks nvmlDeviceGetGpuFabricInfoV")
            return
        if self._try("GPU fabric", self._lib.nvmlDeviceGetGpuFabricInfoV, h, ctypes.byref(info)) is None:
            return
        gpu.clique = fabric_clique(int(info.state), int(info.status), bytes(info.clusterUuid), int(info.cliqueId))
        if gpu.clique is not None and int(getattr(info, "healthMask", 0)) & 0x3 == 1:
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
            for lk in g.links:
                if not lk.active:
                    # Expected when the GPU uses NVLink at all or this link was once up; an unwired
                    # PCIe card reports every link inactive and is simply not NVLink-connected.
                    if any_active or (g.uuid, lk.index) in self._tracker.ever_active:
                        degraded.append(
                            DegradedLink(gpu=g.index, link=lk.index, state=LinkState.DOWN, detail="link not active")
                        )
                        g.health = _worst(g.health, Health.DEGRADED)
                        g.reasons.append(f"NVLink link {lk.index} down")
                    continue
                if lk.verdict.degraded:
                    degraded.append(
                        DegradedLink(gpu=g.index, link=lk.index, state=LinkState.DEGRADED, detail=lk.verdict.detail)
                    )
                    g.health = _worst(g.health, Health.DEGRADED)
                    g.reasons.append(f"NVLink link {lk.index} degraded: {lk.verdict.detail}")
                    continue
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
                    reasons=tuple(dict.fromkeys(g.reasons)),
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
