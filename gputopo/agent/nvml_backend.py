"""NVML adapter: the only module that imports `pynvml` (package nvidia-ml-py).

Everything read through NVML passes here: GPUs, memory, PCIe bus and NUMA node, MIG mode, row
remapping, NVLink state and error counters, fabric registration and health. The readings are judged by
`gputopo.agent.nvml_health` (error counters) and assembled by `gputopo.agent.nvml_topology` into a
`gputopo.model.NodeTopology` (without NICs; those come from sysfs). The library is reached through
the `NvmlLib` protocol so tests pass a fake module.

- links are enumerated by `nvmlDeviceGetNvLinkState` until it raises InvalidArgument/NotSupported;
  never by capability (TRUE for every index on B200), never up to the binding's NVML_NVLINK_MAX_LINKS;
- each NVLink error counter is read on its own: one the GPU does not support is absent, one whose
  read fails is marked failed (its link's health is then unknown, never healthy);
- NotSupported / FunctionNotFound / InvalidArgument mean "absent";
- one GPU's failure is that GPU's only: an NVML error fails it with the error; any other exception while
  reading it (OSError, a decode or type error) or a value out of the model's range makes it `failed`
  with the reason `health unknown: ...` and nothing else of its reading; the other GPUs are published
  as they are: their links to it count as links to a GPU that cannot be read, never to an NVSwitch;
- Xid errors arrive through NVML's event API: one event set for the agent's life, each GPU registered
  once for critical Xids, drained without waiting each discovery (`gputopo.agent.nvml_events`);
  `gputopo.agent.nvml_xid` judges them. An NVML or binding without the event API is a note.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

from pydantic import ValidationError

from gputopo.agent.nvml_events import XidEvents
from gputopo.agent.nvml_health import COUNTERS, HealthTracker, LinkCounters
from gputopo.agent.nvml_lib import NvmlLib
from gputopo.agent.nvml_topology import (
    BUS_ID,
    DEVICE_TYPE_GPU,
    FABRIC_STATE_COMPLETED,
    NVML_SUCCESS,
    GpuReading,
    LinkReading,
    assemble,
    decode_fabric_info,
    fabric_clique,
    gpu_fabric,
    gpu_info,
    normalize_bus_id,
    nvlink_generation,
    nvlink_pairs,
    p2p_status_words,
    with_p2p_faults,
    worst_health,
)
from gputopo.agent.nvml_xid import XidMemory
from gputopo.agent.sysfs import pci_numa_node
from gputopo.model import (
    MAX_GPUS_PER_NODE,
    MAX_NAME_LENGTH,
    MAX_NVLINKS,
    MAX_TEXT_LENGTH,
    FabricHealth,
    Health,
    NodeTopology,
    decode_health,
    degraded_reason,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

# NVML constants, copied from the C API (stable values) rather than read from the binding, whose
# set of names differs between nvidia-ml-py versions.
FEATURE_ENABLED = 1
AFFINITY_SCOPE_NODE = 0
MIG_ENABLE = 1
# The health reason that marks a GPU in MIG mode; the device plugin refuses such a node by it.
MIG_REASON = "MIG mode enabled: the GPU is partitioned and has no NVLink peer-to-peer"
MIB = 1024 * 1024
P2P_CAPS_INDEX_NVLINK = 2
P2P_STATUS_OK = 0

# A P2P failure's own words are cut shorter than a reason, so the sentence around them fits too.
_MAX_P2P_DETAIL = MAX_TEXT_LENGTH // 2


class NvmlUnavailableError(RuntimeError):
    """NVML cannot be used on this machine (no driver, no library, no permission)."""


class NvmlDiscoveryError(RuntimeError):
    """NVML answered something no node can be built from (a GPU count past the model's bound)."""


def load_pynvml() -> NvmlLib:
    """Import the real binding; the only `import pynvml` in gputopo."""
    try:
        import pynvml
    except ImportError as e:
        raise NvmlUnavailableError(f"the nvidia-ml-py package is not installed ({e})") from None
    return cast(NvmlLib, pynvml)


@dataclass(frozen=True)
class NvmlDiscovery:
    """One discovery result: the topology (no NICs) plus notes on calls the hardware does not support."""

    topology: NodeTopology
    notes: tuple[str, ...] = ()


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    where = ".".join(str(p) for p in err["loc"])
    return f"{where}: {err['msg']}" if where else str(err["msg"])


def _clip(text: str, limit: int = MAX_TEXT_LENGTH) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


class NvmlAdapter:
    """Reads GPUs, NVLink, fabric and health through NVML. Keep one instance for the agent's life:
    error counters and link history are compared across calls of `discover`."""

    def __init__(
        self,
        lib: NvmlLib,
        sysfs_root: Path = Path("/sys"),
        clock: Callable[[], float] = time.monotonic,
        tracker: HealthTracker | None = None,
        xids: XidMemory | None = None,
    ) -> None:
        self._lib = lib
        self._sysfs = sysfs_root
        self._clock = clock
        self._tracker = tracker or HealthTracker()
        self._absent = (lib.NVMLError_NotSupported, lib.NVMLError_InvalidArgument, lib.NVMLError_FunctionNotFound)
        self._open = False
        self._notes: list[str] = []
        self._uuids: dict[int, str] = {}  # the last UUID read per index
        self._buses: dict[int, str] = {}  # the last PCI bus id read per index
        self._handles: dict[int, Any] = {}  # this cycle's handles, for the peer-to-peer checks
        self._xid_events = XidEvents(lib, self._absent, xids or XidMemory())

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
            self._xid_events.close()
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
        self._handles = {}
        now = self._clock()
        count = int(self._lib.nvmlDeviceGetCount())
        if not 0 <= count <= MAX_GPUS_PER_NODE:
            # Checked before any GPU is read: a driver answering 2^32-1 would otherwise cost that many
            # calls per poll, to publish nothing the model admits.
            raise NvmlDiscoveryError(f"NVML reports {count} GPUs; a node has at most {MAX_GPUS_PER_NODE}")
        gpus = self._unique_identities([self._read_gpu(i, now) for i in range(count)])
        # Only the GPUs there now are remembered: UUIDs that change (a driver's garbage, GPUs swapped
        # without end) must not grow the link history or the last-read identities poll after poll.
        self._tracker.keep_only({g.uuid for g in gpus})
        self._uuids = {i: u for i, u in self._uuids.items() if i < count}
        self._buses = {i: b for i, b in self._buses.items() if i < count}
        self._xid_events.poll(gpus, self._handles, now, self._notes)
        topology = assemble(gpus, self._tracker.ever_active)
        topology = with_p2p_faults(topology, self._p2p_faults(topology))
        return NvmlDiscovery(topology=topology, notes=tuple(dict.fromkeys(self._notes)))

    def _p2p_faults(self, topology: NodeTopology) -> dict[tuple[int, int], str]:
        """Why peer-to-peer over NVLink does not work, per NVLink-connected pair of readable GPUs: an Active
        link can still carry no traffic (a fabric manager or driver fault), which only this call shows."""
        faults: dict[tuple[int, int], str] = {}
        for i, j in nvlink_pairs(topology):
            try:
                status = int(
                    self._lib.nvmlDeviceGetP2PStatus(self._handles[i], self._handles[j], P2P_CAPS_INDEX_NVLINK)
                )
            except self._lib.NVMLError_FunctionNotFound as e:
                self._notes.append(f"NVLink P2P status: {type(e).__name__.removeprefix('NVMLError_')}")
                return {}  # an older driver: nothing checked, nothing claimed
            except self._absent as e:
                # This pair only: one GPU that refuses the call must not hide another pair's dead link.
                self._notes.append(f"NVLink P2P status: {type(e).__name__.removeprefix('NVMLError_')}")
                continue
            except self._lib.NVMLError_GpuIsLost:
                continue  # the GPU is failed by its own reading next cycle; the pair says nothing more
            except Exception as e:  # any other NVML error, or a binding's type error: unknown, never healthy
                faults[(i, j)] = _clip(f"could not be checked ({type(e).__name__}: {e})", _MAX_P2P_DETAIL)
                continue
            if status != P2P_STATUS_OK:
                faults[(i, j)] = (
                    f"not working although its links are Active (NVML P2P status: {p2p_status_words(status)})"
                )
        return faults

    def _read_gpu(self, index: int, now: float) -> GpuReading:
        gpu = GpuReading(index=index)
        lib = self._lib
        try:
            h = lib.nvmlDeviceGetHandleByIndex(index)
            self._handles[index] = h
            gpu.uuid = str(lib.nvmlDeviceGetUUID(h))
            # The bus first: a GPU that fails later in its reading is still found at the far end of its
            # peers' NVLinks, so they are not taken for links to an NVSwitch. Only in BDF form: it is
            # joined into sysfs paths and published, so a path or garbage fails this GPU instead.
            bus_id = normalize_bus_id(lib.nvmlDeviceGetPciInfo(h).busId)
            if not BUS_ID.fullmatch(bus_id):
                raise ValueError(f"PCI bus id {bus_id[:64]!r} is not domain:bus:device.function")
            gpu.bus_id = bus_id
            gpu.model = str(lib.nvmlDeviceGetName(h))
            gpu.memory_mib = int(lib.nvmlDeviceGetMemoryInfo(h).total) // MIB
            gpu.numa = self._numa(h, gpu.bus_id)
            self._read_links(h, gpu, now)
            self._read_health(h, gpu)
            self._read_fabric(h, gpu)
        except lib.NVMLError as e:
            # GpuIsLost, Unknown and the like: the GPU must not get work; say why.
            gpu.health = Health.FAILED
            gpu.reasons.append(_clip(f"NVML error: {e} ({type(e).__name__})"))
            gpu.uuid = gpu.uuid or self._uuids.get(index, "")
            gpu.bus_id = gpu.bus_id or self._buses.get(index, "")
            log.error("GPU discovery failed", extra={"gpu": index, "error": str(e)})
            return gpu
        except Exception as e:
            # Anything else (OSError from sysfs, a binding's decode or type error): this GPU only.
            return self._unreadable(gpu, f"reading it failed: {type(e).__name__}: {e}")
        try:
            gpu_info(gpu, reasons=False)
        except ValidationError as e:  # a value out of the model's range (memory, NUMA node, a name's length)
            return self._unreadable(gpu, f"a reading is out of range: {_first_error(e)}")
        self._uuids[index] = gpu.uuid
        self._buses[index] = gpu.bus_id
        return gpu

    def _unique_identities(self, gpus: list[GpuReading]) -> list[GpuReading]:
        """`gpus` with every GPU whose PCI bus id or UUID another one also reports failed: which of them lies
        cannot be told. A shared bus is dropped (published twice it would give the peers' links to one GPU
        to the other, or unplaced to an NVSwitch); a shared UUID is one device ID for two GPUs, so neither
        may be handed out."""
        buses = Counter(g.bus_id for g in gpus if g.bus_id)
        uuids = Counter(g.uuid for g in gpus if g.uuid)
        out = []
        for g in gpus:
            field, value = ("PCI bus id", g.bus_id) if buses[g.bus_id] > 1 else ("UUID", g.uuid)
            if buses[g.bus_id] < 2 and uuids[g.uuid] < 2:
                out.append(g)
                continue
            others = ", ".join(str(o.index) for o in gpus if o is not g and value in (o.bus_id, o.uuid))
            why = f"health unknown: {field} {value} is also reported by GPU {others}"
            bus = "" if field == "PCI bus id" else g.bus_id
            failed = GpuReading(index=g.index, uuid=g.uuid, bus_id=bus, health=Health.FAILED, reasons=[_clip(why)])
            if not bus:
                self._buses.pop(g.index, None)  # never republished as this GPU's when it fails later
            log.error("GPU discovery failed", extra={"gpu": g.index, "error": why})
            out.append(failed)
        return out

    def _unreadable(self, gpu: GpuReading, why: str) -> GpuReading:
        """What is published for a GPU whose reading failed: its index, UUID and PCI bus (this cycle's, else
        the last one read, so the device plugin's device keeps its ID and the peers' links to it are known
        as links to it), failed so it gets no work, health unknown with the reason; nothing else of the
        reading is trusted."""
        uuid = gpu.uuid if isinstance(gpu.uuid, str) and 0 < len(gpu.uuid) <= MAX_NAME_LENGTH else ""
        out = GpuReading(
            index=gpu.index,
            uuid=uuid or self._uuids.get(gpu.index, ""),
            # Only to find it at the far end of its peers' links: set only after normalize_bus_id passed.
            bus_id=gpu.bus_id or self._buses.get(gpu.index, ""),
            health=Health.FAILED,
        )
        out.reasons.append(_clip(f"health unknown: {why}"))
        log.error("GPU discovery failed", extra={"gpu": gpu.index, "error": why})
        return out

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

    def _read_links(self, h: Any, gpu: GpuReading, now: float) -> None:
        lib = self._lib
        for link in range(MAX_NVLINKS + 1):
            try:
                state = lib.nvmlDeviceGetNvLinkState(h, link)
            except self._absent as e:
                if link == 0:
                    self._notes.append(f"NVLink: {type(e).__name__.removeprefix('NVMLError_')}")
                break  # past the last link (InvalidArgument) or no NVLink at all (NotSupported)
            if link == MAX_NVLINKS:
                # A library that never rejects a link index: stop, and trust none of this GPU's reading.
                raise ValueError(f"NVML reports more than {MAX_NVLINKS} NVLinks")
            entry = LinkReading(index=link, active=state == FEATURE_ENABLED)
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

    def _counters(self, h: Any, gpu: GpuReading, link: int) -> LinkCounters:
        """Each counter on its own: NotSupported leaves that one absent, any other error marks it failed."""
        values: dict[str, int | None] = {}
        failed: list[str] = []
        for name, ctr, words in COUNTERS:
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

    def _read_health(self, h: Any, gpu: GpuReading) -> None:
        rows = self._try("remapped rows", self._lib.nvmlDeviceGetRemappedRows, h)
        if rows is not None:
            _corr, _unc, pending, failure = (int(x) for x in rows)
            if failure:
                gpu.health = worst_health(gpu.health, Health.FAILED)
                gpu.reasons.append("HBM row remapping failed: replace the GPU (RMA candidate)")
            elif pending:
                gpu.health = worst_health(gpu.health, Health.DEGRADED)
                gpu.reasons.append("HBM row remapping pending: the GPU needs a reset")
        mig = self._try("MIG mode", self._lib.nvmlDeviceGetMigMode, h)
        if mig is not None and int(mig[0]) == MIG_ENABLE:
            gpu.reasons.append(MIG_REASON)

    def _read_fabric(self, h: Any, gpu: GpuReading) -> None:
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
        gpu.fabric = gpu_fabric(fabric)
        if fabric.state > FABRIC_STATE_COMPLETED:
            self._notes.append(f"GPU fabric: unknown registration state {fabric.state}")
        if fabric.state == FABRIC_STATE_COMPLETED and fabric.status != NVML_SUCCESS:
            # Registration ended in an error (Insufficient Resources and the like): the GPU passes its
            # own checks, but its multi-node NVLink is not set up, so it is not healthy.
            gpu.health = worst_health(gpu.health, Health.DEGRADED)
            gpu.reasons.append(f"NVLink fabric registration failed: {self._error_words(fabric.status)}")
        health, why = decode_health(gpu.fabric)
        if health is FabricHealth.DEGRADED:
            # The GPU still works inside its tray, but its multi-node NVLink does not at full strength.
            gpu.health = worst_health(gpu.health, Health.DEGRADED)
            gpu.reasons.append(degraded_reason(why))

    def _error_words(self, code: int) -> str:
        """NVML's words for a return code (the binding asks the library), with the code."""
        try:
            words = str(self._lib.NVMLError(code))
        except Exception:  # a binding that cannot build the error: the code alone still says it
            return f"NVML status {code}"
        return _clip(f"{words} (NVML status {code})")
