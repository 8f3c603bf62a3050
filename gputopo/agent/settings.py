"""The agent's settings (docs/configuration.md's gputopo-agent table) and its command line's parsing.

Every setting is a flag and an environment variable (`NODE_NAME`, `GPUTOPO_*`), both read by pydantic-settings
itself; flags win.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from pathlib import Path

from pydantic import AliasChoices, Field, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
)

from gputopo.agent.deviceplugin.devices import DeviceListStrategy
from gputopo.agent.deviceplugin.preferred import PreferredAllocation
from gputopo.agent.deviceplugin.server import DEFAULT_PLUGIN_DIR
from gputopo.agent.dra.cdi import DEFAULT_CDI_DIR
from gputopo.agent.dra.server import DEFAULT_PLUGINS_DIR as DEFAULT_DRA_PLUGINS_DIR
from gputopo.agent.dra.server import DEFAULT_REGISTRY_DIR as DEFAULT_DRA_REGISTRY_DIR
from gputopo.agent.podresources.client import DEFAULT_SOCKET
from gputopo.model import AGENT_COMPONENT, DEFAULT_NAMESPACE, GPU_RESOURCE
from gputopo.settingsconfig import ENV_PREFIX, command_settings

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
    dra_best_fit_order: bool = Field(
        False,
        description="DRA: list the devices so that the allocator's first fit is best fit, re-published after "
        "each claim prepared or unprepared (Kubernetes 1.36+ documents that order)",
    )
    dra_blocks: bool = Field(
        False,
        description="DRA: also publish each NVLink clique's aligned blocks of 2, 4, 8 and 16 GPUs as one device "
        "each, with counters so no GPU is allocated twice (partitionable devices, Kubernetes 1.36+; where the "
        "API server drops the counters only single GPUs are published)",
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


def settings_error(e: ValidationError) -> str:
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
