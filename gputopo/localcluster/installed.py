"""gputopo installed as users install it: ``helm install`` of the packaged chart onto a node that
runs containers (``ContainerdNode``), from images built here. Shared by ``gputopo demo --installed``
and ``e2e/test_installed.py``.

``start_control_plane`` starts a control plane with the ServiceAccount admission plugin (pods get
their service-account tokens, as in any cluster), kube-controller-manager and a default
kube-scheduler (the DaemonSet's, the Deployment's and the hook Job's pods are scheduled as in a
cluster). ``install`` builds or reuses the images (``images.ensure_images``), starts one containerd
node labelled as a GPU node with those images imported (nothing is ever pulled), and installs the
chart packaged by the pinned helm: agent backend ``fixture:dgx-1v`` with the device plugin on, one
scheduler replica with leader election, every image local with ``pullPolicy: Never``. On leaving it
uninstalls the release (unless that was done) and stops the node.

Needs root and the runtime packages (``containerd.containerd_unavailable`` says why not).
"""

from __future__ import annotations

import contextlib
import secrets
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from gputopo.localcluster.chart import CHART_DIR, run_helm
from gputopo.localcluster.containerd import ContainerdNode
from gputopo.localcluster.controlplane import ApiFeatures, ControlPlane, ControlPlaneError, Lifetime
from gputopo.localcluster.images import ImageSet, ensure_images
from gputopo.localcluster.kube import KubeApiError, KubeClient
from gputopo.localcluster.procs import EPHEMERAL
from gputopo.model import PLACEMENT_ANNOTATION, SCHEDULER_NAME, parse_placement
from gputopo.systems import build_system

SYSTEM = "dgx-1v"
GPUS = 8
RELEASE = "gputopo"
# What `helm uninstall` must leave no gputopo object of: in the release namespace, and cluster-wide
# (selected by the release's instance label).
NAMESPACED_KINDS = "all,configmaps,secrets,serviceaccounts,roles,rolebindings,poddisruptionbudgets,leases,jobs"
CLUSTER_KINDS = (
    "clusterroles,clusterrolebindings,validatingadmissionpolicies,validatingadmissionpolicybindings,"
    "mutatingwebhookconfigurations"
)
# Every namespace has these (the root CA publisher's ConfigMap, the default account).
NAMESPACE_OWN = frozenset({"configmap/kube-root-ca.crt", "serviceaccount/default"})
T = TypeVar("T")


class InstalledError(ControlPlaneError):
    """helm failed, or the installed release did not reach the state waited for."""


def eventually(check: Callable[[], T | None], what: str, timeout: float = 120.0, state: Callable[[], str] = str) -> T:
    """``check()`` until it returns something other than None or False; InstalledError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got is not None and got is not False:
            return got
        if time.monotonic() > deadline:
            raise InstalledError(f"timed out after {timeout:.0f}s waiting for {what}; {state()}")
        time.sleep(0.5)


@dataclass
class Tp4:
    """A TP-4 pod that ran: its placement and the GPUs its container was given."""

    namespace: str
    name: str
    uid: str
    node: str
    placement: tuple[int, ...]
    visible: tuple[str, ...]  # NVIDIA_VISIBLE_DEVICES, as the container printed it


@dataclass
class Installed:
    cp: ControlPlane
    kube: KubeClient
    node: ContainerdNode
    images: ImageSet
    namespace: str
    work: Path
    release: str = RELEASE
    chart: Path = field(default=Path())  # the packaged chart (.tgz), set by ``install``
    uninstalled: bool = False

    @property
    def values(self) -> Path:
        return self.work / "values.yaml"

    def helm(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        proc = run_helm(self.cp, *args, timeout=timeout)
        if check and proc.returncode != 0:
            raise InstalledError(
                f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}\n{proc.stdout}\n{self.state()}"
            )
        return proc

    def write_values(self, *, log_level: str = "info") -> None:
        gputopo = self.images.one("gputopo")
        sched = self.images.scheduler_for(self.cp.bin_dir)
        curl = self.images.one("curl")
        on_node = {"kubernetes.io/hostname": self.node.node}
        values = {
            "logLevel": log_level,
            "image": {"repository": gputopo.repository, "tag": gputopo.tag, "pullPolicy": "Never"},
            "agent": {
                "backend": f"fixture:{SYSTEM}",
                "intervalSeconds": 2,
                "heartbeatSeconds": 5,
                "devicePlugin": {"enabled": True},
                "nodeSelector": on_node,
            },
            "scheduler": {
                "replicas": 1,
                "leaderElection": {"enabled": True},
                "image": {"repository": sched.repository, "tag": sched.tag, "pullPolicy": "Never"},
                "nodeSelector": on_node,
            },
            "extender": {"staleAfterSeconds": 30},
            "cleanup": {"waitSeconds": 60},
            "tests": {"image": {"repository": curl.repository, "tag": curl.tag, "pullPolicy": "Never"}},
        }
        self.values.write_text(yaml.safe_dump(values))

    def pods(self, component: str) -> list[dict[str, Any]]:
        selector = f"app.kubernetes.io/instance={self.release},app.kubernetes.io/component={component}"
        return [
            p
            for p in self.kube.list_pods(self.namespace, label_selector=selector)
            if not p["metadata"].get("deletionTimestamp")
        ]

    def running(self, component: str, *, ready: bool = True) -> dict[str, Any] | None:
        """The component's one pod when it runs on the containerd node (and is Ready), else None."""
        pods = self.pods(component)
        if len(pods) != 1:
            return None
        p = pods[0]
        if p["spec"].get("nodeName") != self.node.node or p["status"].get("phase") != "Running":
            return None
        conds = {c["type"]: c["status"] for c in p["status"].get("conditions", [])}
        return p if not ready or conds.get("Ready") == "True" else None

    def state(self) -> str:
        """What the pods of the release namespace are doing, for failure messages."""
        lines = []
        for p in self.kube.list_pods(self.namespace):
            st = p.get("status", {})
            cs = [
                f"{c['name']}:{'ready' if c.get('ready') else 'not-ready'}:{','.join(c.get('state', {}))}"
                f":restarts={c.get('restartCount')}"
                for c in st.get("containerStatuses", [])
            ]
            lines.append(f"{p['metadata']['name']} {st.get('phase')} node={p['spec'].get('nodeName')} {cs}")
        return "pods in " + self.namespace + ": " + ("; ".join(lines) or "none")

    def uuid_of(self) -> dict[int, str]:
        return {g.index: g.uuid for g in build_system(SYSTEM, self.node.node).gpus}

    def workload_namespace(self) -> str:
        """A new namespace for workloads, once its default ServiceAccount exists."""
        ns = f"work-{secrets.token_hex(3)}"
        self.kube.create_namespace(ns)

        def has_default_sa() -> bool:
            try:
                self.kube.request("GET", f"/api/v1/namespaces/{ns}/serviceaccounts/default")
            except KubeApiError:
                return False
            return True

        eventually(has_default_sa, f"the default ServiceAccount in {ns}", timeout=30)
        return ns

    def run_tp4(self, namespace: str, name: str = "tp4") -> Tp4:
        """A TP-4 pod under gputopo-scheduler, running as a real container; what it printed."""
        eventually(lambda: self.running("scheduler"), "the scheduler pod Ready", state=self.state)
        self.kube.create_pod(tp4_pod(namespace, name, self.images.one("curl").ref))

        def running() -> dict[str, Any] | None:
            p = self.kube.get_pod(namespace, name)
            return p if p["status"].get("phase") == "Running" else None

        pod = eventually(
            running, "the TP-4 pod Running", state=lambda: str(self.kube.get_pod(namespace, name).get("status"))
        )
        line = eventually(
            lambda: next(
                (
                    ln
                    for ln in self.node.container_log(namespace, name, "train").splitlines()
                    if "NVIDIA_VISIBLE_DEVICES=" in ln
                ),
                None,
            ),
            "the TP-4 container's output",
            timeout=30,
        )
        visible = tuple(line.split("NVIDIA_VISIBLE_DEVICES=", 1)[1].strip().split(","))
        placement = parse_placement(pod["metadata"]["annotations"][PLACEMENT_ANNOTATION])
        return Tp4(namespace, name, pod["metadata"]["uid"], placement.node, tuple(sorted(placement.gpus)), visible)

    def uninstall(self, *, timeout: str = "3m") -> None:
        self.uninstalled = True
        self.helm("uninstall", self.release, "-n", self.namespace, "--wait", "--timeout", timeout)

    def leftovers(self) -> set[str]:
        """Objects of the release still in the cluster (``kind/name``), besides the namespace's own."""
        left = set(self.kube.kubectl("get", NAMESPACED_KINDS, "-n", self.namespace, "-o", "name").split())
        left |= set(
            self.kube.kubectl(
                "get", CLUSTER_KINDS, "-l", f"app.kubernetes.io/instance={self.release}", "-o", "name"
            ).split()
        )
        return left - NAMESPACE_OWN


def tp4_pod(namespace: str, name: str, image: str) -> dict[str, Any]:
    """A pod of 4 GPUs that must form one NVLink clique; it prints the GPUs it was given, then waits."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "annotations": {"gputopo.io/nvlink": "required"}},
        "spec": {
            "schedulerName": SCHEDULER_NAME,
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "train",
                    "image": image,
                    "imagePullPolicy": "Never",
                    "command": ["sh", "-c", 'echo "NVIDIA_VISIBLE_DEVICES=$NVIDIA_VISIBLE_DEVICES"; exec sleep 3600'],
                    "resources": {"limits": {"nvidia.com/gpu": "4"}},
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": 65532,
                        "allowPrivilegeEscalation": False,
                        "readOnlyRootFilesystem": True,
                        "capabilities": {"drop": ["ALL"]},
                    },
                }
            ],
        },
    }


def start_control_plane(
    bin_dir: Path, *, lifetime: Lifetime = EPHEMERAL, progress: Callable[[str], None] | None = None
) -> ControlPlane:
    """A started control plane with ServiceAccount admission, kube-controller-manager and a default
    scheduler; ``lifetime`` and ``progress`` go to ``ControlPlane``. The caller tears it down."""
    features = ApiFeatures(service_account_admission=True)
    cp = ControlPlane(bin_dir, lifetime=lifetime, progress=progress, features=features)
    cp.start()
    try:
        cp.start_controller_manager()
        cp.start_scheduler("default-scheduler", profile="default-scheduler")
    except BaseException:
        cp.teardown()
        raise
    return cp


@contextlib.contextmanager
def install(cp: ControlPlane, progress: Callable[[str], None]) -> Iterator[Installed]:
    """The chart installed (``--wait``) on a new containerd node of ``cp``; on leaving, the release
    uninstalled (unless ``Installed.uninstall`` ran), the node's pods deleted and the node stopped."""
    t0 = time.monotonic()
    images = ensure_images([cp.bin_dir], progress=progress)
    progress(
        f"images ready in {time.monotonic() - t0:.1f}s: "
        + ", ".join(f"{i.ref} {i.bytes / 1e6:.1f} MB" for i in images.images)
    )
    kube = cp.client()
    node_name = f"ctrd-{secrets.token_hex(3)}"
    node = ContainerdNode(
        cp,
        node_name,
        images=[images.one("pause"), images.one("gputopo"), images.scheduler_for(cp.bin_dir), images.one("curl")],
        labels={"nvidia.com/gpu.present": "true"},
        progress=progress,
    )
    work = Path(tempfile.mkdtemp(prefix="installed-", dir=cp.dir))
    inst: Installed | None = None
    try:
        t1 = time.monotonic()
        node.start()
        progress(f"containerd node {node_name} Ready in {time.monotonic() - t1:.1f}s")
        namespace = f"gputopo-{secrets.token_hex(3)}"
        kube.create_namespace(namespace)
        inst = Installed(cp, kube, node, images, namespace, work)
        inst.write_values()
        inst.helm("package", str(CHART_DIR), "--destination", str(work / "chart"))
        (inst.chart,) = (work / "chart").glob("gputopo-*.tgz")
        t2 = time.monotonic()
        inst.helm(
            "install",
            inst.release,
            str(inst.chart),
            "-n",
            namespace,
            "-f",
            str(inst.values),
            "--wait",
            "--timeout",
            "4m",
        )
        progress(f"helm install --wait done in {time.monotonic() - t2:.1f}s")
        yield inst
    finally:
        if inst is not None and not inst.uninstalled:
            inst.helm("uninstall", inst.release, "-n", inst.namespace, "--wait", check=False)
        with kube:
            for p in kube.request("GET", "/api/v1/pods", query={"fieldSelector": f"spec.nodeName={node_name}"}).get(
                "items", []
            ):
                kube.delete_pod(p["metadata"]["namespace"], p["metadata"]["name"])
            with contextlib.suppress(InstalledError):
                eventually(lambda: not node.tasks(), "the kubelet to stop every container", timeout=60)
        node.stop()
