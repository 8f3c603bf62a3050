"""Xid errors through NVML's event API, for the adapter in `gputopo.agent.nvml_backend`.

One event set for the adapter's life; each GPU registered once for critical Xids
(`nvmlEventTypeXidCriticalError`); the queue drained without waiting each discovery, at most
`XID_EVENTS_PER_POLL` events (a flood's rest waits in NVML's queue for the next poll). Each Xid is
judged by `gputopo.agent.nvml_xid`. An NVML or binding without the event API is a note, not an error.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from gputopo.agent.nvml_topology import GpuReading, worst_health
from gputopo.agent.nvml_xid import XidKind, XidMemory, classify

log = logging.getLogger(__name__)

# nvmlEventTypeXidCriticalError (C API value): the only event type registered.
EVENT_TYPE_XID = 0x8
# Bounds one poll's draining of an Xid flood; the rest waits in NVML's queue for the next poll.
XID_EVENTS_PER_POLL = 256


class EventLib(Protocol):
    """The event part of the `pynvml` module (`gputopo.agent.nvml_lib.NvmlLib` declares it too)."""

    @property
    def NVMLError(self) -> type[Exception]: ...
    @property
    def NVMLError_Timeout(self) -> type[Exception]: ...

    def nvmlEventSetCreate(self) -> Any: ...
    def nvmlDeviceRegisterEvents(self, handle: Any, event_types: int, event_set: Any) -> None: ...
    def nvmlEventSetWait_v2(self, event_set: Any, timeout_ms: int) -> Any: ...
    def nvmlEventSetFree(self, event_set: Any) -> None: ...


def _address(handle: Any) -> int | None:
    """A device handle's address (the event names its GPU by the handle NVML gave for it)."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return None


class XidEvents:
    """The adapter's Xid event set and what its Xids made of each GPU (`memory`)."""

    def __init__(self, lib: EventLib, absent: tuple[type[Exception], ...], memory: XidMemory) -> None:
        self._lib = lib
        self._absent = absent
        self.memory = memory
        self._notes: list[str] = []
        self._event_set: Any = None
        self._events_absent: str | None = None  # why there are no Xid events (said in every discovery)
        self._registered: set[str] = set()  # UUIDs registered for Xid events (or refused for good)

    def close(self) -> None:
        """Free the event set (NVML is being shut down); the next poll creates a new one."""
        if self._event_set is not None:
            try:
                self._lib.nvmlEventSetFree(self._event_set)
            except self._lib.NVMLError as e:
                log.warning("nvmlEventSetFree failed", extra={"error": str(e)})
            self._event_set = None
            self._registered.clear()

    def poll(self, gpus: Sequence[GpuReading], handles: Mapping[int, Any], now: float, notes: list[str]) -> None:
        """Register new GPUs for Xid events, take what NVML queued since the last poll, and apply each
        GPU's Xid verdict to its reading."""
        self._notes = notes
        if self._events():
            for gpu in gpus:
                if gpu.uuid and gpu.uuid not in self._registered and gpu.index in handles:
                    self._register(gpu, handles[gpu.index])
            self._drain(gpus, handles, now)
        for gpu in gpus:
            verdict = self.memory.verdict(gpu.uuid, now) if gpu.uuid else None
            if verdict is not None:
                gpu.health = worst_health(gpu.health, verdict[0])
                gpu.reasons.append(verdict[1])

    def _events(self) -> bool:
        """The event set, created once; False (with a note) where NVML or the binding has no event API."""
        if self._event_set is None and self._events_absent is None:
            try:
                self._event_set = self._lib.nvmlEventSetCreate()
            except AttributeError:  # a binding (or a test's fake) without the event API
                self._events_absent = "binding lacks nvmlEventSetCreate"
            except self._absent as e:
                self._events_absent = type(e).__name__.removeprefix("NVMLError_")
            except self._lib.NVMLError as e:  # transient: tried again next poll
                self._notes.append(f"Xid events: cannot create an event set ({e})")
                return False
        if self._events_absent is not None:
            self._notes.append(f"Xid events: {self._events_absent}")
            return False
        return True

    def _register(self, gpu: GpuReading, handle: Any) -> None:
        try:
            self._lib.nvmlDeviceRegisterEvents(handle, EVENT_TYPE_XID, self._event_set)
        except self._absent as e:
            # This GPU cannot report Xids (NotSupported on some boards): not asked again.
            self._registered.add(gpu.uuid)
            self._notes.append(f"Xid events on GPU {gpu.index}: {type(e).__name__.removeprefix('NVMLError_')}")
        except self._lib.NVMLError as e:  # a GPU lost this cycle: tried again when it is back
            log.warning("Xid event registration failed", extra={"gpu": gpu.index, "error": str(e)})
        else:
            self._registered.add(gpu.uuid)

    def _drain(self, gpus: Sequence[GpuReading], handles: Mapping[int, Any], now: float) -> None:
        by_handle = {_address(h): i for i, h in handles.items()}
        uuids = {g.index: g.uuid for g in gpus if g.uuid}
        for _ in range(XID_EVENTS_PER_POLL):
            try:
                data = self._lib.nvmlEventSetWait_v2(self._event_set, 0)
            except self._lib.NVMLError_Timeout:
                return  # nothing more queued
            except self._lib.NVMLError as e:
                self._notes.append(f"Xid events: waiting failed ({type(e).__name__.removeprefix('NVMLError_')})")
                return
            if int(data.eventType) & EVENT_TYPE_XID == 0:
                continue
            index = by_handle.get(_address(data.device))
            uuid = uuids.get(index) if index is not None else None
            code = int(data.eventData)
            # An application's Xids can come by the thousand: only the ones that say something of the GPU
            # are logged as warnings.
            level = logging.DEBUG if classify(code)[0] is XidKind.APPLICATION else logging.WARNING
            log.log(level, "Xid", extra={"gpu": index, "xid": code, "what": classify(code)[1]})
            if uuid is None or not self.memory.observe(uuid, code, now):
                self._notes.append("Xid events: an event for a GPU this poll did not read was dropped")
        # Said each poll it happens (the agent logs a note only once per process).
        log.warning("Xid flood: the rest is read next poll", extra={"per_poll": XID_EVENTS_PER_POLL})
        self._notes.append(f"Xid events: more than {XID_EVENTS_PER_POLL} queued; the rest next poll")
