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

from conftest import StackNodes, serve
from gputopo.localcluster import CONTROLLER_MANAGER, TEST_LABEL, ControlPlane, KubeClient, pod_manifest
from gputopo.localcluster.stack import GpuNode, Stack
from gputopo.model import (
    GPUS_IN_USE_ANNOTATION,
    LABEL_NETWORK_LEAF,
    LABEL_NETWORK_SPINE,
    PLACEMENT_ANNOTATION,
    parse_gpus_in_use,
    parse_placement,
)

pytestmark = pytest.mark.e2e

JOB_NAME_LABEL = "batch.kubernetes.io/job-name"


@pytest.fixture(scope="module")
def stack(control_plane: ControlPlane, kube: KubeClient) -> Iterator[Stack]:
    yield from serve(Stack(control_plane, kube, stale_after_seconds=60))


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
    assert len(set(bound.values())) == 2, "members of whole nodes take one node each"


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


# ---------------------------------------------------------------- the jobs, on a fabric


def _ranked(kube: KubeClient, namespace: str, names: list[str], group: str) -> dict[int, str]:
    """Until every pod is bound: rank (the placement's stage) -> node, the placements naming ``group``."""
    bound = _placed(kube, namespace, names, group)
    ranks: dict[int, str] = {}
    for name, node in bound.items():
        p = parse_placement(kube.get_pod(namespace, name)["metadata"]["annotations"][PLACEMENT_ANNOTATION])
        assert p.stage is not None, (name, p)
        ranks[p.stage] = node
    assert sorted(ranks) == list(range(len(names))), ranks
    return ranks


def _fabric(spine: str, leaf: str) -> dict[str, str]:
    return {LABEL_NETWORK_SPINE: spine, LABEL_NETWORK_LEAF: leaf}


@pytest.mark.usefixtures("owner_crds")
def test_jobs_jobset_of_four_whole_node_workers_binds_in_one_leaf_with_ranks_along_the_fabric(
    kube: KubeClient, nodes: StackNodes, namespace: str, test_id: str
) -> None:
    # Seven nodes, their names alternating between leaf-2 (4 nodes: room for the JobSet) and leaf-1 (3).
    added = nodes.add(
        *[GpuNode(f"js-{i}", "dgx-h100", labels=_fabric("spine-a", f"leaf-{2 - i % 2}")) for i in range(7)]
    )
    leaf2 = [n for i, n in enumerate(added) if i % 2 == 0]
    # 4 workers x 8 GPUs and no gputopo annotation: two Jobs of two pods, ranks across the Jobs.
    rjob = wl.replicated_job("workers", _template(test_id, 8, {}), replicas=2, pods=2)
    js = wl.create(kube, wl.jobset("pretrain", namespace, [rjob]))
    service = wl.jobset_service(js)
    assert service is not None
    for obj in [*wl.jobset_jobs(js), service]:
        wl.create(kube, obj)
    names = [p["metadata"]["name"] for p in wl.wait_pods(kube, namespace, f"{wl.JOBSET_NAME}=pretrain", 4)]
    ranks = _ranked(kube, namespace, names, "jobset/pretrain")
    # All four bound together under leaf-2, one per node, ranks in fabric order (switch path, then
    # node), so consecutive ranks share the nearest switch.
    assert [ranks[r] for r in range(4)] == leaf2
    for name in names:
        pod = kube.get_pod(namespace, name)
        labels = pod["metadata"]["labels"]
        rank = 2 * int(labels[wl.JOB_GLOBAL_INDEX]) + int(labels[wl.JOB_COMPLETION_INDEX])
        assert pod["spec"]["nodeName"] == ranks[rank], "the rank is the JobSet's, from its labels"
        sentence = f"group jobset/pretrain, rank {rank} of 4, from JobSet labels and its Jobs"
        event = kube.wait_pod_event(namespace, name, "TopologyPlacement", contains=sentence)
        assert f"stage {rank}/4 shares leaf leaf-2 with stages" in event.message, event.message


def test_jobs_indexed_job_of_half_node_pods_pairs_ranks_on_nodes_and_fills_one_leaf_first(
    kube: KubeClient, nodes: StackNodes, namespace: str, test_id: str
) -> None:
    # 16 pods x 4 GPUs on 8 nodes over two leaves, their names alternating between the leaves.
    added = nodes.add(*[GpuNode(f"ij-{i}", "dgx-h100", labels=_fabric("spine-a", f"leaf-{i % 2}")) for i in range(8)])
    leaf = {n: i % 2 for i, n in enumerate(added)}
    wl.create(kube, wl.indexed_job("train", namespace, _template(test_id, 4, {}), completions=16))
    pods = wl.wait_pods(kube, namespace, f"{JOB_NAME_LABEL}=train", 16)
    ranks = _ranked(kube, namespace, [p["metadata"]["name"] for p in pods], "job/train")
    assert all(ranks[2 * k] == ranks[2 * k + 1] for k in range(8)), ranks
    assert len(set(ranks.values())) == 8
    assert len({leaf[ranks[r]] for r in range(8)}) == 1 and len({leaf[ranks[r]] for r in range(8, 16)}) == 1
    for p in pods:  # the rank is the Job controller's completion index
        got = kube.get_pod(namespace, p["metadata"]["name"])
        rank = int(got["metadata"]["labels"][wl.JOB_COMPLETION_INDEX])
        assert got["spec"]["nodeName"] == ranks[rank]


@pytest.mark.usefixtures("owner_crds")
def test_jobs_lws_groups_of_a_leader_and_three_workers_are_each_their_own_gang_leader_first(
    kube: KubeClient, nodes: StackNodes, namespace: str, test_id: str
) -> None:
    added = nodes.add(*[GpuNode(f"lw-{i}", "dgx-h100", labels=_fabric("spine-a", f"leaf-{i % 2}")) for i in range(8)])
    leaf = {n: i % 2 for i, n in enumerate(added)}
    template = _template(test_id, 8, {})
    template["spec"]["schedulingGates"] = [{"name": WEBHOOK_GATE}]
    lws = wl.create(kube, wl.leaderworkerset("serve", namespace, template, size=4, replicas=2))
    wl.create(kube, wl.lws_service(lws))
    wl.create(kube, wl.lws_leader_statefulset(lws))
    leaders = wl.wait_pods(kube, namespace, f"{wl.LWS_NAME}=serve,{wl.LWS_WORKER_INDEX}=0", 2)
    assert [p["metadata"]["name"] for p in leaders] == ["serve-0", "serve-1"]
    leaders = [_as_lws_webhook_would(kube, p) for p in leaders]
    for g, leader in enumerate(leaders):
        # Group 1's workers do not exist yet while group 0 binds: each group is its own gang.
        wl.create(kube, wl.lws_worker_statefulset(lws, leader))
        selector = f"{wl.LWS_NAME}=serve,{wl.LWS_GROUP_INDEX}={g}"
        members = wl.wait_pods(kube, namespace, selector, 4)
        names = [p["metadata"]["name"] for p in members]
        assert names == [f"serve-{g}", *[f"serve-{g}-{i}" for i in (1, 2, 3)]]
        for worker in members[1:]:
            _as_lws_webhook_would(kube, worker)
        ranks = _ranked(kube, namespace, names, f"lws/serve/{g}")
        assert ranks[0] == kube.get_pod(namespace, f"serve-{g}")["spec"]["nodeName"], "the leader is rank 0"
        assert len(set(ranks.values())) == 4 and len({leaf[n] for n in ranks.values()}) == 1
        if g == 0:
            other = kube.get_pod(namespace, "serve-1")
            assert not other["spec"].get("nodeName")
            kube.wait_pod_event(namespace, "serve-1", "FailedScheduling", contains="group lws/serve/1: 1/4 pods exist")


def test_jobs_job_created_while_only_8_of_12_fit_binds_nothing_until_all_fit_then_all(
    stack: Stack, kube: KubeClient, nodes: StackNodes, namespace: str, test_id: str
) -> None:
    # 12 pods x 2 GPUs packed 4 to a node; the third node's agent reports all its GPUs in use (by
    # something outside Kubernetes), so two nodes hold 8 of the 12.
    *_, third = nodes.add(*[GpuNode(f"an-{i}", "dgx-h100", in_use=list(range(8)) if i == 2 else []) for i in range(3)])
    wl.create(kube, wl.indexed_job("wide", namespace, _template(test_id, 2, {}), completions=12))
    pods = [p["metadata"]["name"] for p in wl.wait_pods(kube, namespace, f"{JOB_NAME_LABEL}=wide", 12)]
    # Members tried before the 12th existed were told the group is incomplete; whether kube-scheduler
    # retries them before the next cluster event is its business, so one member saying 8 fit will do.
    KubeClient._wait(
        lambda: next((n for n in pods if any("; 8 fit" in e.message for e in kube.pod_events(namespace, n))), None),
        90,
        "a member's FailedScheduling saying 8 of the 12 fit",
        lambda: "; ".join(e.message for e in kube.pod_events(namespace, pods[-1])),
    )
    assert not [p for p in wl.live_pods(kube, namespace, f"{JOB_NAME_LABEL}=wide") if p["spec"].get("nodeName")]
    # The GPUs come free: the agent's Node update is the event kube-scheduler retries the pods on.
    stack.set_in_use(third, [])
    stack.wait_node_annotation(third, GPUS_IN_USE_ANNOTATION, lambda v: not (parse_gpus_in_use(v) if v else []))
    bound = _placed(kube, namespace, pods, "job/wide")
    assert third in bound.values() and len(set(bound.values())) == 3
