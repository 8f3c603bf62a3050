"""The real job controllers place their pods with gputopo: JobSet, LeaderWorkerSet, Kueue and Kubeflow Trainer,
built from their Go modules (``gputopo/localcluster/build_controllers.sh``), each with its own admission
webhooks (``gputopo.localcluster.jobcontrollers``). Objects are written as users submit them: whatever the
controllers and their webhooks add, they add here for real; gputopo-scheduler then binds the pods.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import workloads as wl

from conftest import StackNodes, serve
from gputopo.localcluster import (
    TEST_LABEL,
    ControlPlane,
    ControlPlaneError,
    KubeApiError,
    KubeClient,
    PodScheduling,
    pod_manifest,
)
from gputopo.localcluster.controllermanifests import KUEUE_MANAGED_LABEL, KUEUE_MANAGED_VALUE
from gputopo.localcluster.jobcontrollers import JobControllers
from gputopo.localcluster.stack import GpuNode, Stack, StackTiming
from gputopo.model import LABEL_NETWORK_LEAF, LABEL_NETWORK_SPINE, PLACEMENT_ANNOTATION, parse_placement

pytestmark = pytest.mark.e2e

SCHEDULER = "gputopo-scheduler"
JOB_NAME = "batch.kubernetes.io/job-name"
JOB_INDEX = "batch.kubernetes.io/job-completion-index"
QUEUE_NAME = "kueue.x-k8s.io/queue-name"
KUEUE_API = "kueue.x-k8s.io/v1beta2"
KUEUE = "/apis/kueue.x-k8s.io/v1beta2"


@pytest.fixture(scope="module")
def stack(control_plane: ControlPlane, kube: KubeClient) -> Iterator[Stack]:
    yield from serve(Stack(control_plane, kube, timing=StackTiming(stale_after_seconds=60)))


# ---------------------------------------------------------------- objects as users write them


def _pod_spec(test_id: str, gpus: int) -> dict[str, Any]:
    spec: dict[str, Any] = pod_manifest(
        "t", gpus=gpus, scheduling=PodScheduling(scheduler_name=SCHEDULER, node_selector={TEST_LABEL: test_id})
    )["spec"]
    spec["restartPolicy"] = "Never"
    return spec


def _job_template(test_id: str, gpus: int, pods: int, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "spec": {
            "parallelism": pods,
            "completions": pods,
            "completionMode": "Indexed",
            "backoffLimit": 0,
            "template": {"metadata": {"annotations": dict(annotations or {})}, "spec": _pod_spec(test_id, gpus)},
        }
    }


def _jobset(name: str, namespace: str, test_id: str, *, replicas: int, pods: int, labels: dict[str, str]) -> Any:
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "replicatedJobs": [{"name": "workers", "replicas": replicas, "template": _job_template(test_id, 8, pods)}]
        },
    }


def _post(kube: KubeClient, path: str, obj: dict[str, Any]) -> Any:
    return kube.request("POST", path, obj)


def _post_once_seen(kube: KubeClient, path: str, obj: dict[str, Any], timeout: float = 60) -> Any:
    """POST ``obj`` once the controller's webhook has seen what it refers to: Trainer's validating
    webhook reads the TrainingRuntime from its informer cache, which learns a runtime created a moment
    earlier only a moment later ("must be created before the TrainJob is created")."""

    def attempt() -> Any:
        try:
            return _post(kube, path, obj)
        except KubeApiError as e:
            if e.status == 403 and "must be created before" in str(e):
                return None
            raise

    what = f"the webhook to admit {obj['kind']} {obj['metadata']['name']}"
    return KubeClient._wait(attempt, timeout, what, lambda: "refused: what it names is not in its cache yet")


def _fabric(spine: str, leaf: str) -> dict[str, str]:
    return {LABEL_NETWORK_SPINE: spine, LABEL_NETWORK_LEAF: leaf}


def _placed(kube: KubeClient, namespace: str, names: list[str], group: str) -> dict[int, str]:
    """Until every pod is bound: rank (its placement's stage) -> node; every placement names ``group``."""
    bound = kube.wait_pods_bound(namespace, names, timeout=120)
    ranks: dict[int, str] = {}
    for name, node in bound.items():
        p = parse_placement(kube.get_pod(namespace, name)["metadata"]["annotations"][PLACEMENT_ANNOTATION])
        assert (p.node, p.group) == (node, group), (name, p)
        assert p.stage is not None, (name, p)
        ranks[p.stage] = node
    assert sorted(ranks) == list(range(len(names))), ranks
    return ranks


def _sentence(kube: KubeClient, namespace: str, name: str, contains: str) -> str:
    return kube.wait_pod_event(namespace, name, "TopologyPlacement", contains=contains, timeout=60).message


# ---------------------------------------------------------------- bad input


def test_controllers_a_manager_that_exits_at_start_fails_naming_it_with_its_log(
    control_plane: ControlPlane, job_controllers: JobControllers, tmp_path: Path
) -> None:
    # A build whose JobSet binary exits at once, on a control plane of its own (the session's may run
    # the real JobSet under the same component name).
    (tmp_path / "bin").mkdir()
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "jobset").symlink_to(job_controllers.directory / "src" / "jobset")
    fake = tmp_path / "bin" / "jobset"
    fake.write_text("#!/bin/sh\necho 'E1203 no such flag: --config' >&2\nexit 3\n")
    fake.chmod(0o755)
    with ControlPlane(control_plane.bin_dir) as cp, cp.client() as kube:
        with pytest.raises(ControlPlaneError) as info:
            JobControllers(cp, kube, tmp_path).ensure("jobset")
        assert not JobControllers(cp, kube, tmp_path).running
    message = str(info.value)
    assert message.startswith("JobSet controller did not start: jobset-controller-manager exited with status 3")
    assert "E1203 no such flag: --config" in message


def test_controllers_a_missing_build_fails_naming_the_controller(
    control_plane: ControlPlane, kube: KubeClient, tmp_path: Path
) -> None:
    with pytest.raises(ControlPlaneError, match=r"^LeaderWorkerSet: .*/bin/lws is missing"):
        JobControllers(control_plane, kube, tmp_path).ensure("lws")


# ---------------------------------------------------------------- JobSet


def test_controllers_jobset_binds_in_one_leaf_with_ranks_along_the_fabric(
    controllers: Callable[..., None], kube: KubeClient, nodes: StackNodes, namespace: str, test_id: str
) -> None:
    controllers("jobset")
    # Seven nodes alternating between leaf-2 (4 nodes: room for the JobSet) and leaf-1 (3).
    added = nodes.add(
        *[GpuNode(f"rjs-{i}", "dgx-h100", labels=_fabric("spine-a", f"leaf-{2 - i % 2}")) for i in range(7)]
    )
    leaf2 = [n for i, n in enumerate(added) if i % 2 == 0]
    js = _jobset("pretrain", namespace, test_id, replicas=2, pods=2, labels={})
    _post(kube, f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{namespace}/jobsets", js)
    pods = wl.wait_pods(kube, namespace, f"{wl.JOBSET_NAME}=pretrain", 4, timeout=90)
    names = [p["metadata"]["name"] for p in pods]
    ranks = _placed(kube, namespace, names, "jobset/pretrain")
    assert [ranks[r] for r in range(4)] == leaf2, "one node each under leaf-2, ranks in fabric order"
    for pod in pods:
        labels = pod["metadata"]["labels"]
        rank = 2 * int(labels[wl.JOB_GLOBAL_INDEX]) + int(labels[wl.JOB_COMPLETION_INDEX])
        assert kube.get_pod(namespace, pod["metadata"]["name"])["spec"]["nodeName"] == ranks[rank]
        message = _sentence(kube, namespace, pod["metadata"]["name"], f"group jobset/pretrain, rank {rank} of 4")
        assert f"stage {rank}/4 shares leaf leaf-2 with stages" in message, message


def test_controllers_jobset_exclusive_placement_puts_each_job_in_its_own_leaf(
    controllers: Callable[..., None], kube: KubeClient, nodes: StackNodes, namespace: str, test_id: str
) -> None:
    controllers("jobset")
    added = nodes.add(*[GpuNode(f"rex-{i}", "dgx-h100", labels=_fabric("spine-a", f"leaf-{i % 2}")) for i in range(4)])
    leaf = {n: i % 2 for i, n in enumerate(added)}
    js = _jobset("excl", namespace, test_id, replicas=2, pods=2, labels={})
    js["metadata"]["annotations"] = {wl.EXCLUSIVE_TOPOLOGY: LABEL_NETWORK_LEAF}
    _post(kube, f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{namespace}/jobsets", js)
    # JobSet's validating webhook holds each Job's followers back until its leader is scheduled.
    pods = wl.wait_pods(kube, namespace, f"{wl.JOBSET_NAME}=excl", 4, timeout=120)
    bound = kube.wait_pods_bound(namespace, [p["metadata"]["name"] for p in pods], timeout=120)
    for j in range(2):
        job = [p["metadata"]["name"] for p in pods if p["metadata"]["labels"][wl.JOB_INDEX] == str(j)]
        assert len({leaf[bound[n]] for n in job}) == 1, "each Job in one leaf"
        for pod in pods:  # JobSet's mutating webhook wrote the leader's leaf into each follower
            if pod["metadata"]["labels"][wl.JOB_INDEX] == str(j) and pod["metadata"]["labels"][JOB_INDEX] != "0":
                selector = kube.get_pod(namespace, pod["metadata"]["name"])["spec"]["nodeSelector"]
                assert selector[LABEL_NETWORK_LEAF] == f"leaf-{leaf[bound[pod['metadata']['name']]]}"
    assert len({leaf[n] for n in bound.values()}) == 2


def test_controllers_jobset_driver_and_workers_rank_across_replicated_jobs_in_spec_order(
    controllers: Callable[..., None], kube: KubeClient, nodes: StackNodes, namespace: str, test_id: str
) -> None:
    controllers("jobset")
    # A 4-GPU driver, then 2 Jobs of one 8-GPU worker: ranks 0 (driver), 1 and 2 (workers), one group.
    added = nodes.add(*[GpuNode(f"rdw-{i}", "dgx-h100", labels=_fabric("spine-a", "leaf-1")) for i in range(3)])
    js = _jobset("dw", namespace, test_id, replicas=2, pods=1, labels={})
    js["spec"]["replicatedJobs"].insert(0, {"name": "driver", "replicas": 1, "template": _job_template(test_id, 4, 1)})
    _post(kube, f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{namespace}/jobsets", js)
    pods = wl.wait_pods(kube, namespace, f"{wl.JOBSET_NAME}=dw", 3, timeout=90)
    ranks = _placed(kube, namespace, [p["metadata"]["name"] for p in pods], "jobset/dw")
    assert set(ranks.values()) <= set(added)
    for pod in pods:
        name, labels = pod["metadata"]["name"], pod["metadata"]["labels"]
        rank = int(labels[wl.JOB_GLOBAL_INDEX])  # one pod per Job: the Job's global index is the rank
        assert kube.get_pod(namespace, name)["spec"]["nodeName"] == ranks[rank]
        message = _sentence(kube, namespace, name, f"group jobset/dw, rank {rank} of 3, from JobSet labels")
        assert f"stage {rank}/3" in message, message
        gpus = parse_placement(kube.get_pod(namespace, name)["metadata"]["annotations"][PLACEMENT_ANNOTATION]).gpus
        assert len(gpus) == (4 if labels[wl.REPLICATED_JOB] == "driver" else 8)


# ---------------------------------------------------------------- LeaderWorkerSet


LWS_PATH = "/apis/leaderworkerset.x-k8s.io/v1/namespaces/{namespace}/leaderworkersets"


def _lws(name: str, namespace: str, test_id: str, *, replicas: int, size: int, leader_gpus: int | None = None) -> Any:
    """A LeaderWorkerSet of 8-GPU workers; with `leader_gpus`, a leader template of its own."""
    template: dict[str, Any] = {
        "size": size,
        "workerTemplate": {"spec": _pod_spec(test_id, 8) | {"restartPolicy": "Always"}},
    }
    if leader_gpus is not None:
        template["leaderTemplate"] = {"spec": _pod_spec(test_id, leader_gpus) | {"restartPolicy": "Always"}}
    return {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"replicas": replicas, "leaderWorkerTemplate": template},
    }


def test_controllers_lws_groups_are_each_their_own_gang_leader_first(
    controllers: Callable[..., None], kube: KubeClient, nodes: StackNodes, namespace: str, test_id: str
) -> None:
    controllers("lws")
    added = nodes.add(*[GpuNode(f"rlw-{i}", "dgx-h100", labels=_fabric("spine-a", f"leaf-{i % 2}")) for i in range(4)])
    leaf = {n: i % 2 for i, n in enumerate(added)}
    _post(kube, LWS_PATH.format(namespace=namespace), _lws("serve", namespace, test_id, replicas=2, size=2))
    for g in range(2):
        members = wl.wait_pods(kube, namespace, f"{wl.LWS_NAME}=serve,{wl.LWS_GROUP_INDEX}={g}", 2, timeout=90)
        names = [p["metadata"]["name"] for p in members]
        assert names == [f"serve-{g}", f"serve-{g}-1"]
        ranks = _placed(kube, namespace, names, f"lws/serve/{g}")
        assert ranks[0] == kube.get_pod(namespace, f"serve-{g}")["spec"]["nodeName"], "the leader is rank 0"
        assert len(set(ranks.values())) == 2 and len({leaf[n] for n in ranks.values()}) == 1
        _sentence(kube, namespace, f"serve-{g}", f"group lws/serve/{g}, rank 0 of 2, from LeaderWorkerSet labels")


def test_controllers_lws_leader_without_gpus_is_placed_beside_its_workers(
    controllers: Callable[..., None], kube: KubeClient, nodes: StackNodes, namespace: str, test_id: str
) -> None:
    controllers("lws")
    added = nodes.add(*[GpuNode(f"rll-{i}", "dgx-h100", labels=_fabric("spine-a", f"leaf-{i % 2}")) for i in range(4)])
    leaf = {n: i % 2 for i, n in enumerate(added)}
    # A CPU-only leader (a router) and two 8-GPU workers per group.
    lws = _lws("route", namespace, test_id, replicas=1, size=3, leader_gpus=0)
    _post(kube, LWS_PATH.format(namespace=namespace), lws)
    members = wl.wait_pods(kube, namespace, f"{wl.LWS_NAME}=route", 3, timeout=90)
    ranks = _placed(kube, namespace, [p["metadata"]["name"] for p in members], "lws/route/0")
    assert len({leaf[n] for n in ranks.values()}) == 1, "leader and workers under one leaf"
    assert ranks[0] == ranks[1], "the GPU-less leader (rank 0) sits on its nearest GPU rank's node"
    leader = parse_placement(kube.get_pod(namespace, "route-0")["metadata"]["annotations"][PLACEMENT_ANNOTATION])
    assert (leader.stage, list(leader.gpus)) == (0, [])
    _sentence(kube, namespace, "route-0", "group lws/route/0, rank 0 of 3, from LeaderWorkerSet labels")


# ---------------------------------------------------------------- Kueue


def _kueue_namespace(kube: KubeClient, namespace: str) -> None:
    kube.request(
        "PATCH",
        f"/api/v1/namespaces/{namespace}",
        {"metadata": {"labels": {KUEUE_MANAGED_LABEL: KUEUE_MANAGED_VALUE}}},
        content_type="application/merge-patch+json",
    )


def _queue(kube: KubeClient, namespace: str, test_id: str, gpus: int, topology: str | None = None) -> str:
    """A ResourceFlavor of this test's nodes (with a topology, if given), a ClusterQueue with ``gpus`` GPUs of
    it, and a LocalQueue in ``namespace``; returns the LocalQueue's name."""
    flavor: dict[str, Any] = {"nodeLabels": {TEST_LABEL: test_id}}
    if topology is not None:
        flavor["topologyName"] = topology
    _post(kube, f"{KUEUE}/resourceflavors", {"apiVersion": KUEUE_API, "kind": "ResourceFlavor",
                                              "metadata": {"name": test_id}, "spec": flavor})  # fmt: skip
    quota = [("cpu", "100"), ("memory", "100Gi"), ("nvidia.com/gpu", str(gpus))]
    cq = {
        "apiVersion": KUEUE_API,
        "kind": "ClusterQueue",
        "metadata": {"name": test_id},
        "spec": {
            "namespaceSelector": {},
            "resourceGroups": [
                {
                    "coveredResources": [r for r, _ in quota],
                    "flavors": [{"name": test_id, "resources": [{"name": r, "nominalQuota": q} for r, q in quota]}],
                }
            ],
        },
    }
    _post(kube, f"{KUEUE}/clusterqueues", cq)
    lq = {"apiVersion": KUEUE_API, "kind": "LocalQueue", "metadata": {"name": "lq", "namespace": namespace},
          "spec": {"clusterQueue": test_id}}  # fmt: skip
    _post(kube, f"{KUEUE}/namespaces/{namespace}/localqueues", lq)
    return "lq"


def _admitted(kube: KubeClient, namespace: str) -> dict[str, Any]:
    """Until one Workload in ``namespace`` is Admitted; returns it."""

    def check() -> dict[str, Any] | None:
        for w in kube.request("GET", f"{KUEUE}/namespaces/{namespace}/workloads").get("items", []):
            if any(
                c["type"] == "Admitted" and c["status"] == "True" for c in w.get("status", {}).get("conditions", [])
            ):
                return dict(w)
        return None

    def state() -> str:
        items = kube.request("GET", f"{KUEUE}/namespaces/{namespace}/workloads").get("items", [])
        return "; ".join(f"{w['metadata']['name']}: {w.get('status', {}).get('conditions')}" for w in items) or "none"

    return KubeClient._wait(check, 90, f"an admitted Workload in {namespace}", state)


def test_controllers_kueue_admits_a_batch_job_that_then_binds_as_one_group(
    controllers: Callable[..., None], kube: KubeClient, nodes: StackNodes, namespace: str, test_id: str
) -> None:
    controllers("kueue")
    nodes.add(GpuNode("rkj-a", "dgx-h100"), GpuNode("rkj-b", "dgx-h100"))
    _kueue_namespace(kube, namespace)
    queue = _queue(kube, namespace, test_id, gpus=16)
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "train", "namespace": namespace,
           "labels": {QUEUE_NAME: queue}}} | _job_template(test_id, 8, 2)  # fmt: skip
    created = _post(kube, f"/apis/batch/v1/namespaces/{namespace}/jobs", job)
    assert created["spec"].get("suspend") is True, "Kueue's webhook suspends the Job until it is admitted"
    _admitted(kube, namespace)
    pods = wl.wait_pods(kube, namespace, f"{JOB_NAME}=train", 2, timeout=90)
    names = [p["metadata"]["name"] for p in pods]
    ranks = _placed(kube, namespace, names, "job/train")
    assert len(set(ranks.values())) == 2
    _sentence(kube, namespace, names[0], "group job/train, rank")


def test_controllers_kueue_pod_group_is_admitted_and_binds_as_one_group(
    controllers: Callable[..., None], kube: KubeClient, nodes: StackNodes, namespace: str, test_id: str
) -> None:
    controllers("kueue")
    nodes.add(GpuNode("rkp-a", "dgx-h100"), GpuNode("rkp-b", "dgx-h100"))
    _kueue_namespace(kube, namespace)
    queue = _queue(kube, namespace, test_id, gpus=16)
    names = [f"member-{i}" for i in range(2)]
    for name in names:
        pod = pod_manifest(
            name,
            namespace=namespace,
            gpus=8,
            labels={QUEUE_NAME: queue, "kueue.x-k8s.io/pod-group-name": "pg"},
            annotations={"kueue.x-k8s.io/pod-group-total-count": "2"},
            scheduling=PodScheduling(scheduler_name=SCHEDULER, node_selector={TEST_LABEL: test_id}),
        )
        created = kube.create_pod(pod)
        gates = [g["name"] for g in created["spec"].get("schedulingGates", [])]
        assert "kueue.x-k8s.io/admission" in gates, "Kueue's pod webhook gates the pod until admission"
    _admitted(kube, namespace)
    ranks = _placed(kube, namespace, names, "kueue/pg")
    assert len(set(ranks.values())) == 2
    _sentence(kube, namespace, names[0], "group kueue/pg")


def test_controllers_kueue_tas_down_to_the_leaf_binds_the_job_in_the_leaf_kueue_chose(
    controllers: Callable[..., None], kube: KubeClient, nodes: StackNodes, namespace: str, test_id: str
) -> None:
    controllers("kueue")
    added = nodes.add(*[GpuNode(f"rkt-{i}", "dgx-h100", labels=_fabric("spine-a", f"leaf-{i % 2}")) for i in range(4)])
    leaf = {n: f"leaf-{i % 2}" for i, n in enumerate(added)}
    _kueue_namespace(kube, namespace)
    topology = {"apiVersion": KUEUE_API, "kind": "Topology", "metadata": {"name": test_id},
                "spec": {"levels": [{"nodeLabel": LABEL_NETWORK_LEAF}]}}  # fmt: skip
    _post(kube, f"{KUEUE}/topologies", topology)
    queue = _queue(kube, namespace, test_id, gpus=32, topology=test_id)
    template = _job_template(test_id, 8, 2, {"kueue.x-k8s.io/podset-required-topology": LABEL_NETWORK_LEAF})
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "tas", "namespace": namespace,
           "labels": {QUEUE_NAME: queue}}} | template  # fmt: skip
    _post(kube, f"/apis/batch/v1/namespaces/{namespace}/jobs", job)
    workload = _admitted(kube, namespace)
    (assignment,) = workload["status"]["admission"]["podSetAssignments"]
    assert assignment["topologyAssignment"]["levels"] == [LABEL_NETWORK_LEAF]
    pods = wl.wait_pods(kube, namespace, f"{JOB_NAME}=tas", 2, timeout=90)
    names = [p["metadata"]["name"] for p in pods]
    ranks = _placed(kube, namespace, names, "job/tas")
    chosen = {kube.get_pod(namespace, n)["spec"]["nodeSelector"][LABEL_NETWORK_LEAF] for n in names}
    assert len(chosen) == 1, "Kueue wrote one leaf into every member's nodeSelector"
    assert {leaf[n] for n in ranks.values()} == chosen


def test_controllers_kueue_tas_down_to_the_hostname_binds_each_pod_on_the_node_kueue_chose(
    controllers: Callable[..., None], kube: KubeClient, nodes: StackNodes, namespace: str, test_id: str
) -> None:
    controllers("kueue")
    nodes.add(*[GpuNode(f"rkh-{i}", "dgx-h100", labels=_fabric("spine-a", "leaf-0")) for i in range(2)])
    _kueue_namespace(kube, namespace)
    levels = [{"nodeLabel": LABEL_NETWORK_LEAF}, {"nodeLabel": "kubernetes.io/hostname"}]
    _post(kube, f"{KUEUE}/topologies", {"apiVersion": KUEUE_API, "kind": "Topology", "metadata": {"name": test_id},
                                        "spec": {"levels": levels}})  # fmt: skip
    queue = _queue(kube, namespace, test_id, gpus=16, topology=test_id)
    template = _job_template(test_id, 8, 2, {"kueue.x-k8s.io/podset-required-topology": LABEL_NETWORK_LEAF})
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "host", "namespace": namespace,
           "labels": {QUEUE_NAME: queue}}} | template  # fmt: skip
    _post(kube, f"/apis/batch/v1/namespaces/{namespace}/jobs", job)
    _admitted(kube, namespace)
    names = [p["metadata"]["name"] for p in wl.wait_pods(kube, namespace, f"{JOB_NAME}=host", 2, timeout=90)]
    ranks = _placed(kube, namespace, names, "job/host")
    for name in names:
        pod = kube.get_pod(namespace, name)
        assert pod["spec"]["nodeName"] == pod["spec"]["nodeSelector"]["kubernetes.io/hostname"]
    assert len(set(ranks.values())) == 2


def test_controllers_kueue_admits_a_jobset_that_then_binds_as_one_group(
    controllers: Callable[..., None], kube: KubeClient, nodes: StackNodes, namespace: str, test_id: str
) -> None:
    controllers("kueue")
    nodes.add(GpuNode("rkjs-a", "dgx-h100"), GpuNode("rkjs-b", "dgx-h100"))
    _kueue_namespace(kube, namespace)
    queue = _queue(kube, namespace, test_id, gpus=16)
    js = _jobset("queued", namespace, test_id, replicas=2, pods=1, labels={QUEUE_NAME: queue})
    created = _post(kube, f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{namespace}/jobsets", js)
    assert created["spec"].get("suspend") is True, "Kueue's webhook suspends the JobSet until it is admitted"
    _admitted(kube, namespace)
    names = [p["metadata"]["name"] for p in wl.wait_pods(kube, namespace, f"{wl.JOBSET_NAME}=queued", 2, timeout=90)]
    ranks = _placed(kube, namespace, names, "jobset/queued")
    assert len(set(ranks.values())) == 2
    _sentence(kube, namespace, names[0], "group jobset/queued, rank")


def test_controllers_jobset_members_without_gpus_are_placed_with_their_group(
    controllers: Callable[..., None], kube: KubeClient, nodes: StackNodes, namespace: str, test_id: str
) -> None:
    controllers("jobset")
    added = nodes.add(*[GpuNode(f"rng-{i}", "dgx-h100", labels=_fabric("spine-a", f"leaf-{i % 2}")) for i in range(4)])
    leaf = {n: i % 2 for i, n in enumerate(added)}
    js = _jobset("mixed", namespace, test_id, replicas=1, pods=2, labels={})
    driver = {"name": "driver", "replicas": 1, "template": _job_template(test_id, 0, 1)}
    js["spec"]["replicatedJobs"].insert(0, driver)
    _post(kube, f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{namespace}/jobsets", js)
    pods = wl.wait_pods(kube, namespace, f"{wl.JOBSET_NAME}=mixed", 3, timeout=90)
    ranks = _placed(kube, namespace, [p["metadata"]["name"] for p in pods], "jobset/mixed")
    assert len({leaf[n] for n in ranks.values()}) == 1
    assert ranks[0] == ranks[1], "the CPU-only driver (rank 0) sits beside its nearest GPU rank"
    for pod in pods:  # rank, stage and "of N" agree between the sentence and gputopo.io/placement
        name, labels = pod["metadata"]["name"], pod["metadata"]["labels"]
        rank = int(labels[wl.JOB_GLOBAL_INDEX]) + int(labels[wl.JOB_COMPLETION_INDEX])
        placement = parse_placement(kube.get_pod(namespace, name)["metadata"]["annotations"][PLACEMENT_ANNOTATION])
        assert placement.stage == rank, (name, placement)
        message = _sentence(kube, namespace, name, f"group jobset/mixed, rank {rank} of 3")
        if rank > 0:
            assert f"stage {rank}/3" in message, message


@pytest.mark.parametrize("annotated", [True, False], ids=["annotated", "inferred"])
def test_controllers_jobset_binds_as_one_group_and_goes_with_the_jobset(
    controllers: Callable[..., None],
    kube: KubeClient,
    nodes: StackNodes,
    namespace: str,
    test_id: str,
    annotated: bool,
) -> None:
    controllers("jobset")
    nodes.add(GpuNode("rgc-a", "dgx-h100"), GpuNode("rgc-b", "dgx-h100"))
    js = _jobset("pretrain", namespace, test_id, replicas=2, pods=1, labels={})
    group = "jobset/pretrain"
    if annotated:  # gputopo's own annotations override what the JobSet's labels give
        group = "pretrain"
        template = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
        template["metadata"]["annotations"] = {"gputopo.io/group": group, "gputopo.io/group-size": "2"}
    stored = _post(kube, f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{namespace}/jobsets", js)
    selector = f"{wl.JOBSET_NAME}=pretrain"
    pods = wl.wait_pods(kube, namespace, selector, 2, timeout=90)
    for p in pods:  # what the real controllers and JobSet's pod webhook wrote
        labels = p["metadata"]["labels"]
        assert labels[JOB_NAME] == f"pretrain-workers-{labels[wl.JOB_INDEX]}"
        assert labels["jobset.sigs.k8s.io/jobset-uid"] == stored["metadata"]["uid"]
        assert "jobset.sigs.k8s.io/priority" in labels
    ranks = _placed(kube, namespace, [p["metadata"]["name"] for p in pods], group)
    assert len(set(ranks.values())) == 2
    # JobSet -> Jobs -> pods, followed by the garbage collector (it learns the JobSet kind on its
    # discovery resync, every 30 s).
    kube.request(
        "DELETE",
        f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{namespace}/jobsets/pretrain",
        {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"},
    )
    wl.wait_gone(kube, namespace, selector, timeout=120)


# ---------------------------------------------------------------- Kubeflow Trainer


def test_controllers_trainjob_with_the_torch_runtime_binds_its_nodes_as_one_group(
    controllers: Callable[..., None], kube: KubeClient, nodes: StackNodes, namespace: str, test_id: str
) -> None:
    controllers("trainer")
    nodes.add(GpuNode("rtj-a", "dgx-h100"), GpuNode("rtj-b", "dgx-h100"))
    # The project's torch runtime, as a namespaced TrainingRuntime whose pods name gputopo-scheduler and
    # this test's nodes (a TrainJob's own overrides cannot set the scheduler).
    torch = kube.request("GET", "/apis/trainer.kubeflow.org/v1alpha1/clustertrainingruntimes/torch-distributed")
    spec = torch["spec"]
    for rjob in spec["template"]["spec"]["replicatedJobs"]:
        pod = rjob["template"]["spec"]["template"]["spec"]
        pod["schedulerName"] = SCHEDULER
        pod["nodeSelector"] = {TEST_LABEL: test_id}
    runtime = {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainingRuntime",
               "metadata": {"name": "torch", "namespace": namespace, "labels": torch["metadata"].get("labels", {})},
               "spec": spec}  # fmt: skip
    _post(kube, f"/apis/trainer.kubeflow.org/v1alpha1/namespaces/{namespace}/trainingruntimes", runtime)
    trainjob = {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": "tune", "namespace": namespace},
        "spec": {
            "runtimeRef": {"name": "torch", "kind": "TrainingRuntime"},
            "trainer": {"numNodes": 2, "resourcesPerNode": {"limits": {"nvidia.com/gpu": "8"}}},
        },
    }
    _post_once_seen(kube, f"/apis/trainer.kubeflow.org/v1alpha1/namespaces/{namespace}/trainjobs", trainjob)
    names = [p["metadata"]["name"] for p in wl.wait_pods(kube, namespace, f"{wl.JOBSET_NAME}=tune", 2, timeout=90)]
    ranks = _placed(kube, namespace, names, "jobset/tune")
    assert len(set(ranks.values())) == 2
    _sentence(kube, namespace, names[0], "group jobset/tune, rank")
