"""Kueue's balanced placement and gputopo on the same NVL72 cases, end to end: the outcomes are facts that
docs/annotations.md ("Tensor parallelism across nodes") reports, not a race to make them equal.

What runs: real etcd, kube-apiserver and kube-scheduler with the real gputopo-extender, one real
gputopo-agent per tray (the racks of e2e/test_rack.py: racks ra and rb of 18 GB200 trays of 4 GPUs, ra's
tray 5 reporting a degraded NVLink fabric, healthMask 0xa9), and the real Kueue v0.19.2 manager with
`TopologyAwareScheduling` and `TASBalancedPlacement` on. Every tray also carries `nvidia.com/gpu.clique`
(as GPU Feature Discovery writes it), the one NVLink domain both read, and one spine label (each rack
has its own leaf already).

- Kueue's run: an Indexed Job of 4-GPU pods in a Kueue-managed namespace, queued to a ClusterQueue whose
  ResourceFlavor names a Topology of three levels: the spine, `nvidia.com/gpu.clique`, then
  `kubernetes.io/hostname`. Its pod template prefers one spine (`podset-preferred-topology`; one case
  prefers the clique) and, where the case has TP groups, asks each slice of tp/4 pods to lie in one
  clique (`podset-slice-size`, `podset-slice-required-topology`).
  Kueue admits the Job and writes each pod's tray into its nodeSelector, by completion index. The pods
  name gputopo-scheduler but carry no `gputopo.io/` annotation: gputopo only binds each on the one tray
  Kueue left it, so where they land is Kueue's choice.
- gputopo's run: the same pods as a `gputopo.io/group` with `gputopo.io/tp-size`, no Kueue.

The racks are made once for the module (36 agents are the slow part); each test deletes its pods and
Jobs and puts back any label it changed.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import test_rack
import workloads as wl
from test_controllers import JOB_NAME, KUEUE, QUEUE_NAME, _admitted, _job_template, _kueue_namespace, _post, _queue
from test_rack import CAP_LABEL, DEGRADED, RACKS, Gang, rack_of, tray_topology

from gputopo.localcluster import KubeApiError, KubeClient
from gputopo.localcluster.controllermanifests import start_order
from gputopo.localcluster.jobcontrollers import JobControllers, controllers_missing
from gputopo.model import LABEL_NETWORK_SPINE, PLACEMENT_ANNOTATION, parse_placement

pytestmark = pytest.mark.e2e

# test_rack's fixtures, instantiated for this module: its own stack and racks, made once here.
stack = test_rack.stack
racks = test_rack.racks
gang = test_rack.gang

SPINE = "spine-1"  # both racks' leaves under one spine: the level above the clique
CLIQUE = "nvidia.com/gpu.clique"
HOSTNAME = "kubernetes.io/hostname"
SLICE_SIZE = "kueue.x-k8s.io/podset-slice-size"
SLICE_TOPOLOGY = "kueue.x-k8s.io/podset-slice-required-topology"
PREFERRED = "kueue.x-k8s.io/podset-preferred-topology"
TP_SIZE = "gputopo.io/tp-size"


class Kueue:
    """The module's Kueue queue over the racks: one managed namespace with its LocalQueue; `run` posts an
    Indexed Job there, `placed` waits for its pods to bind, `delete` removes every Job it made."""

    def __init__(self, kube: KubeClient, namespace: str, label: str, queue: str) -> None:
        self.kube, self.namespace, self.label, self.queue = kube, namespace, label, queue
        self.jobs: list[str] = []

    def run(
        self, name: str, pods: int, tp: int | None, preferred: str = LABEL_NETWORK_SPINE, tp_size: int | None = None
    ) -> None:
        """A Job of `pods` 4-GPU pods preferring one domain of `preferred`; with `tp`, slices of tp/4 pods each
        in one clique; with `tp_size`, gputopo's `gputopo.io/tp-size` on the pod template too."""
        ann = {PREFERRED: preferred}
        if tp is not None:
            ann |= {SLICE_SIZE: str(tp // 4), SLICE_TOPOLOGY: CLIQUE}
        if tp_size is not None:
            ann |= {TP_SIZE: str(tp_size)}
        job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name, "namespace": self.namespace,
               "labels": {QUEUE_NAME: self.queue}}} | _job_template(self.label, 4, pods, ann)  # fmt: skip
        _post(self.kube, f"/apis/batch/v1/namespaces/{self.namespace}/jobs", job)
        self.jobs.append(name)

    def placed(self, name: str, pods: int) -> dict[int, str]:
        """Until every pod of Job `name` is bound: completion index -> tray, each the tray Kueue chose."""
        _admitted(self.kube, self.namespace)  # one Job at a time in the namespace: its Workload
        made = wl.wait_pods(self.kube, self.namespace, f"{JOB_NAME}={name}", pods, timeout=120)
        bound = self.kube.wait_pods_bound(self.namespace, [p["metadata"]["name"] for p in made], timeout=240)
        ranks: dict[int, str] = {}
        for p in made:
            pod = self.kube.get_pod(self.namespace, p["metadata"]["name"])
            assert pod["spec"]["nodeSelector"][HOSTNAME] == bound[p["metadata"]["name"]], "Kueue's tray"
            ranks[int(pod["metadata"]["labels"][wl.JOB_COMPLETION_INDEX])] = bound[p["metadata"]["name"]]
        return ranks

    def refused(self, contains: str) -> str:
        """Until the namespace's Workload waits for quota with a message containing `contains`; returns it."""

        def check() -> str | None:
            for w in self.kube.request("GET", f"{KUEUE}/namespaces/{self.namespace}/workloads").get("items", []):
                for c in w.get("status", {}).get("conditions", []):
                    if c["type"] == "QuotaReserved" and c["status"] == "False" and contains in c["message"]:
                        return str(c["message"])
            return None

        def state() -> str:
            loads = self.kube.request("GET", f"{KUEUE}/namespaces/{self.namespace}/workloads").get("items", [])
            return "; ".join(str(w.get("status", {}).get("conditions")) for w in loads) or "none"

        return KubeClient._wait(check, 90, f"a Workload refused with {contains!r}", state)

    def delete(self) -> None:
        """Every Job made here, its pods at once (no kubelet finishes a graceful delete) and its Workload."""
        for name in self.jobs:
            try:
                self.kube.request(
                    "DELETE",
                    f"/apis/batch/v1/namespaces/{self.namespace}/jobs/{name}",
                    {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"},
                )
            except KubeApiError as e:
                if e.status != 404:
                    raise
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            pods = self.kube.list_pods(self.namespace)
            loads = self.kube.request("GET", f"{KUEUE}/namespaces/{self.namespace}/workloads").get("items", [])
            if not pods and not loads:
                break
            for p in pods:
                self.kube.delete_pod(self.namespace, p["metadata"]["name"])
            time.sleep(0.5)
        self.jobs.clear()


@pytest.fixture(scope="module")
def bench(racks: dict[str, list[str]], kube: KubeClient, job_controllers: JobControllers) -> Callable[[], Kueue]:
    """Kueue running; the trays labelled with their clique and one spine; a Topology (spine, clique,
    hostname), a ResourceFlavor of the racks' trays and a ClusterQueue with all their GPUs. Returns a maker
    of a test's `Kueue`."""
    missing = controllers_missing(job_controllers.directory, start_order(["kueue"]))
    if missing is not None:
        pytest.fail(f"e2e: {missing}", pytrace=False)
    if "kueue" not in job_controllers.running:
        job_controllers.ensure("kueue")
        print(f"\nkueue controller up in {job_controllers.startup_seconds['kueue']:.1f}s", file=sys.stderr)
    label = racks["label"][0]
    for r in RACKS:
        for tray in racks[r]:
            clique = tray_topology(tray, r).fabric
            assert clique is not None and clique.clique is not None
            kube.patch_node(tray, {"metadata": {"labels": {CLIQUE: clique.clique, LABEL_NETWORK_SPINE: SPINE}}})
    levels = [{"nodeLabel": LABEL_NETWORK_SPINE}, {"nodeLabel": CLIQUE}, {"nodeLabel": HOSTNAME}]
    _post(kube, f"{KUEUE}/topologies", {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Topology",
                                        "metadata": {"name": label}, "spec": {"levels": levels}})  # fmt: skip
    namespace = f"kq-{label}"
    kube.create_namespace(namespace)
    _kueue_namespace(kube, namespace)
    queue = _queue(kube, namespace, label, gpus=4 * 18 * len(RACKS), topology=label)
    return lambda: Kueue(kube, namespace, label, queue)


@pytest.fixture
def kueue(bench: Callable[[], Kueue]) -> Iterator[Kueue]:
    k = bench()
    yield k
    k.delete()


def per_rack(nodes: dict[Any, str]) -> Counter[str]:
    return Counter(rack_of(n) for n in nodes.values())


def straddling(ranks: dict[int, str], per_group: int) -> list[int]:
    """The TP groups (ranks `per_group` at a time, in order) whose trays lie in more than one rack."""
    return [g for g in range(len(ranks) // per_group)
            if len({rack_of(ranks[r]) for r in range(g * per_group, (g + 1) * per_group)}) > 1]  # fmt: skip


def gang_ranks(bound: dict[str, str], name: str) -> dict[int, str]:
    return {int(pod.rsplit("-", 1)[1]): node for pod, node in bound.items() if pod.startswith(f"{name}-")}


def test_rack_kueue_32_trays_of_tp16_both_split_16_16_on_tp_boundaries(
    kube: KubeClient, namespace: str, gang: Gang, kueue: Kueue
) -> None:
    bound = kube.wait_pods_bound(namespace, gang.create("llm", 32, 16), timeout=240)
    ours = gang_ranks(bound, "llm")
    assert per_rack(ours) == Counter({"ra": 16, "rb": 16}) and straddling(ours, 4) == []
    gang.delete()
    # Kueue: the spine preferred, slices of 4 pods each required in one clique.
    kueue.run("sliced", 32, 16)
    theirs = kueue.placed("sliced", 32)
    assert per_rack(theirs) == Counter({"ra": 16, "rb": 16}) and straddling(theirs, 4) == []


def test_rack_kueue_preferring_the_clique_itself_admits_whole_slices_and_straddles_without_them(kueue: Kueue) -> None:
    # Slices required at the preferred level: Kueue v0.19.2 admits them, each slice in one clique (v0.17.0's
    # balanced placement admitted nothing: "Cannot find optimal domain set to fit the request").
    kueue.run("same-level", 32, 16, preferred=CLIQUE)
    sliced = kueue.placed("same-level", 32)
    assert sum(per_rack(sliced).values()) == 32 and straddling(sliced, 4) == [], sliced
    kueue.delete()
    # Without slices Kueue counts pods (balance is per tray, the level below the preferred one): one rack
    # full, the rest on the other (which one comes first varies between runs), one TP group across them.
    kueue.run("pods", 32, None, preferred=CLIQUE)
    unsliced = kueue.placed("pods", 32)
    assert sorted(per_rack(unsliced).values()) == [14, 18]
    assert len(straddling(unsliced, 4)) == 1, unsliced


def test_rack_kueue_job_with_tp_size_waits_where_kueue_straddles_a_tp_group_and_binds_its_slices(
    kube: KubeClient, kueue: Kueue
) -> None:
    # The Job's pods ask gputopo for TP-16: its inferred group job/<name> checks Kueue's trays as a whole.
    ns = kueue.namespace
    kueue.run("straddled", 32, None, preferred=CLIQUE, tp_size=16)
    made = wl.wait_pods(kube, ns, f"{JOB_NAME}=straddled", 32, timeout=120)
    last = max(made, key=lambda p: int(p["metadata"]["labels"][wl.JOB_COMPLETION_INDEX]))["metadata"]["name"]
    event = kube.wait_pod_event(ns, last, "FailedScheduling", contains="on trays of NVLink domains", timeout=120)
    assert "group job/straddled: the members' spec.nodeSelector (Kueue's topology assignment) puts TP group" in (
        event.message
    )
    assert "gputopo.io/nvlink: required keeps each TP group in one NVLink domain" in event.message
    assert not any(kube.get_pod(ns, p["metadata"]["name"])["spec"].get("nodeName") for p in made)
    kueue.delete()
    # Slices of 4 pods in one clique: Kueue's trays keep every TP group whole, and gputopo says the split.
    kueue.run("sliced-tp", 32, 16, tp_size=16)
    theirs = kueue.placed("sliced-tp", 32)
    assert per_rack(theirs) == Counter({"ra": 16, "rb": 16}) and straddling(theirs, 4) == []
    pods = {int(p["metadata"]["labels"][wl.JOB_COMPLETION_INDEX]): p["metadata"]["name"] for p in kube.list_pods(ns)}
    reason = parse_placement(kube.get_pod(ns, pods[20])["metadata"]["annotations"][PLACEMENT_ANNOTATION]).reason
    assert "TP group 5/8 (16 GPUs, ranks 20-23) in NVLink domain " in reason, reason
    assert "4+4 TP groups over 2 domains" in reason


def test_rack_kueue_36_trays_of_tp8_with_a_cap_of_16_gputopo_waits_kueue_takes_the_spares(
    kube: KubeClient, namespace: str, gang: Gang, kueue: Kueue, racks: dict[str, list[str]]
) -> None:
    trays = [t for r in RACKS for t in racks[r]]
    for t in trays:
        kube.patch_node(t, {"metadata": {"labels": {CAP_LABEL: "16"}}})
    try:
        waiting = gang.create("big", 36, 8)
        event = kube.wait_pod_event(namespace, waiting[-1], "FailedScheduling", contains="cap of 16 trays", timeout=90)
        assert "needs 18 TP groups of 8 GPUs" in event.message
        gang.delete()
        kueue.run("big", 36, 8)
        theirs = kueue.placed("big", 36)
        assert per_rack(theirs) == Counter({"ra": 18, "rb": 18}) and straddling(theirs, 2) == []
    finally:
        for t in trays:
            kube.patch_node(t, {"metadata": {"labels": {CAP_LABEL: None}}})


def test_rack_kueue_tp64_on_a_rack_with_a_degraded_tray_gputopo_leaves_it_kueue_takes_it(
    kube: KubeClient, namespace: str, gang: Gang, kueue: Kueue, racks: dict[str, list[str]]
) -> None:
    bad = racks[DEGRADED[0]][DEGRADED[1] - 1]
    # Rack rb partly taken first (pods outside Kueue, which it counts on their trays): only ra holds 16.
    kube.wait_pods_bound(namespace, gang.create("rb-part", 4, 16), timeout=90)
    ours = kube.wait_pods_bound(namespace, gang.create("tp64", 16, 64), timeout=120)
    assert set(per_rack(ours)) == {"ra"} and bad not in ours.values()
    for pod in ours:
        kube.delete_pod(namespace, pod)
    KubeClient._wait(
        lambda: True if not {p["metadata"]["name"] for p in kube.list_pods(namespace)} & set(ours) else None,
        60,
        "gputopo's TP-64 pods gone",
        lambda: "",
    )
    kueue.run("tp64", 16, 64)
    theirs = kueue.placed("tp64", 16)
    assert set(per_rack(theirs)) == {"ra"}
    # Kueue knows no fabric health: ties go to tray names, trays 1-16 of ra, the degraded tray 5 among them.
    assert bad in theirs.values() and sorted(theirs.values()) == racks["ra"][:16]
