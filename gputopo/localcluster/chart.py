"""The Helm chart (charts/gputopo) rendered for the local control plane.

The local stack holds no copy of gputopo's RBAC, admission policies or scheduler configuration:
``helm template`` renders the chart, and the stack applies the access objects (ServiceAccounts,
Roles, ClusterRoles, their bindings, ValidatingAdmissionPolicies and their bindings), runs
kube-scheduler with the KubeSchedulerConfiguration from the rendered ConfigMap, and runs the extender
with its sidecar container's environment. What must differ for processes on one machine is
rewritten here and nowhere else: ``local_scheduler_config`` and ``local_extender_args``.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from gputopo.model import DEFAULT_NAMESPACE, EXTENDER_COMPONENT, SCHEDULER_NAME

if TYPE_CHECKING:
    from gputopo.localcluster.controlplane import ControlPlane

CHART_DIR = Path(__file__).resolve().parents[2] / "charts" / "gputopo"
RELEASE = "gputopo"
NAMESPACE = DEFAULT_NAMESPACE
KUBE_VERSION = "1.34.4"
ACCESS_KINDS = (
    "ServiceAccount",
    "ClusterRole",
    "ClusterRoleBinding",
    "Role",
    "RoleBinding",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
    "DeviceClass",  # rendered with agent.dra.enabled: what claims for gputopo's GPUs name
)

Doc = dict[str, Any]


class ChartError(RuntimeError):
    """helm failed, or the rendered chart lacks what the local stack needs."""


def helm_binary(bin_dir: Path) -> Path:
    """``$GPUTOPO_HELM`` if set, else the pinned helm built next to the control-plane binaries."""
    env = os.environ.get("GPUTOPO_HELM")
    path = Path(env) if env else bin_dir / "helm"
    if not path.is_file():
        raise ChartError(f"helm not found at {path}; run gputopo/localcluster/build_binaries.sh")
    return path


def run_helm(cp: ControlPlane, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """helm ``args`` against ``cp``'s API server, its cache, configuration and data under ``cp``'s
    directory (none of the user's); the exit status is the caller's to judge."""
    env = {
        **cp.env(),
        "HELM_CACHE_HOME": str(cp.dir / "helm" / "cache"),
        "HELM_CONFIG_HOME": str(cp.dir / "helm" / "config"),
        "HELM_DATA_HOME": str(cp.dir / "helm" / "data"),
    }
    return subprocess.run(
        [str(helm_binary(cp.bin_dir)), "--kubeconfig", str(cp.kubeconfig), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )


def local_values(
    *,
    scheduler_name: str = SCHEDULER_NAME,
    replicas: int = 1,
    lease_name: str = "gputopo-scheduler",
    stale_after_seconds: float | None = None,
    reservation_timeout_seconds: float | None = None,
    dra: bool = False,
) -> Doc:
    """Chart values for the local layout. One replica runs without leader election (nothing to
    elect, and no Lease left by an earlier stack to wait out); two elect a leader on the Lease
    ``lease_name`` in the release namespace, as in a cluster. The extender's timings are chart
    values when they are whole seconds (the chart's schema); ``local_extender_args`` passes others.
    ``dra``: the agents are DRA drivers (their RBAC, and the DeviceClass)."""
    scheduler: Doc = {
        "schedulerName": scheduler_name,
        "replicas": replicas,
        "leaderElection": {"enabled": replicas > 1, "resourceName": lease_name},
    }
    extender: Doc = {}
    for key, value in (
        ("staleAfterSeconds", stale_after_seconds),
        ("reservationTimeoutSeconds", reservation_timeout_seconds),
    ):
        if value is not None and float(value).is_integer() and value >= 1:
            extender[key] = int(value)
    out: Doc = {"scheduler": scheduler, "extender": extender}
    if dra:
        out["agent"] = {"dra": {"enabled": True}}
    return out


def render(
    helm: Path,
    values: Mapping[str, Any],
    *,
    release: str = RELEASE,
    namespace: str = NAMESPACE,
    chart: Path = CHART_DIR,
    timeout: float = 120.0,
    kube_version: str = KUBE_VERSION,
) -> RenderedChart:
    """``helm template`` with ``values`` (written to a file, so nested values keep their types), for the
    Kubernetes release ``kube_version``."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="gputopo-values-") as f:
        json.dump(dict(values), f)
        f.flush()
        argv = [
            str(helm),
            "template",
            release,
            str(chart),
            "--namespace",
            namespace,
            "--kube-version",
            kube_version,
            "-f",
            f.name,
        ]
        # helm keeps caches and configuration under $HOME; a private folder keeps renders apart.
        with tempfile.TemporaryDirectory(prefix="gputopo-helm-") as home:
            env = {
                **os.environ,
                "HELM_CACHE_HOME": f"{home}/cache",
                "HELM_CONFIG_HOME": f"{home}/config",
                "HELM_DATA_HOME": f"{home}/data",
            }
            proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise ChartError(f"helm template {chart} failed ({proc.returncode}):\n{proc.stderr.strip()}")
    docs = [d for d in yaml.safe_load_all(proc.stdout) if isinstance(d, dict)]
    return RenderedChart(docs=docs, release=release, namespace=namespace)


def _containers(workload: Doc) -> list[Doc]:
    spec = workload.get("spec", {}).get("template", {}).get("spec", {})
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


def _runs_extender(container: Doc) -> bool:
    argv = [*container.get("command", []), *container.get("args", [])]
    return EXTENDER_COMPONENT in argv or container.get("name") == "extender"


@dataclass(frozen=True)
class RenderedChart:
    """The documents one ``helm template`` produced, and the parts the local stack uses."""

    docs: list[Doc]
    release: str
    namespace: str

    def of_kind(self, kind: str) -> list[Doc]:
        return [d for d in self.docs if d.get("kind") == kind]

    def component(self, kind: str, component: str) -> Doc:
        found = [
            d
            for d in self.of_kind(kind)
            if d.get("metadata", {}).get("labels", {}).get("app.kubernetes.io/component") == component
        ]
        if len(found) != 1:
            raise ChartError(f"the chart rendered {len(found)} {kind} objects for component {component}, not one")
        return found[0]

    def access_objects(self) -> list[Doc]:
        """Every ServiceAccount, (Cluster)Role, binding and admission policy the chart renders,
        in an order the API server accepts (accounts and roles before what refers to them)."""
        return [d for kind in ACCESS_KINDS for d in self.of_kind(kind)]

    def scheduler_config(self) -> Doc:
        """The KubeSchedulerConfiguration in the scheduler's ConfigMap, as the chart wrote it."""
        cm = self.component("ConfigMap", "scheduler")
        cfg = yaml.safe_load(cm["data"]["config.yaml"])
        if not isinstance(cfg, dict):
            raise ChartError("the scheduler ConfigMap's config.yaml is not a mapping")
        return cfg

    def _service_account(self, workload: Doc) -> str:
        sa = workload["spec"]["template"]["spec"].get("serviceAccountName")
        if not sa:
            raise ChartError(f"{workload['kind']} {workload['metadata']['name']} names no service account")
        return str(sa)

    @property
    def scheduler_service_account(self) -> str:
        return self._service_account(self.component("Deployment", "scheduler"))

    @property
    def agent_service_account(self) -> str:
        return self._service_account(self.component("DaemonSet", "agent"))

    @property
    def extender_service_account(self) -> str:
        """The account of the pod whose container runs gputopo-extender: the scheduler's, where
        the extender is the scheduler pod's sidecar."""
        for d in [*self.of_kind("Deployment"), *self.of_kind("DaemonSet")]:
            if any(_runs_extender(c) for c in _containers(d)):
                return self._service_account(d)
        raise ChartError("no rendered workload runs gputopo-extender")

    def extender_env(self) -> dict[str, str]:
        """The extender container's environment as a pod in the release namespace would see it:
        literal values, and the namespace from the downward API. Other references are left out."""
        for d in [*self.of_kind("Deployment"), *self.of_kind("DaemonSet")]:
            for c in _containers(d):
                if not _runs_extender(c):
                    continue
                env: dict[str, str] = {}
                for e in c.get("env", []):
                    if "value" in e:
                        env[str(e["name"])] = str(e["value"])
                    elif e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.namespace":
                        env[str(e["name"])] = self.namespace
                return env
        raise ChartError("no rendered workload runs gputopo-extender")

    @property
    def extender_is_sidecar(self) -> bool:
        return any(_runs_extender(c) for c in _containers(self.component("Deployment", "scheduler")))


def local_scheduler_config(
    cfg: Mapping[str, Any],
    *,
    kubeconfig: Path,
    extender_url: str,
    client_qps: float | None = None,
    client_burst: int | None = None,
) -> Doc:
    """The chart's KubeSchedulerConfiguration for one kube-scheduler process on this machine.

    These are the only rewrites; everything else runs as the chart wrote it:

    - ``clientConnection.kubeconfig``: the replica's service-account kubeconfig. In a pod the
      scheduler finds its token in the mounted service-account volume; a local process has a file.
    - ``extenders[*].urlPrefix``: this replica's extender, ``extender_url``. In a cluster every
      replica's sidecar listens on the same loopback port of its own pod; here the replicas share
      one host's loopback, so each pair has a port of its own. The sidecar's listener is plain
      HTTP on loopback, so a chart still pointing at an HTTPS Service loses its TLS fields too.
    - ``clientConnection.qps`` / ``burst``, only when given (the throughput benchmark).
    """
    out: Doc = copy.deepcopy(dict(cfg))
    conn: Doc = dict(out.get("clientConnection") or {})
    conn["kubeconfig"] = str(kubeconfig)
    if client_qps is not None:
        conn["qps"] = client_qps
    if client_burst is not None:
        conn["burst"] = client_burst
    out["clientConnection"] = conn
    extenders: Sequence[Doc] = out.get("extenders") or []
    if not extenders:
        raise ChartError("the chart's scheduler configuration calls no extender")
    for ext in extenders:
        ext["urlPrefix"] = extender_url
        if not extender_url.startswith("https://"):
            ext.pop("tlsConfig", None)
            ext["enableHTTPS"] = False
    return out


def local_extender_args(
    *,
    port: int,
    metrics_port: int,
    kubeconfig: Path,
    env: Mapping[str, str],
    stale_after_seconds: float | None = None,
    reservation_timeout_seconds: float | None = None,
) -> list[str]:
    """Flags for one local gputopo-extender process, on top of the chart container's environment
    ``env`` (``RenderedChart.extender_env``); flags win over the environment. These are the only changes:

    - ``--port``: this replica's own loopback port (see ``extenders[*].urlPrefix`` above).
    - ``--metrics-host=127.0.0.1`` and ``--metrics-port``: a port of its own, on loopback only (in a
      pod, any address of the pod's own network namespace).
    - ``--kubeconfig``: the pod's service-account token in a file.
    - ``--stale-after-seconds`` / ``--reservation-timeout-seconds``, only where the rendered value
      differs from the one asked for (not whole seconds, which the chart's schema cannot hold, or a
      chart rendered without ``local_values``' timings).
    """
    args = [f"--port={port}", "--metrics-host=127.0.0.1", f"--metrics-port={metrics_port}"]
    args.append(f"--kubeconfig={kubeconfig}")
    for flag, key, value in (
        ("--stale-after-seconds", "GPUTOPO_STALE_AFTER_SECONDS", stale_after_seconds),
        ("--reservation-timeout-seconds", "GPUTOPO_RESERVATION_TIMEOUT_SECONDS", reservation_timeout_seconds),
    ):
        if value is not None and _as_float(env.get(key)) != float(value):
            args.append(f"{flag}={value}")
    return args


def _as_float(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None
