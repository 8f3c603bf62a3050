"""Workload objects for the e2e suite: batch/v1 Jobs and apps/v1 StatefulSets whose pods the real Job
and StatefulSet controllers of kube-controller-manager create, and the JobSet- and LeaderWorkerSet-made
children of those shapes.

The JobSet and LeaderWorkerSet controllers cannot be built here (their Go modules are not served),
so this module writes what they create, as they write it, and the real Job and StatefulSet
controllers take over from there. Labels, annotations, names, owner references and spec fields come
from the controllers' sources:

- JobSet v0.12.0 (kubernetes-sigs/jobset): ``pkg/controllers/jobset_controller.go``
  (``constructJob``, ``labelAndAnnotateObject``, ``createJobs``, ``createHeadlessSvcIfNecessary``),
  ``api/jobset/v1alpha2/jobset_types.go`` and ``pkg/constants/constants.go`` (the keys),
  ``pkg/webhooks/jobset_webhook.go`` (``Default``: Indexed completion, OnFailure, DNS hostnames on)
  and ``pkg/util/placement/placement.go`` (``GenJobName``).
- LeaderWorkerSet v0.10.0 (kubernetes-sigs/lws): ``pkg/controllers/leaderworkerset_controller.go``
  (``constructLeaderStatefulSetApplyConfiguration``), ``pkg/controllers/pod_controller.go``
  (``constructWorkerStatefulSetApplyConfiguration``, ``setControllerReferenceWithStatefulSet``),
  ``pkg/utils/controller/controller_utils.go`` (the headless Service),
  ``pkg/webhooks/leaderworkerset_webhook.go`` (``Default``) and ``pkg/webhooks/pod_webhook.go``
  (the labels its pod webhook adds, ``lws_pod_webhook_labels``), keys from
  ``api/leaderworkerset/v1/leaderworkerset_types.go``.

Two values cannot be reproduced and are documented where they are made: LWS's
``template-revision-hash`` (the hash of a ControllerRevision the LWS controller writes) and, since no
webhook runs, the labels LWS's pod webhook puts on pods (a test patches them on, as the webhook would
have). The owners (a JobSet, a LeaderWorkerSet) are real objects of minimal CRDs (``crds``), so that
owner references carry real UIDs and the garbage collector follows them.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from gputopo.localcluster import KubeClient

JSON = dict[str, Any]

# ---------------------------------------------------------------- JobSet v0.12.0 keys

JOBSET_GROUP = "jobset.x-k8s.io"
JOBSET_API = f"{JOBSET_GROUP}/v1alpha2"
JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"
JOBSET_UID = "jobset.sigs.k8s.io/jobset-uid"
REPLICATED_JOB_NAME = "jobset.sigs.k8s.io/replicatedjob-name"
REPLICATED_JOB_REPLICAS = "jobset.sigs.k8s.io/replicatedjob-replicas"
GLOBAL_REPLICAS = "jobset.sigs.k8s.io/global-replicas"
JOB_INDEX = "jobset.sigs.k8s.io/job-index"
JOB_GLOBAL_INDEX = "jobset.sigs.k8s.io/job-global-index"
JOB_KEY = "jobset.sigs.k8s.io/job-key"
RESTART_ATTEMPT = "jobset.sigs.k8s.io/restart-attempt"
GROUP_NAME = "jobset.sigs.k8s.io/group-name"
GROUP_REPLICAS = "jobset.sigs.k8s.io/group-replicas"
JOB_GROUP_INDEX = "jobset.sigs.k8s.io/job-group-index"
COORDINATOR = "jobset.sigs.k8s.io/coordinator"
EXCLUSIVE_TOPOLOGY = "alpha.jobset.sigs.k8s.io/exclusive-topology"
NODE_SELECTOR_STRATEGY = "alpha.jobset.sigs.k8s.io/node-selector"
NAMESPACED_JOB = "alpha.jobset.sigs.k8s.io/namespaced-job"
NO_SCHEDULE_TAINT = "alpha.jobset.sigs.k8s.io/no-schedule"

# ---------------------------------------------------------------- LeaderWorkerSet v0.10.0 keys

LWS_GROUP = "leaderworkerset.x-k8s.io"
LWS_API = f"{LWS_GROUP}/v1"
LWS_NAME = "leaderworkerset.sigs.k8s.io/name"
LWS_GROUP_INDEX = "leaderworkerset.sigs.k8s.io/group-index"
LWS_WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"
LWS_SIZE = "leaderworkerset.sigs.k8s.io/size"
LWS_REPLICAS = "leaderworkerset.sigs.k8s.io/replicas"
LWS_GROUP_KEY = "leaderworkerset.sigs.k8s.io/group-key"
LWS_LEADER_NAME = "leaderworkerset.sigs.k8s.io/leader-name"
LWS_REVISION = "leaderworkerset.sigs.k8s.io/template-revision-hash"
LWS_EXCLUSIVE_TOPOLOGY = "leaderworkerset.sigs.k8s.io/exclusive-topology"

# The Job controller's annotation and label with a pod's completion index (Indexed Jobs).
JOB_COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
# The StatefulSet controller's pod-ordinal label (PodIndexLabel, on by default since 1.28).
POD_INDEX = "apps.kubernetes.io/pod-index"


def _sha1(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


def _controller_ref(owner: Mapping[str, Any]) -> JSON:
    """``ctrl.SetControllerReference`` / ``metav1.NewControllerRef``: controller and blockOwnerDeletion."""
    meta = owner["metadata"]
    if not meta.get("uid"):
        raise ValueError(f"{owner.get('kind')} {meta.get('name')!r} has no metadata.uid: create it first")
    return {
        "apiVersion": owner["apiVersion"],
        "kind": owner["kind"],
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


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


# ---------------------------------------------------------------- the owners' CRDs


def _crd(group: str, version: str, kind: str, plural: str, short: str) -> JSON:
    # Minimal, not the projects' generated schemas: these objects only own children here.
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"kind": kind, "plural": plural, "singular": kind.lower(), "shortNames": [short]},
            "versions": [
                {
                    "name": version,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "spec": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                                "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                            },
                        }
                    },
                }
            ],
        },
    }


def crds() -> list[JSON]:
    """CustomResourceDefinitions for JobSet (v1alpha2) and LeaderWorkerSet (v1)."""
    return [
        _crd(JOBSET_GROUP, "v1alpha2", "JobSet", "jobsets", "js"),
        _crd(LWS_GROUP, "v1", "LeaderWorkerSet", "leaderworkersets", "lws"),
    ]


# ---------------------------------------------------------------- JobSet


def replicated_job(
    name: str, template: Mapping[str, Any], *, replicas: int = 1, pods: int = 1, group_name: str = "default"
) -> JSON:
    """One entry of ``spec.replicatedJobs``: ``replicas`` Jobs of ``pods`` pods each (parallelism =
    completions = pods), from the pod template ``template``."""
    return {
        "name": name,
        "groupName": group_name,
        "replicas": replicas,
        "template": {
            "metadata": {},
            "spec": {
                "parallelism": pods,
                "completions": pods,
                "backoffLimit": 0,
                "template": copy.deepcopy(dict(template)),
            },
        },
    }


def jobset(
    name: str,
    namespace: str,
    replicated_jobs: Sequence[Mapping[str, Any]],
    *,
    annotations: Mapping[str, str] | None = None,
    suspend: bool = False,
) -> JSON:
    """A JobSet as the API server stores it after JobSet's defaulting webhook (jobset_webhook.go
    ``Default``): child Jobs Indexed, pods OnFailure, DNS hostnames and not-ready addresses on."""
    rjobs = [copy.deepcopy(dict(r)) for r in replicated_jobs]
    for r in rjobs:
        r.setdefault("groupName", "default")
        r.setdefault("replicas", 1)
        spec = r["template"]["spec"]
        spec.setdefault("completionMode", "Indexed")
        spec["template"].setdefault("spec", {}).setdefault("restartPolicy", "OnFailure")
    return {
        "apiVersion": JOBSET_API,
        "kind": "JobSet",
        "metadata": {"name": name, "namespace": namespace, "annotations": dict(annotations or {})},
        "spec": {
            "replicatedJobs": rjobs,
            "successPolicy": {"operator": "All"},
            "startupPolicy": {"startupPolicyOrder": "AnyOrder"},
            "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
            **({"suspend": True} if suspend else {}),  # omitempty: no default is stored
        },
    }


def _subdomain(js: Mapping[str, Any]) -> str:
    sub = (js["spec"].get("network") or {}).get("subdomain")
    return str(sub) if sub else str(js["metadata"]["name"])


def _jobset_meta(js: Mapping[str, Any], rjob: Mapping[str, Any], job_idx: int) -> dict[str, str]:
    """The labels ``labelAndAnnotateObject`` sets (the same keys go in as annotations)."""
    name, ns = js["metadata"]["name"], js["metadata"]["namespace"]
    rjobs = js["spec"]["replicatedJobs"]
    job_name = f"{name}-{rjob['name']}-{job_idx}"  # placement.GenJobName
    group = rjob.get("groupName", "default")
    before = 0
    for r in rjobs:
        if r["name"] == rjob["name"]:
            break
        before += int(r["replicas"])
    group_before = 0
    for r in rjobs:
        if r.get("groupName", "default") != group:
            continue
        if r["name"] == rjob["name"]:
            break
        group_before += int(r["replicas"])
    meta = {
        JOBSET_NAME: name,
        JOBSET_UID: js["metadata"]["uid"],
        REPLICATED_JOB_NAME: rjob["name"],
        RESTART_ATTEMPT: str(int((js.get("status") or {}).get("restarts", 0))),
        # jobset.sigs.k8s.io/job-restart-attempt only with the RestartJob gate (alpha, off).
        REPLICATED_JOB_REPLICAS: str(int(rjob["replicas"])),
        GLOBAL_REPLICAS: str(sum(int(r["replicas"]) for r in rjobs)),
        JOB_INDEX: str(job_idx),
        JOB_KEY: _sha1(f"{ns}/{job_name}"),
        JOB_GLOBAL_INDEX: str(before + job_idx),
        GROUP_NAME: group,
        GROUP_REPLICAS: str(sum(int(r["replicas"]) for r in rjobs if r.get("groupName", "default") == group)),
        JOB_GROUP_INDEX: str(group_before + job_idx),
    }
    coord = js["spec"].get("coordinator")
    if coord:
        meta[COORDINATOR] = (
            f"{name}-{coord['replicatedJob']}-{int(coord.get('jobIndex', 0))}-{int(coord.get('podIndex', 0))}"
            f".{_subdomain(js)}"
        )
    return meta


def _label_and_annotate(obj: JSON, js: Mapping[str, Any], rjob: Mapping[str, Any], job_idx: int) -> None:
    meta = obj.setdefault("metadata", {})
    keys = _jobset_meta(js, rjob, job_idx)
    labels = {**(meta.get("labels") or {}), **keys}
    annotations = {**(meta.get("annotations") or {}), **keys}
    # Exclusive placement: only as annotations, the JobSet's first, the ReplicatedJob's winning.
    for source in (
        js["metadata"].get("annotations") or {},
        rjob["template"].get("metadata", {}).get("annotations") or {},
    ):
        if EXCLUSIVE_TOPOLOGY in source:
            annotations[EXCLUSIVE_TOPOLOGY] = source[EXCLUSIVE_TOPOLOGY]
            if NODE_SELECTOR_STRATEGY in source:
                annotations[NODE_SELECTOR_STRATEGY] = source[NODE_SELECTOR_STRATEGY]
    meta["labels"], meta["annotations"] = labels, annotations


def jobset_jobs(js: Mapping[str, Any]) -> list[JSON]:
    """The Jobs the JobSet controller creates for ``js`` (as stored: it must carry ``metadata.uid``),
    in ``constructJobsFromTemplate`` order: ``<jobset>-<replicatedJob>-<index>``."""
    if js["spec"].get("volumeClaimPolicies"):
        raise ValueError("jobset_jobs: spec.volumeClaimPolicies is not reproduced here")
    owner = _controller_ref(js)
    name, ns = js["metadata"]["name"], js["metadata"]["namespace"]
    network = js["spec"].get("network") or {}
    jobs = []
    for rjob in js["spec"]["replicatedJobs"]:
        tmeta = rjob["template"].get("metadata") or {}
        for idx in range(int(rjob["replicas"])):
            job: JSON = {
                "apiVersion": "batch/v1",
                "kind": "Job",
                "metadata": {
                    "name": f"{name}-{rjob['name']}-{idx}",
                    "namespace": ns,
                    "labels": dict(tmeta.get("labels") or {}),
                    "annotations": dict(tmeta.get("annotations") or {}),
                    "ownerReferences": [dict(owner)],
                },
                "spec": copy.deepcopy(rjob["template"]["spec"]),
            }
            _label_and_annotate(job, js, rjob, idx)
            _label_and_annotate(job["spec"]["template"], js, rjob, idx)
            pod_spec = job["spec"]["template"]["spec"]
            if network.get("enableDNSHostnames"):
                pod_spec["subdomain"] = _subdomain(js)
            if (
                EXCLUSIVE_TOPOLOGY in job["metadata"]["annotations"]
                and NODE_SELECTOR_STRATEGY in job["metadata"]["annotations"]
            ):
                pod_spec.setdefault("nodeSelector", {})[NAMESPACED_JOB] = f"{ns}_{job['metadata']['name']}"
                pod_spec.setdefault("tolerations", []).append(
                    {"key": NO_SCHEDULE_TAINT, "operator": "Exists", "effect": "NoSchedule"}
                )
            job["spec"]["suspend"] = bool(js["spec"].get("suspend", False))
            jobs.append(job)
    return jobs


def jobset_service(js: Mapping[str, Any]) -> JSON | None:
    """The headless Service for the pods' hostnames (None when DNS hostnames are off)."""
    network = js["spec"].get("network") or {}
    if not network.get("enableDNSHostnames"):
        return None
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": _subdomain(js),
            "namespace": js["metadata"]["namespace"],
            "ownerReferences": [_controller_ref(js)],
        },
        "spec": {
            "clusterIP": "None",
            "selector": {JOBSET_NAME: js["metadata"]["name"]},
            "publishNotReadyAddresses": bool(network.get("publishNotReadyAddresses", True)),
        },
    }


# ---------------------------------------------------------------- LeaderWorkerSet


def leaderworkerset(
    name: str,
    namespace: str,
    worker_template: Mapping[str, Any],
    *,
    size: int,
    replicas: int = 1,
    leader_template: Mapping[str, Any] | None = None,
    annotations: Mapping[str, str] | None = None,
) -> JSON:
    """A LeaderWorkerSet as stored after its defaulting webhook (leaderworkerset_webhook.go
    ``Default``): RecreateGroupOnPodRestart, RollingUpdate (maxUnavailable 1, maxSurge 0), a
    subdomain shared by all groups."""
    if size < 1 or replicas < 0:
        raise ValueError(f"leaderworkerset {name!r}: size must be >= 1 and replicas >= 0 (got {size}, {replicas})")
    tpl: JSON = {
        "size": size,
        "restartPolicy": "RecreateGroupOnPodRestart",
        "workerTemplate": copy.deepcopy(dict(worker_template)),
    }
    if leader_template is not None:
        tpl["leaderTemplate"] = copy.deepcopy(dict(leader_template))
    return {
        "apiVersion": LWS_API,
        "kind": "LeaderWorkerSet",
        "metadata": {"name": name, "namespace": namespace, "annotations": dict(annotations or {})},
        "spec": {
            "replicas": replicas,
            "startupPolicy": "LeaderCreated",
            "leaderWorkerTemplate": tpl,
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {"maxUnavailable": 1, "maxSurge": 0, "partition": 0},
            },
            "networkConfig": {"subdomainPolicy": "Shared"},
        },
    }


_SAFE = "bcdfghjklmnpqrstvwxz2456789"  # k8s.io/apimachinery/pkg/util/rand SafeEncodeString's alphabet


def lws_revision_key(lws: Mapping[str, Any]) -> str:
    """A stand-in for ``template-revision-hash``. The LWS controller hashes (FNV-32a) a ControllerRevision
    holding its Go JSON encoding of the template; this hashes this module's JSON of it the same way,
    so the value has the real one's form and changes with the template, but is not the same string."""
    data = json.dumps(lws["spec"]["leaderWorkerTemplate"], sort_keys=True).encode()
    h = 0x811C9DC5
    for b in data:
        h = ((h ^ b) * 0x01000193) & 0xFFFFFFFF
    return "".join(_SAFE[ord(c) % len(_SAFE)] for c in str(h))


def _annotate_pods(
    tmeta: dict[str, Any], meta: Mapping[str, Any], tpl_spec: Mapping[str, Any], extra: Mapping[str, str] | None = None
) -> None:
    """The annotations LWS puts on the pods of a group's StatefulSet: the group size, the LWS's
    exclusive-topology annotation where it has one, and `extra` (a worker's leader name)."""
    pod_annotations = {LWS_SIZE: str(int(tpl_spec["size"])), **(extra or {})}
    if (meta.get("annotations") or {}).get(LWS_EXCLUSIVE_TOPOLOGY):
        pod_annotations[LWS_EXCLUSIVE_TOPOLOGY] = meta["annotations"][LWS_EXCLUSIVE_TOPOLOGY]
    tmeta["annotations"] = {**(tmeta.get("annotations") or {}), **pod_annotations}


def _merge(user: Mapping[str, str] | None, controller: Mapping[str, str]) -> dict[str, str]:
    return {**(user or {}), **controller}  # metadata.go mergeMetadata: the controller's keys win


def _max_unavailable(lws: Mapping[str, Any]) -> int:
    cfg = lws["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"]
    replicas = int(lws["spec"]["replicas"])

    def scaled(v: int | str, round_up: bool) -> int:
        if isinstance(v, int):
            return v
        pct = int(str(v).rstrip("%"))
        q, r = divmod(pct * replicas, 100)
        return q + (1 if round_up and r else 0)

    surge = min(scaled(cfg.get("maxSurge", 0), True), replicas)
    return max(scaled(cfg.get("maxUnavailable", 1), False) + surge, 1)


def lws_leader_statefulset(lws: Mapping[str, Any], *, revision_key: str | None = None) -> JSON:
    """The leader StatefulSet (named as the LWS, owned by it): one leader pod per group, worker-index 0."""
    meta, spec = lws["metadata"], lws["spec"]
    tpl_spec = spec["leaderWorkerTemplate"]
    revision = revision_key or lws_revision_key(lws)
    template = copy.deepcopy(tpl_spec.get("leaderTemplate") or tpl_spec["workerTemplate"])
    tmeta = template.setdefault("metadata", {})
    tmeta["labels"] = {
        **(tmeta.get("labels") or {}),
        LWS_WORKER_INDEX: "0",
        LWS_NAME: meta["name"],
        LWS_REVISION: revision,
    }
    _annotate_pods(tmeta, meta, tpl_spec)
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {
            "name": meta["name"],
            "namespace": meta["namespace"],
            "labels": _merge(meta.get("labels"), {LWS_NAME: meta["name"], LWS_REVISION: revision}),
            "annotations": _merge(meta.get("annotations"), {LWS_REPLICAS: str(int(spec["replicas"]))}),
            "ownerReferences": [_controller_ref(lws)],
        },
        "spec": {
            "serviceName": meta["name"],
            "replicas": int(spec["replicas"]),
            "podManagementPolicy": "Parallel",
            "template": template,
            "updateStrategy": {
                "type": spec["rolloutStrategy"]["type"],
                "rollingUpdate": {
                    "maxUnavailable": _max_unavailable(lws),
                    "partition": 0,
                },
            },
            "selector": {"matchLabels": {LWS_NAME: meta["name"], LWS_WORKER_INDEX: "0"}},
        },
    }


def lws_service(lws: Mapping[str, Any]) -> JSON:
    """The headless Service shared by every group (subdomainPolicy Shared), owned by the LWS."""
    name = lws["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": name,
            "namespace": lws["metadata"]["namespace"],
            "labels": {LWS_NAME: name},
            "ownerReferences": [_controller_ref(lws)],
        },
        "spec": {"clusterIP": "None", "selector": {LWS_NAME: name}, "publishNotReadyAddresses": True},
    }


_ORDINAL = re.compile(r"^(.*)-(\d+)$")  # statefulsetutils.GetParentNameAndOrdinal


def lws_pod_webhook_labels(pod: Mapping[str, Any]) -> dict[str, str]:
    """The labels LWS's pod webhook (pod_webhook.go ``Default``) adds to a pod of a LeaderWorkerSet:
    a leader (worker-index 0) gets its group index (the ordinal in its name) and group key
    (sha1 of ``<namespace>/<pod name>``), a worker its worker index (its ordinal)."""
    meta = pod["metadata"]
    labels = meta.get("labels") or {}
    if LWS_NAME not in labels:
        return {}
    match = _ORDINAL.match(str(meta["name"]))
    if match is None:
        raise ValueError(f"pod {meta['name']!r} has no StatefulSet ordinal in its name")
    ordinal = match.group(2)
    if labels.get(LWS_WORKER_INDEX) == "0":
        out = {}
        if LWS_GROUP_INDEX not in labels:
            out[LWS_GROUP_INDEX] = ordinal
        if LWS_GROUP_KEY not in labels:
            out[LWS_GROUP_KEY] = _sha1(f"{meta['namespace']}/{meta['name']}")
        return out
    return {LWS_WORKER_INDEX: ordinal}


def lws_worker_statefulset(lws: Mapping[str, Any], leader_pod: Mapping[str, Any]) -> JSON:
    """The worker StatefulSet of one group: named as its leader pod and owned by it, ``size - 1``
    workers with ordinals from 1 (``<lws>-<group>-1`` ...). The leader's group labels are read as
    the webhook left them (``lws_pod_webhook_labels`` fills in any that are missing)."""
    meta, tpl_spec = lws["metadata"], lws["spec"]["leaderWorkerTemplate"]
    leader_labels = {**lws_pod_webhook_labels(leader_pod), **(leader_pod["metadata"].get("labels") or {})}
    if leader_labels.get(LWS_WORKER_INDEX) != "0":
        raise ValueError(f"pod {leader_pod['metadata']['name']!r} is not a leader (worker-index 0)")
    selector = {
        LWS_GROUP_INDEX: leader_labels[LWS_GROUP_INDEX],
        LWS_NAME: meta["name"],
        LWS_GROUP_KEY: leader_labels[LWS_GROUP_KEY],
    }
    labels = {**selector, LWS_REVISION: leader_labels.get(LWS_REVISION, "")}
    template = copy.deepcopy(tpl_spec["workerTemplate"])
    tmeta = template.setdefault("metadata", {})
    tmeta["labels"] = {**(tmeta.get("labels") or {}), **labels}
    _annotate_pods(tmeta, meta, tpl_spec, {LWS_LEADER_NAME: leader_pod["metadata"]["name"]})
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {
            "name": leader_pod["metadata"]["name"],
            "namespace": leader_pod["metadata"]["namespace"],
            "labels": _merge(meta.get("labels"), labels),
            "annotations": dict(meta.get("annotations") or {}),
            "ownerReferences": [
                _controller_ref({"apiVersion": "v1", "kind": "Pod", "metadata": leader_pod["metadata"]})
            ],
        },
        "spec": {
            "serviceName": meta["name"],  # subdomainPolicy Shared
            "replicas": int(tpl_spec["size"]) - 1,
            "podManagementPolicy": "Parallel",
            "template": template,
            "ordinals": {"start": 1},
            "selector": {"matchLabels": selector},
        },
    }


# ---------------------------------------------------------------- on the cluster

_PLURALS = {
    "Job": "jobs",
    "StatefulSet": "statefulsets",
    "Service": "services",
    "Pod": "pods",
    "JobSet": "jobsets",
    "LeaderWorkerSet": "leaderworkersets",
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
