"""`gputopo-agent`: the node agent's command line (settings in `gputopo.agent.settings`), and its wiring.

`--once --print` and `--once --json` discover once, print and exit without an API server.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import FrameType

from pydantic import ValidationError
from pydantic_settings import SettingsError

from gputopo.agent.backends import (
    BackendError,
    BackendSpecError,
    InUseError,
    InUseFile,
    InUseSource,
    NoneInUse,
    PodLookup,
    PodResourcesInUse,
    TopologyBackend,
    make_backend,
)
from gputopo.agent.confirmedwrite import PublishResult
from gputopo.agent.deviceplugin.devices import MigModeError
from gputopo.agent.deviceplugin.plugin import DevicePlugin, PluginConfig, TopologyTap
from gputopo.agent.dra.plugin import DraConfig, DraPlugin
from gputopo.agent.dra.slices import KubeSliceApi
from gputopo.agent.metrics import AgentMetrics
from gputopo.agent.nodepublisher import KubeNodeApi, LeaseTerms, NodeApi, Publisher
from gputopo.agent.nvml_backend import NvmlUnavailableError
from gputopo.agent.nvml_lib import NvmlLib
from gputopo.agent.pods import KubeLocalPods, KubePodSource, LocalPods, StaticLocalPods
from gputopo.agent.runner import Agent, Pacing
from gputopo.agent.settings import (
    PROG,
    AgentSettings,
    default_node_name,
    parse_command,
    serves_device_plugin,
    settings_error,
)
from gputopo.jsonlog import configure_logging
from gputopo.kube import Kube
from gputopo.render import render_topology

log = logging.getLogger("agent")


def make_in_use(settings: AgentSettings, pods: PodLookup | None = None) -> InUseSource:
    """`pods` (the node-local pod view) attributes the kubelet's GPUs to pod UIDs; without it every
    GPU in use is published as `other`."""
    if settings.in_use_file is not None:
        return InUseFile(settings.in_use_file)
    if settings.backend == "nvml" or serves_device_plugin(settings):  # a kubelet allocates: it knows the truth
        return PodResourcesInUse(settings.podresources_socket, pods=pods, resource=settings.resource_name)
    return NoneInUse()


PodsFactory = Callable[[AgentSettings, str], KubeLocalPods | StaticLocalPods]


class AgentKube:
    """The agent's one Kubernetes client (one connection pool), built on first use: the publisher, the
    node-local pod view and the DRA driver all share it. Closed last, after every part has stopped."""

    def __init__(self, settings: AgentSettings) -> None:
        self._settings = settings
        self._kube: Kube | None = None

    def get(self) -> Kube:
        if self._kube is None:
            self._kube = Kube(self._settings.kubeconfig or None, request_timeout=10.0)
        return self._kube

    def close(self) -> None:
        if self._kube is not None:
            self._kube.close()


def make_local_pods(
    settings: AgentSettings,
    node: str,
    once: bool,
    factory: PodsFactory | None = None,
    kube: AgentKube | None = None,
) -> KubeLocalPods | StaticLocalPods | None:
    """The node-local pod view (list+watch of this node's pods) when something reads it: the device plugin,
    or the per-pod attribution of the kubelet's PodResources. `--once` runs without one. `kube`: the
    agent's client (None: one of its own)."""
    uses_podresources = settings.backend == "nvml" and settings.in_use_file is None
    if once or not (serves_device_plugin(settings) or uses_podresources):
        return None
    if factory is not None:
        return factory(settings, node)
    return KubeLocalPods(node, KubePodSource((kube or AgentKube(settings)).get()), resource=settings.resource_name)


def start_device_plugin(
    settings: AgentSettings, node: str, backend: TopologyBackend, pods: LocalPods | None
) -> DevicePlugin:
    """Serve and register; raises BackendError (no first topology), MigModeError, OSError or ValueError."""
    config = PluginConfig(
        resource_name=settings.resource_name,
        plugin_dir=settings.device_plugin_dir,
        device_list_strategy=settings.device_list_strategy,
        preferred_allocation=settings.preferred_allocation,
        podresources_socket=settings.podresources_socket,
        unhealthy_after_s=settings.unhealthy_after_seconds,
    )
    plugin = DevicePlugin(config, pods if pods is not None else StaticLocalPods(node))
    plugin.start(backend.discover())
    log.info(
        "device plugin started",
        extra={
            "resource": config.resource_name,
            "dir": str(config.plugin_dir),
            "strategy": config.device_list_strategy.value,
            "preferred": config.preferred_allocation.value,
        },
    )
    return plugin


DraFactory = Callable[[AgentSettings, DraConfig, Callable[[float], bool]], DraPlugin]


def make_dra(
    settings: AgentSettings, config: DraConfig, sleep: Callable[[float], bool], kube: AgentKube | None = None
) -> DraPlugin:
    """The DRA driver on the agent's client (claims read and the slice written through it)."""
    client = (kube or AgentKube(settings)).get()
    return DraPlugin(config, client, KubeSliceApi(client), sleep)


def start_dra(
    settings: AgentSettings,
    node: str,
    backend: TopologyBackend,
    sleep: Callable[[float], bool],
    factory: DraFactory | None = None,
    kube: AgentKube | None = None,
) -> DraPlugin:
    """Serve, register and publish; raises BackendError (no first topology), OSError or ValueError."""
    config = DraConfig(
        node=node,
        plugins_dir=settings.dra_plugins_dir,
        registry_dir=settings.dra_registry_dir,
        cdi_dir=settings.cdi_dir,
        list_attributes=settings.dra_list_attributes,
        device_taints=settings.dra_device_taints,
        best_fit_order=settings.dra_best_fit_order,
        blocks=settings.dra_blocks,
        sysfs_root=settings.sysfs_root,
    )
    topology = backend.discover()
    plugin = factory(settings, config, sleep) if factory else make_dra(settings, config, sleep, kube)
    result = plugin.start(topology)
    log.info(
        "DRA driver started",
        extra={
            "driver": config.driver,
            "plugins_dir": str(config.plugins_dir),
            "registry_dir": str(config.registry_dir),
            "cdi_dir": str(config.cdi_dir),
            "list_attributes": config.list_attributes,
            "device_taints": config.device_taints,
            "blocks": config.blocks,
            "slice": result.value,
        },
    )
    return plugin


def _fail(message: str, code: int = 1) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return code


def run_once_output(backend: TopologyBackend, in_use: InUseSource, as_json: bool) -> str:
    topology = backend.discover()
    if as_json:
        return topology.to_annotation()
    try:
        used: frozenset[int] | None = in_use.gpus_in_use(topology).all
    except InUseError as e:
        log.warning("GPUs in use unknown", extra={"error": str(e)})
        used = None
    return render_topology(topology, used).rstrip("\n")


def main(
    argv: Sequence[str] | None = None,
    node_api_factory: Callable[[AgentSettings], NodeApi] | None = None,
    nvml_lib: Callable[[], NvmlLib] | None = None,
    local_pods_factory: PodsFactory | None = None,
    dra_factory: DraFactory | None = None,
) -> int:
    try:
        command = parse_command(sys.argv[1:] if argv is None else argv)
    except ValidationError as e:
        return _fail(f"invalid settings: {settings_error(e)}", 2)
    except SettingsError as e:  # an unknown flag or a flag without its value
        return _fail(str(e), 2)
    settings = command.settings()
    configure_logging(settings.log_level)
    if not command.once and not settings.node_name:
        return _fail("the node name is required: set NODE_NAME (downward API) or --node-name", 2)
    node = default_node_name(settings)

    try:
        backend = make_backend(settings.backend, node, settings.sysfs_root, nvml_lib)
    except (BackendSpecError, NvmlUnavailableError) as e:
        return _fail(str(e))
    kube = AgentKube(settings)
    try:
        pods = make_local_pods(settings, node, command.once, local_pods_factory, kube)
    except Exception as e:
        backend.close()
        return _fail(f"cannot configure the Kubernetes client: {e}")
    in_use = make_in_use(settings, pods)
    try:
        if command.once and (command.print_topology or command.json_topology):
            try:
                print(run_once_output(backend, in_use, command.json_topology))
            except BackendError as e:
                return _fail(str(e))
            return 0
        access = ApiAccess(kube=kube, node_api_factory=node_api_factory, dra_factory=dra_factory)
        return _run(settings, node, backend, in_use, command.once, pods, access)
    finally:
        in_use.close()
        backend.close()
        if pods is not None:
            pods.close()
        kube.close()  # last: every part above used it


@dataclass(frozen=True, kw_only=True)
class ApiAccess:
    """How the agent reaches the API server: its one client (None: made from the settings), and the
    stand-ins tests pass for the Node API and the DRA driver (None: the real ones on that client)."""

    kube: AgentKube | None = None
    node_api_factory: Callable[[AgentSettings], NodeApi] | None = None
    dra_factory: DraFactory | None = None


def _run(
    settings: AgentSettings,
    node: str,
    backend: TopologyBackend,
    in_use: InUseSource,
    once: bool,
    pods: LocalPods | None = None,
    access: ApiAccess = ApiAccess(),
) -> int:
    stop = threading.Event()
    kube = access.kube
    try:
        if access.node_api_factory is not None:
            api = access.node_api_factory(settings)
        else:
            api = KubeNodeApi((kube or AgentKube(settings)).get())
    except Exception as e:
        return _fail(f"cannot configure the Kubernetes client: {e}")
    # The Lease lasts as long as the extender's default staleness (4 heartbeats = 120 s).
    lease = LeaseTerms(settings.namespace, max(1, round(4 * settings.heartbeat_seconds)))
    publisher = Publisher(api, node, lease, sleep=stop.wait)
    metrics = AgentMetrics()
    plugin: DevicePlugin | None = None
    dra: DraPlugin | None = None
    if settings.dra and not once:
        if settings.device_plugin:
            log.warning("--dra and --device-plugin: a node's GPUs have one owner; serving DRA only")
        try:
            dra = start_dra(settings, node, backend, stop.wait, access.dra_factory, kube)
        except Exception as e:  # no first topology, a socket path, the Kubernetes client's configuration
            return _fail(f"cannot start the DRA driver: {e}")
        started = dra
        metrics.dra_counters_dropped.set_function(lambda: float(started.counters_dropped))
    elif settings.device_plugin and not once:
        try:
            plugin = start_device_plugin(settings, node, backend, pods)
        except (BackendError, MigModeError, OSError, ValueError) as e:
            return _fail(f"cannot start the device plugin: {e}")
        backend = TopologyTap(backend, plugin.update)  # every discovery cycle updates the plugin's devices
    agent = Agent(
        backend,
        in_use,
        publisher,
        metrics,
        Pacing(settings.interval_seconds, settings.heartbeat_seconds, stop),
        # Every discovery cycle then updates the DRA driver and republishes its ResourceSlice on change.
        dra_update=dra.update if dra is not None else None,
    )
    if once:
        result = agent.cycle()
        ok = result.published in (PublishResult.CHANGED, PublishResult.UNCHANGED) and publisher.heartbeat()
        return 0 if ok else 1

    try:
        _serve(agent, stop, metrics, settings.metrics_port, node, backend.description, settings.interval_seconds)
    finally:
        # The Lease first: the node is stale for the extender before its device plugin goes.
        publisher.release_lease()
        if plugin is not None:
            plugin.stop()
        if dra is not None:
            dra.stop()
    log.info("agent stopped", extra={"node": node})
    return 0


def _serve(
    agent: Agent,
    stop: threading.Event,
    metrics: AgentMetrics,
    metrics_port: int,
    node: str,
    backend: str,
    interval: float,
) -> None:
    """Run the loop until SIGTERM or SIGINT, serving /metrics meanwhile."""

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("stopping", extra={"signal": signal.Signals(signum).name})
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if metrics_port:
        from gputopo.agent.metricsserver import serve_metrics

        # Scraped from outside the node's pod network namespace, so it listens on all addresses; bounded in
        # connections and time (gputopo/agent/metricsserver.py).
        serve_metrics(metrics_port, metrics.registry)
    log.info("agent started", extra={"node": node, "backend": backend, "interval_s": interval})
    agent.run()


if __name__ == "__main__":
    sys.exit(main())
