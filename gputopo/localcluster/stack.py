"""gputopo running for real on the local control plane: the extender, a kube-scheduler whose profile
calls it, and one `gputopo-agent` process per simulated GPU node (fixture or file backend), each with
its own node-bound service-account token. Used by the e2e suite and by `gputopo demo`."""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gputopo.localcluster.controlplane import ControlPlane, free_port
from gputopo.localcluster.kube import GPU_RESOURCE, KubeApiError, KubeClient, SimNode
from gputopo.localcluster.kubelet import RealKubelet
from gputopo.model import GpusInUse, NodeTopology
from gputopo.systems import build_system

NAMESPACE = "gputopo-system"
AGENT_SA = "gputopo-agent"
EXTENDER_SA = "gputopo-extender"
EXTENDER = "gputopo-extender"


def rbac_objects(namespace: str = NAMESPACE) -> list[dict[str, Any]]:
    """Least privilege for each component, the same rules as the Helm chart's RBAC templates."""
    sa = [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": n, "namespace": namespace}}
        for n in (AGENT_SA, EXTENDER_SA)
    ]
    roles: list[dict[str, Any]] = [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": "gputopo-agent"},
            "rules": [
                {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]},
                # Pods on its own node only (field selector spec.nodeName): which pod holds which
                # GPUs, and, as the device plugin, the placement of the pod being admitted.
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": "gputopo-agent", "namespace": namespace},
            "rules": [
                {
                    "apiGroups": ["coordination.k8s.io"],
                    "resources": ["leases"],
                    "verbs": ["get", "create", "update", "patch"],
                }
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": "gputopo-extender"},
            "rules": [
                {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]},
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "patch"]},
                {"apiGroups": [""], "resources": ["pods/binding"], "verbs": ["create"]},
                {"apiGroups": ["", "events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]},
                {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "list", "watch"]},
            ],
        },
    ]
    bindings = [
        _binding("ClusterRoleBinding", "gputopo-agent", AGENT_SA, namespace),
        _binding("RoleBinding", "gputopo-agent", AGENT_SA, namespace),
        _binding("ClusterRoleBinding", "gputopo-extender", EXTENDER_SA, namespace),
    ]
    return [*sa, *roles, *bindings]


def _binding(kind: str, role: str, sa: str, namespace: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": role}
    if kind == "RoleBinding":
        meta["namespace"] = namespace
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": kind,
        "metadata": meta,
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role" if kind == "RoleBinding" else "ClusterRole",
            "name": role,
        },
        "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": namespace}],
    }


@dataclass
class GpuNode:
    """A simulated GPU node: a named system (`fixture`) or an explicit topology (file backend)."""

    name: str
    fixture: str | None = None
    topology: NodeTopology | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    in_use: Sequence[int] = ()

    def resolved(self) -> NodeTopology:
        if self.topology is not None:
            return self.topology
        return build_system(self.fixture or "dgx-h100", self.name)


def _http_ok(url: str, ctx: ssl.SSLContext | None = None) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1, context=ctx) as r:
            return bool(r.status == 200)
    except OSError:
        return False


class Stack:
    """The gputopo parts on top of a started ControlPlane. Every process is a component of the
    control plane, so its log sits in the control plane's directory and teardown stops it."""

    def __init__(
        self,
        cp: ControlPlane,
        kube: KubeClient,
        *,
        namespace: str = NAMESPACE,
        stale_after_seconds: float = 120,
        heartbeat_seconds: float = 2,
        interval_seconds: float = 1,
        reservation_timeout_seconds: float = 120,
        scheduler_name: str = "gputopo-scheduler",
        extender_name: str = EXTENDER,
        tls: bool = False,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        self.cp = cp
        self.kube = kube
        self.namespace = namespace
        self.stale_after_seconds = stale_after_seconds
        self.heartbeat_seconds = heartbeat_seconds
        self.interval_seconds = interval_seconds
        self.reservation_timeout_seconds = reservation_timeout_seconds
        self.scheduler_name = scheduler_name  # also the profile pods name in schedulerName
        self.extender_name = extender_name
        self.tls = tls
        self.ca_file: Path | None = None
        self.extender_url = ""
        self.nodes: dict[str, GpuNode] = {}
        # Nodes run by a real kubelet, and their agents' device-plugin options (mode, resource).
        self.kubelets: dict[str, RealKubelet] = {}
        self._plugin_options: dict[str, tuple[str, str]] = {}
        self.dir = cp.dir / "gputopo"
        self.dir.mkdir(exist_ok=True)
        self._progress = progress
        self._extender_port = 0

    def _say(self, msg: str) -> None:
        if self._progress is not None:
            self._progress(msg)

    @staticmethod
    def _exe(name: str) -> str:
        """The console script next to this interpreter (the project's venv), else on PATH."""
        local = Path(sys.executable).with_name(name)
        if local.exists():
            return str(local)
        found = shutil.which(name)
        if found is None:
            raise FileNotFoundError(f"{name} not found next to {sys.executable} nor on PATH; pip install -e .")
        return found

    # ---------------------------------------------------------------- setup

    def install(self) -> None:
        """Namespace and RBAC for the agents and the extender."""
        try:
            self.kube.create_namespace(self.namespace)
        except KubeApiError as e:
            if e.status != 409:
                raise
        self.kube.apply(rbac_objects(self.namespace))

    def _token_kubeconfig(self, sa: str, name: str, *, bound_node: str | None = None) -> Path:
        token = self.kube.create_token(self.namespace, sa, bound_node=bound_node)
        return self.cp.write_kubeconfig(self.dir / f"{name}.kubeconfig", token=token, user=name)

    def serving_cert(self, label: str = "tls") -> tuple[Path, Path, Path]:
        """A throwaway CA and a serving certificate for 127.0.0.1 (what the chart generates in-cluster),
        in a directory of their own per `label`: (ca.crt, tls.crt, tls.key)."""
        d = self.dir / f"{self.extender_name}-{label}"
        d.mkdir(exist_ok=True)
        ca_key, ca, key, csr, crt = (d / n for n in ("ca.key", "ca.crt", "tls.key", "tls.csr", "tls.crt"))
        ext = d / "san.cnf"
        ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        for argv in (
            [
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-keyout",
                ca_key,
                "-out",
                ca,
                "-days",
                "2",
                "-subj",
                "/CN=gputopo-local-ca",
            ],
            ["req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr, "-subj", "/CN=gputopo-extender"],
            [
                "x509",
                "-req",
                "-in",
                csr,
                "-CA",
                ca,
                "-CAkey",
                ca_key,
                "-CAcreateserial",
                "-out",
                crt,
                "-days",
                "2",
                "-extfile",
                ext,
            ],
        ):
            subprocess.run(["openssl", *map(str, argv)], check=True, capture_output=True)
        return ca, crt, key

    def start_extender(self, *, extra_args: Sequence[str] = ()) -> str:
        """Run `gputopo-extender` with its own service-account token (over HTTPS when `tls`); returns its URL."""
        kubeconfig = self._token_kubeconfig(EXTENDER_SA, self.extender_name)
        self._extender_port = self._extender_port or free_port()
        scheme = "https" if self.tls else "http"
        self.extender_url = f"{scheme}://127.0.0.1:{self._extender_port}"
        tls_args: list[str] = []
        ready_ctx: ssl.SSLContext | None = None
        if self.tls:
            ca, crt, key = self.serving_cert()
            self.ca_file = ca
            tls_args = [f"--tls-cert-file={crt}", f"--tls-key-file={key}"]
            ready_ctx = ssl.create_default_context(cafile=str(ca))
        argv = [
            self._exe("gputopo-extender"),
            "--host=127.0.0.1",
            f"--port={self._extender_port}",
            f"--kubeconfig={kubeconfig}",
            f"--namespace={self.namespace}",
            f"--stale-after-seconds={self.stale_after_seconds}",
            f"--reservation-timeout-seconds={self.reservation_timeout_seconds}",
            *tls_args,
            *extra_args,
        ]
        self._say(f"starting gputopo-extender ({scheme})")
        self.cp.start_process(
            self.extender_name, argv, ready=lambda: _http_ok(f"{self.extender_url}/readyz", ready_ctx)
        )
        return self.extender_url

    def restart_extender(self) -> None:
        self.cp.restart(self.extender_name)

    def start_scheduler(self, **kwargs: Any) -> str:
        self._say(f"starting kube-scheduler with the {self.scheduler_name} profile")
        return self.cp.start_gputopo_scheduler(
            self.extender_url, name=self.scheduler_name, profile=self.scheduler_name, ca_file=self.ca_file, **kwargs
        )

    # ---------------------------------------------------------------- nodes and agents

    def _node_files(self, name: str) -> tuple[Path, Path]:
        return self.dir / f"{name}.topology.json", self.dir / f"{name}.in-use.json"

    def add_nodes(self, nodes: Sequence[GpuNode], *, extra_labels: Mapping[str, str] | None = None) -> None:
        """Create the Node objects (capacity from the topology), then start one agent per node."""
        sims = []
        for n in nodes:
            topo = n.resolved()
            self.nodes[n.name] = n
            topo_file, in_use_file = self._node_files(n.name)
            topo_file.write_text(topo.to_annotation())
            in_use_file.write_text(json.dumps(list(n.in_use)))
            sims.append(SimNode(name=n.name, gpus=len(topo.gpus), labels={**n.labels, **(extra_labels or {})}))
        self.kube.create_nodes(sims)
        for n in nodes:
            self.start_agent(n.name)

    def agent_component(self, node: str) -> str:
        return f"agent-{node}"

    def start_agent(self, node: str) -> None:
        n = self.nodes[node]
        topo_file, in_use_file = self._node_files(node)
        kubeconfig = self._token_kubeconfig(AGENT_SA, f"agent-{node}", bound_node=node)
        backend = f"fixture:{n.fixture}" if n.fixture and n.topology is None else f"file:{topo_file}"
        argv = [
            self._exe("gputopo-agent"),
            f"--node-name={node}",
            f"--namespace={self.namespace}",
            f"--backend={backend}",
            *self._in_use_args(node, in_use_file),
            f"--interval-seconds={self.interval_seconds}",
            f"--heartbeat-seconds={self.heartbeat_seconds}",
            f"--kubeconfig={kubeconfig}",
            "--metrics-port=0",
        ]
        self._say(f"starting gputopo-agent for {node} ({backend.split(':')[0]} backend)")
        self.cp.start_process(self.agent_component(node), argv, ready=lambda: True)

    def _in_use_args(self, node: str, in_use_file: Path) -> list[str]:
        """A simulated node's agent reads GPUs in use from a file; a real kubelet's agent is its
        device plugin and reads them from the kubelet's PodResources."""
        kubelet = self.kubelets.get(node)
        if kubelet is None:
            return [f"--in-use-file={in_use_file}"]
        mode, resource = self._plugin_options[node]
        return [
            f"--podresources-socket={kubelet.podresources_socket}",
            "--device-plugin",
            f"--device-plugin-dir={kubelet.device_plugin_dir}",
            f"--resource-name={resource}",
            f"--preferred-allocation={mode}",
        ]

    def add_kubelet_node(
        self,
        name: str,
        system: str,
        *,
        labels: Mapping[str, str] | None = None,
        taints: Sequence[str] = (),
        preferred_allocation: str = "placement",
        resource_name: str = GPU_RESOURCE,
        timeout: float = 120.0,
    ) -> RealKubelet:
        """A node run by a real kubelet (``RealKubelet``, needs root) next to the simulated ones. Its
        agent has the fixture backend ``system`` (GPU UUIDs derived from the node name) and serves
        the kubelet as its device plugin. Returns once the kubelet advertises every GPU."""
        kubelet = RealKubelet(self.cp, name, labels=labels, taints=taints, progress=self._progress)
        self.kubelets[name] = kubelet
        self._plugin_options[name] = (preferred_allocation, resource_name)
        self.nodes[name] = GpuNode(name, system, labels=dict(labels or {}))
        kubelet.start(timeout=timeout)
        # The agent's token is bound to the Node object, which the kubelet has just registered.
        self.start_agent(name)
        kubelet.wait_allocatable(resource_name, len(self.nodes[name].resolved().gpus), timeout=timeout)
        return kubelet

    def set_preferred_allocation(self, node: str, mode: str) -> None:
        """Restart a kubelet node's agent with another ``--preferred-allocation`` mode."""
        self._plugin_options[node] = (mode, self._plugin_options[node][1])
        self.cp.remove(self.agent_component(node), grace=3)
        self.start_agent(node)

    def remove_kubelet_node(self, node: str) -> None:
        """Stop the node's agent and kubelet, and delete the Node."""
        if self.agent_component(node) in self.cp.components():
            self.cp.remove(self.agent_component(node), grace=3)
        kubelet = self.kubelets.pop(node, None)
        if kubelet is not None:
            kubelet.stop()
        self.nodes.pop(node, None)
        self._plugin_options.pop(node, None)
        try:
            self.kube.delete_node(node)
        except KubeApiError as e:
            if e.status != 404:
                raise

    def stop_agent(self, node: str) -> None:
        self.cp.stop(self.agent_component(node), grace=3)

    def set_in_use(
        self, node: str, gpus: Sequence[int] = (), *, pods: Mapping[str, Sequence[int]] | None = None
    ) -> None:
        """What the kubelet would report as allocated; the agent republishes it within an interval.

        `gpus` alone writes the plain list (every GPU unattributed); with `pods` (pod UID to indices)
        it writes the per-pod version 2 form with `gpus` as `other`."""
        if pods is None:
            text = json.dumps(list(gpus))
        else:
            text = GpusInUse(pods={u: frozenset(g) for u, g in pods.items()}, other=frozenset(gpus)).to_annotation()
        self._node_files(node)[1].write_text(text)

    def set_topology(self, node: str, topology: NodeTopology) -> None:
        """Change a file-backed node's hardware (e.g. a link goes down) under its running agent."""
        self.nodes[node].topology = topology
        self._node_files(node)[0].write_text(topology.to_annotation())

    def wait_published(self, nodes: Sequence[str] | None = None, *, timeout: float = 60.0) -> None:
        """Until every node carries its topology annotation and its agent's Lease exists."""
        want = list(nodes or self.nodes)
        deadline = time.monotonic() + timeout
        missing: list[str] = want
        while time.monotonic() < deadline:
            missing = []
            for name in want:
                node = self.kube.get_node(name)
                if "gputopo.io/topology" not in node.get("metadata", {}).get("annotations", {}):
                    missing.append(name)
                    continue
                try:
                    self.kube.request(
                        "GET",
                        f"/apis/coordination.k8s.io/v1/namespaces/{self.namespace}/leases/gputopo-agent-{name}",
                    )
                except KubeApiError:
                    missing.append(name)
            if not missing:
                return
            time.sleep(0.3)
        raise TimeoutError(f"agents did not publish within {timeout:.0f}s: {', '.join(missing)}")

    def wait_heartbeat(self, node: str, *, after: float, timeout: float = 30.0) -> None:
        """Until the agent's Lease was renewed later than `after` (epoch seconds)."""
        from datetime import datetime

        path = f"/apis/coordination.k8s.io/v1/namespaces/{self.namespace}/leases/gputopo-agent-{node}"
        deadline = time.monotonic() + timeout
        renewed = ""
        while time.monotonic() < deadline:
            try:
                renewed = str(self.kube.request("GET", path).get("spec", {}).get("renewTime") or "")
            except KubeApiError:
                renewed = ""
            if renewed and datetime.fromisoformat(renewed.replace("Z", "+00:00")).timestamp() > after:
                return
            time.sleep(0.3)
        raise TimeoutError(f"agent of {node} did not renew its Lease within {timeout:.0f}s; last renewTime {renewed!r}")

    def wait_node_annotation(
        self, node: str, key: str, predicate: Callable[[str | None], bool], *, timeout: float = 30.0
    ) -> str | None:
        deadline = time.monotonic() + timeout
        value: str | None = None
        while time.monotonic() < deadline:
            value = self.kube.get_node(node).get("metadata", {}).get("annotations", {}).get(key)
            if predicate(value):
                return value
            time.sleep(0.3)
        raise TimeoutError(f"node {node} annotation {key} did not reach the expected value; last: {value!r}")
