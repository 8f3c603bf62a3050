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
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from gputopo.localcluster import ControlPlane, Lifetime, find_binaries
from gputopo.localcluster.containerd import containerd_unavailable
from gputopo.localcluster.installed import GPUS, Installed, Tp4, eventually, install, start_control_plane
from gputopo.model import (
    GPU_RESOURCE,
    GPUS_IN_USE_ANNOTATION,
    PLACEMENT_ANNOTATION,
    TOPOLOGY_ANNOTATION,
    agent_lease_name,
    parse_gpus_in_use_report,
    parse_placement,
)

pytestmark = pytest.mark.e2e


def _say(msg: str) -> None:
    print(f"[installed] {msg}", file=sys.stderr, flush=True)


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
    cp = start_control_plane(bin_dir, lifetime=Lifetime(keep=os.environ.get("GPUTOPO_E2E_KEEP") == "1"))
    try:
        yield cp
    finally:
        cp.teardown()


@pytest.fixture(scope="module")
def installed(control_plane: ControlPlane) -> Iterator[Installed]:
    with install(control_plane, _say) as inst:
        yield inst


def test_installed_agent_runs_from_the_image_and_serves_the_kubelet(installed: Installed) -> None:
    """The agent DaemonSet's pod runs the built image on the containerd node, is that kubelet's device
    plugin (8 GPUs allocatable), and publishes the Node's topology and its Lease."""
    inst = installed
    pod = eventually(lambda: inst.running("agent"), "the agent pod Running on the containerd node", state=inst.state)
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
    pod = eventually(lambda: inst.running("scheduler"), "the scheduler pod Ready", state=inst.state)
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

    eventually(leader, f"{name} to hold the leader Lease", timeout=60)


@pytest.fixture(scope="module")
def tp4(installed: Installed) -> Tp4:
    """A TP-4 pod under gputopo-scheduler, running as a real container; what it printed."""
    got = installed.run_tp4(installed.workload_namespace())
    assert got.node == installed.node.node
    return got


def test_installed_tp4_pod_sees_exactly_the_gpus_of_its_placement(installed: Installed, tp4: Tp4) -> None:
    uuid = installed.uuid_of()
    assert sorted(tp4.visible) == sorted(uuid[i] for i in tp4.placement)
    assert tp4.placement in ((0, 1, 2, 3), (4, 5, 6, 7))  # DGX-1V's only 4-GPU NVLink cliques
    described = installed.kube.describe_pod(tp4.namespace, tp4.name)
    assert "TopologyPlacement" in described, described


def test_installed_helm_test_passes(installed: Installed) -> None:
    eventually(lambda: installed.running("scheduler"), "the scheduler pod Ready", state=installed.state)
    proc = installed.helm("test", installed.release, "-n", installed.namespace, "--timeout", "3m")
    assert "Succeeded" in proc.stdout, proc.stdout


def test_installed_upgrade_rolls_pods_and_running_pods_keep_their_gpus(installed: Installed, tp4: Tp4) -> None:
    inst = installed
    before = {
        c: eventually(functools.partial(inst.running, c), f"the {c} pod", state=inst.state)["metadata"]["uid"]
        for c in ("agent", "scheduler")
    }
    inst.write_values(log_level="debug")
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
        p = eventually(functools.partial(rolled, component), f"a new {component} pod Ready", state=inst.state)
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
    eventually(reported, "the new agent to report the TP-4 pod's GPUs in use", timeout=60)
    assert sorted(uuid[i] for i in tp4.placement) == sorted(tp4.visible)


def test_installed_uninstall_leaves_no_gputopo_object(installed: Installed, tp4: Tp4) -> None:
    """After ``helm uninstall`` no object of the release is left, in its namespace or cluster-wide:
    no Lease either (each agent deletes its heartbeat when it stops, the post-delete hook the
    leader Lease), and the hook's own Job, account and RBAC are gone. The agent's device-plugin
    socket is gone too. (The agents' Node annotations stay: docs/install.md, "Uninstall".)"""
    inst = installed
    lease = agent_lease_name(inst.node.node)
    held = inst.kube.kubectl("get", "leases", "-n", inst.namespace, "-o", "name").split()
    assert {f"lease.coordination.k8s.io/{n}" for n in (lease, "gputopo-scheduler")} <= set(held), held
    inst.kube.delete_pod(tp4.namespace, tp4.name)
    inst.uninstall()
    left: set[str] = set()

    def nothing_left() -> bool:
        nonlocal left
        left = inst.leftovers()
        return not left

    eventually(nothing_left, "every object of the release to go", timeout=120, state=lambda: f"left: {sorted(left)}")
    eventually(
        lambda: not (inst.node.device_plugin_dir / "gputopo-gpu.sock").exists(),
        "the agent's device-plugin socket to go",
        timeout=30,
    )
