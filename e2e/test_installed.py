"""gputopo installed as users install it: ``helm install`` of the packaged chart onto a node that runs
containers (a real kubelet on containerd + runc, ``ContainerdNode``), from images built here.

The module starts a control plane of its own with the ServiceAccount admission plugin (pods get their
service-account tokens, as in any cluster), kube-controller-manager and a default kube-scheduler (the
DaemonSet's and the Deployment's pods are scheduled as in a cluster), then one containerd node labelled as
a GPU node, with the images from ``build_images.sh`` imported (nothing is ever pulled). It installs the
chart with the pinned helm: agent backend ``fixture:dgx-1v`` with the device plugin on, one scheduler
replica with leader election, every image local with ``pullPolicy: Never``. The tests run in order on
that one release and end with its uninstall.

Needs root, the runtime packages (``containerd``, ``runc``, ``containernetworking-plugins``; the image
build installs them as root) and the images (built here when missing: minutes); skipped without root or
the packages, with the reason.
"""

from __future__ import annotations

import functools
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

from gputopo.localcluster import ControlPlane, KubeApiError, KubeClient, find_binaries
from gputopo.localcluster.chart import CHART_DIR, helm_binary
from gputopo.localcluster.containerd import ContainerdNode, containerd_unavailable
from gputopo.localcluster.images import ImageSet, ensure_images
from gputopo.model import (
    GPU_RESOURCE,
    GPUS_IN_USE_ANNOTATION,
    PLACEMENT_ANNOTATION,
    SCHEDULER_NAME,
    TOPOLOGY_ANNOTATION,
    agent_lease_name,
    parse_gpus_in_use_report,
    parse_placement,
)
from gputopo.systems import build_system

pytestmark = pytest.mark.e2e

SYSTEM = "dgx-1v"
GPUS = 8
T = TypeVar("T")


def _say(msg: str) -> None:
    print(f"[installed] {msg}", file=sys.stderr, flush=True)


def _eventually(check: Callable[[], T | None], what: str, timeout: float = 120.0, state: Callable[[], str] = str) -> T:
    """``check()`` until it returns something other than None or False; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got is not None and got is not False:
            return got
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}; {state()}")
        time.sleep(0.5)


@dataclass
class Installed:
    cp: ControlPlane
    kube: KubeClient
    node: ContainerdNode
    images: ImageSet
    release: str
    namespace: str
    chart: Path  # the packaged chart (.tgz)
    values: Path

    def helm(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        env = {
            **self.cp.env(),
            "HELM_CACHE_HOME": str(self.cp.dir / "helm" / "cache"),
            "HELM_CONFIG_HOME": str(self.cp.dir / "helm" / "config"),
            "HELM_DATA_HOME": str(self.cp.dir / "helm" / "data"),
        }
        proc = subprocess.run(
            [str(helm_binary(self.cp.bin_dir)), "--kubeconfig", str(self.cp.kubeconfig), *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
            check=False,
        )
        if check and proc.returncode != 0:
            pytest.fail(
                f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}\n{proc.stdout}\n{self.state()}"
            )
        return proc

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
        with_ns = self.kube.list_pods(self.namespace)
        for p in with_ns:
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


def _write_values(path: Path, node: str, images: ImageSet, scheduler_tag: str, *, log_level: str) -> None:
    gputopo = images.one("gputopo")
    sched = images.one("kube-scheduler", scheduler_tag)
    curl = images.one("curl")
    on_node = {"kubernetes.io/hostname": node}
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
        "tests": {"image": {"repository": curl.repository, "tag": curl.tag, "pullPolicy": "Never"}},
    }
    path.write_text(yaml.safe_dump(values))


@pytest.fixture(scope="module")
def control_plane() -> Iterator[ControlPlane]:
    """This module's own control plane (named as the session's, so failures get its log tails):
    with the ServiceAccount admission plugin, kube-controller-manager and a default scheduler."""
    bin_dir = find_binaries()
    if bin_dir is None:
        pytest.fail("e2e: the control-plane binaries are not built; see e2e/conftest.py", pytrace=False)
    reason = containerd_unavailable(bin_dir)
    if reason is not None:
        pytest.skip(reason)
    cp = ControlPlane(bin_dir, keep=os.environ.get("GPUTOPO_E2E_KEEP") == "1", service_account_admission=True)
    cp.start()
    try:
        cp.start_controller_manager()
        cp.start_scheduler("default-scheduler", profile="default-scheduler")
        yield cp
    finally:
        cp.teardown()


@pytest.fixture(scope="module")
def installed(control_plane: ControlPlane) -> Iterator[Installed]:
    cp = control_plane
    t0 = time.monotonic()
    images = ensure_images([cp.bin_dir], progress=_say)
    _say(
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
        progress=_say,
    )
    work = Path(tempfile.mkdtemp(prefix="installed-", dir=cp.dir))
    inst: Installed | None = None
    try:
        t1 = time.monotonic()
        node.start()
        _say(f"containerd node {node_name} Ready in {time.monotonic() - t1:.1f}s")
        namespace = f"gputopo-{secrets.token_hex(3)}"
        kube.create_namespace(namespace)
        values = work / "values.yaml"
        _write_values(values, node_name, images, images.scheduler_for(cp.bin_dir).tag, log_level="info")
        inst = Installed(cp, kube, node, images, "gputopo", namespace, work / "chart", values)
        inst.helm("package", str(CHART_DIR), "--destination", str(work / "chart"))
        (tgz,) = (work / "chart").glob("gputopo-*.tgz")
        inst.chart = tgz
        t2 = time.monotonic()
        inst.helm("install", inst.release, str(tgz), "-n", namespace, "-f", str(values), "--wait", "--timeout", "4m")
        _say(f"helm install --wait done in {time.monotonic() - t2:.1f}s")
        yield inst
    finally:
        if inst is not None:
            inst.helm("uninstall", inst.release, "-n", inst.namespace, "--wait", check=False)
        with kube:
            for p in kube.request("GET", "/api/v1/pods", query={"fieldSelector": f"spec.nodeName={node_name}"}).get(
                "items", []
            ):
                kube.delete_pod(p["metadata"]["namespace"], p["metadata"]["name"])
            _eventually(lambda: not node.tasks(), "the kubelet to stop every container", timeout=60)
        node.stop()


def _workload_namespace(inst: Installed) -> str:
    ns = f"work-{secrets.token_hex(3)}"
    inst.kube.create_namespace(ns)

    def has_default_sa() -> bool:
        try:
            inst.kube.request("GET", f"/api/v1/namespaces/{ns}/serviceaccounts/default")
        except KubeApiError:
            return False
        return True

    _eventually(has_default_sa, f"the default ServiceAccount in {ns}", timeout=30)
    return ns


def test_installed_agent_runs_from_the_image_and_serves_the_kubelet(installed: Installed) -> None:
    """The agent DaemonSet's pod runs the built image on the containerd node, is that kubelet's device
    plugin (8 GPUs allocatable), and publishes the Node's topology and its Lease."""
    inst = installed
    pod = _eventually(lambda: inst.running("agent"), "the agent pod Running on the containerd node", state=inst.state)
    (c,) = pod["status"]["containerStatuses"]
    assert c["image"] == inst.images.one("gputopo").ref
    assert c["imageID"].startswith("sha256:") or "@sha256:" in c["imageID"]
    inst.node.wait_allocatable(GPU_RESOURCE, GPUS)
    assert inst.node.plugin_connections(GPU_RESOURCE) >= 1
    assert (inst.node.device_plugin_dir / "gputopo-gpu.sock").is_socket()
    ann = inst.kube.get_node(inst.node.node)["metadata"].get("annotations", {})
    assert TOPOLOGY_ANNOTATION in ann
    lease = inst.kube.request(
        "GET", f"/apis/coordination.k8s.io/v1/namespaces/{inst.namespace}/leases/{agent_lease_name(inst.node.node)}"
    )
    assert lease["spec"].get("renewTime")


def test_installed_scheduler_pod_leads_and_is_ready(installed: Installed) -> None:
    """Both containers of the scheduler pod run from the built images, pass their probes (Ready, no
    restart), and its kube-scheduler holds the leader Lease."""
    inst = installed
    pod = _eventually(lambda: inst.running("scheduler"), "the scheduler pod Ready", state=inst.state)
    images = {c["name"]: c for c in pod["status"]["containerStatuses"]}
    assert images["extender"]["image"] == inst.images.one("gputopo").ref
    assert images["kube-scheduler"]["image"] == inst.images.scheduler_for(inst.cp.bin_dir).ref
    assert all(c["ready"] and c["restartCount"] == 0 for c in images.values()), images
    name = pod["metadata"]["name"]

    def leader() -> str | None:
        lease = inst.kube.request(
            "GET", f"/apis/coordination.k8s.io/v1/namespaces/{inst.namespace}/leases/gputopo-scheduler"
        )
        holder = str(lease["spec"].get("holderIdentity") or "")
        return holder if holder.startswith(name) else None

    _eventually(leader, f"{name} to hold the leader Lease", timeout=60)


def _tp4_pod(namespace: str, name: str, image: str) -> dict[str, Any]:
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
                    "resources": {"limits": {GPU_RESOURCE: "4"}},
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


@dataclass
class Tp4:
    namespace: str
    name: str
    uid: str
    placement: tuple[int, ...]
    visible: tuple[str, ...]


@pytest.fixture(scope="module")
def tp4(installed: Installed) -> Tp4:
    """A TP-4 pod under gputopo-scheduler, running as a real container; what it printed."""
    inst = installed
    _eventually(lambda: inst.running("scheduler"), "the scheduler pod Ready", state=inst.state)
    ns = _workload_namespace(inst)
    inst.kube.create_pod(_tp4_pod(ns, "tp4", inst.images.one("curl").ref))

    def running() -> dict[str, Any] | None:
        p = inst.kube.get_pod(ns, "tp4")
        return p if p["status"].get("phase") == "Running" else None

    pod = _eventually(running, "the TP-4 pod Running", state=lambda: str(inst.kube.get_pod(ns, "tp4").get("status")))
    line = _eventually(
        lambda: next(
            (ln for ln in inst.node.container_log(ns, "tp4", "train").splitlines() if "NVIDIA_VISIBLE_DEVICES=" in ln),
            None,
        ),
        "the TP-4 container's output",
        timeout=30,
    )
    visible = tuple(line.split("NVIDIA_VISIBLE_DEVICES=", 1)[1].strip().split(","))
    placement = parse_placement(pod["metadata"]["annotations"][PLACEMENT_ANNOTATION])
    assert placement.node == inst.node.node
    return Tp4(ns, "tp4", pod["metadata"]["uid"], tuple(sorted(placement.gpus)), visible)


def test_installed_tp4_pod_sees_exactly_the_gpus_of_its_placement(installed: Installed, tp4: Tp4) -> None:
    uuid = installed.uuid_of()
    assert sorted(tp4.visible) == sorted(uuid[i] for i in tp4.placement)
    assert tp4.placement in ((0, 1, 2, 3), (4, 5, 6, 7))  # DGX-1V's only 4-GPU NVLink cliques
    described = installed.kube.describe_pod(tp4.namespace, tp4.name)
    assert "TopologyPlacement" in described, described


def test_installed_helm_test_passes(installed: Installed) -> None:
    _eventually(lambda: installed.running("scheduler"), "the scheduler pod Ready", state=installed.state)
    proc = installed.helm("test", installed.release, "-n", installed.namespace, "--timeout", "3m")
    assert "Succeeded" in proc.stdout, proc.stdout


def test_installed_upgrade_rolls_pods_and_running_pods_keep_their_gpus(installed: Installed, tp4: Tp4) -> None:
    inst = installed
    before = {
        c: _eventually(functools.partial(inst.running, c), f"the {c} pod", state=inst.state)["metadata"]["uid"]
        for c in ("agent", "scheduler")
    }
    _write_values(
        inst.values, inst.node.node, inst.images, inst.images.scheduler_for(inst.cp.bin_dir).tag, log_level="debug"
    )
    inst.helm(
        "upgrade",
        inst.release,
        str(inst.chart),
        "-n",
        inst.namespace,
        "-f",
        str(inst.values),
        "--wait",
        "--timeout",
        "4m",
    )

    def rolled(component: str) -> dict[str, Any] | None:
        p = inst.running(component)
        return p if p is not None and p["metadata"]["uid"] != before[component] else None

    for component in ("agent", "scheduler"):
        p = _eventually(functools.partial(rolled, component), f"a new {component} pod Ready", state=inst.state)
        env = {e["name"]: e.get("value") for c in p["spec"]["containers"] for e in c.get("env", [])}
        assert env["GPUTOPO_LOG_LEVEL"] == "debug"
    inst.node.wait_allocatable(GPU_RESOURCE, GPUS)
    pod = inst.kube.get_pod(tp4.namespace, tp4.name)
    assert pod["metadata"]["uid"] == tp4.uid and pod["status"]["phase"] == "Running"
    assert pod["status"]["containerStatuses"][0]["restartCount"] == 0
    assert tuple(sorted(parse_placement(pod["metadata"]["annotations"][PLACEMENT_ANNOTATION]).gpus)) == tp4.placement
    uuid = installed.uuid_of()

    def reported() -> bool:
        ann = inst.kube.get_node(inst.node.node)["metadata"].get("annotations", {})
        report = parse_gpus_in_use_report(ann.get(GPUS_IN_USE_ANNOTATION, "[]"), GPUS)
        return tuple(sorted(report.pods.get(tp4.uid, ()))) == tp4.placement

    # The new agent reads the kubelet's PodResources: the pod still holds its placement's GPUs.
    _eventually(reported, "the new agent to report the TP-4 pod's GPUs in use", timeout=60)
    assert sorted(uuid[i] for i in tp4.placement) == sorted(tp4.visible)


def test_installed_uninstall_leaves_no_gputopo_object(installed: Installed, tp4: Tp4) -> None:
    """After ``helm uninstall`` no object of the release is left, in its namespace or cluster-wide, and
    the agent's device-plugin socket is gone. What stays is what the components wrote at run time and
    docs/install.md ("Uninstall") says to delete: the agent's heartbeat Lease and kube-scheduler's
    leader Lease (and the agents' Node annotations)."""
    inst = installed
    inst.kube.delete_pod(tp4.namespace, tp4.name)
    inst.helm("uninstall", inst.release, "-n", inst.namespace, "--wait", "--timeout", "3m")
    kinds = "all,configmaps,secrets,serviceaccounts,roles,rolebindings,poddisruptionbudgets,leases"
    cluster_kinds = (
        "clusterroles,clusterrolebindings,validatingadmissionpolicies,validatingadmissionpolicybindings,"
        "mutatingwebhookconfigurations"
    )
    # The namespace's own (the root CA publisher's ConfigMap, the default account) and the runtime Leases.
    expected = {
        "configmap/kube-root-ca.crt",
        "serviceaccount/default",
        "lease.coordination.k8s.io/gputopo-scheduler",
        f"lease.coordination.k8s.io/{agent_lease_name(inst.node.node)}",
    }
    left: set[str] = set()

    def nothing_left() -> bool:
        nonlocal left
        left = set(inst.kube.kubectl("get", kinds, "-n", inst.namespace, "-o", "name").split())
        left |= set(
            inst.kube.kubectl(
                "get", cluster_kinds, "-l", f"app.kubernetes.io/instance={inst.release}", "-o", "name"
            ).split()
        )
        return left <= expected

    _eventually(nothing_left, "every object of the release to go", timeout=120, state=lambda: f"left: {sorted(left)}")
    _eventually(
        lambda: not (inst.node.device_plugin_dir / "gputopo-gpu.sock").exists(),
        "the agent's device-plugin socket to go",
        timeout=30,
    )
