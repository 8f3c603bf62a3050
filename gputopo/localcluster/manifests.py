"""Manifests of the objects the local cluster creates: simulated Nodes and bare Pods, and pod status views."""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gputopo.model import GPU_RESOURCE, LABEL_NETWORK_LEAF, LABEL_NETWORK_SPINE

JSON = dict[str, Any]

TEST_LABEL = "gputopo.io/e2e-test"  # per-test node label used by the e2e suite
NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"
FIXED_TIME = "2026-01-01T00:00:00Z"


@dataclass(frozen=True)
class SimNode:
    """A simulated node (no kubelet): a Node object created with its status set."""

    name: str
    gpus: int = 8
    cpu: str = "64"
    memory: str = "512Gi"
    pods: int = 110
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    taints: Sequence[Mapping[str, str]] = ()

    def manifest(self) -> JSON:
        resources = {"cpu": self.cpu, "memory": self.memory, "pods": str(self.pods)}
        if self.gpus:
            resources[GPU_RESOURCE] = str(self.gpus)
        labels = {
            "kubernetes.io/hostname": self.name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            "gputopo.io/simulated": "true",
            **self.labels,
        }
        spec: JSON = {}
        if self.taints:
            spec["taints"] = [dict(t) for t in self.taints]
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": self.name, "labels": labels, "annotations": dict(self.annotations)},
            "spec": spec,
            "status": {
                "capacity": dict(resources),
                "allocatable": dict(resources),
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True",
                        "reason": "KubeletReady",
                        "message": "simulated node (no kubelet)",
                        "lastHeartbeatTime": FIXED_TIME,
                        "lastTransitionTime": FIXED_TIME,
                    }
                ],
                "addresses": [{"type": "Hostname", "address": self.name}],
                "nodeInfo": {
                    "architecture": "amd64",
                    "operatingSystem": "linux",
                    "kubeletVersion": "simulated",
                    "kubeProxyVersion": "simulated",
                    "containerRuntimeVersion": "simulated://0",
                    "kernelVersion": "",
                    "osImage": "gputopo simulated node",
                    "machineID": "",
                    "systemUUID": "",
                    "bootID": "",
                },
                "phase": "Running",
            },
        }


def network_labels(*, leaf: str | None = None, spine: str | None = None) -> dict[str, str]:
    """gputopo's default network-tier labels (leaf and spine)."""
    out: dict[str, str] = {}
    if leaf is not None:
        out[LABEL_NETWORK_LEAF] = leaf
    if spine is not None:
        out[LABEL_NETWORK_SPINE] = spine
    return out


@dataclass(frozen=True, kw_only=True)
class PodScheduling:
    """How a pod asks to be scheduled: the scheduler it names, the nodes it selects, the taints it
    tolerates and its priority (None: the cluster's default)."""

    scheduler_name: str = "default-scheduler"
    node_selector: Mapping[str, str] | None = None
    tolerations: Sequence[Mapping[str, Any]] = ()
    priority: int | None = None


@dataclass(frozen=True, kw_only=True)
class PodContainer:
    """A pod's one container: its image (never pulled: there is no kubelet) and its CPU and memory,
    requested as much as its limits."""

    image: str = "pause:3.10"
    cpu: str = "100m"
    memory: str = "64Mi"


DEFAULT_SCHEDULING = PodScheduling()
PAUSE_CONTAINER = PodContainer()


def pod_manifest(
    name: str,
    *,
    namespace: str = "default",
    gpus: int = 0,
    annotations: Mapping[str, str] | None = None,
    labels: Mapping[str, str] | None = None,
    scheduling: PodScheduling = DEFAULT_SCHEDULING,
    container: PodContainer = PAUSE_CONTAINER,
) -> JSON:
    """A bare Pod (no controller) with one container; ``gpus`` sets ``nvidia.com/gpu`` limits
    (requests default to limits)."""
    limits: dict[str, str] = {"cpu": container.cpu, "memory": container.memory}
    if gpus:
        limits[GPU_RESOURCE] = str(gpus)
    spec: JSON = {
        "schedulerName": scheduling.scheduler_name,
        "terminationGracePeriodSeconds": 0,
        "containers": [{"name": "main", "image": container.image, "resources": {"limits": limits, "requests": limits}}],
    }
    if scheduling.node_selector:
        spec["nodeSelector"] = dict(scheduling.node_selector)
    if scheduling.tolerations:
        spec["tolerations"] = [dict(t) for t in scheduling.tolerations]
    if scheduling.priority is not None:
        spec["priority"] = scheduling.priority
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "annotations": dict(annotations or {}),
            "labels": dict(labels or {}),
        },
        "spec": spec,
    }


@dataclass(frozen=True)
class PodCondition:
    type: str
    status: str
    reason: str
    message: str


@dataclass(frozen=True)
class PodEvent:
    type: str  # Normal | Warning
    reason: str
    message: str
    source: str  # reporting component, e.g. default-scheduler / gputopo-scheduler
    count: int


def pod_webhook_manifest(
    name: str, url: str, ca_pem: bytes, namespace: str, *, side_effects: str = "None", timeout_seconds: int = 5
) -> JSON:
    """A MutatingWebhookConfiguration that sends pod CREATEs in `namespace` to the extender's webhook
    at `url` (HTTPS, trusted through `ca_pem`), failing closed: what the chart's webhook is, for one
    test's namespace."""
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": [
            {
                "name": "pods.gputopo.io",
                "clientConfig": {"url": f"{url}/mutate", "caBundle": base64.b64encode(ca_pem).decode()},
                "rules": [{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"], "resources": ["pods"]}],
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                "sideEffects": side_effects,
                "admissionReviewVersions": ["v1"],
                "failurePolicy": "Fail",
                "timeoutSeconds": timeout_seconds,
            }
        ],
    }
