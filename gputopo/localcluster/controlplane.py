"""A real, local Kubernetes control plane: etcd, kube-apiserver, kube-scheduler and
kube-controller-manager processes.

Everything runs as child processes of this Python process, binds 127.0.0.1 only, on free ports,
and lives in one private directory (data, certificates, keys, configs and one log file per
component). Nodes have no kubelet: they are Node objects created through the API (see
``kube.KubeClient.create_nodes``). kube-controller-manager runs when asked
(``start_controller_manager``), with the workload controllers and the garbage collector only.

Typical use::

    with ControlPlane(feature_gates={"SomeGate": True}) as cp:
        cp.start_controller_manager()
        cp.start_plain_scheduler()
        kube = cp.client()
        ...

Only processes this object started are ever signalled, by PID.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import shutil
import ssl
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from gputopo.localcluster.binaries import find_binaries
from gputopo.localcluster.commandlines import (
    CONTROLLERS,
    SA_ISSUER,
    SERVICE_CIDR,
    Serving,
    apiserver_argv,
    controller_manager_argv,
    etcd_argv,
    scheduler_argv,
)
from gputopo.localcluster.featureflags import DEFAULT_FEATURES, ApiFeatures, feature_gates_arg, runtime_config_arg
from gputopo.localcluster.pki import (
    admission_configuration,
    generate_client_certificate,
    generate_sa_keys,
    kubeconfig_text,
    webhook_client_kubeconfig,
    write_private,
)

# The process supervision, the credential files, the components' command lines and the scheduler
# configuration live in their own modules; these names stay importable from here, where callers have always found them.
from gputopo.localcluster.procs import (
    EPHEMERAL,
    HOST,
    Component,
    ControlPlaneError,
    Lifetime,
    Supervisor,
    free_port,
    http_ok,
    insecure_ctx,
)
from gputopo.localcluster.schedconfig import LOCAL_SCHEDULER, ExtenderConfig, SchedulerOptions, scheduler_configuration
from gputopo.model import SCHEDULER_NAME

if TYPE_CHECKING:
    from gputopo.localcluster.kube import KubeClient

__all__ = [
    "ADMIN_USER",
    "APISERVER",
    "CONTROLLERS",
    "CONTROLLER_MANAGER",
    "CONTROLLER_MANAGER_USER",
    "ETCD",
    "GPUTOPO_PROFILE",
    "HOST",
    "PLAIN_PROFILE",
    "SA_ISSUER",
    "SERVICE_CIDR",
    "WEBHOOK_CLIENT_NAME",
    "ApiFeatures",
    "ControlPlane",
    "ControlPlaneError",
    "ExtenderConfig",
    "Lifetime",
    "SchedulerOptions",
    "free_port",
    "kubeconfig_text",
    "scheduler_configuration",
]

ETCD = "etcd"
APISERVER = "kube-apiserver"
GPUTOPO_PROFILE = SCHEDULER_NAME
PLAIN_PROFILE = "plain-scheduler"
ADMIN_USER = "gputopo-admin"
# The CN of the client certificate kube-apiserver presents to every admission webhook (a webhook that
# asks for one, like gputopo's with --webhook-client-ca-file, can tell the API server from anyone else).
WEBHOOK_CLIENT_NAME = "gputopo-local-kube-apiserver"
CONTROLLER_MANAGER = "kube-controller-manager"
# The identity the bootstrap RBAC binds to the system:kube-controller-manager ClusterRole.
CONTROLLER_MANAGER_USER = "system:kube-controller-manager"


class ControlPlane(Supervisor):
    """etcd + kube-apiserver (+ kube-schedulers, kube-controller-manager) on loopback, in a private directory.

    ``bin_dir``: the directory with the binaries (default: the built cache, see
    ``binaries.find_binaries``; raises if they are missing). ``base_dir``: parent for the private
    directory (default: the system temp dir). ``lifetime``: whether the directory (logs) stays on
    teardown and whether the children die with the thread that started them (``Lifetime``).
    ``features``: feature gates (as ``--feature-gates`` to every component that has the flag),
    runtime-config (kube-apiserver's ``--runtime-config``), both checked here
    (``featureflags.FlagError``), and ServiceAccount admission (``ApiFeatures``).
    """

    def __init__(
        self,
        bin_dir: Path | None = None,
        *,
        base_dir: Path | None = None,
        lifetime: Lifetime = EPHEMERAL,
        startup_timeout: float = 90.0,
        verbosity: int = 2,
        progress: Callable[[str], None] | None = None,
        features: ApiFeatures = DEFAULT_FEATURES,
    ) -> None:
        # Checked before anything is created: a bad name fails here, not in a component's log.
        self.feature_gates = dict(features.feature_gates)
        self.runtime_config = dict(features.runtime_config)
        self.service_account_admission = features.service_account_admission
        self._gate_args = [f"--feature-gates={feature_gates_arg(self.feature_gates)}"] if self.feature_gates else []
        self._runtime_args = (
            [f"--runtime-config={runtime_config_arg(self.runtime_config)}"] if self.runtime_config else []
        )
        if bin_dir is None:
            bin_dir = find_binaries()
            if bin_dir is None:
                raise ControlPlaneError(
                    "control-plane binaries are not built; run gputopo/localcluster/build_binaries.sh "
                    "(or localcluster.ensure_binaries())"
                )
        self.bin_dir = Path(bin_dir)
        for b in ("etcd", "kube-apiserver", "kube-scheduler", "kubectl"):
            if not (self.bin_dir / b).is_file():
                raise ControlPlaneError(f"{self.bin_dir / b} is missing")
        self.keep = lifetime.keep
        self.die_with_parent = lifetime.die_with_parent
        self.startup_timeout = startup_timeout
        self.verbosity = verbosity
        self._progress = progress
        self.dir = Path(tempfile.mkdtemp(prefix="gputopo-cp-", dir=base_dir))
        self.dir.chmod(0o700)
        self.admin_token = secrets.token_hex(24)
        self.controller_manager_token = secrets.token_hex(24)
        self.controller_manager_port: int | None = None
        self.etcd_port = free_port()
        self.etcd_peer_port = free_port()
        self.apiserver_port = free_port()
        self.server = f"https://{HOST}:{self.apiserver_port}"
        self.kubeconfig = self.dir / "admin.kubeconfig"
        self.ca_file: Path | None = None
        # The CA of the client certificate kube-apiserver presents to admission webhooks (CN WEBHOOK_CLIENT_NAME).
        self.webhook_client_ca: Path = self.dir / "webhook-client" / "ca.crt"
        self._components: dict[str, Component] = {}
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
        """Stop every process this object started (schedulers, controller manager, agents, then
        apiserver and etcd), by PID, and remove the directory unless ``keep``."""
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
        from gputopo.localcluster.kube import KubeClient

        return KubeClient(kubeconfig or self.kubeconfig, kubectl=self.kubectl)

    def token_client(self, token: str, *, user: str = "user") -> KubeClient:
        """A ``KubeClient`` authenticating with ``token`` (kubeconfig written into the dir)."""
        path = self.dir / "kubeconfigs" / f"{user}-{secrets.token_hex(4)}.kubeconfig"
        return self.client(self.write_kubeconfig(path, token=token, user=user))

    def write_kubeconfig(self, path: Path, *, token: str, user: str = "user") -> Path:
        """Write a kubeconfig for ``token`` against this apiserver (mode 0600)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        write_private(path, kubeconfig_text(self.server, token=token, user=user, ca_file=self.ca_file))
        return path

    # ----------------------------------------------------------------- component control

    def remove(self, name: str, *, grace: float = 5.0) -> None:
        """Stop a scheduler (or any component but etcd and kube-apiserver) and forget it, so that
        its name (and profile) can be used again.
        Its log file stays. etcd and kube-apiserver cannot be removed (use ``stop``)."""
        if name in (ETCD, APISERVER):
            raise ControlPlaneError(f"{name} cannot be removed; use stop() or teardown()")
        c = self._get(name)
        self._stop(c, grace)
        self._removed_pids.extend(c.started_pids)
        del self._components[name]
        self._scheduler_ports.pop(name, None)
        if name == CONTROLLER_MANAGER:
            self.controller_manager_port = None

    def start_scheduler(
        self,
        name: str,
        *,
        profile: str | None = None,
        extender: ExtenderConfig | None = None,
        options: SchedulerOptions = LOCAL_SCHEDULER,
        verbosity: int | None = None,
        extra_args: Sequence[str] = (),
    ) -> str:
        """Start a kube-scheduler process whose only profile is ``profile`` (default: ``name``),
        calling ``extender`` if given, as the admin. Returns the component name (``name``); waits
        for /healthz. gputopo's own scheduler runs the chart's configuration instead
        (``Stack.start_scheduler``)."""
        cfg = scheduler_configuration(self.kubeconfig, profile or name, extender, options)
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
        argv = scheduler_argv(
            self.bin_dir / "kube-scheduler",
            cfg_path,
            serving=Serving(port, cert_dir),
            auth=kubeconfig or self.kubeconfig,
            verbosity=self.verbosity if verbosity is None else verbosity,
            extra=[*self._gate_args, *extra_args],
        )
        url = f"https://{HOST}:{port}/healthz"
        try:
            return self.start_process(
                name, argv, ready=lambda: http_ok(url, ctx=insecure_ctx()), log_name=f"scheduler-{safe}"
            )
        except BaseException:
            self._scheduler_ports.pop(name, None)
            raise

    def start_plain_scheduler(self, *, name: str = PLAIN_PROFILE, **kwargs: Any) -> str:
        """A scheduler with the single profile ``plain-scheduler`` and no extender."""
        return self.start_scheduler(name, profile=PLAIN_PROFILE, **kwargs)

    def start_controller_manager(self, *, verbosity: int | None = None, extra_args: Sequence[str] = ()) -> str:
        """Start kube-controller-manager with ``CONTROLLERS``, as its own user
        (``CONTROLLER_MANAGER_USER``, a token of its own) and each controller with its own
        service account (``--use-service-account-credentials``), as in a kubeadm cluster. No leader
        election: there is one. Returns the component name; waits for /healthz."""
        self._require_started()
        if CONTROLLER_MANAGER in self._components:
            raise ControlPlaneError(f"component {CONTROLLER_MANAGER!r} exists; use restart()")
        exe = self.bin_dir / CONTROLLER_MANAGER
        if not exe.is_file():
            raise ControlPlaneError(f"{exe} is missing; run gputopo/localcluster/build_binaries.sh")
        kubeconfig = self.write_kubeconfig(
            self.dir / "kubeconfigs" / "kube-controller-manager.kubeconfig",
            token=self.controller_manager_token,
            user=CONTROLLER_MANAGER_USER,
        )
        port = free_port()
        cert_dir = self.dir / "kube-controller-manager-certs"
        cert_dir.mkdir(exist_ok=True)
        argv = controller_manager_argv(
            exe,
            kubeconfig,
            serving=Serving(port, cert_dir),
            sa_key=self.dir / "sa.key",
            ca_file=self.ca_file,
            verbosity=min(self.verbosity, 2) if verbosity is None else verbosity,
            extra=[*self._gate_args, *extra_args],
        )
        url = f"https://{HOST}:{port}/healthz"
        self.controller_manager_port = port
        try:
            return self.start_process(CONTROLLER_MANAGER, argv, ready=lambda: http_ok(url, ctx=insecure_ctx()))
        except BaseException:
            self.controller_manager_port = None
            raise

    # ----------------------------------------------------------------- internals

    def _prepare_files(self) -> None:
        (self.dir / "pki").mkdir(mode=0o700)
        generate_sa_keys(self.dir / "sa.key", self.dir / "sa.pub")
        client = self.dir / "webhook-client"
        client.mkdir(mode=0o700)
        self.webhook_client_ca, crt, key = generate_client_certificate(client, WEBHOOK_CLIENT_NAME)
        (client / "webhooks.kubeconfig").write_text(webhook_client_kubeconfig(crt, key))
        (self.dir / "admission.json").write_text(admission_configuration(client / "webhooks.kubeconfig"))
        write_private(
            self.dir / "tokens.csv",
            f'{self.admin_token},{ADMIN_USER},{ADMIN_USER},"system:masters"\n'
            f"{self.controller_manager_token},{CONTROLLER_MANAGER_USER},{CONTROLLER_MANAGER_USER}\n",
        )

    def _add_etcd(self) -> None:
        client = f"http://{HOST}:{self.etcd_port}"
        peer = f"http://{HOST}:{self.etcd_peer_port}"
        argv = etcd_argv(self.bin_dir / "etcd", self.dir / "etcd", client, peer)
        self._components[ETCD] = Component(
            name=ETCD, argv=argv, log_path=self.dir / "etcd.log", ready=lambda: http_ok(f"{client}/health")
        )

    def _add_apiserver(self) -> None:
        argv = apiserver_argv(
            self.bin_dir / "kube-apiserver",
            self.dir,
            etcd_port=self.etcd_port,
            port=self.apiserver_port,
            service_account_admission=self.service_account_admission,
            verbosity=min(self.verbosity, 2),
            extra=[*self._gate_args, *self._runtime_args],
        )
        readyz = f"{self.server}/readyz"
        self._components[APISERVER] = Component(
            name=APISERVER,
            argv=argv,
            log_path=self.dir / "kube-apiserver.log",
            ready=lambda: http_ok(readyz, token=self.admin_token, ctx=insecure_ctx()),
        )

    def _write_admin_kubeconfig(self) -> None:
        # The apiserver wrote a self-signed serving certificate (and its CA) into --cert-dir;
        # trust it if it verifies for 127.0.0.1, otherwise skip verification.
        crt = self.dir / "pki" / "apiserver.crt"
        self.ca_file = None
        if crt.is_file():
            try:
                ctx = ssl.create_default_context(cafile=str(crt))
                if http_ok(f"{self.server}/readyz", token=self.admin_token, ctx=ctx):
                    self.ca_file = crt
            except ssl.SSLError:
                self.ca_file = None
        self.write_kubeconfig(self.kubeconfig, token=self.admin_token, user=ADMIN_USER)
