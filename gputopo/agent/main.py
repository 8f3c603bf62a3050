"""`gputopo-agent`: the node agent's command line (settings per docs/configuration.md).

Every setting is a flag and an environment variable (`NODE_NAME`, `GPUTOPO_*`), both read by pydantic-settings
itself; flags win.
`--once --print` and `--once --json` discover once, print and exit without an API server.
"""

from __future__ import annotations

import logging
import signal
import socket
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType

from pydantic import AliasChoices, Field, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsError,
)

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
from gputopo.agent.deviceplugin.devices import DeviceListStrategy, MigModeError
from gputopo.agent.deviceplugin.plugin import DevicePlugin, PluginConfig, TopologyTap
from gputopo.agent.deviceplugin.preferred import PreferredAllocation
from gputopo.agent.deviceplugin.server import DEFAULT_PLUGIN_DIR
from gputopo.agent.dra.cdi import DEFAULT_CDI_DIR
from gputopo.agent.dra.plugin import DraConfig, DraPlugin
from gputopo.agent.dra.server import DEFAULT_PLUGINS_DIR as DEFAULT_DRA_PLUGINS_DIR
from gputopo.agent.dra.server import DEFAULT_REGISTRY_DIR as DEFAULT_DRA_REGISTRY_DIR
from gputopo.agent.dra.slices import KubeSliceApi
from gputopo.agent.metrics import AgentMetrics
from gputopo.agent.nvml_backend import NvmlLib, NvmlUnavailableError
from gputopo.agent.podresources.client import DEFAULT_SOCKET
from gputopo.agent.pods import KubeLocalPods, KubePodSource, LocalPods, StaticLocalPods
from gputopo.agent.publisher import KubeNodeApi, NodeApi, Publisher, PublishResult
from gputopo.agent.runner import Agent
from gputopo.jsonlog import configure_logging
from gputopo.kube import Kube
from gputopo.model import AGENT_COMPONENT, DEFAULT_NAMESPACE, GPU_RESOURCE
from gputopo.render import render_topology
from gputopo.settingsconfig import ENV_PREFIX, command_settings

log = logging.getLogger("agent")

PROG = AGENT_COMPONENT
# An extended resource name: <DNS subdomain>/<name>, as the kubelet's device manager accepts it.
_RESOURCE_NAME = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"


class AgentSettings(BaseSettings):
    """The agent's settings, docs/configuration.md's gputopo-agent table: each is a flag and an environment
    variable (`NODE_NAME` for the node name, from the downward API)."""

    model_config = command_settings(PROG)

    node_name: str | None = Field(
        default=None,
        validation_alias=AliasChoices("node_name", "NODE_NAME"),
        description="the Node to publish to (env NODE_NAME; required unless --once)",
    )
    namespace: str = Field(DEFAULT_NAMESPACE, description="namespace of the heartbeat Lease")
    backend: str = Field("nvml", description="nvml, fixture:NAME or file:PATH")
    interval_seconds: float = Field(default=10.0, gt=0, description="discovery period")
    heartbeat_seconds: float = Field(default=30.0, gt=0, description="Lease renewal period")
    sysfs_root: Path = Field(Path("/sys"), description="root of class/infiniband and bus/pci")
    podresources_socket: Path = Field(Path(DEFAULT_SOCKET), description="kubelet PodResources socket")
    in_use_file: Path | None = Field(
        None, description="simulated nodes: a gpus-in-use value (index list or per-pod object), re-read every cycle"
    )
    kubeconfig: str | None = Field(None, description="kubeconfig file (default: in-cluster config)")
    metrics_port: int = Field(default=9401, ge=0, le=65535, description="Prometheus /metrics port (0 = off)")
    log_level: str = Field("info", description="debug, info, warning, error or critical")
    device_plugin: bool = Field(
        False, description="serve the kubelet device plugin for the GPUs, following gputopo placements (not --once)"
    )
    device_plugin_dir: Path = Field(DEFAULT_PLUGIN_DIR, description="kubelet device plugin directory")
    resource_name: str = Field(
        default=GPU_RESOURCE, pattern=_RESOURCE_NAME, description="extended resource the device plugin serves"
    )
    device_list_strategy: DeviceListStrategy = Field(
        DeviceListStrategy.ENVVAR,
        description="how Allocate names the GPUs to the NVIDIA Container Toolkit: envvar, cdi-annotations or cdi-cri",
    )
    unhealthy_after_seconds: float = Field(
        120.0,
        gt=0,
        description="device plugin: with no successful discovery for this long, every GPU is reported Unhealthy",
    )
    preferred_allocation: PreferredAllocation = Field(
        PreferredAllocation.PLACEMENT,
        description="placement (the pod's gputopo placement, else best effort) or besteffort (ignore placements)",
    )
    dra: bool = Field(
        False,
        description="serve the GPUs as the kubelet DRA driver gpu.gputopo.io and publish their ResourceSlice "
        "(not --once; the device plugin then does not start)",
    )
    dra_list_attributes: bool = Field(
        False, description="DRA: publish the NVLink cliques as a list attribute (needs the DRAListTypeAttributes gate)"
    )
    dra_device_taints: bool = Field(
        False,
        description="DRA: publish a failed GPU with a NoSchedule device taint (needs DRADeviceTaints); "
        "without it a failed GPU is left out of the ResourceSlice",
    )
    dra_plugins_dir: Path = Field(DEFAULT_DRA_PLUGINS_DIR, description="DRA: the kubelet's plugins directory")
    dra_registry_dir: Path = Field(
        DEFAULT_DRA_REGISTRY_DIR, description="DRA: the kubelet's plugin registration directory"
    )
    cdi_dir: Path = Field(DEFAULT_CDI_DIR, description="DRA: where the CDI specs of the GPUs and claims are written")

    @field_validator("backend")
    @classmethod
    def _backend_form(cls, v: str) -> str:
        kind, sep, arg = v.partition(":")
        if not ((kind == "nvml" and not sep) or (kind in ("fixture", "file") and arg)):
            raise ValueError(f"{v!r} is not nvml, fixture:NAME or file:PATH")
        return v

    @field_validator("log_level")
    @classmethod
    def _level(cls, v: str) -> str:
        if v.lower() not in ("debug", "info", "warning", "error", "critical"):
            raise ValueError("must be debug, info, warning, error or critical")
        return v.lower()


class AgentCommand(AgentSettings):
    """Discover this node's GPUs, NVLink, NICs, health and GPUs in use; publish them to its Node. Every flag but
    --once, --print and --json is also an environment variable (--interval-seconds is GPUTOPO_INTERVAL_SECONDS,
    --node-name is NODE_NAME); flags win."""

    once: bool = Field(False, description="discover once and exit")
    print_topology: bool = Field(
        False, alias="print", description="with --once: show the topology like nvidia-smi topo -m"
    )
    json_topology: bool = Field(False, alias="json", description="with --once: print the gputopo.io/topology document")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The environment feeds only AgentSettings' fields: an environment variable named ONCE, PRINT or JSON
        # must not turn a DaemonSet agent into a one-shot command. (The command line is added on top.)
        return (init_settings, EnvSettingsSource(AgentSettings))

    @model_validator(mode="after")
    def _actions(self) -> AgentCommand:
        if self.print_topology and self.json_topology:
            raise ValueError("--print and --json are exclusive")
        if (self.print_topology or self.json_topology) and not self.once:
            raise ValueError("--print and --json need --once")
        return self

    def settings(self) -> AgentSettings:
        """The settings alone (already validated), without the one-shot actions."""
        return AgentSettings.model_construct(**{k: getattr(self, k) for k in AgentSettings.model_fields})


def parse_command(argv: Sequence[str] | None = None) -> AgentCommand:
    """Flags (`argv`, default: none) over `NODE_NAME`/GPUTOPO_* environment variables over defaults.

    Raises pydantic's ValidationError (a bad value) or pydantic-settings' SettingsError (an unknown flag)."""
    return AgentCommand(_cli_parse_args=list(argv or ()))


def load_settings(argv: Sequence[str] | None = None) -> AgentSettings:
    return parse_command(argv).settings()


def _flag(loc: str) -> str:
    """`--flag (ENV)` for a settings field, `--flag` for the flag-only actions."""
    flag = "--" + loc.replace("_", "-")
    if loc == "node_name":
        return f"{flag} (NODE_NAME)"
    if loc in AgentSettings.model_fields:
        return f"{flag} ({ENV_PREFIX}{loc.upper()})"
    return flag


def _settings_error(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        msg = str(err["msg"]).removeprefix("Value error, ")
        parts.append(f"{_flag(str(err['loc'][0]))}: {msg}" if err["loc"] else msg)
    return "; ".join(parts)


def default_node_name(settings: AgentSettings) -> str:
    if settings.node_name:
        return settings.node_name
    kind, _, arg = settings.backend.partition(":")
    return arg if kind == "fixture" else socket.gethostname()


def serves_device_plugin(settings: AgentSettings) -> bool:
    """--device-plugin, unless --dra owns the node's GPUs."""
    return settings.device_plugin and not settings.dra


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
        return _fail(f"invalid settings: {_settings_error(e)}", 2)
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
        return _run(settings, node, backend, in_use, command.once, node_api_factory, pods, dra_factory, kube)
    finally:
        in_use.close()
        backend.close()
        if pods is not None:
            pods.close()
        kube.close()  # last: every part above used it


def _run(
    settings: AgentSettings,
    node: str,
    backend: TopologyBackend,
    in_use: InUseSource,
    once: bool,
    node_api_factory: Callable[[AgentSettings], NodeApi] | None,
    pods: LocalPods | None = None,
    dra_factory: DraFactory | None = None,
    kube: AgentKube | None = None,
) -> int:
    stop = threading.Event()
    try:
        api = node_api_factory(settings) if node_api_factory else KubeNodeApi((kube or AgentKube(settings)).get())
    except Exception as e:
        return _fail(f"cannot configure the Kubernetes client: {e}")
    publisher = Publisher(
        api,
        node,
        settings.namespace,
        # The Lease lasts as long as the extender's default staleness (4 heartbeats = 120 s).
        lease_duration_s=max(1, round(4 * settings.heartbeat_seconds)),
        sleep=stop.wait,
    )
    metrics = AgentMetrics()
    plugin: DevicePlugin | None = None
    dra: DraPlugin | None = None
    if settings.dra and not once:
        if settings.device_plugin:
            log.warning("--dra and --device-plugin: a node's GPUs have one owner; serving DRA only")
        try:
            dra = start_dra(settings, node, backend, stop.wait, dra_factory, kube)
        except Exception as e:  # no first topology, a socket path, the Kubernetes client's configuration
            return _fail(f"cannot start the DRA driver: {e}")
        backend = TopologyTap(backend, dra.update)  # every discovery cycle republishes on change
    elif settings.device_plugin and not once:
        try:
            plugin = start_device_plugin(settings, node, backend, pods)
        except (BackendError, MigModeError, OSError, ValueError) as e:
            return _fail(f"cannot start the device plugin: {e}")
        backend = TopologyTap(backend, plugin.update)  # every discovery cycle updates the plugin's devices
    agent = Agent(backend, in_use, publisher, metrics, settings.interval_seconds, settings.heartbeat_seconds, stop)
    if once:
        result = agent.cycle()
        ok = result.published in (PublishResult.CHANGED, PublishResult.UNCHANGED) and publisher.heartbeat()
        return 0 if ok else 1

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("stopping", extra={"signal": signal.Signals(signum).name})
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if settings.metrics_port:
        from prometheus_client import start_http_server

        # Scraped from outside the node's pod network namespace, so it listens on all addresses.
        start_http_server(settings.metrics_port, registry=metrics.registry)
    log.info(
        "agent started",
        extra={"node": node, "backend": backend.description, "interval_s": settings.interval_seconds},
    )
    try:
        agent.run()
    finally:
        # The Lease first: the node is stale for the extender before its device plugin goes.
        publisher.release_lease()
        if plugin is not None:
            plugin.stop()
        if dra is not None:
            dra.stop()
    log.info("agent stopped", extra={"node": node})
    return 0


if __name__ == "__main__":
    sys.exit(main())
