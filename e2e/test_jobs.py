"""Pods made by controllers: kube-controller-manager's Job and StatefulSet controllers create the pods of
Jobs and StatefulSets, gputopo-scheduler places them, and the garbage collector removes them with
their owner. JobSet, LeaderWorkerSet, Kueue and Trainer run for real in ``test_controllers.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import workloads as wl

from conftest import StackNodes, serve
from gputopo.localcluster import CONTROLLER_MANAGER, TEST_LABEL, ControlPlane, KubeClient, PodScheduling, pod_manifest
from gputopo.localcluster.stack import GpuNode, Stack, StackTiming
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
    yield from serve(Stack(control_plane, kube, timing=StackTiming(stale_after_seconds=60)))


def _template(test_id: str, gpus: int, annotations: dict[str, str], scheduler: str = "gputopo-scheduler") -> Any:
    pod = pod_manifest(
        "t",
        gpus=gpus,
        annotations=annotations,
        scheduling=PodScheduling(scheduler_name=scheduler, node_selector={TEST_LABEL: test_id}),
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
