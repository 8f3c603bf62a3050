"""The agent loop: discover every interval, publish on change, renew the Lease every heartbeat.

Discovery only returns data; each cycle then publishes openly: the Node's metadata and, in DRA mode,
the DRA driver's update (its devices, then its ResourceSlice). Both write only on change
(`gputopo.agent.confirmedwrite`).

Time and stopping are injected (a clock and a stop signal such as threading.Event), so tests and the benchmark run the
loop fast and deterministically; SIGTERM sets the event and the loop ends at its next wait.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from gputopo.agent.backends import BackendError, InUseError, InUseSource, TopologyBackend
from gputopo.agent.confirmedwrite import PublishResult
from gputopo.agent.metrics import AgentMetrics
from gputopo.agent.nodepublisher import Publisher
from gputopo.model import GpusInUse, NodeTopology

log = logging.getLogger(__name__)


class StopSignal(Protocol):
    """What the loop needs of a threading.Event: tests pass one that also advances a fake clock."""

    def is_set(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> bool: ...


@dataclass(frozen=True)
class CycleResult:
    topology: NodeTopology | None
    gpus_in_use: GpusInUse | None
    published: PublishResult | None
    slice: PublishResult | None = None  # the ResourceSlice, in DRA mode


@dataclass(frozen=True)
class Pacing:
    """When the loop acts: discovery every `interval_s`, the Lease every `heartbeat_s`, read on `clock`;
    it waits on `stop` and ends once it is set."""

    interval_s: float
    heartbeat_s: float
    stop: StopSignal
    clock: Callable[[], float] = time.monotonic


class Agent:
    def __init__(
        self,
        backend: TopologyBackend,
        in_use: InUseSource,
        publisher: Publisher | None,
        metrics: AgentMetrics,
        pacing: Pacing,
        dra_update: Callable[[NodeTopology], PublishResult] | None = None,
    ) -> None:
        self._backend = backend
        self._dra_update = dra_update
        self._in_use = in_use
        self._publisher = publisher
        self._metrics = metrics
        self._interval = pacing.interval_s
        self._heartbeat = pacing.heartbeat_s
        self._stop = pacing.stop
        self._clock = pacing.clock
        self._last_in_use: GpusInUse | None = None
        self.discovery_ok = False

    def discover(self) -> tuple[NodeTopology, GpusInUse | None]:
        """Topology plus GPUs in use; an in-use failure keeps the last known value (or None)."""
        start = self._clock()
        try:
            topology = self._backend.discover()
            try:
                self._last_in_use = self._in_use.gpus_in_use(topology)
            except InUseError as e:
                log.warning("GPUs in use unknown this cycle; keeping the last value", extra={"error": str(e)})
        finally:
            self._metrics.discovery_duration.observe(max(0.0, self._clock() - start))
        self._metrics.links_degraded.set(len(topology.degraded_links))
        return topology, self._last_in_use

    def cycle(self) -> CycleResult:
        try:
            topology, in_use = self.discover()
        except BackendError as e:
            self.discovery_ok = False
            log.error("discovery failed; the Lease is not renewed until it works", extra={"error": str(e)})
            return CycleResult(None, None, None)
        except Exception:
            self.discovery_ok = False
            log.exception("discovery failed unexpectedly")
            return CycleResult(None, None, None)
        self.discovery_ok = True
        result = None
        if self._publisher is not None:
            result = self._publisher.publish(topology, in_use)
            self._metrics.publish_total.labels(result=result.value).inc()
        return CycleResult(topology, in_use, result, self._publish_slice(topology))

    def _publish_slice(self, topology: NodeTopology) -> PublishResult | None:
        if self._dra_update is None:
            return None
        try:
            return self._dra_update(topology)
        except Exception:
            # The Node's metadata is published already; the next cycle tries the driver again.
            log.exception("DRA driver update failed")
            return PublishResult.ERROR

    def run(self) -> None:
        """Until the stop event: a cycle every interval, then the heartbeat when it is due.

        The Lease says "this node's published topology is current", so it is renewed only while
        discovery works; a node whose discovery keeps failing goes stale for the extender.
        """
        next_cycle = next_beat = self._clock()
        while not self._stop.is_set():
            now = self._clock()
            if now >= next_cycle:
                self.cycle()
                next_cycle = now + self._interval
            now = self._clock()
            if now >= next_beat:
                if self.discovery_ok and self._publisher is not None:
                    self._publisher.heartbeat()
                    next_beat = now + self._heartbeat
                else:
                    next_beat = next_cycle  # try again right after the next cycle
            self._stop.wait(max(0.0, min(next_cycle, next_beat) - self._clock()))
