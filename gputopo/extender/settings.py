"""Settings of gputopo-extender (docs/configuration.md): every setting is a flag and a GPUTOPO_* environment
variable, both read by pydantic-settings itself (`load_settings`); flags win over the environment. What one
listener allows, as its servers read it, is `ListenerLimits`; the defaults live here, beside the settings."""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, CliSuppress

from gputopo.engine.dra import claims as draclaims
from gputopo.engine.state.scoring import ScoreWeights
from gputopo.model import DEFAULT_NAMESPACE, EXTENDER_COMPONENT, SCHEDULER_NAME
from gputopo.settingsconfig import ENV_PREFIX, command_settings
from gputopo.tiers import DEFAULT_TIERS, TierConfig

# A kube-scheduler filter call for 15,000 nodes with typical 40-character node names is ~0.7 MB
# (NodeNames only: the chart's extender is nodeCacheCapable). 15,000 names of the longest legal length
# (253 characters) plus a Pod at etcd's 1.5 MiB object limit is ~5.4 MB. 8 MiB covers both with headroom.
DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
# GPUs one namespace's JobSets may hold for pods not created yet (128 8-GPU nodes): no ResourceQuota
# counts a pod that does not exist (gputopo.extender.verbs.exclusive).
DEFAULT_MAX_HELD_GPUS_PER_NAMESPACE = 1024

# Every listener (docs/configuration.md): what a client on the pod network may hold of the process.
DEFAULT_MAX_HEADER_BYTES = 64 * 1024
# Longer than the 90 s that Go's HTTP clients (kube-scheduler's, the API server's) keep an idle connection:
# the server then never closes one the client is about to reuse.
DEFAULT_IDLE_TIMEOUT_S = 120.0
DEFAULT_READ_TIMEOUT_S = 10.0
DEFAULT_MAX_CONNECTIONS = 256
# Near the read timeout: a handshake on the pod network takes milliseconds, and until it is done the
# connection holds a slot that nobody can be answered on.
DEFAULT_HANDSHAKE_TIMEOUT_S = 10.0
# A quarter of the default cap: one address (an attacker's, or one misbehaving client's) holds at most a
# quarter of a listener, while the API server's few addresses (one per replica) still find room.
DEFAULT_MAX_CONNECTIONS_PER_PEER = DEFAULT_MAX_CONNECTIONS // 4
# New TLS handshakes one address may start per second (and as a burst): the API server keeps its
# connections alive and opens a few per replica, while a flood of handshakes from one address is CPU the
# verbs listener shares (on two cores 400 handshakes a second took its p99 to 3.3x idle).
DEFAULT_HANDSHAKES_PER_PEER_PER_S = 20.0
# New TLS handshakes the webhook starts per second over all addresses, bursts of 2 (an address that has
# presented the API server's certificate is outside the limit): a handshake is CPU on the loop that answers
# the API server's kept-alive connections, and the pace per address does not bound a flood from many
# addresses. 20 a second is a few percent of a core (RSA-2048): under 48 forging addresses the API server's
# review stayed within a few ms of idle (docs/benchmarks.md, "Hostile callers on the listeners").
DEFAULT_HANDSHAKES_PER_S = 20.0
# Request bodies one listener holds at once, over all its connections: four of the largest the verbs take
# (--max-request-bytes, 8 MiB). Parsed, a body costs a few times its size: 32 MiB of them stays well inside
# the chart's 1 GiB memory limit, while the API server's reviews (a pod, at most etcd's 1.5 MiB, twice) fit
# many at once.
DEFAULT_MAX_BODY_BYTES_IN_FLIGHT = 32 * 1024 * 1024


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
    # Who may call /mutate (gputopo/extender/http/clientauth.py): the API server, by its client certificate.
    webhook_client_ca_file: Path | None = Field(
        None, description="CA (PEM) of the API server's webhook client certificate; /mutate refuses other callers"
    )
    webhook_client_names: str = Field(
        "", description="comma-separated names (CN or subjectAltName) of --webhook-client-ca-file's allowed clients"
    )
    # Prometheus: scraped from outside the pod, so it listens on every address by default.
    metrics_host: str = Field("0.0.0.0", description="listen address of /metrics")
    metrics_port: int = Field(9402, ge=0, le=65535, description="port of /metrics, /healthz, /readyz (0 = off)")
    kubeconfig: Path | None = Field(None, description="kubeconfig to reach the API server (unset: in-cluster)")
    namespace: str = Field(DEFAULT_NAMESPACE, description="namespace of the agents' Leases")
    # A pod's spec.schedulerName is a DNS-1123 subdomain; only pods under this name are gputopo's.
    scheduler_name: str = Field(
        SCHEDULER_NAME,
        max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
        description="the kube-scheduler profile whose pods are gputopo's: group members, inferred gangs, the webhook's",
    )
    stale_after_seconds: float = Field(120.0, gt=0, description="a node whose agent Lease is older is stale")
    reservation_timeout_seconds: float = Field(120.0, gt=0, description="unbound group reservations expire")
    max_held_gpus_per_namespace: int = Field(
        DEFAULT_MAX_HELD_GPUS_PER_NAMESPACE,
        ge=0,
        le=1_000_000,
        description="GPUs one namespace's JobSets may hold for pods not created yet (exclusive placement's "
        "followers) where no ResourceQuota of the namespace bounds its GPUs; 0: none are held",
    )
    filter_best_only: bool = Field(
        False,
        description="a lone pod's filter passes only the engine's best node, so kube-scheduler skips its own "
        "scoring and prioritize (the chart turns it on)",
    )
    snapshot: Path | None = Field(None, description="serve from a static cluster file, no API server")
    log_level: LogLevel = "info"
    # Larger request bodies get 413 before they are parsed (gputopo/extender/http/bodylimit.py sizes the default).
    max_request_bytes: int = Field(
        DEFAULT_MAX_REQUEST_BYTES, ge=64 * 1024, le=1024**3, description="larger bodies get HTTP 413 unparsed"
    )
    # Every listener (gputopo/extender/http/refusals.py): what a client on the pod network may hold of the process.
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
    max_connections_per_peer: int | None = Field(
        None,
        ge=1,
        le=65536,
        description="open connections of one client address on the webhook and metrics listeners "
        "(unset: a quarter of --max-connections)",
    )
    handshake_timeout_seconds: float = Field(
        DEFAULT_HANDSHAKE_TIMEOUT_S, gt=0, le=3600, description="the webhook's TLS handshake must end within this"
    )
    handshakes_per_peer_per_second: float = Field(
        DEFAULT_HANDSHAKES_PER_PEER_PER_S,
        ge=0,
        le=1_000_000,
        description="TLS handshakes one client address starts per second on the webhook (and as a burst); 0: no pace",
    )
    handshakes_per_second: float = Field(
        DEFAULT_HANDSHAKES_PER_S,
        ge=0,
        le=1_000_000,
        description="TLS handshakes the webhook starts per second over all addresses, taken round-robin across "
        "them; 0: no limit",
    )
    max_body_bytes_in_flight: int = Field(
        DEFAULT_MAX_BODY_BYTES_IN_FLIGHT,
        ge=64 * 1024,
        le=16 * 1024**3,
        description="request body bytes the verbs and the webhook listener each hold at once; more get HTTP 503",
    )
    # DRA (docs/annotations.md, "Claims under DRA"): the nodes' GPUs are gputopo's DRA devices, so the webhook
    # turns an opted-in pod's nvidia.com/gpu into a ResourceClaim that asks for an NVLink clique.
    dra: bool = Field(False, description="the webhook gives opted-in pods a ResourceClaim asking for a GPU clique")
    dra_list_attributes: bool = Field(
        False, description="with --dra: claims match the nvlinkCliques list attribute (DRAListTypeAttributes)"
    )
    dra_blocks: bool = Field(
        False,
        description="with --dra: the agents publish clique blocks (--dra-blocks), so a clique claim of a block "
        "size asks for one whole block first",
    )
    dra_memory_classes: str = Field(
        "",
        description="with --dra: comma-separated GPU memory figures (MiB, as NVML reports them) a claim's minimum "
        "HBM may round up to, beside the named systems'",
    )
    # Gang members wait outside kube-scheduler's queue until their group is whole (docs/annotations.md, "While
    # a gang is gated"): the webhook gates them, the extender lifts the gate (gputopo.extender.verbs.groupgates).
    group_gate: bool = Field(
        False, description="the webhook gives group members the gputopo.io/group-complete scheduling gate"
    )
    group_gate_release_seconds: float = Field(
        900.0,
        gt=0,
        le=7 * 86400,
        description="a gated group still not whole, or whole and not placed, this long after its pods' creation is "
        "told so and released",
    )
    # kube-scheduler's leader election Lease (the chart's scheduler.leaderElection.resourceName): only the leader's
    # extender lifts group gates (gputopo.extender.state.leadership). Empty: no election, this replica leads.
    leader_lease: str = Field(
        "",
        max_length=253,
        pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*)?$",
        description="kube-scheduler's leader election Lease in --namespace: group gates are lifted only while this "
        "pod's kube-scheduler holds it (empty: no election)",
    )
    # Environment only (JSON): GPUTOPO_SCORE_WEIGHTS, and GPUTOPO_TIERS as the chart passes it. Hidden from
    # --help because a JSON object per flag invites quoting mistakes; the environment is the documented way.
    score_weights: CliSuppress[ScoreWeights] = ScoreWeights()
    tiers: CliSuppress[TierConfig] = DEFAULT_TIERS

    @field_validator("dra_memory_classes")
    @classmethod
    def _mib_figures(cls, value: str) -> str:
        for part in (p.strip() for p in value.split(",")):
            if part and not (part.isascii() and part.isdigit() and 0 < int(part) <= 16 * 1024**2):
                raise ValueError(
                    f"{part!r} is not a GPU memory figure: give whole MiB, 1 to 16777216, comma-separated "
                    "(e.g. 40960,95830)"
                )
        return value

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
        if self.webhook_client_ca_file is not None and not self.webhook_port:
            raise ValueError("--webhook-client-ca-file authenticates the webhook's callers: set --webhook-port")
        if self.webhook_client_ca_file is not None and not self.client_names:
            raise ValueError(
                "--webhook-client-ca-file needs --webhook-client-names: the names (CN or subjectAltName) of "
                "the API server's client certificate, so that no other certificate of that CA is let in"
            )
        if self.client_names and self.webhook_client_ca_file is None:
            raise ValueError("--webhook-client-names needs --webhook-client-ca-file, the CA that signed them")
        if self.max_body_bytes_in_flight < self.max_request_bytes:
            raise ValueError(
                f"--max-body-bytes-in-flight {self.max_body_bytes_in_flight} is under --max-request-bytes "
                f"{self.max_request_bytes}: the largest body allowed could never be read"
            )
        if self.dra_memory_classes.strip() and not self.dra:
            raise ValueError("--dra-memory-classes shapes the claims of --dra: set --dra as well")
        if self.dra_list_attributes and not self.dra:
            raise ValueError("--dra-list-attributes shapes the claims of --dra: set --dra as well")
        if self.dra_blocks and not self.dra:
            raise ValueError("--dra-blocks shapes the claims of --dra: set --dra as well")
        ports = {"--port": self.port, "--webhook-port": self.webhook_port, "--metrics-port": self.metrics_port}
        used = [(flag, p) for flag, p in ports.items() if p]
        for i, (flag, p) in enumerate(used):
            for other, q in used[i + 1 :]:
                if p == q:
                    raise ValueError(f"{flag} and {other} are both {p}: each listener needs its own port")
        return self

    @property
    def memory_classes(self) -> tuple[int, ...]:
        """--dra-memory-classes added to the named systems' figures (gputopo.engine.dra.claims)."""
        extra = tuple(int(m) for m in self.dra_memory_classes.split(",") if m.strip())
        return draclaims.memory_classes(extra)

    @property
    def client_names(self) -> frozenset[str]:
        """--webhook-client-names as a set (blanks around the commas ignored)."""
        return frozenset(n.strip() for n in self.webhook_client_names.split(",") if n.strip())


# Settings read from the environment only (JSON documents, hidden from the flags).
ENV_ONLY = frozenset({"score_weights", "tiers"})


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
        if field in ENV_ONLY:  # a JSON document: name the variable and where in it
            inside = ".".join(str(p) for p in e["loc"][1:])
            parts.append(f"{env_of(field)}{' at ' + inside if inside else ''}: {msg}")
        elif field in Settings.model_fields:
            parts.append(f"{flag_of(field)} ({env_of(field)}): {msg}")
        else:
            parts.append(msg)
    return "; ".join(parts)


def load_settings(argv: Sequence[str] | None = None) -> Settings:
    """Flags (`argv`, default: none) over GPUTOPO_* environment variables over defaults.

    Raises pydantic's ValidationError (a bad value) or pydantic-settings' SettingsError (an unknown flag)."""
    return Settings(_cli_parse_args=list(argv or ()))


@dataclass(frozen=True)
class ListenerLimits:
    """What one listener allows (the settings of the same names, docs/configuration.md)."""

    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S  # head and body of one request, from its first byte
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S  # a kept-alive connection with nothing to do
    max_connections: int = DEFAULT_MAX_CONNECTIONS  # open at once, per listener, counted from the accept
    handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S  # TLS handshake, from the accept
    max_connections_per_peer: int = DEFAULT_MAX_CONNECTIONS_PER_PEER  # of one client address (webhook, metrics)
    handshakes_per_peer_per_s: float = DEFAULT_HANDSHAKES_PER_PEER_PER_S  # TLS handshakes one address starts; 0: any
    handshakes_per_s: float = DEFAULT_HANDSHAKES_PER_S  # TLS handshakes started, all addresses; 0: any
    max_body_bytes_in_flight: int = DEFAULT_MAX_BODY_BYTES_IN_FLIGHT  # request bodies held at once, all connections
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # one body (an address's share of the above is at least this)

    @classmethod
    def of(cls, settings: Settings) -> ListenerLimits:
        per_peer = settings.max_connections_per_peer
        return cls(
            max_header_bytes=settings.max_header_bytes,
            read_timeout_s=settings.read_timeout_seconds,
            idle_timeout_s=settings.idle_timeout_seconds,
            max_connections=settings.max_connections,
            handshake_timeout_s=settings.handshake_timeout_seconds,
            max_connections_per_peer=max(1, settings.max_connections // 4) if per_peer is None else per_peer,
            handshakes_per_peer_per_s=settings.handshakes_per_peer_per_second,
            handshakes_per_s=settings.handshakes_per_second,
            max_body_bytes_in_flight=settings.max_body_bytes_in_flight,
            max_request_bytes=settings.max_request_bytes,
        )

    @property
    def body_bytes_per_peer(self) -> int:
        """One client address's share of `max_body_bytes_in_flight` on the webhook: a quarter, and at least
        one body of `max_request_bytes`."""
        return min(self.max_body_bytes_in_flight, max(self.max_body_bytes_in_flight // 4, self.max_request_bytes))
