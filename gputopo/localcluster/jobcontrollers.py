"""The real job controllers (JobSet, LeaderWorkerSet, Kueue, Kubeflow Trainer) on a local control plane.

Each controller manager runs as a host process, a component of the ``ControlPlane`` (its log in the
control plane's directory, stopped with it), built from its Go module by ``build_controllers.sh`` into a
cache whose ``bin/`` holds the binaries and ``src/`` each module's source. From that source come its CRDs
(applied server-side), its admission webhook configurations and its manager ClusterRole, rewritten for
loopback by ``controllermanifests``: the webhooks call ``https://127.0.0.1:<port>`` with the bundle of a
CA made here, and the manager serves them with a certificate for 127.0.0.1, its own certificate
management off, leader election off, metrics off, health probes on loopback.

Credentials: each manager authenticates with a token of its own ServiceAccount (namespace
``gputopo-controllers``), bound to the project's own manager ClusterRole, as its install does. Only the
setup here (CRDs, webhook configurations, RBAC, Trainer's runtimes) uses the admin.

Two fixed paths: Kueue (v0.17 to v0.19) reads a metrics serving certificate from ``/etc/kueue/metrics/certs`` even
with metrics off and exits without one (cmd/kueue/main.go has no setting for it), so one is written there
when none is; Trainer's webhook server takes no certificate directory, so it runs with ``TMPDIR`` set to a
private directory whose ``k8s-webhook-server/serving-certs`` holds its certificate.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import yaml

from gputopo.localcluster.binaries import run_script
from gputopo.localcluster.controllermanifests import (
    JSON,
    SPECS,
    ControllerSpec,
    conversion_patches,
    manager_config,
    rbac_objects,
    start_order,
    webhook_configurations,
    with_conversion,
)
from gputopo.localcluster.controlplane import ControlPlane
from gputopo.localcluster.kube import KubeClient, WaitTimeout
from gputopo.localcluster.pki import generate_serving_certificate
from gputopo.localcluster.procs import HOST, ControlPlaneError, free_port, http_ok

__all__ = [
    "BUILD_CONTROLLERS_SCRIPT",
    "CONTROLLERS_DIR_ENV",
    "CONTROLLERS_NAMESPACE",
    "KUEUE_METRICS_CERTS",
    "JobControllers",
    "controllers_missing",
    "ensure_controllers",
    "find_controllers_dir",
]

CONTROLLERS_DIR_ENV = "GPUTOPO_CONTROLLERS_DIR"
BUILD_CONTROLLERS_SCRIPT = Path(__file__).resolve().with_name("build_controllers.sh")
CONTROLLERS_NAMESPACE = "gputopo-controllers"
KUEUE_METRICS_CERTS = Path("/etc/kueue/metrics/certs")


def find_controllers_dir() -> Path | None:
    """``$GPUTOPO_CONTROLLERS_DIR`` if set, else the build script's cache directory when every controller
    is built there (``build_controllers.sh --check``), else None."""
    env = os.environ.get(CONTROLLERS_DIR_ENV)
    if env:
        return Path(env)
    proc = subprocess.run(
        ["bash", str(BUILD_CONTROLLERS_SCRIPT), "--check"], capture_output=True, text=True, check=False
    )
    out = proc.stdout.strip()
    return Path(out) if proc.returncode == 0 and out else None


def ensure_controllers(names: Sequence[str], progress: Callable[[str], None] | None = None) -> Path:
    """Build ``names`` if needed (once per machine: minutes each) and return the build's directory;
    ``$GPUTOPO_CONTROLLERS_DIR`` names a ready one. ``progress`` gets each line the build writes."""
    env = os.environ.get(CONTROLLERS_DIR_ENV)
    if env:
        missing = controllers_missing(Path(env), names)
        if missing is not None:
            raise ControlPlaneError(f"{CONTROLLERS_DIR_ENV}={env}: {missing}")
        return Path(env)
    rc, out, tail = run_script(["bash", str(BUILD_CONTROLLERS_SCRIPT), *names], progress)
    if rc != 0 or not out.strip():
        raise ControlPlaneError(
            f"{BUILD_CONTROLLERS_SCRIPT.name} {' '.join(names)} failed with exit status {rc}; last output:\n"
            + "\n".join(tail)
        )
    return Path(out.strip().splitlines()[-1])


def controllers_missing(directory: Path | None, names: Iterable[str]) -> str | None:
    """What is missing for ``names`` in ``directory`` (a sentence with the fix), or None."""
    if directory is None:
        return (
            "the job controllers are not built; build them once per machine with "
            f"`bash {BUILD_CONTROLLERS_SCRIPT.relative_to(BUILD_CONTROLLERS_SCRIPT.parents[2])}` "
            f"(needs Go; about 12 minutes on two cores), or set {CONTROLLERS_DIR_ENV} to a ready directory"
        )
    for name in names:
        title = SPECS[name].title if name in SPECS else name
        for path in (directory / "bin" / name, directory / "src" / name):
            if not path.exists():
                return f"{title}: {path} is missing in {directory}; run gputopo/localcluster/build_controllers.sh"
    return None


def _load(path: Path) -> list[JSON]:
    try:
        return [d for d in yaml.safe_load_all(path.read_text()) if isinstance(d, dict)]
    except (OSError, yaml.YAMLError) as e:
        raise ControlPlaneError(f"cannot read {path}: {e}") from e


def _answers(url: str, ca: Path) -> bool:
    """Whether a TLS server that ``ca`` vouches for answers at ``url`` (any HTTP status)."""
    try:
        with urllib.request.urlopen(url, timeout=2, context=ssl.create_default_context(cafile=str(ca))):
            return True
    except urllib.error.HTTPError:
        return True
    except (urllib.error.URLError, OSError, ssl.SSLError):
        return False


class JobControllers:
    """Starts job controller managers on a started ``cp`` from the build in ``directory`` (see
    ``find_controllers_dir``). ``ensure(*names)`` starts what is asked and what it needs, once each;
    ``startup_seconds`` records how long each took (CRDs, RBAC, process, webhooks)."""

    def __init__(self, cp: ControlPlane, kube: KubeClient, directory: Path, *, timeout: float = 120.0) -> None:
        self.cp = cp
        self.kube = kube
        self.directory = Path(directory)
        self.timeout = timeout
        self.startup_seconds: dict[str, float] = {}
        self.running: list[str] = []

    @staticmethod
    def component(name: str) -> str:
        """The control-plane component name of a controller's manager process."""
        return f"{name}-controller-manager"

    def ensure(self, *names: str) -> list[str]:
        """Start ``names`` and what they need (dependencies first) unless already running; returns the
        component names of ``names``."""
        try:
            order = start_order(names)
        except KeyError as e:
            raise ControlPlaneError(str(e.args[0])) from None
        missing = controllers_missing(self.directory, order)
        if missing is not None:
            raise ControlPlaneError(missing)
        for name in order:
            if name not in self.running:
                self.start(name)
        return [self.component(n) for n in names]

    def start(self, name: str) -> float:
        """Start one controller (its ``needs`` must run already); returns the seconds it took."""
        spec = SPECS[name]
        t0 = time.monotonic()
        src = self.directory / "src" / name
        work = self.cp.dir / "controllers" / name
        work.mkdir(parents=True, exist_ok=True)
        port = free_port()
        base_url = f"https://{HOST}:{port}"
        env = {"KUBECONFIG": str(self._kubeconfig(spec, src))}
        cert_dir = work / "certs"
        if not spec.cert_dir_in_config:  # its webhook server reads <TMPDIR>/k8s-webhook-server/serving-certs
            env["TMPDIR"] = str(work / "tmp")
            cert_dir = work / "tmp" / "k8s-webhook-server" / "serving-certs"
        ca, crt, key = generate_serving_certificate(cert_dir, f"{name}-webhook")
        if name == "kueue":
            _kueue_metrics_cert(crt, key)
        ca_pem = ca.read_bytes()
        self._apply_crds(spec, src, base_url, ca_pem)
        probe = free_port()
        config = manager_config(
            spec, webhook_port=port, cert_dir=str(cert_dir), probe_port=probe, namespace=CONTROLLERS_NAMESPACE
        )
        config_path = work / "config.yaml"
        config_path.write_text(json.dumps(config, indent=2) + "\n")
        exe = self.directory / "bin" / name

        def ready() -> bool:
            return http_ok(f"http://{HOST}:{probe}/readyz") and _answers(f"{base_url}/readyz", ca)

        component = self.component(name)
        try:
            self.cp.start_process(component, [str(exe), f"--config={config_path}"], ready=ready, env=env)
        except ControlPlaneError as e:
            raise ControlPlaneError(f"{spec.title} controller did not start: {e}") from None
        self.kube.apply(webhook_configurations(spec, _load(src / spec.webhooks), base_url=base_url, ca_pem=ca_pem))
        for post in spec.post:
            self._apply_when_admitted(spec, _load(src / post))
        self.running.append(name)
        self.startup_seconds[name] = time.monotonic() - t0
        return self.startup_seconds[name]

    # ----------------------------------------------------------------- setup steps

    def _apply_crds(self, spec: ControllerSpec, src: Path, base_url: str, ca_pem: bytes) -> None:
        kustomization = src / spec.crd_kustomization
        kdoc = _load(kustomization)[0] if kustomization.is_file() else {}
        patch_docs = {
            str(p.get("path")): _load(kustomization.parent / str(p.get("path")))[0]
            for p in kdoc.get("patches") or []
            if (kustomization.parent / str(p.get("path", ""))).is_file()
        }
        conversions = conversion_patches(kdoc, patch_docs)
        crds = [
            with_conversion(d, conversions.get(d["metadata"]["name"]), base_url=base_url, ca_pem=ca_pem)
            for crd_dir in spec.crd_dirs
            for path in sorted((src / crd_dir).glob("*.yaml"))
            for d in _load(path)
            if d.get("kind") == "CustomResourceDefinition"
        ]
        if not crds:
            raise ControlPlaneError(f"{spec.title}: no CRDs under {', '.join(spec.crd_dirs)} in {src}")
        self.kube.apply(crds, server_side=True)
        self._wait_established(spec, [str(c["metadata"]["name"]) for c in crds])

    def _wait_established(self, spec: ControllerSpec, names: list[str]) -> None:
        try:
            self.kube.wait_crds_established(names, timeout=self.timeout)
        except WaitTimeout as e:
            raise ControlPlaneError(f"{spec.title}: {e}") from None

    def _kubeconfig(self, spec: ControllerSpec, src: Path) -> Path:
        """The manager's own ServiceAccount, bound to its project's manager roles; a kubeconfig
        with a token of it."""
        account = self.component(spec.name)
        self.kube.create_namespace(CONTROLLERS_NAMESPACE)
        self.kube.create_service_account(CONTROLLERS_NAMESPACE, account)
        try:
            rbac = rbac_objects(spec, [d for r in spec.roles for d in _load(src / r)], CONTROLLERS_NAMESPACE, account)
        except ValueError as e:
            raise ControlPlaneError(str(e)) from None
        self.kube.apply(rbac)
        token = self.kube.create_token(CONTROLLERS_NAMESPACE, account)
        return self.cp.write_kubeconfig(
            self.cp.dir / "kubeconfigs" / f"{account}.kubeconfig", token=token, user=account
        )

    def _apply_when_admitted(self, spec: ControllerSpec, objects: list[JSON]) -> None:
        """Apply objects its own webhooks admit: the API server may call them only a moment after their
        configuration is stored, so an unreachable-webhook refusal is retried until the timeout."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                self.kube.apply(objects, server_side=True)
                return
            except RuntimeError as e:
                if time.monotonic() > deadline:
                    raise ControlPlaneError(f"{spec.title}: could not apply its runtimes: {e}") from None
                time.sleep(0.5)


def _kueue_metrics_cert(crt: Path, key: Path) -> None:
    """Kueue's metrics certificate at its fixed path, written when none is there (see the module doc)."""
    have = [KUEUE_METRICS_CERTS / "tls.crt", KUEUE_METRICS_CERTS / "tls.key"]
    if all(p.is_file() for p in have):
        return
    try:
        KUEUE_METRICS_CERTS.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(crt, have[0])
        shutil.copyfile(key, have[1])
        have[1].chmod(0o600)
    except OSError as e:
        with contextlib.suppress(OSError):
            for p in have:
                p.unlink(missing_ok=True)
        raise ControlPlaneError(
            f"Kueue: it reads a metrics certificate from {KUEUE_METRICS_CERTS} and exits without one; "
            f"could not write one there ({e}); create tls.crt and tls.key there (any pair) and retry"
        ) from None
