"""Settings of gputopo-extender (docs/configuration.md): every setting is a flag and a GPUTOPO_* environment
variable, both read by pydantic-settings itself (`load_settings`); flags win over the environment."""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, CliSuppress

from extender.bounded import (
    DEFAULT_IDLE_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_READ_TIMEOUT_S,
)
from extender.limits import DEFAULT_MAX_REQUEST_BYTES
from gputopo.engine.scoring import ScoreWeights
from gputopo.model import DEFAULT_NAMESPACE, EXTENDER_COMPONENT
from gputopo.settingsconfig import ENV_PREFIX, command_settings
from gputopo.tiers import DEFAULT_TIERS, TierConfig

LogLevel = Literal["debug", "info", "warning", "error", "critical"]
PROG = EXTENDER_COMPONENT


def is_loopback(host: str) -> bool:
    """True for `localhost` and every loopback address (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class Settings(BaseSettings):
    """Topology-aware kube-scheduler extender (filter, prioritize, bind, preempt), its mutating webhook and its
    metrics. Every flag is also an environment variable (--stale-after-seconds is GPUTOPO_STALE_AFTER_SECONDS);
    flags win. GPUTOPO_SCORE_WEIGHTS and GPUTOPO_TIERS (JSON) are environment only."""

    model_config = command_settings(PROG)

    # The scheduling verbs and their health endpoints: plain HTTP, loopback only (see _listeners).
    host: str = Field("127.0.0.1", description="listen address of the scheduling verbs; loopback only")
    port: int = Field(8888, ge=1, le=65535, description="port of the scheduling verbs, /healthz and /readyz")
    # The mutating webhook: HTTPS, because the API server calls webhooks only over TLS.
    webhook_host: str = Field("0.0.0.0", description="listen address of the mutating webhook")
    webhook_port: int = Field(0, ge=0, le=65535, description="HTTPS port of /mutate, /healthz, /readyz (0 = off)")
    tls_cert_file: Path | None = Field(None, description="the webhook's serving certificate (PEM)")
    tls_key_file: Path | None = Field(None, description="private key of --tls-cert-file")
    # Prometheus: scraped from outside the pod, so it listens on every address by default.
    metrics_host: str = Field("0.0.0.0", description="listen address of /metrics")
    metrics_port: int = Field(9402, ge=0, le=65535, description="port of /metrics, /healthz, /readyz (0 = off)")
    kubeconfig: Path | None = Field(None, description="kubeconfig to reach the API server (unset: in-cluster)")
    namespace: str = Field(DEFAULT_NAMESPACE, description="namespace of the agents' Leases")
    stale_after_seconds: float = Field(120.0, gt=0, description="a node whose agent Lease is older is stale")
    reservation_timeout_seconds: float = Field(120.0, gt=0, description="unbound group reservations expire")
    snapshot: Path | None = Field(None, description="serve from a static cluster file, no API server")
    log_level: LogLevel = "info"
    # Larger request bodies get 413 before they are parsed (extender/limits.py sizes the default).
    max_request_bytes: int = Field(
        DEFAULT_MAX_REQUEST_BYTES, ge=64 * 1024, le=1024**3, description="larger bodies get HTTP 413 unparsed"
    )
    # Every listener (extender/bounded.py): what a client on the pod network may hold of the process.
    max_header_bytes: int = Field(
        DEFAULT_MAX_HEADER_BYTES, ge=4096, le=16 * 1024**2, description="larger request heads get HTTP 431"
    )
    read_timeout_seconds: float = Field(
        DEFAULT_READ_TIMEOUT_S, gt=0, le=3600, description="a request's head and body must arrive within this"
    )
    idle_timeout_seconds: float = Field(
        DEFAULT_IDLE_TIMEOUT_S, gt=0, le=86400, description="kept-alive connections idle this long are closed"
    )
    max_connections: int = Field(
        DEFAULT_MAX_CONNECTIONS, ge=1, le=65536, description="open connections per listener; more get HTTP 503"
    )
    # DRA (docs/annotations.md, "Claims under DRA"): the nodes' GPUs are gputopo's DRA devices, so the webhook
    # turns an opted-in pod's nvidia.com/gpu into a ResourceClaim that asks for an NVLink clique.
    dra: bool = Field(False, description="the webhook gives opted-in pods a ResourceClaim asking for a GPU clique")
    dra_list_attributes: bool = Field(
        False, description="with --dra: claims match the nvlinkCliques list attribute (DRAListTypeAttributes)"
    )
    # Environment only (JSON): GPUTOPO_SCORE_WEIGHTS, and GPUTOPO_TIERS as the chart passes it. Hidden from
    # --help because a JSON object per flag invites quoting mistakes; the environment is the documented way.
    score_weights: CliSuppress[ScoreWeights] = ScoreWeights()
    tiers: CliSuppress[TierConfig] = DEFAULT_TIERS

    @model_validator(mode="after")
    def _listeners(self) -> Settings:
        # The verbs decide placements and bind pods: only kube-scheduler in the same pod may reach them.
        if not is_loopback(self.host):
            raise ValueError(
                f"--host {self.host} is not a loopback address: the scheduling verbs are served only to "
                "kube-scheduler in the same pod; use 127.0.0.1 (the webhook and metrics have their own --*-host)"
            )
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("--tls-cert-file and --tls-key-file must be given together")
        if self.webhook_port and self.tls_cert_file is None:
            raise ValueError(
                "--webhook-port needs --tls-cert-file and --tls-key-file: the API server calls webhooks over TLS"
            )
        if not self.webhook_port and self.tls_cert_file is not None:
            raise ValueError(
                "--tls-cert-file and --tls-key-file serve only the webhook listener: set --webhook-port "
                "(the scheduling verbs are plain HTTP on loopback)"
            )
        if self.dra_list_attributes and not self.dra:
            raise ValueError("--dra-list-attributes shapes the claims of --dra: set --dra as well")
        ports = {"--port": self.port, "--webhook-port": self.webhook_port, "--metrics-port": self.metrics_port}
        used = [(flag, p) for flag, p in ports.items() if p]
        for i, (flag, p) in enumerate(used):
            for other, q in used[i + 1 :]:
                if p == q:
                    raise ValueError(f"{flag} and {other} are both {p}: each listener needs its own port")
        return self


def flag_of(field: str) -> str:
    return "--" + field.replace("_", "-")


def env_of(field: str) -> str:
    return ENV_PREFIX + field.upper()


def describe_error(err: ValidationError) -> str:
    """One line per problem, naming the flag and the environment variable it came from."""
    parts = []
    for e in err.errors():
        msg = str(e["msg"]).removeprefix("Value error, ")
        field = str(e["loc"][0]) if e["loc"] else ""
        if field in Settings.model_fields:
            parts.append(f"{flag_of(field)} ({env_of(field)}): {msg}")
        else:
            parts.append(msg)
    return "; ".join(parts)


def load_settings(argv: Sequence[str] | None = None) -> Settings:
    """Flags (`argv`, default: none) over GPUTOPO_* environment variables over defaults.

    Raises pydantic's ValidationError (a bad value) or pydantic-settings' SettingsError (an unknown flag)."""
    return Settings(_cli_parse_args=list(argv or ()))
