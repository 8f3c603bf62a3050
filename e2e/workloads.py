"""Workload objects for the e2e suite, as users write them: batch/v1 Jobs and apps/v1 StatefulSets whose
pods the real Job and StatefulSet controllers of kube-controller-manager create, and the label keys
the real JobSet and LeaderWorkerSet controllers (``e2e/test_controllers.py``, built from their Go
modules) put on what they create, which the tests read back.

Nothing here writes what a controller would write: the objects a controller makes come from the
controller itself.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from gputopo.localcluster import KubeClient
from gputopo.localcluster.kube import WaitTimeout

T = TypeVar("T")

JSON = dict[str, Any]

# ---------------------------------------------------------------- keys JobSet v0.12.0 writes

JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"
JOB_INDEX = "jobset.sigs.k8s.io/job-index"
JOB_GLOBAL_INDEX = "jobset.sigs.k8s.io/job-global-index"
REPLICATED_JOB = "jobset.sigs.k8s.io/replicatedjob-name"
EXCLUSIVE_TOPOLOGY = "alpha.jobset.sigs.k8s.io/exclusive-topology"

# ---------------------------------------------------------------- keys LeaderWorkerSet v0.9.0 writes

LWS_NAME = "leaderworkerset.sigs.k8s.io/name"
LWS_GROUP_INDEX = "leaderworkerset.sigs.k8s.io/group-index"
LWS_WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"

# The Job controller's annotation and label with a pod's completion index (Indexed Jobs).
JOB_COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
# The StatefulSet controller's pod-ordinal label (PodIndexLabel, on by default since 1.28).
POD_INDEX = "apps.kubernetes.io/pod-index"


def pod_template(pod: Mapping[str, Any]) -> JSON:
    """A PodTemplateSpec from a Pod manifest (``pod_manifest``): its labels, annotations and spec."""
    meta = pod.get("metadata", {})
    return {
        "metadata": {"labels": dict(meta.get("labels") or {}), "annotations": dict(meta.get("annotations") or {})},
        "spec": copy.deepcopy(pod["spec"]),
    }


# ---------------------------------------------------------------- plain workloads


def indexed_job(name: str, namespace: str, template: Mapping[str, Any], *, completions: int) -> JSON:
    """An Indexed Job running ``completions`` pods at once (parallelism = completions), no retries."""
    tpl = copy.deepcopy(dict(template))
    tpl["spec"].setdefault("restartPolicy", "Never")
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "completionMode": "Indexed",
            "completions": completions,
            "parallelism": completions,
            "backoffLimit": 0,
            "template": tpl,
        },
    }


def two_job_jobset(
    name: str, namespace: str, pod_spec: Mapping[str, Any], *, annotations: Mapping[str, str] | None = None
) -> JSON:
    """A JobSet of two Indexed Jobs of two pods each (`pod_spec`, restartPolicy Never), made by the JobSet
    controller; `annotations` on the JobSet (e.g. exclusive placement)."""
    spec = {**copy.deepcopy(dict(pod_spec)), "restartPolicy": "Never"}
    job = {
        "spec": {
            "parallelism": 2,
            "completions": 2,
            "completionMode": "Indexed",
            "backoffLimit": 0,
            "template": {"spec": spec},
        }
    }
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": name, "namespace": namespace, "annotations": dict(annotations or {})},
        "spec": {"replicatedJobs": [{"name": "workers", "replicas": 2, "template": job}]},
    }


def statefulset(name: str, namespace: str, template: Mapping[str, Any], *, replicas: int) -> JSON:
    """A StatefulSet with Parallel pod management (all pods at once), selecting ``app=<name>``."""
    tpl = copy.deepcopy(dict(template))
    tpl["metadata"].setdefault("labels", {})["app"] = name
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "serviceName": name,
            "replicas": replicas,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": {"app": name}},
            "template": tpl,
        },
    }


_PLURALS = {
    "Job": "jobs",
    "StatefulSet": "statefulsets",
    "Pod": "pods",
}


def api_path(api_version: str, kind: str, namespace: str, name: str = "") -> str:
    """The REST path of a namespaced object (or of its collection, without ``name``)."""
    if kind not in _PLURALS:
        raise ValueError(f"api_path: kind {kind!r} is not one of {', '.join(sorted(_PLURALS))}")
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{base}/namespaces/{namespace}/{_PLURALS[kind]}"
    return f"{path}/{name}" if name else path


def create(kube: KubeClient, obj: Mapping[str, Any]) -> JSON:
    """POST ``obj``; returns it as stored (with its UID)."""
    return kube.request("POST", api_path(obj["apiVersion"], obj["kind"], obj["metadata"]["namespace"]), dict(obj))


def delete(kube: KubeClient, obj: Mapping[str, Any], *, propagation: str = "Background") -> None:
    """DELETE ``obj``, leaving its dependents to the garbage collector (batch/v1 Jobs would
    otherwise orphan their pods, the API's default for them)."""
    meta = obj["metadata"]
    kube.request(
        "DELETE",
        api_path(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"]),
        {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": propagation},
    )


def events_about(kube: KubeClient, namespace: str, kind: str, name: str) -> list[JSON]:
    """Events whose involved object is ``kind/name`` (core/v1 view)."""
    doc = kube.request(
        "GET",
        f"/api/v1/namespaces/{namespace}/events",
        query={"fieldSelector": f"involvedObject.kind={kind},involvedObject.name={name}"},
    )
    items: list[JSON] = doc.get("items", [])
    return items


def live_pods(kube: KubeClient, namespace: str, selector: str) -> list[JSON]:
    """Pods matching ``selector`` that are not being deleted, by name."""
    pods = [p for p in kube.list_pods(namespace, label_selector=selector) if not p["metadata"].get("deletionTimestamp")]
    return sorted(pods, key=lambda p: str(p["metadata"]["name"]))


def wait_pods(kube: KubeClient, namespace: str, selector: str, count: int, *, timeout: float = 60.0) -> list[JSON]:
    """Until exactly ``count`` live pods match ``selector`` (a controller made them); returns them."""

    def check() -> list[JSON] | None:
        pods = live_pods(kube, namespace, selector)
        return pods if len(pods) == count else None

    return KubeClient._wait(
        check,
        timeout,
        f"{count} pods matching {selector!r} in {namespace}",
        lambda: ", ".join(p["metadata"]["name"] for p in live_pods(kube, namespace, selector)) or "none",
    )


def wait_gone(kube: KubeClient, namespace: str, selector: str, *, timeout: float = 60.0) -> None:
    """Until no pod (live or terminating) matches ``selector``."""

    def check() -> bool | None:
        return True if not kube.list_pods(namespace, label_selector=selector) else None

    KubeClient._wait(
        check,
        timeout,
        f"no pods matching {selector!r} in {namespace}",
        lambda: ", ".join(p["metadata"]["name"] for p in kube.list_pods(namespace, label_selector=selector)),
    )


def bound_after_nudges(kube: KubeClient, ns: str, pod: str, node: str, *, timeout: float = 60) -> str:
    """Until `pod` is bound, touching `node`'s labels every few seconds.

    kube-scheduler retries a pod that an extender refused only on a cluster event (or after its
    5-minute unschedulable flush). On a real node the agent's next Node update is that event, once
    the freed GPUs or the renewed Lease reach it. These nodes have no kubelet and report nothing new,
    and the extender's watch can lag behind the scheduler's: a retry may come before the extender
    has seen the change. Each touch is a new event and a new retry, until the extender has caught up."""
    return after_nudges(kube, node, lambda wait: kube.wait_pod_bound(ns, pod, timeout=wait), timeout=timeout)


def event_after_nudges(kube: KubeClient, ns: str, pod: str, node: str, contains: str, *, timeout: float = 90) -> Any:
    """Until `pod` has a FailedScheduling event containing `contains`, touching `node`'s labels (as
    `bound_after_nudges`: a pod refused while its group was not yet complete is retried only on a cluster
    event; a new pod of the group is none on every release)."""
    return after_nudges(
        kube,
        node,
        lambda wait: kube.wait_pod_event(ns, pod, "FailedScheduling", contains=contains, timeout=wait),
        timeout=timeout,
    )


def after_nudges(kube: KubeClient, node: str, wait: Callable[[float], T], *, timeout: float) -> T:
    """`wait(seconds)` again after each touch of `node`'s labels, until it returns or `timeout` passes."""
    deadline = time.monotonic() + timeout
    touch = 0
    while True:
        touch += 1
        kube.patch_node(node, {"metadata": {"labels": {"e2e.gputopo.io/nudge": str(touch)}}})
        try:
            return wait(min(3.0, max(0.1, deadline - time.monotonic())))
        except WaitTimeout:
            if time.monotonic() >= deadline:
                raise
