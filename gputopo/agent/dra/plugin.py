"""The agent as the node's DRA driver `gpu.gputopo.io`: serve, register, prepare, publish.

`DraPlugin.start(topology)` loads the checkpoint, writes the GPUs' CDI spec, serves the DRA and
registration sockets and publishes the node's ResourceSlice; the agent's loop calls `update(topology)`
after every successful discovery (CDI spec and slice follow topology and health, written only on change);
`stop()` closes the sockets and leaves the slice and the checkpoint: a restarting agent answers the
kubelet from them, and the kubelet deletes the slice itself when the driver stays away.

With `best_fit_order` the slice lists the devices so that the allocator's first fit is best fit
(`gputopo.engine.dra.order`), from the GPUs the prepared claims hold; every Prepare or Unprepare that
changes them wakes one thread that re-publishes (changes that come while it writes are coalesced into
its next write, so at most one slice write follows each change, none when the order stays the same).
An order that ran past its work budget (a node wired against the clique search) is still correct but
partly in index order; the first such order is logged once, as a warning.
The kubelet prepares a claim when its pod arrives, after kube-scheduler allocated it: allocations in
between read the order before it, which costs only optimality (a device's name is its GPU whatever
the order).

With `blocks` the node's NVLink cliques are published as block devices too, beside the single GPUs,
with counters so that no GPU is allocated twice (`gputopo.agent.dra.pool`); their order follows
`best_fit_order` the same way.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from gputopo.agent.confirmedwrite import PublishResult
from gputopo.agent.dra.cdi import DEFAULT_CDI_DIR, CdiWriter
from gputopo.agent.dra.checkpoint import CHECKPOINT_NAME, Checkpoint
from gputopo.agent.dra.driver import ClaimReader, DraDriver
from gputopo.agent.dra.pool import PoolPublisher
from gputopo.agent.dra.server import DEFAULT_PLUGINS_DIR, DEFAULT_REGISTRY_DIR, DraServer, plugin_dir
from gputopo.agent.dra.slices import SliceApi, SlicePublisher, SliceShape
from gputopo.agent.sysfs import pci_path
from gputopo.engine.dra.blocks import node_blocks
from gputopo.engine.dra.devices import DRIVER, best_fit
from gputopo.model import NodeTopology

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraConfig:
    node: str
    plugins_dir: Path = DEFAULT_PLUGINS_DIR
    registry_dir: Path = DEFAULT_REGISTRY_DIR
    cdi_dir: Path = DEFAULT_CDI_DIR
    list_attributes: bool = False
    device_taints: bool = False
    sysfs_root: Path | None = Path("/sys")  # for the pcieRoot attribute; None: leave it out
    dev_root: Path = Path("/")  # where /dev and /proc are read for the CDI spec
    poll_s: float = 1.0
    driver: str = DRIVER
    best_fit_order: bool = False
    blocks: bool = False  # the NVLink cliques also as block devices with counters (gputopo.agent.dra.pool)


def _sysfs_bus_id(bus_id: str) -> str:
    domain, sep, rest = bus_id.lower().partition(":")
    return f"{domain[-4:]}{sep}{rest}" if sep and len(domain) > 4 else bus_id.lower()


def pcie_roots(sysfs_root: Path | None, topology: NodeTopology) -> dict[int, str]:
    """Per GPU index, its PCIe root complex (`pci0000:3a`) where sysfs shows it."""
    if sysfs_root is None:
        return {}
    out: dict[int, str] = {}
    for g in topology.gpus:
        path = pci_path(sysfs_root, _sysfs_bus_id(g.pci_bus_id)) if g.pci_bus_id else None
        if path is not None:
            out[g.index] = path.root
    return out


class DraPlugin:
    def __init__(
        self,
        config: DraConfig,
        claims: ClaimReader,
        slices: SliceApi,
        sleep: Callable[[float], bool],
        labels: Callable[[], Mapping[str, str]] | None = None,
    ) -> None:
        self.config = config
        self._claims = claims
        self._labels = labels
        shape = SliceShape(
            list_attributes=config.list_attributes,
            device_taints=config.device_taints,
            driver=config.driver,
            best_fit_order=config.best_fit_order,
            blocks=config.blocks,
        )
        self.publisher: SlicePublisher | PoolPublisher = (
            PoolPublisher(slices, config.node, shape, sleep=sleep)
            if config.blocks
            else SlicePublisher(slices, config.node, shape, sleep=sleep)
        )
        self.driver: DraDriver | None = None
        self.server: DraServer | None = None
        self._roots: tuple[tuple[str, ...], dict[int, str]] | None = None
        self._publish_lock = threading.Lock()  # the discovery loop and the re-publisher share the publisher
        self._topology: NodeTopology | None = None
        self._dirty = threading.Event()
        self._stopping = threading.Event()
        self._republisher: threading.Thread | None = None
        self._told_capped = False  # the log said once that an order ran past its work budget

    def start(self, topology: NodeTopology) -> PublishResult:
        """Raises OSError or ValueError (a socket path too long) before anything is served."""
        c = self.config
        checkpoint = Checkpoint(plugin_dir(c.plugins_dir, c.driver) / CHECKPOINT_NAME)
        self.driver = DraDriver(c.node, self._claims, checkpoint, CdiWriter(c.cdi_dir, c.dev_root), topology, c.driver)
        server = DraServer(
            self.driver,
            on_status=self._on_registration,
            plugins_dir=c.plugins_dir,
            registry_dir=c.registry_dir,
            poll_s=c.poll_s,
        )
        self.server = server
        self.driver.blocks_published = self._block_published
        result = self._publish(topology)  # the slice first: a registered driver with no devices is useless
        if c.best_fit_order:
            self.driver.on_change = self._dirty.set
            self._republisher = threading.Thread(target=self._republish_loop, name="dra-republish", daemon=True)
            self._republisher.start()
        server.start()
        return result

    def _republish_loop(self) -> None:
        while True:
            self._dirty.wait()
            if self._stopping.is_set():
                return
            self._dirty.clear()
            try:
                self.republish()
            except Exception:  # the next change or discovery cycle tries again
                log.exception("re-publishing the ResourceSlice in best-fit order failed")

    def republish(self) -> PublishResult | None:
        """The slice again with the GPUs in use now (None before the first topology)."""
        return self._publish(self._topology) if self._topology is not None else None

    def _on_registration(self, ok: bool, _error: str) -> None:
        if ok:
            self.publisher.reverify()

    def _pcie_roots(self, topology: NodeTopology) -> dict[int, str]:
        key = tuple(g.pci_bus_id for g in topology.gpus)
        if self._roots is None or self._roots[0] != key:
            self._roots = (key, pcie_roots(self.config.sysfs_root, topology))
        return self._roots[1]

    def _publish(self, topology: NodeTopology) -> PublishResult:
        with self._publish_lock:
            self._topology = topology
            labels = self._labels() if self._labels is not None else None
            in_use = self.driver.in_use() if self.driver is not None else frozenset()
            result = self.publisher.publish(
                topology, labels=labels, pcie_roots=self._pcie_roots(topology), in_use=in_use
            )
            if self.config.best_fit_order and not self._told_capped and best_fit(topology, in_use).capped:
                self._told_capped = True
                log.warning(
                    "best-fit order ran past its work budget: the slice lists some GPUs by index (correct, "
                    "maybe not best fit); this node's NVLink wiring defeats the clique search",
                    extra={"gpus": len(topology.gpus), "in_use": len(in_use)},
                )
            return result

    def _block_published(self, mask: int) -> bool:
        """Whether the block over `mask` is one the pool publishes with the topology published last."""
        topology = self._topology
        if not self.config.blocks or self.counters_dropped or topology is None:
            return False
        return mask in node_blocks(topology).masks

    @property
    def counters_dropped(self) -> bool:
        """The API server dropped the blocks' counters: single GPUs only (`gputopo.agent.dra.pool`)."""
        return isinstance(self.publisher, PoolPublisher) and self.publisher.counters_dropped

    def update(self, topology: NodeTopology) -> PublishResult:
        """The driver's devices follow `topology`, then the ResourceSlice is published."""
        if self.driver is not None:
            self.driver.update(topology)
        return self._publish(topology)

    def stop(self) -> None:
        self._stopping.set()
        self._dirty.set()
        if self._republisher is not None:
            self._republisher.join(timeout=10)
        if self.server is not None:
            self.server.stop()
