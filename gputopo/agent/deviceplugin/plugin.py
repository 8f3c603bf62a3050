"""The agent as the node's device plugin for whole GPUs, carrying out the extender's placements.

`DevicePlugin.start(topology)` refuses a node with a MIG-mode GPU, serves the DevicePlugin service on
`<dir>/gputopo-<suffix>.sock` and registers with the kubelet; `update(topology)` is called by every
successful discovery cycle (with none for `unhealthy_after_s`, every device is reported Unhealthy until
the next); `stop()` ends the streams and removes the socket. With `podresources_socket` set, the
kubelet's PodResources `List` tells which pod it is admitting (see `preferred`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gputopo.agent.backends import TopologyBackend
from gputopo.agent.deviceplugin.devices import CDI_KIND, DeviceListStrategy, check_no_mig
from gputopo.agent.deviceplugin.preferred import BestEffort, PreferredAllocation, Preferrer
from gputopo.agent.deviceplugin.server import DEFAULT_PLUGIN_DIR, PluginServer
from gputopo.agent.deviceplugin.servicer import DevicePluginServicer
from gputopo.agent.podresources.client import PodResourcesClient
from gputopo.agent.pods import LocalPods
from gputopo.engine.node.besteffort import best_effort
from gputopo.model import GPU_RESOURCE, NodeTopology

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PluginConfig:
    resource_name: str = GPU_RESOURCE
    plugin_dir: Path = DEFAULT_PLUGIN_DIR
    device_list_strategy: DeviceListStrategy = DeviceListStrategy.ENVVAR
    preferred_allocation: PreferredAllocation = PreferredAllocation.PLACEMENT
    cdi_kind: str = CDI_KIND
    poll_s: float = 1.0
    podresources_socket: Path | None = None
    # The kubelet waits on GetPreferredAllocation while we ask it; a short bound, then the guess.
    podresources_timeout_s: float = 2.0
    # No discovery succeeded for this long: every device is reported Unhealthy until one does (None: never).
    unhealthy_after_s: float | None = 120.0


class DevicePlugin:
    def __init__(self, config: PluginConfig, pods: LocalPods, best: BestEffort = best_effort) -> None:
        self.config = config
        self._kubelet: PodResourcesClient | None = None
        if config.podresources_socket is not None:
            self._kubelet = PodResourcesClient(
                config.podresources_socket, config.podresources_timeout_s, config.resource_name
            )
        self.preferrer = Preferrer(pods, config.preferred_allocation, best, self._kubelet)
        self.servicer: DevicePluginServicer | None = None
        self.server: PluginServer | None = None

    def start(self, topology: NodeTopology) -> None:
        """Raises MigModeError (naming the GPU) before anything is served on a MIG node."""
        check_no_mig(topology)
        self.servicer = DevicePluginServicer(
            topology,
            self.preferrer,
            self.config.device_list_strategy,
            self.config.cdi_kind,
            unhealthy_after_s=self.config.unhealthy_after_s,
        )
        self.server = PluginServer(
            self.servicer, self.config.resource_name, self.config.plugin_dir, poll_s=self.config.poll_s
        )
        self.server.start()

    def update(self, topology: NodeTopology) -> None:
        if self.servicer is not None:
            self.servicer.update(topology)

    def stop(self) -> None:
        if self.servicer is not None:
            self.servicer.stop()
        if self.server is not None:
            self.server.stop()
        if self._kubelet is not None:
            self._kubelet.close()


class TopologyTap:
    """A TopologyBackend that hands every discovered topology to `observer` (the plugin's update)."""

    def __init__(self, backend: TopologyBackend, observer: Callable[[NodeTopology], None]) -> None:
        self._backend = backend
        self._observer = observer

    @property
    def description(self) -> str:
        return self._backend.description

    def discover(self) -> NodeTopology:
        topology = self._backend.discover()
        try:
            self._observer(topology)
        except Exception:
            # The Node's annotations are still worth publishing when the plugin cannot take an update.
            log.exception("device plugin update failed")
        return topology

    def close(self) -> None:
        self._backend.close()
