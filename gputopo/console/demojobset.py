"""The demo's JobSet part: a JobSet written as users write it, with no gputopo annotation, made into
Jobs by the real JobSet controller (its admission webhooks on) and into pods by kube-controller-manager's
Job controller. gputopo-scheduler places its pods as one group, the group and the ranks taken from the
JobSet's labels: a CPU-only driver and two Jobs of two 8-GPU workers. The demo prints where each pod went
and why, rank by rank."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from gputopo.model import SCHEDULER_NAME

JOBSET = "llama-pretrain"
JOBSET_LABEL = "jobset.sigs.k8s.io/jobset-name"
GLOBAL_INDEX = "jobset.sigs.k8s.io/job-global-index"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
MEMBERS = 5  # the driver and 2 Jobs x 2 workers


def _replicated_job(name: str, replicas: int, pods: int, gpus: int) -> dict[str, Any]:
    container: dict[str, Any] = {"name": name, "image": "registry.invalid/trainer:demo"}
    if gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}}
    return {
        "name": name,
        "replicas": replicas,
        "template": {
            "spec": {
                "completions": pods,
                "parallelism": pods,
                "backoffLimit": 0,
                "template": {
                    "spec": {"schedulerName": SCHEDULER_NAME, "restartPolicy": "Never", "containers": [container]}
                },
            }
        },
    }


def jobset_manifest(namespace: str) -> dict[str, Any]:
    """The demo's JobSet: a CPU-only driver, then 2 Jobs of 2 workers with 8 GPUs each."""
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": JOBSET, "namespace": namespace},
        "spec": {"replicatedJobs": [_replicated_job("driver", 1, 1, 0), _replicated_job("workers", 2, 2, 8)]},
    }


def _rank(pod: dict[str, Any]) -> tuple[int, int]:
    labels = pod["metadata"].get("labels") or {}
    return int(labels.get(GLOBAL_INDEX, 0)), int(labels.get(COMPLETION_INDEX, 0))


def jobset_part(
    cp: Any,
    kube: Any,
    namespace: str,
    timeout: float,
    say: Callable[[str], None],
    report: Callable[[Any, str, str], bool],
) -> None:
    """Build (once) and start the JobSet controller, submit the JobSet, report its pods by rank."""
    from gputopo.localcluster import ControlPlaneError
    from gputopo.localcluster.jobcontrollers import JobControllers, ensure_controllers

    say(
        "\n== a JobSet through the real JobSet controller, no gputopo annotation: "
        "a CPU-only driver and 2 Jobs x 2 workers"
    )
    try:
        directory = ensure_controllers(["jobset"], lambda line: say(f"   {line}"))
        JobControllers(cp, kube, directory).ensure("jobset")
    except ControlPlaneError as e:
        say(f"   (no JobSet part: {e})")
        return
    kube.request("POST", f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{namespace}/jobsets", jobset_manifest(namespace))
    selector = f"{JOBSET_LABEL}={JOBSET}"
    deadline = time.monotonic() + timeout
    pods: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        pods = kube.list_pods(namespace, label_selector=selector)
        if len(pods) == MEMBERS and all(p["spec"].get("nodeName") for p in pods):
            break
        time.sleep(0.5)
    placed = 0
    for pod in sorted(pods, key=_rank):
        placed += report(kube, namespace, pod["metadata"]["name"])
    say(f"\n{placed}/{MEMBERS} pods of JobSet {JOBSET} placed.")
