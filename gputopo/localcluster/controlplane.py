"""A real, local Kubernetes control plane: etcd, kube-apiserver and kube-scheduler processes.

Everything runs as child processes of this Python process, binds 127.0.0.1 only, on free ports,
and lives in one private directory (data, certificates, keys, configs and one log file per
component). Nodes have no kubelet: they are Node objects created through the API (see
``kube.KubeClient.create_nodes``). No kube-controller-manager runs.

Typical use::

    with ControlPlane() as cp:
        cp.start_plain_scheduler()
        kube = cp.client()
        ...

Only processes this object started are ever signalled, by PID.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from gputopo.model import GPU_RESOURCE, SCHEDULER_NAME

from .binaries import find_binaries

if TYPE_CHECKING:
    from .kube import KubeClient

ETCD = "etcd"
APISERVER = "kube-apiserver"
GPUTOPO_PROFILE = SCHEDULER_NAME
PLAIN_PROFILE = "plain-scheduler"
ADMIN_USER = "gputopo-admin"
SA_ISSUER = "https://kubernetes.default.svc.cluster.local"
SERVICE_CIDR = "10.0.0.0/24"
HOST = "127.0.0.1"


class ControlPlaneError(RuntimeError):
    """A component failed to start or the control plane is used wrongly."""


@dataclass(frozen=True)
class ExtenderConfig:
    """One ``extenders[]`` entry of a KubeSchedulerConfiguration (upstream field names in comments)."""

    url: str  # urlPrefix
    filter_verb: str | None = "filter"
    prioritize_verb: str | None = "prioritize"
    bind_verb: str | None = "bind"
    preempt_verb: str | None = None  # "preempt": clique-aware victims (docs/extender.md, "Preemption")
    weight: int = 5
    node_cache_capable: bool = True
    http_timeout: str = "5s"
    ignorable: bool = False
    # (name, ignoredByScheduler)
    managed_resources: tuple[tuple[str, bool], ...] = ((GPU_RESOURCE, False),)
    ca_file: Path | None = None  # tlsConfig.caFile: verify the extender's serving certificate

    def to_config(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "urlPrefix": self.url,
            "weight": self.weight,
            "nodeCacheCapable": self.node_cache_capable,
            "enableHTTPS": self.url.startswith("https://"),
            "httpTimeout": self.http_timeout,
            "ignorable": self.ignorable,
            "managedResources": [{"name": n, "ignoredByScheduler": ignored} for n, ignored in self.managed_resources],
        }
        if self.ca_file is not None:
            out["tlsConfig"] = {"caFile": str(self.ca_file)}
        for key, verb in (
            ("filterVerb", self.filter_verb),
            ("prioritizeVerb", self.prioritize_verb),
            ("bindVerb", self.bind_verb),
            ("preemptVerb", self.preempt_verb),
        ):
            if verb:
                out[key] = verb
        return out


def scheduler_configuration(
    kubeconfig: Path,
    profile: str,
    extender: ExtenderConfig | None = None,
    *,
    percentage_of_nodes_to_score: int = 100,
    disable_preemption: bool = True,
    client_qps: float = 50.0,
    client_burst: int = 100,
    parallelism: int | None = None,
) -> dict[str, Any]:
    """The KubeSchedulerConfiguration (as a dict) for a scheduler with exactly one profile."""
    prof: dict[str, Any] = {"schedulerName": profile}
    if disable_preemption:
        prof["plugins"] = {"postFilter": {"disabled": [{"name": "DefaultPreemption"}]}}
    cfg: dict[str, Any] = {
        "apiVersion": "kubescheduler.config.k8s.io/v1",
        "kind": "KubeSchedulerConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig), "qps": client_qps, "burst": client_burst},
        "leaderElection": {"leaderElect": False},
        "percentageOfNodesToScore": percentage_of_nodes_to_score,
        "profiles": [prof],
    }
    if parallelism is not None:
        cfg["parallelism"] = parallelism
    if extender is not None:
        cfg["extenders"] = [extender.to_config()]
    return cfg


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _insecure_ctx() -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def _http_ok(url: str, *, token: str | None = None, ctx: ssl.SSLContext | None = None) -> bool:
    req = urllib.request.Request(url)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=2, context=ctx) as resp:
            return int(resp.status) == 200
    except (urllib.error.URLError, OSError, ssl.SSLError):
        return False


def _set_pdeathsig() -> None:  # pragma: no cover - runs in the child between fork and exec
    # PR_SET_PDEATHSIG = 1: the kernel sends SIGTERM to the child when the forking thread exits.
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)


def _tail(path: Path, lines: int = 40) -> str:
    try:
        with path.open("r", errors="replace") as f:
            return "".join(deque(f, maxlen=lines))
    except OSError:
        return "(no log)"


def _diagnosis(path: Path, lines: int = 40) -> str:
    """Error lines from anywhere in a log (cobra prints the error before a long usage text;
    klog's E/F lines; etcd's JSON error levels), then the tail."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    errors = [
        ln
        for ln in text
        if ln.startswith(("Error:", "error:", "E1", "E0", "F1", "F0"))
        or '"level":"error"' in ln
        or '"level":"fatal"' in ln
        or '"level":"panic"' in ln
    ][-10:]
    head = ("error lines:\n" + "\n".join(errors) + "\n--- last lines:\n") if errors else ""
    return head + "\n".join(text[-lines:])


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _generate_sa_keys(key: Path, pub: Path) -> None:
    """RSA key pair for signing service-account tokens: openssl CLI, else ``cryptography``."""
    openssl = shutil.which("openssl")
    if openssl:
        subprocess.run(
            [openssl, "genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", str(key)],
            check=True,
            capture_output=True,
        )
        subprocess.run([openssl, "pkey", "-in", str(key), "-pubout", "-out", str(pub)], check=True, capture_output=True)
        key.chmod(0o600)
        return
    try:
        import importlib

        rsa: Any = importlib.import_module("cryptography.hazmat.primitives.asymmetric.rsa")
        ser: Any = importlib.import_module("cryptography.hazmat.primitives.serialization")
    except ImportError as e:
        raise ControlPlaneError(
            "need the openssl command or the Python 'cryptography' package to create service-account signing keys"
        ) from e
    k = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    _write_private(
        key,
        k.private_bytes(ser.Encoding.PEM, ser.PrivateFormat.PKCS8, ser.NoEncryption()).decode(),
    )
    pub.write_bytes(k.public_key().public_bytes(ser.Encoding.PEM, ser.PublicFormat.SubjectPublicKeyInfo))


@dataclass
class _Component:
    name: str
    argv: list[str]
    log_path: Path
    ready: Callable[[], bool]
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    started_pids: list[int] = field(default_factory=list)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def kubeconfig_text(server: str, *, token: str, user: str, ca_file: Path | None, cluster: str = "gputopo-local") -> str:
    """A kubeconfig (JSON, which is YAML) for one bearer token."""
    cl: dict[str, Any] = {"server": server}
    if ca_file is not None:
        cl["certificate-authority"] = str(ca_file)
    else:
        cl["insecure-skip-tls-verify"] = True
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": cluster, "cluster": cl}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": f"{user}@{cluster}", "context": {"cluster": cluster, "user": user}}],
        "current-context": f"{user}@{cluster}",
        "preferences": {},
    }
    return json.dumps(doc, indent=2) + "\n"


class ControlPlane:
    """etcd + kube-apiserver (+ kube-schedulers) on loopback, in a private directory.

    ``bin_dir``: the directory with the binaries (default: the built cache, see
    ``binaries.find_binaries``; raises if they are missing). ``base_dir``: parent for the private
    directory (default: the system temp dir). ``keep``: leave the directory (logs) on teardown.
    ``die_with_parent``: the kernel stops the children when the thread that started them exits
    (Linux ``PR_SET_PDEATHSIG``); set False (e.g. ``gputopo demo --keep``) for a control plane
    that outlives this process, and start it from a thread that lives as long as it should.
    """

    def __init__(
        self,
        bin_dir: Path | None = None,
        *,
        base_dir: Path | None = None,
        keep: bool = False,
        die_with_parent: bool = True,
        startup_timeout: float = 90.0,
        verbosity: int = 2,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        if bin_dir is None:
            bin_dir = find_binaries()
            if bin_dir is None:
                raise ControlPlaneError(
                    "control-plane binaries are not built; run gputopo/localcluster/build_binaries.sh "
                    "(or gputopo.localcluster.ensure_binaries())"
                )
        self.bin_dir = Path(bin_dir)
        for b in ("etcd", "kube-apiserver", "kube-scheduler", "kubectl"):
            if not (self.bin_dir / b).is_file():
                raise ControlPlaneError(f"{self.bin_dir / b} is missing")
        self.keep = keep
        self.die_with_parent = die_with_parent
        self.startup_timeout = startup_timeout
        self.verbosity = verbosity
        self._progress = progress
        self.dir = Path(tempfile.mkdtemp(prefix="gputopo-cp-", dir=base_dir))
        self.dir.chmod(0o700)
        self.admin_token = secrets.token_hex(24)
        self.etcd_port = free_port()
        self.etcd_peer_port = free_port()
        self.apiserver_port = free_port()
        self.server = f"https://{HOST}:{self.apiserver_port}"
        self.kubeconfig = self.dir / "admin.kubeconfig"
        self.ca_file: Path | None = None
        self._components: dict[str, _Component] = {}
        self._scheduler_ports: dict[str, int] = {}
        self._removed_pids: list[int] = []
        self._torn_down = False
        self._started = False
        atexit.register(self._atexit)

    # ----------------------------------------------------------------- lifecycle

    def __enter__(self) -> ControlPlane:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.teardown()

    def start(self) -> ControlPlane:
        """Start etcd and kube-apiserver, wait for /readyz, write the admin kubeconfig."""
        if self._started:
            return self
        if self._torn_down:
            raise ControlPlaneError("this control plane was torn down; create a new one")
        self._started = True
        try:
            self._prepare_files()
            self._add_etcd()
            self._add_apiserver()
            self._start(ETCD)
            self._start(APISERVER)
            self._write_admin_kubeconfig()
        except BaseException:
            self.teardown()
            raise
        return self

    def teardown(self) -> None:
        """Stop every process this object started (schedulers, apiserver, etcd), by PID, and
        remove the directory unless ``keep``."""
        if self._torn_down:
            return
        self._torn_down = True
        atexit.unregister(self._atexit)
        # Clients first: a kube-apiserver with open watches (or an etcd with an apiserver
        # attached) can take seconds to finish a graceful shutdown.
        order = [n for n in self._components if n not in (ETCD, APISERVER)] + [APISERVER, ETCD]
        for name in order:
            if name in self._components:
                self._stop(self._components[name], 3.0)
        if not self.keep:
            shutil.rmtree(self.dir, ignore_errors=True)

    close = teardown

    def detach(self) -> None:
        """Forget the processes without stopping them (for a control plane left running on
        purpose). Their PIDs stay in ``pids.json`` in the directory."""
        self._torn_down = True
        atexit.unregister(self._atexit)

    def _atexit(self) -> None:
        with contextlib.suppress(Exception):
            self.teardown()

    # ----------------------------------------------------------------- public queries

    @property
    def kubectl(self) -> Path:
        return self.bin_dir / "kubectl"

    def components(self) -> list[str]:
        return list(self._components)

    def pid(self, name: str) -> int | None:
        c = self._get(name)
        return c.proc.pid if c.running and c.proc is not None else None

    def is_running(self, name: str) -> bool:
        return self._get(name).running

    def owned_pids(self) -> list[int]:
        """Every PID this control plane has started, including stopped ones."""
        return self._removed_pids + [p for c in self._components.values() for p in c.started_pids]

    def log_path(self, name: str) -> Path:
        return self._get(name).log_path

    def log_tail(self, name: str, lines: int = 40) -> str:
        return _tail(self._get(name).log_path, lines)

    def scheduler_port(self, name: str) -> int:
        """The scheduler's secure port (serves /healthz, /readyz, /metrics without auth)."""
        return self._scheduler_ports[name]

    def env(self) -> dict[str, str]:
        """Environment for subprocesses that should use this cluster (KUBECONFIG set)."""
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.kubeconfig)
        return env

    def client(self, kubeconfig: Path | None = None) -> KubeClient:
        """A ``KubeClient`` for the admin (or for the given kubeconfig)."""
        from .kube import KubeClient

        return KubeClient(kubeconfig or self.kubeconfig, kubectl=self.kubectl)

    def token_client(self, token: str, *, user: str = "user") -> KubeClient:
        """A ``KubeClient`` authenticating with ``token`` (kubeconfig written into the dir)."""
        path = self.dir / "kubeconfigs" / f"{user}-{secrets.token_hex(4)}.kubeconfig"
        return self.client(self.write_kubeconfig(path, token=token, user=user))

    def write_kubeconfig(self, path: Path, *, token: str, user: str = "user") -> Path:
        """Write a kubeconfig for ``token`` against this apiserver (mode 0600)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_private(path, kubeconfig_text(self.server, token=token, user=user, ca_file=self.ca_file))
        return path

    # ----------------------------------------------------------------- component control

    def stop(self, name: str, *, grace: float = 5.0) -> None:
        """Stop one component (SIGTERM, then SIGKILL after ``grace`` seconds). Start it again
        with ``start_component`` or ``restart``. A kube-apiserver with schedulers watching it
        usually needs the whole grace period, since its graceful shutdown waits for them."""
        self._stop(self._get(name), grace)

    def kill(self, name: str) -> None:
        """SIGKILL one component at once, as a crash or an evicted pod would end it: nothing is
        flushed or released. Start it again with ``start_component``."""
        c = self._get(name)
        if c.proc is not None and c.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(c.proc.pid, signal.SIGKILL)
            c.proc.wait(timeout=30)
        self._write_pids()

    def restart(self, name: str, *, grace: float = 5.0) -> None:
        """Stop (if running) and start one component again with the same ports, data and
        configuration, waiting until it is ready."""
        c = self._get(name)
        self._stop(c, grace)
        self._start(name)

    def remove(self, name: str, *, grace: float = 5.0) -> None:
        """Stop a scheduler and forget it, so that its name (and profile) can be used again.
        Its log file stays. etcd and kube-apiserver cannot be removed (use ``stop``)."""
        if name in (ETCD, APISERVER):
            raise ControlPlaneError(f"{name} cannot be removed; use stop() or teardown()")
        c = self._get(name)
        self._stop(c, grace)
        self._removed_pids.extend(c.started_pids)
        del self._components[name]
        self._scheduler_ports.pop(name, None)

    def start_component(self, name: str) -> None:
        """Start a stopped component again (no-op if it runs)."""
        if not self._get(name).running:
            self._start(name)

    def start_scheduler(
        self,
        name: str,
        *,
        profile: str | None = None,
        extender: ExtenderConfig | None = None,
        percentage_of_nodes_to_score: int = 100,
        disable_preemption: bool = True,
        client_qps: float = 50.0,
        client_burst: int = 100,
        parallelism: int | None = None,
        verbosity: int | None = None,
        extra_args: Sequence[str] = (),
    ) -> str:
        """Start a kube-scheduler process whose only profile is ``profile`` (default: ``name``),
        calling ``extender`` if given, as the admin. Returns the component name (``name``); waits
        for /healthz. gputopo's own scheduler runs the chart's configuration instead
        (``Stack.start_scheduler``)."""
        cfg = scheduler_configuration(
            self.kubeconfig,
            profile or name,
            extender,
            percentage_of_nodes_to_score=percentage_of_nodes_to_score,
            disable_preemption=disable_preemption,
            client_qps=client_qps,
            client_burst=client_burst,
            parallelism=parallelism,
        )
        return self.start_scheduler_config(name, cfg, verbosity=verbosity, extra_args=extra_args)

    def start_scheduler_config(
        self,
        name: str,
        config: Mapping[str, Any],
        *,
        kubeconfig: Path | None = None,
        verbosity: int | None = None,
        extra_args: Sequence[str] = (),
    ) -> str:
        """Start a kube-scheduler process with a whole KubeSchedulerConfiguration. ``kubeconfig``
        (default: the admin's) also serves the scheduler's delegated authentication and
        authorization, as the in-cluster config would. Waits for /healthz."""
        self._require_started()
        if name in self._components:
            raise ControlPlaneError(f"component {name!r} exists; use restart()")
        safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)
        cfg_path = self.dir / f"scheduler-{safe}.yaml"
        cfg_path.write_text(json.dumps(dict(config), indent=2) + "\n")
        port = free_port()
        self._scheduler_ports[name] = port
        cert_dir = self.dir / f"scheduler-{safe}-certs"
        cert_dir.mkdir(exist_ok=True)
        auth = kubeconfig or self.kubeconfig
        argv = [
            str(self.bin_dir / "kube-scheduler"),
            f"--config={cfg_path}",
            f"--bind-address={HOST}",
            f"--secure-port={port}",
            f"--cert-dir={cert_dir}",
            f"--authentication-kubeconfig={auth}",
            f"--authorization-kubeconfig={auth}",
            "--authorization-always-allow-paths=/healthz,/readyz,/livez,/metrics",
            f"--v={self.verbosity if verbosity is None else verbosity}",
            *extra_args,
        ]
        url = f"https://{HOST}:{port}/healthz"
        try:
            return self.start_process(
                name, argv, ready=lambda: _http_ok(url, ctx=_insecure_ctx()), log_name=f"scheduler-{safe}"
            )
        except BaseException:
            self._scheduler_ports.pop(name, None)
            raise

    def start_process(
        self,
        name: str,
        argv: Sequence[str],
        *,
        ready: Callable[[], bool],
        env: Mapping[str, str] | None = None,
        log_name: str | None = None,
    ) -> str:
        """Run a process (a scheduler, the extender, an agent) as a managed component: logged into
        the directory, stopped with the rest, restartable by name. Waits until ``ready()``."""
        self._require_started()
        if name in self._components:
            raise ControlPlaneError(f"component {name!r} exists; use restart()")
        safe = log_name or "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)
        self._components[name] = _Component(
            name=name, argv=list(argv), log_path=self.dir / f"{safe}.log", ready=ready, env=dict(env or {})
        )
        try:
            self._start(name)
        except BaseException:
            c = self._components.pop(name)
            self._removed_pids.extend(c.started_pids)
            raise
        return name

    def start_plain_scheduler(self, *, name: str = PLAIN_PROFILE, **kwargs: Any) -> str:
        """A scheduler with the single profile ``plain-scheduler`` and no extender."""
        return self.start_scheduler(name, profile=PLAIN_PROFILE, **kwargs)

    # ----------------------------------------------------------------- internals

    def _say(self, msg: str) -> None:
        if self._progress is not None:
            self._progress(msg)

    def _get(self, name: str) -> _Component:
        try:
            return self._components[name]
        except KeyError:
            raise ControlPlaneError(f"no component {name!r}; have {', '.join(self._components) or 'none'}") from None

    def _require_started(self) -> None:
        if not self._started or self._torn_down:
            raise ControlPlaneError("the control plane is not running; call start() first")

    def _prepare_files(self) -> None:
        (self.dir / "pki").mkdir(mode=0o700)
        _generate_sa_keys(self.dir / "sa.key", self.dir / "sa.pub")
        _write_private(self.dir / "tokens.csv", f'{self.admin_token},{ADMIN_USER},{ADMIN_USER},"system:masters"\n')

    def _add_etcd(self) -> None:
        client = f"http://{HOST}:{self.etcd_port}"
        peer = f"http://{HOST}:{self.etcd_peer_port}"
        argv = [
            str(self.bin_dir / "etcd"),
            "--name=gputopo",
            f"--data-dir={self.dir / 'etcd'}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=gputopo={peer}",
            "--initial-cluster-state=new",
            "--unsafe-no-fsync=true",
            "--log-level=warn",
            "--quota-backend-bytes=8589934592",
        ]
        self._components[ETCD] = _Component(
            name=ETCD, argv=argv, log_path=self.dir / "etcd.log", ready=lambda: _http_ok(f"{client}/health")
        )

    def _add_apiserver(self) -> None:
        argv = [
            str(self.bin_dir / "kube-apiserver"),
            f"--etcd-servers=http://{HOST}:{self.etcd_port}",
            f"--bind-address={HOST}",
            f"--advertise-address={HOST}",
            f"--secure-port={self.apiserver_port}",
            f"--cert-dir={self.dir / 'pki'}",
            f"--token-auth-file={self.dir / 'tokens.csv'}",
            "--authorization-mode=Node,RBAC",
            f"--service-account-issuer={SA_ISSUER}",
            f"--service-account-key-file={self.dir / 'sa.pub'}",
            f"--service-account-signing-key-file={self.dir / 'sa.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            # No kube-controller-manager: no default ServiceAccount, and nobody would remove the
            # not-ready taint that TaintNodesByCondition puts on every new Node.
            "--disable-admission-plugins=ServiceAccount,TaintNodesByCondition",
            "--enable-admission-plugins=NodeRestriction,ValidatingAdmissionPolicy",
            "--allow-privileged=true",
            # The `kubernetes` Service cannot point at a loopback address; skip it.
            "--endpoint-reconciler-type=none",
            "--profiling=false",
            f"--v={min(self.verbosity, 2)}",
        ]
        readyz = f"{self.server}/readyz"
        self._components[APISERVER] = _Component(
            name=APISERVER,
            argv=argv,
            log_path=self.dir / "kube-apiserver.log",
            ready=lambda: _http_ok(readyz, token=self.admin_token, ctx=_insecure_ctx()),
        )

    def _write_admin_kubeconfig(self) -> None:
        # The apiserver wrote a self-signed serving certificate (and its CA) into --cert-dir;
        # trust it if it verifies for 127.0.0.1, otherwise skip verification.
        crt = self.dir / "pki" / "apiserver.crt"
        self.ca_file = None
        if crt.is_file():
            try:
                ctx = ssl.create_default_context(cafile=str(crt))
                if _http_ok(f"{self.server}/readyz", token=self.admin_token, ctx=ctx):
                    self.ca_file = crt
            except ssl.SSLError:
                self.ca_file = None
        self.write_kubeconfig(self.kubeconfig, token=self.admin_token, user=ADMIN_USER)

    def _write_pids(self) -> None:
        pids = {n: c.proc.pid for n, c in self._components.items() if c.running and c.proc is not None}
        with contextlib.suppress(OSError):
            (self.dir / "pids.json").write_text(json.dumps(pids, indent=2) + "\n")

    def _start(self, name: str) -> None:
        c = self._get(name)
        if c.running:
            return
        self._say(f"starting {name}")
        with c.log_path.open("ab") as log:
            log.write(f"\n=== {time.strftime('%Y-%m-%dT%H:%M:%S')} starting: {' '.join(c.argv)}\n".encode())
            log.flush()
            c.proc = subprocess.Popen(
                c.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.dir,
                env={**os.environ, **c.env} if c.env else None,
                start_new_session=True,
                preexec_fn=_set_pdeathsig if self.die_with_parent else None,
            )
        c.started_pids.append(c.proc.pid)
        self._write_pids()
        deadline = time.monotonic() + self.startup_timeout
        while True:
            rc = c.proc.poll()
            if rc is not None:
                raise ControlPlaneError(
                    f"{name} exited with status {rc} during startup; log {c.log_path}:\n" + _diagnosis(c.log_path)
                )
            if c.ready():
                self._say(f"{name} ready (pid {c.proc.pid})")
                return
            if time.monotonic() > deadline:
                self._stop(c)
                raise ControlPlaneError(
                    f"{name} not ready after {self.startup_timeout:.0f}s; log {c.log_path}:\n" + _diagnosis(c.log_path)
                )
            time.sleep(0.1)

    def _stop(self, c: _Component, timeout: float = 5.0) -> None:
        p = c.proc
        if p is None:
            return
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
                p.wait(timeout=30)
        self._write_pids()
