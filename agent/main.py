"""`gputopo-agent`: the node agent's command line (settings per docs/configuration.md).

Every setting is a flag and an environment variable (`NODE_NAME`, `GPUTOPO_*`); flags win.
`--once --print` and `--once --json` discover once, print and exit without an API server.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from pydantic import AliasChoices, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from agent.backends import (
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
from agent.deviceplugin.devices import DeviceListStrategy, MigModeError
from agent.deviceplugin.plugin import DevicePlugin, PluginConfig, TopologyTap
from agent.deviceplugin.preferred import PreferredAllocation
from agent.deviceplugin.server import DEFAULT_PLUGIN_DIR
from agent.metrics import AgentMetrics
from agent.nvml_backend import NvmlLib, NvmlUnavailableError
from agent.podresources.client import DEFAULT_SOCKET
from agent.pods import KubeLocalPods, KubePodSource, LocalPods, StaticLocalPods
from agent.publisher import KubeNodeApi, NodeApi, Publisher, PublishResult
from agent.runner import Agent
from gputopo.jsonlog import configure_logging
from gputopo.model import GPU_RESOURCE
from gputopo.render import render_topology

log = logging.getLogger("agent")

PROG = "gputopo-agent"
# An extended resource name: <DNS subdomain>/<name>, as the kubelet's device manager accepts it.
_RESOURCE_NAME = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"


class AgentSettings(BaseSettings):
    """docs/configuration.md, gputopo-agent table."""

    model_config = SettingsConfigDict(env_prefix="GPUTOPO_", extra="ignore", frozen=True)

    node_name: str | None = Field(default=None, validation_alias=AliasChoices("node_name", "NODE_NAME"))
    namespace: str = "gputopo-system"
    backend: str = "nvml"
    interval_seconds: float = Field(default=10.0, gt=0)
    heartbeat_seconds: float = Field(default=30.0, gt=0)
    sysfs_root: Path = Path("/sys")
    podresources_socket: Path = Path(DEFAULT_SOCKET)
    in_use_file: Path | None = None
    kubeconfig: str | None = None
    metrics_port: int = Field(default=9401, ge=0, le=65535)
    log_level: str = "info"
    device_plugin: bool = False
    device_plugin_dir: Path = DEFAULT_PLUGIN_DIR
    resource_name: str = Field(default=GPU_RESOURCE, pattern=_RESOURCE_NAME)
    device_list_strategy: DeviceListStrategy = DeviceListStrategy.ENVVAR
    preferred_allocation: PreferredAllocation = PreferredAllocation.PLACEMENT

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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Discover this node's GPUs, NVLink, NICs, health and GPUs in use; publish them to its Node.",
    )
    # Defaults are None so that only flags given on the command line override the environment.
    p.add_argument("--node-name", help="the Node to publish to (env NODE_NAME; required unless --once)")
    p.add_argument("--namespace", help="namespace of the heartbeat Lease (default gputopo-system)")
    p.add_argument("--backend", help="nvml (default), fixture:NAME or file:PATH")
    p.add_argument("--interval-seconds", type=float, help="discovery period (default 10)")
    p.add_argument("--heartbeat-seconds", type=float, help="Lease renewal period (default 30)")
    p.add_argument("--sysfs-root", help="root of class/infiniband and bus/pci (default /sys)")
    p.add_argument("--podresources-socket", help=f"kubelet PodResources socket (default {DEFAULT_SOCKET})")
    p.add_argument(
        "--in-use-file", help="simulated nodes: a gpus-in-use value (index list or per-pod object), re-read every cycle"
    )
    p.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster config)")
    p.add_argument("--metrics-port", type=int, help="Prometheus /metrics port (default 9401, 0 = off)")
    p.add_argument("--log-level", help="debug, info, warning or error (default info)")
    p.add_argument(
        "--device-plugin",
        action=argparse.BooleanOptionalAction,
        help="serve the kubelet device plugin for the GPUs, following gputopo placements (default off; not --once)",
    )
    p.add_argument("--device-plugin-dir", help=f"kubelet device plugin directory (default {DEFAULT_PLUGIN_DIR})")
    p.add_argument("--resource-name", help=f"extended resource the device plugin serves (default {GPU_RESOURCE})")
    p.add_argument(
        "--device-list-strategy",
        choices=[s.value for s in DeviceListStrategy],
        help="how Allocate names the GPUs to the NVIDIA Container Toolkit (default envvar)",
    )
    p.add_argument(
        "--preferred-allocation",
        choices=[s.value for s in PreferredAllocation],
        help="placement: the pod's gputopo placement, else best effort (default); besteffort: ignore placements",
    )
    p.add_argument("--once", action="store_true", help="discover once and exit")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--print", action="store_true", help="with --once: show the topology like nvidia-smi topo -m")
    out.add_argument("--json", action="store_true", help="with --once: print the gputopo.io/topology document")
    return p


def load_settings(args: argparse.Namespace) -> AgentSettings:
    keys = [
        "node_name",
        "namespace",
        "backend",
        "interval_seconds",
        "heartbeat_seconds",
        "sysfs_root",
        "podresources_socket",
        "in_use_file",
        "kubeconfig",
        "metrics_port",
        "log_level",
        "device_plugin",
        "device_plugin_dir",
        "resource_name",
        "device_list_strategy",
        "preferred_allocation",
    ]
    given: dict[str, Any] = {k: getattr(args, k) for k in keys if getattr(args, k) is not None}
    return AgentSettings(**given)


def _settings_error(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"])
        parts.append(f"{loc}: {str(err['msg']).removeprefix('Value error, ')}")
    return "; ".join(parts)


def default_node_name(settings: AgentSettings) -> str:
    if settings.node_name:
        return settings.node_name
    kind, _, arg = settings.backend.partition(":")
    return arg if kind == "fixture" else socket.gethostname()


def make_in_use(settings: AgentSettings, pods: PodLookup | None = None) -> InUseSource:
    """`pods` (the node-local pod view) attributes the kubelet's GPUs to pod UIDs; without it every
    GPU in use is published as `other`."""
    if settings.in_use_file is not None:
        return InUseFile(settings.in_use_file)
    if settings.backend == "nvml" or settings.device_plugin:  # a kubelet allocates: it knows the truth
        return PodResourcesInUse(settings.podresources_socket, pods=pods, resource=settings.resource_name)
    return NoneInUse()


PodsFactory = Callable[[AgentSettings, str], KubeLocalPods | StaticLocalPods]


def make_local_pods(
    settings: AgentSettings, node: str, once: bool, factory: PodsFactory | None = None
) -> KubeLocalPods | StaticLocalPods | None:
    """The node-local pod view (list+watch of this node's pods) when something reads it: the device plugin,
    or the per-pod attribution of the kubelet's PodResources. `--once` runs without one."""
    uses_podresources = settings.backend == "nvml" and settings.in_use_file is None
    if once or not (settings.device_plugin or uses_podresources):
        return None
    if factory is not None:
        return factory(settings, node)
    return KubeLocalPods(node, KubePodSource(settings.kubeconfig), resource=settings.resource_name)


def start_device_plugin(
    settings: AgentSettings, node: str, backend: TopologyBackend, pods: LocalPods | None
) -> DevicePlugin:
    """Serve and register; raises BackendError (no first topology), MigModeError, OSError or ValueError."""
    config = PluginConfig(
        resource_name=settings.resource_name,
        plugin_dir=settings.device_plugin_dir,
        device_list_strategy=settings.device_list_strategy,
        preferred_allocation=settings.preferred_allocation,
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
) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.print or args.json) and not args.once:
        parser.error("--print and --json need --once")
    try:
        settings = load_settings(args)
    except ValidationError as e:
        return _fail(f"invalid settings: {_settings_error(e)}", 2)
    configure_logging(settings.log_level)
    if not args.once and not settings.node_name:
        return _fail("the node name is required: set NODE_NAME (downward API) or --node-name", 2)
    node = default_node_name(settings)

    try:
        backend = make_backend(settings.backend, node, settings.sysfs_root, nvml_lib)
    except (BackendSpecError, NvmlUnavailableError) as e:
        return _fail(str(e))
    try:
        pods = make_local_pods(settings, node, args.once, local_pods_factory)
    except Exception as e:
        backend.close()
        return _fail(f"cannot configure the Kubernetes client: {e}")
    in_use = make_in_use(settings, pods)
    try:
        if args.once and (args.print or args.json):
            try:
                print(run_once_output(backend, in_use, args.json))
            except BackendError as e:
                return _fail(str(e))
            return 0
        return _run(settings, node, backend, in_use, args.once, node_api_factory, pods)
    finally:
        in_use.close()
        backend.close()
        if pods is not None:
            pods.close()


def _run(
    settings: AgentSettings,
    node: str,
    backend: TopologyBackend,
    in_use: InUseSource,
    once: bool,
    node_api_factory: Callable[[AgentSettings], NodeApi] | None,
    pods: LocalPods | None = None,
) -> int:
    stop = threading.Event()
    try:
        api = node_api_factory(settings) if node_api_factory else KubeNodeApi(settings.kubeconfig)
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
    if settings.device_plugin and not once:
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
        if plugin is not None:
            plugin.stop()
    log.info("agent stopped", extra={"node": node})
    return 0


if __name__ == "__main__":
    sys.exit(main())
