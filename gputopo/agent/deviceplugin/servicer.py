"""The DevicePlugin gRPC service: devices from the agent's topology, placements as preferred allocations.

The devices' health is the last discovered topology's while discovery works. When no discovery has
succeeded for `unhealthy_after_s` (discovery failing as a whole, or hung), every device is reported
Unhealthy: the kubelet must not keep admitting pods to GPUs nobody has looked at; the next discovered
topology brings them back."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from gputopo.agent.deviceplugin import api_pb2, api_pb2_grpc
from gputopo.agent.deviceplugin.devices import (
    CDI_KIND,
    DeviceListStrategy,
    DeviceState,
    UnknownDeviceError,
    check_no_mig,
    container_response,
    device_states,
    mig_gpus,
)
from gputopo.agent.deviceplugin.preferred import AllocationRequestError, Preferrer, fallback_answer
from gputopo.model import NodeTopology

log = logging.getLogger(__name__)

# A ListAndWatch stream re-checks that its client is still there at least this often.
_STREAM_RECHECK_S = 5.0


class DevicePluginServicer(api_pb2_grpc.DevicePluginServicer):  # type: ignore[misc]
    """One instance outlives the gRPC servers that serve it (they are re-created when the kubelet restarts)."""

    def __init__(
        self,
        topology: NodeTopology,
        preferrer: Preferrer,
        strategy: DeviceListStrategy = DeviceListStrategy.ENVVAR,
        cdi_kind: str = CDI_KIND,
        unhealthy_after_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        check_no_mig(topology)
        self._preferrer = preferrer
        self._strategy = strategy
        self._cdi_kind = cdi_kind
        self._cond = threading.Condition()
        self._topology = topology
        self._states = device_states(topology)
        self._generation = 0
        self._stopped = False
        self._mig_logged: tuple[str, ...] = ()
        self._unhealthy_after = unhealthy_after_s
        self._clock = clock
        self._last_ok = clock()
        self._stale = False

    @property
    def topology(self) -> NodeTopology:
        with self._cond:
            return self._topology

    def devices(self) -> tuple[DeviceState, ...]:
        """What ListAndWatch reports now (every device Unhealthy while discovery is stale)."""
        with self._cond:
            self._check_stale()
            return self._reported()

    def _reported(self) -> tuple[DeviceState, ...]:
        if not self._stale:
            return self._states
        return tuple(dataclasses.replace(s, healthy=False) for s in self._states)

    def _check_stale(self) -> None:
        """Under the lock: mark the devices stale once no discovery has succeeded for unhealthy_after_s."""
        if self._unhealthy_after is None or self._stale:
            return
        quiet = self._clock() - self._last_ok
        if quiet >= self._unhealthy_after:
            self._stale = True
            self._generation += 1
            self._cond.notify_all()
            log.error(
                "no GPU discovery succeeded; every device is reported Unhealthy until one does",
                extra={"seconds": round(quiet, 1), "unhealthy_after_s": self._unhealthy_after},
            )

    def _until_stale(self) -> float:
        if self._unhealthy_after is None or self._stale:
            return _STREAM_RECHECK_S
        return max(0.0, min(_STREAM_RECHECK_S, self._last_ok + self._unhealthy_after - self._clock()))

    def update(self, topology: NodeTopology) -> None:
        """A discovery cycle's topology; ListAndWatch streams an update when a device's state changed."""
        mig = tuple(mig_gpus(topology))
        states = device_states(topology)
        with self._cond:
            self._topology = topology
            self._last_ok = self._clock()
            if mig and mig != self._mig_logged:
                log.error("GPUs switched to MIG mode are reported Unhealthy", extra={"gpus": list(mig)})
            self._mig_logged = mig
            if self._stale:
                self._stale = False
                self._generation += 1
                self._cond.notify_all()
                log.info("GPU discovery works again; devices report their discovered health")
            if states == self._states:
                return
            changed = sorted(set(states) ^ set(self._states), key=lambda s: s.index)
            self._states = states
            self._generation += 1
            self._cond.notify_all()
        log.info(
            "device list changed",
            extra={"changed": [f"{s.index}:{'ok' if s.healthy else 'unhealthy'}" for s in changed if s in states]},
        )

    def stop(self) -> None:
        """End every ListAndWatch stream (the agent is stopping)."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # ------------------------------------------------------------------ RPCs

    def GetDevicePluginOptions(self, request: api_pb2.Empty, context: Any) -> api_pb2.DevicePluginOptions:
        return api_pb2.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)

    def ListAndWatch(self, request: api_pb2.Empty, context: Any) -> Iterator[api_pb2.ListAndWatchResponse]:
        context.add_callback(self._wake)
        seen = -1
        while True:
            with self._cond:
                self._check_stale()
                while seen == self._generation and not self._stopped and context.is_active():
                    self._cond.wait(self._until_stale())
                    self._check_stale()
                if self._stopped or not context.is_active():
                    return
                seen, states = self._generation, self._reported()
            yield api_pb2.ListAndWatchResponse(devices=[s.to_proto() for s in states])

    def GetPreferredAllocation(
        self, request: api_pb2.PreferredAllocationRequest, context: Any
    ) -> api_pb2.PreferredAllocationResponse:
        topology = self.topology
        out = []
        for creq in request.container_requests:
            try:
                answer = self._preferrer.choose(
                    topology,
                    list(creq.available_deviceIDs),
                    list(creq.must_include_deviceIDs),
                    int(creq.allocation_size),
                )
            except AllocationRequestError as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except Exception:
                # An error here fails the pod's admission in the kubelet; any usable answer is better.
                log.exception("preferred allocation failed; answering with the first available devices")
                answer = fallback_answer(creq.available_deviceIDs, creq.must_include_deviceIDs, creq.allocation_size)
            out.append(api_pb2.ContainerPreferredAllocationResponse(deviceIDs=list(answer.device_ids)))
        return api_pb2.PreferredAllocationResponse(container_responses=out)

    def Allocate(self, request: api_pb2.AllocateRequest, context: Any) -> api_pb2.AllocateResponse:
        topology = self.topology
        index = {g.uuid: g.index for g in topology.gpus}
        out = []
        try:
            for creq in request.container_requests:
                ids = list(dict.fromkeys(creq.devices_ids))
                unknown = next((d for d in ids if d not in index), None)
                if unknown is not None:
                    raise UnknownDeviceError(unknown)
                ids.sort(key=lambda d: index[d])
                out.append(container_response(ids, self._strategy, self._cdi_kind))
        except UnknownDeviceError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        for creq in request.container_requests:
            self._preferrer.allocated(topology, list(creq.devices_ids))
        return api_pb2.AllocateResponse(container_responses=out)

    def PreStartContainer(
        self, request: api_pb2.PreStartContainerRequest, context: Any
    ) -> api_pb2.PreStartContainerResponse:
        return api_pb2.PreStartContainerResponse()
