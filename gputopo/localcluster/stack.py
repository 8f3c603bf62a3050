"""gputopo running for real on the local control plane, laid out as the Helm chart lays it out.

The chart (``charts/gputopo``) is rendered with ``helm template`` (``chart.py``): its ServiceAccounts,
RBAC and admission policies are applied as rendered, and each kube-scheduler runs the KubeSchedulerConfiguration
of the rendered ConfigMap (rewritten only where a local process must differ, ``chart.local_scheduler_config``).
Each scheduler "pod" is a kube-scheduler process and its gputopo-extender sidecar process, on a loopback
port of its own, both authenticating with one token of the pod's service account. One such pod runs by
default; two elect a leader on a Lease in the release namespace. One `gputopo-agent` process runs per
simulated GPU node (fixture or file backend), each with its own node-bound service-account token. Used by the
e2e suite, `gputopo demo` and the benchmarks."""

from __future__ import annotations

import itertools
import ssl
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gputopo.localcluster.chart import (
    KUBE_VERSION,
    NAMESPACE,
    RELEASE,
    RenderedChart,
    helm_binary,
    local_extender_args,
    local_scheduler_config,
    local_values,
    render,
)
from gputopo.localcluster.controlplane import WEBHOOK_CLIENT_NAME, ControlPlane, free_port
from gputopo.localcluster.kube import KubeApiError, KubeClient
from gputopo.localcluster.kubelet import RealKubelet
from gputopo.localcluster.manifests import PodScheduling, pod_manifest, pod_webhook_manifest
from gputopo.localcluster.nodes import GpuNode, KubeletAgent, NodeAgents
from gputopo.localcluster.pki import generate_serving_certificate
from gputopo.model import EXTENDER_COMPONENT, SCHEDULER_NAME

# GpuNode and KubeletAgent live with the nodes and agents; callers import them from here, with the Stack they feed.
__all__ = [
    "LEADER_LOG_LINE",
    "ChartRelease",
    "GpuNode",
    "KubeletAgent",
    "SchedulerPod",
    "SchedulerPods",
    "Stack",
    "StackTiming",
]

# kube-scheduler's log line on winning the election, lower-cased: 1.34 writes "successfully acquired
# lease ns/name", 1.37 the structured "Successfully acquired lease" lock="ns/name".
LEADER_LOG_LINE = "successfully acquired lease"


def _http_ok(url: str, ctx: ssl.SSLContext | None = None) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1, context=ctx) as r:
            return bool(r.status == 200)
    except OSError:
        return False


@dataclass(frozen=True)
class SchedulerPod:
    """One replica of the chart's scheduler pod: a kube-scheduler and its extender sidecar, as two
    components of the control plane, with the ports and the service-account kubeconfig they share."""

    index: int
    scheduler: str  # component names
    extender: str
    extender_port: int
    metrics_port: int
    kubeconfig: Path

    @property
    def extender_url(self) -> str:
        return f"http://127.0.0.1:{self.extender_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"


@dataclass(frozen=True, kw_only=True)
class StackTiming:
    """How fast the stack notices change: a node is stale `stale_after_seconds` after its agent's Lease
    was last renewed; agents renew it every `heartbeat_seconds` and discover every `interval_seconds`; a
    group's reservation lasts `reservation_timeout_seconds`."""

    stale_after_seconds: float = 120
    heartbeat_seconds: float = 2
    interval_seconds: float = 1
    reservation_timeout_seconds: float = 120


@dataclass(frozen=True, kw_only=True)
class SchedulerPods:
    """The scheduler pods: `replicas` of them; with two they elect a leader on the Lease `lease_name`
    (the chart's leader election). `scheduler_name` is the profile pods name in `schedulerName` and the
    component name of replica 0's kube-scheduler; `extender_name` that of replica 0's extender (replica
    i > 0 adds `-<i>` to both). With `webhook` each extender also serves the mutating webhook over HTTPS,
    answering only kube-apiserver's client certificate unless `webhook_client_auth` is False."""

    scheduler_name: str = SCHEDULER_NAME
    extender_name: str = EXTENDER_COMPONENT
    replicas: int = 1
    lease_name: str = "gputopo-scheduler"
    webhook: bool = False
    webhook_client_auth: bool = True


@dataclass(frozen=True, kw_only=True)
class ChartRelease:
    """The chart's release: its `namespace` and `release` name; `dra` renders the agents as DRA drivers
    (their RBAC and the DeviceClass); `values`, more chart values over the local layout's (e.g.
    `tiers`, `tierSets`); `kube_version`, the release the chart is rendered for (what it renders by
    version, such as the clique-block DeviceClasses from 1.36), else the chart module's default."""

    namespace: str = NAMESPACE
    release: str = RELEASE
    dra: bool = False
    values: Mapping[str, Any] = field(default_factory=dict)
    kube_version: str = ""


STACK_TIMING = StackTiming()
ONE_SCHEDULER_POD = SchedulerPods()
LOCAL_RELEASE = ChartRelease()


class Stack(NodeAgents):
    """The gputopo parts on top of a started ControlPlane. Every process is a component of the
    control plane, so its log sits in the control plane's directory and teardown stops it.

    `timing`: staleness, heartbeats, discovery, reservations. `scheduler`: the scheduler pods;
    with their webhook, it is served at ``webhook_url``, trusted through ``ca_file``. `chart`: the release
    (with `dra`, `add_kubelet_node(agent=KubeletAgent(dra=True))` starts an agent as a DRA driver)."""

    def __init__(
        self,
        cp: ControlPlane,
        kube: KubeClient,
        *,
        timing: StackTiming = STACK_TIMING,
        scheduler: SchedulerPods = ONE_SCHEDULER_POD,
        chart: ChartRelease = LOCAL_RELEASE,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        if scheduler.replicas < 1:
            raise ValueError("replicas must be at least 1")
        self.cp = cp
        self.kube = kube
        self.namespace = chart.namespace
        self.release = chart.release
        self.stale_after_seconds = timing.stale_after_seconds
        self.heartbeat_seconds = timing.heartbeat_seconds
        self.interval_seconds = timing.interval_seconds
        self.reservation_timeout_seconds = timing.reservation_timeout_seconds
        self.scheduler_name = scheduler.scheduler_name  # also the profile pods name in schedulerName
        self.extender_name = scheduler.extender_name
        self.replicas = scheduler.replicas
        self.lease_name = scheduler.lease_name
        self.webhook = scheduler.webhook
        self.webhook_client_auth = scheduler.webhook_client_auth
        self.dra = chart.dra
        self.values = dict(chart.values)
        self.kube_version = chart.kube_version or KUBE_VERSION
        self.ca_file: Path | None = None
        self.webhook_url = ""
        self.nodes: dict[str, GpuNode] = {}
        # Nodes run by a real kubelet, and their agents' device-plugin options (mode, resource).
        self.kubelets: dict[str, RealKubelet] = {}
        self._plugin_options: dict[str, tuple[str, str]] = {}
        self._dra: dict[str, tuple[bool, bool, bool]] = {}
        self.dir = cp.dir / "gputopo"
        self.dir.mkdir(exist_ok=True)
        self._progress = progress
        self._chart: RenderedChart | None = None
        self.pods: list[SchedulerPod] = []

    # ---------------------------------------------------------------- setup

    @property
    def chart(self) -> RenderedChart:
        """The chart rendered for this stack's layout (once)."""
        if self._chart is None:
            values = local_values(
                scheduler_name=self.scheduler_name,
                replicas=self.replicas,
                lease_name=self.lease_name,
                stale_after_seconds=self.stale_after_seconds,
                reservation_timeout_seconds=self.reservation_timeout_seconds,
                dra=self.dra,
            )
            values = {**values, **self.values}
            self._chart = render(
                helm_binary(self.cp.bin_dir),
                values,
                release=self.release,
                namespace=self.namespace,
                kube_version=self.kube_version,
            )
        return self._chart

    def install(self) -> None:
        """The release namespace, then the chart's ServiceAccounts, RBAC and admission policies."""
        try:
            self.kube.create_namespace(self.namespace)
        except KubeApiError as e:
            if e.status != 409:
                raise
        self.kube.apply(self.chart.access_objects())

    @property
    def extender_url(self) -> str:
        """Replica 0's extender (the only one unless ``replicas`` > 1)."""
        return self.pods[0].extender_url if self.pods else ""

    def serving_cert(self, label: str = "tls") -> tuple[Path, Path, Path]:
        """A throwaway CA and a serving certificate for 127.0.0.1 (what the chart generates in-cluster),
        in a directory of their own per `label`: (ca.crt, tls.crt, tls.key)."""
        return generate_serving_certificate(self.dir / f"{self.extender_name}-{label}", "gputopo-extender")

    def _pod(self, index: int) -> SchedulerPod:
        if index < len(self.pods):
            return self.pods[index]
        suffix = f"-{index}" if index else ""
        scheduler = f"{self.scheduler_name}{suffix}"
        # One token per pod: its kube-scheduler and, where the chart makes the extender a sidecar,
        # its extender authenticate with it (the pod's service account).
        kubeconfig = self._token_kubeconfig(self.chart.scheduler_service_account, scheduler)
        pod = SchedulerPod(
            index=index,
            scheduler=scheduler,
            extender=f"{self.extender_name}{suffix}",
            extender_port=free_port(),
            metrics_port=free_port(),
            kubeconfig=kubeconfig,
        )
        self.pods.append(pod)
        return pod

    def start_extender(self, *, extra_args: Sequence[str] = ()) -> str:
        """Start every replica's extender sidecar; returns replica 0's URL."""
        for i in range(self.replicas):
            self._start_extender(self._pod(i), extra_args)
        return self.extender_url

    def extender_kubeconfig(self, pod: SchedulerPod) -> Path:
        """The extender's credentials: its pod's, where the chart makes it the scheduler's sidecar."""
        if self.chart.extender_is_sidecar:
            return pod.kubeconfig
        return self._token_kubeconfig(self.chart.extender_service_account, pod.extender)

    def _start_extender(self, pod: SchedulerPod, extra_args: Sequence[str]) -> None:
        kubeconfig = self.extender_kubeconfig(pod)
        webhook_args: list[str] = []
        if self.webhook:
            ca, crt, key = self.serving_cert()
            self.ca_file = ca
            port = free_port()
            self.webhook_url = f"https://127.0.0.1:{port}"
            webhook_args = [
                "--webhook-host=127.0.0.1",
                f"--webhook-port={port}",
                f"--tls-cert-file={crt}",
                f"--tls-key-file={key}",
            ]
            if self.webhook_client_auth:  # only kube-apiserver, by the client certificate it presents
                webhook_args += [
                    f"--webhook-client-ca-file={self.cp.webhook_client_ca}",
                    f"--webhook-client-names={WEBHOOK_CLIENT_NAME}",
                ]
        argv = [
            self._exe(EXTENDER_COMPONENT),
            *local_extender_args(
                port=pod.extender_port,
                metrics_port=pod.metrics_port,
                kubeconfig=kubeconfig,
                env=self.chart.extender_env(),
                stale_after_seconds=self.stale_after_seconds,
                reservation_timeout_seconds=self.reservation_timeout_seconds,
            ),
            *webhook_args,
            *extra_args,
        ]
        self._say(f"starting {pod.extender} (sidecar of {pod.scheduler}, port {pod.extender_port})")
        url = f"{pod.extender_url}/readyz"
        # The sidecar container's environment from the chart; the flags above win over it.
        self.cp.start_process(pod.extender, argv, ready=lambda: _http_ok(url), env=self.chart.extender_env())

    def route_pods_to_webhook(
        self, name: str, namespace: str, *, side_effects: str = "None", timeout_seconds: int = 5, timeout: float = 30.0
    ) -> None:
        """Send `namespace`'s pod CREATEs to the extender's webhook (configuration `name`, with the API server's
        `side_effects` and `timeout_seconds`); return once a probe pod comes back mutated (a new configuration
        takes a moment to reach the admission chain). Probes select no node, so they never schedule."""
        assert self.ca_file is not None, "the extender serves no webhook"
        hook = pod_webhook_manifest(
            name,
            self.webhook_url,
            self.ca_file.read_bytes(),
            namespace,
            side_effects=side_effects,
            timeout_seconds=timeout_seconds,
        )
        self.kube.apply([hook])
        deadline = time.monotonic() + timeout
        for attempt in itertools.count():
            probe = pod_manifest(
                f"probe-{attempt}",
                namespace=namespace,
                annotations={"gputopo.io/nvlink": "preferred"},
                scheduling=PodScheduling(node_selector={"gputopo.io/probe": "matches-no-node"}),
            )
            try:
                mutated = self.kube.create_pod(probe)["spec"]["schedulerName"] == SCHEDULER_NAME
                self.kube.delete_pod(namespace, f"probe-{attempt}")
            except KubeApiError:
                mutated = False
            if mutated:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the webhook {name} never became active for namespace {namespace}")
            time.sleep(0.5)

    def restart_extender(self, index: int | None = None) -> None:
        """Restart one replica's extender (default: every replica's)."""
        for pod in self.pods if index is None else [self.pods[index]]:
            self.cp.restart(pod.extender)

    def start_scheduler(
        self, *, client_qps: float | None = None, client_burst: int | None = None, verbosity: int | None = None
    ) -> str:
        """Start every replica's kube-scheduler with the chart's configuration; returns replica 0's
        component name. With several replicas, returns once one of them leads."""
        for i in range(self.replicas):
            pod = self._pod(i)
            self._say(f"starting {pod.scheduler} with the chart's {self.scheduler_name} profile")
            cfg = local_scheduler_config(
                self.chart.scheduler_config(),
                kubeconfig=pod.kubeconfig,
                extender_url=pod.extender_url,
                client_qps=client_qps,
                client_burst=client_burst,
            )
            self.cp.start_scheduler_config(pod.scheduler, cfg, kubeconfig=pod.kubeconfig, verbosity=verbosity)
        if self.replicas > 1:
            self.wait_leader()
        return self.pods[0].scheduler

    def start(self, **scheduler_kwargs: Any) -> None:
        """install, then every scheduler pod (extenders first: kube-scheduler calls them at once)."""
        self.install()
        self.start_extender()
        self.start_scheduler(**scheduler_kwargs)

    def stop(self) -> None:
        """Remove every scheduler pod's processes (the nodes' agents stay)."""
        for pod in self.pods:
            for name in (pod.scheduler, pod.extender):
                if name in self.cp.components():
                    self.cp.remove(name, grace=3)
        self.pods = []

    # ---------------------------------------------------------------- leader election

    def _leads(self, pod: SchedulerPod) -> bool:
        """Whether this replica's running kube-scheduler holds the Lease: it logged the acquisition
        since its last start, and it is alive (kube-scheduler exits when it loses the Lease)."""
        if pod.scheduler not in self.cp.components() or not self.cp.is_running(pod.scheduler):
            return False
        try:
            text = self.cp.log_path(pod.scheduler).read_text(errors="replace")
        except OSError:
            return False
        return LEADER_LOG_LINE in text.rsplit("\n=== ", 1)[-1].lower()

    def leader(self) -> SchedulerPod | None:
        leading = [p for p in self.pods if self._leads(p)]
        return leading[0] if len(leading) == 1 else None

    def wait_leader(self, *, exclude: SchedulerPod | None = None, timeout: float = 90.0) -> SchedulerPod:
        """Until one live replica (other than ``exclude``) holds the Lease. A Lease left by a killed
        leader is taken over only after its leaseDuration (the chart's: kube-scheduler's 15 s)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pod = self.leader()
            if pod is not None and pod != exclude:
                return pod
            time.sleep(0.3)
        raise TimeoutError(
            f"no scheduler replica acquired the Lease {self.namespace}/{self.lease_name} in {timeout:.0f}s"
        )

    def kill_pod(self, pod: SchedulerPod) -> None:
        """The scheduler pod dies at once (SIGKILL to both processes): nothing is released."""
        for name in (pod.scheduler, pod.extender):
            self.cp.kill(name)
