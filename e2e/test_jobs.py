"""Pods made by controllers: kube-controller-manager's Job and StatefulSet controllers create the pods of
Jobs and StatefulSets, gputopo-scheduler places them, and the garbage collector removes them with
their owner. JobSet and LeaderWorkerSet children are written as those controllers write them
(``workloads.py``, which names the sources and versions) and then handled by the real controllers.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import workloads as wl

from conftest import StackNodes
from gputopo.localcluster import CONTROLLER_MANAGER, TEST_LABEL, ControlPlane, KubeClient, pod_manifest
from gputopo.localcluster.stack import GpuNode, Stack
from gputopo.model import PLACEMENT_ANNOTATION, parse_placement

pytestmark = pytest.mark.e2e

JOB_NAME_LABEL = "batch.kubernetes.io/job-name"


@pytest.fixture(scope="module")
def stack(control_plane: ControlPlane, kube: KubeClient) -> Iterator[Stack]:
    s = Stack(control_plane, kube, stale_after_seconds=60)
    s.start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def owner_crds(kube: KubeClient) -> None:
    """The JobSet and LeaderWorkerSet kinds, so that their children have real owners."""
    kube.apply(wl.crds())
    for crd in wl.crds():
        kube.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{crd['metadata']['name']}")


def _template(test_id: str, gpus: int, annotations: dict[str, str], scheduler: str = "gputopo-scheduler") -> Any:
    pod = pod_manifest(
        "t", scheduler_name=scheduler, gpus=gpus, annotations=annotations, node_selector={TEST_LABEL: test_id}
    )
    return wl.pod_template(pod)


def _controller(obj: dict[str, Any]) -> tuple[str, str]:
    (ref,) = [r for r in obj["metadata"].get("ownerReferences", []) if r.get("controller")]
    return ref["kind"], ref["name"]


def _placed(kube: KubeClient, namespace: str, names: list[str], group: str | None = None) -> dict[str, str]:
    """Until every pod is bound; each one's placement names its node (and ``group``, if given)."""
    bound = kube.wait_pods_bound(namespace, names, timeout=90)
    for name, node in bound.items():
        p = parse_placement(kube.get_pod(namespace, name)["metadata"]["annotations"][PLACEMENT_ANNOTATION])
        assert p.node == node, (name, p)
        assert group is None or p.group == group, (name, p)
    return bound


def _group(annotated: bool, name: str, size: int, inferred: str) -> tuple[dict[str, str], str]:
    """The pod annotations and the group its placement names: gputopo's own annotations, or none at
    all, the group then coming from the controller's labels (docs/annotations.md, "Jobs")."""
    if annotated:
        return {"gputopo.io/group": name, "gputopo.io/group-size": str(size)}, name
    return {}, inferred


# Each group test runs twice: members annotated as a gputopo group, and members with no gputopo.io/
# annotation, their group inferred from what the controllers wrote.
GROUPING = pytest.mark.parametrize("annotated", [True, False], ids=["annotated", "inferred"])


def test_jobs_controller_manager_runs_the_listed_controllers_only(control_plane: ControlPlane) -> None:
    assert control_plane.is_running(CONTROLLER_MANAGER)
    log = control_plane.log_path(CONTROLLER_MANAGER).read_text(errors="replace")
    argv = next(line for line in log.splitlines() if line.startswith("=== ") and "starting:" in line)
    assert "--controllers=" in argv and "node-lifecycle" not in argv and "--bind-address=127.0.0.1" in argv


@GROUPING
def test_jobs_indexed_job_pods_are_made_by_the_job_controller_and_bind_as_one_group(
    kube: KubeClient, nodes: StackNodes, namespace: str, test_id: str, annotated: bool
) -> None:
    nodes.add(GpuNode("job-a", "dgx-h100"), GpuNode("job-b", "dgx-h100"))
    ann, group = _group(annotated, "train", 2, inferred="job/train")
    job = wl.create(kube, wl.indexed_job("train", namespace, _template(test_id, 8, ann), completions=2))
    pods = wl.wait_pods(kube, namespace, f"{JOB_NAME_LABEL}=train", 2)
    assert sorted(p["metadata"]["annotations"][wl.JOB_COMPLETION_INDEX] for p in pods) == ["0", "1"]
    for p in pods:
        ref = next(r for r in p["metadata"]["ownerReferences"] if r.get("controller"))
        assert (ref["kind"], ref["name"], ref["uid"]) == ("Job", "train", job["metadata"]["uid"])
    bound = _placed(kube, namespace, [p["metadata"]["name"] for p in pods], group)
    assert len(set(bound.values())) == 2, "a group spreads over nodes by default"


def test_jobs_statefulset_controller_makes_ordinal_pods_that_bind(
    kube: KubeClient, nodes: StackNodes, namespace: str, test_id: str
) -> None:
    nodes.add(GpuNode("sts", "dgx-h100"))
    template = _template(test_id, 4, {"gputopo.io/nvlink": "required"})
    wl.create(kube, wl.statefulset("serve", namespace, template, replicas=2))
    pods = wl.wait_pods(kube, namespace, "app=serve", 2)
    assert [p["metadata"]["name"] for p in pods] == ["serve-0", "serve-1"]
    assert [p["metadata"]["labels"][wl.POD_INDEX] for p in pods] == ["0", "1"]
    assert {_controller(p) for p in pods} == {("StatefulSet", "serve")}
    bound = _placed(kube, namespace, ["serve-0", "serve-1"])
    gpus = [
        set(parse_placement(kube.get_pod(namespace, n)["metadata"]["annotations"][PLACEMENT_ANNOTATION]).gpus)
        for n in bound
    ]
    assert not gpus[0] & gpus[1]


def test_jobs_deleting_a_job_lets_the_garbage_collector_remove_its_pods(
    kube: KubeClient, namespace: str, test_id: str
) -> None:
    # No scheduler takes these pods: the garbage collector, not a binding, is under test.
    template = _template(test_id, 0, {}, scheduler="none")
    job = wl.create(kube, wl.indexed_job("doomed", namespace, template, completions=3))
    wl.wait_pods(kube, namespace, f"{JOB_NAME_LABEL}=doomed", 3)
    wl.delete(kube, job)
    wl.wait_gone(kube, namespace, f"{JOB_NAME_LABEL}=doomed")


@GROUPING
@pytest.mark.usefixtures("owner_crds")
def test_jobs_jobset_shaped_jobs_make_pods_that_bind_as_one_group_and_go_with_the_jobset(
    kube: KubeClient, nodes: StackNodes, namespace: str, test_id: str, annotated: bool
) -> None:
    nodes.add(GpuNode("js-a", "dgx-h100"), GpuNode("js-b", "dgx-h100"))
    ann, group = _group(annotated, "pretrain", 2, inferred="jobset/pretrain")
    rjob = wl.replicated_job("workers", _template(test_id, 8, ann), replicas=2, pods=1)
    js = wl.create(kube, wl.jobset("pretrain", namespace, [rjob]))
    service = wl.jobset_service(js)
    assert service is not None
    for obj in [*wl.jobset_jobs(js), service]:
        wl.create(kube, obj)
    selector = f"{wl.JOBSET_NAME}=pretrain"
    pods = wl.wait_pods(kube, namespace, selector, 2)
    for p in pods:
        labels = p["metadata"]["labels"]
        job_name = labels[JOB_NAME_LABEL]
        assert job_name == f"pretrain-workers-{labels[wl.JOB_INDEX]}"
        assert labels[wl.JOBSET_UID] == js["metadata"]["uid"]
        assert p["spec"]["subdomain"] == "pretrain"
        assert _controller(p) == ("Job", job_name)
    bound = _placed(kube, namespace, [p["metadata"]["name"] for p in pods], group)
    assert len(set(bound.values())) == 2
    # JobSet -> Jobs -> pods, followed by the garbage collector. It learns new kinds (the CRDs) on
    # its discovery resync, every 30 s.
    wl.delete(kube, js)
    wl.wait_gone(kube, namespace, selector, timeout=90)


# In the pod templates of the LWS test: no webhook runs to label pods at admission, so they wait
# behind a scheduling gate until the test has put on what LWS's pod webhook would have.
WEBHOOK_GATE = "e2e.gputopo.io/lws-webhook-labels"


def _as_lws_webhook_would(kube: KubeClient, pod: dict[str, Any]) -> dict[str, Any]:
    patch = {"metadata": {"labels": wl.lws_pod_webhook_labels(pod)}, "spec": {"schedulingGates": []}}
    return kube.patch_pod(pod["metadata"]["namespace"], pod["metadata"]["name"], patch)


@GROUPING
@pytest.mark.usefixtures("owner_crds")
def test_jobs_lws_shaped_statefulsets_make_a_leader_and_workers_that_bind_as_one_group(
    kube: KubeClient, nodes: StackNodes, namespace: str, test_id: str, annotated: bool
) -> None:
    nodes.add(GpuNode("lws-a", "dgx-h100"), GpuNode("lws-b", "dgx-h100"))
    ann, group = _group(annotated, "infer", 2, inferred="lws/infer/0")
    template = _template(test_id, 8, ann)
    template["spec"]["schedulingGates"] = [{"name": WEBHOOK_GATE}]
    lws = wl.create(kube, wl.leaderworkerset("infer", namespace, template, size=2))
    wl.create(kube, wl.lws_service(lws))
    wl.create(kube, wl.lws_leader_statefulset(lws))
    (leader,) = wl.wait_pods(kube, namespace, f"{wl.LWS_NAME}=infer,{wl.LWS_WORKER_INDEX}=0", 1)
    assert leader["metadata"]["name"] == "infer-0" and _controller(leader) == ("StatefulSet", "infer")
    leader = _as_lws_webhook_would(kube, leader)
    wl.create(kube, wl.lws_worker_statefulset(lws, leader))
    pods = wl.wait_pods(kube, namespace, f"{wl.LWS_NAME}=infer", 2)
    assert [p["metadata"]["name"] for p in pods] == ["infer-0", "infer-0-1"]
    worker = pods[1]
    assert _controller(worker) == ("StatefulSet", "infer-0")
    assert worker["metadata"]["annotations"][wl.LWS_LEADER_NAME] == "infer-0"
    assert worker["metadata"]["labels"][wl.LWS_GROUP_KEY] == leader["metadata"]["labels"][wl.LWS_GROUP_KEY]
    _as_lws_webhook_would(kube, worker)
    bound = _placed(kube, namespace, ["infer-0", "infer-0-1"], group)
    assert len(set(bound.values())) == 2
    # LWS -> leader StatefulSet -> leader pod -> worker StatefulSet -> worker.
    wl.delete(kube, lws)
    wl.wait_gone(kube, namespace, f"{wl.LWS_NAME}=infer", timeout=90)
