"""The job controllers' own install manifests, rewritten for host processes on loopback: pure functions.

Each project ships its admission webhook configurations, CRDs and ClusterRole for an in-cluster Deployment
behind a Service. A host process has no Service: every ``clientConfig.service`` becomes
``url: https://127.0.0.1:<port><path>`` with the CA bundle of a CA generated for the process, and the pod
webhooks are narrowed as the projects' install overlays narrow them (else they would see every pod). The
specs of the four controllers (JobSet, LeaderWorkerSet, Kueue, Kubeflow Trainer) say where in each
module's source these files are and how each manager is configured.
"""

from __future__ import annotations

import base64
import copy
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

JSON = dict[str, Any]

WEBHOOK_KINDS = ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration")
# The namespace label that makes a namespace Kueue-managed here: Kueue's pod and job webhooks and its
# job reconcilers see only such namespaces, so the rest of a shared test cluster is left alone.
KUEUE_MANAGED_LABEL = "e2e.gputopo.io/kueue"
KUEUE_MANAGED_VALUE = "managed"
KUEUE_NAMESPACE_SELECTOR: JSON = {"matchLabels": {KUEUE_MANAGED_LABEL: KUEUE_MANAGED_VALUE}}


@dataclass(frozen=True)
class ControllerSpec:
    """Where one controller's manifests sit in its module source, and how its manager is configured.

    ``pod_label``: the label a pod must carry for the pod webhooks to see it (the install overlay's
    objectSelector); ``namespace_selector``: a selector every webhook on kinds outside the project's own
    API group gets (Kueue's narrowing). ``config_api``: the apiVersion of the manager's Configuration;
    ``cert_key``: the key that turns its internal certificate management off; ``cert_dir_in_config``:
    whether its webhook server reads ``webhook.certDir`` (Trainer's does not: it uses the default under
    the process's temporary directory). ``needs``: controllers that must run first. ``extra``: more
    Configuration fields. ``post``: manifests applied once its webhooks serve (Trainer's runtimes)."""

    name: str
    title: str
    crd_dirs: tuple[str, ...]
    crd_kustomization: str
    webhooks: str
    roles: tuple[str, ...]
    config_api: str
    group: str
    cert_key: str = "internalCertManagement"
    cert_dir_in_config: bool = True
    pod_label: str | None = None
    namespace_selector: Mapping[str, Any] | None = None
    needs: tuple[str, ...] = ()
    extra: Mapping[str, Any] = field(default_factory=dict)
    post: tuple[str, ...] = ()


KUEUE_FRAMEWORKS = (
    "batch/job",
    "pod",
    "jobset.x-k8s.io/jobset",
    "leaderworkerset.x-k8s.io/leaderworkerset",
    "trainer.kubeflow.org/trainjob",
)

SPECS: dict[str, ControllerSpec] = {
    s.name: s
    for s in (
        ControllerSpec(
            name="jobset",
            title="JobSet",
            crd_dirs=("config/components/crd/bases",),
            crd_kustomization="config/components/crd/kustomization.yaml",
            webhooks="config/components/webhook/manifests.yaml",
            roles=("config/components/rbac/role.yaml",),
            config_api="config.jobset.x-k8s.io/v1alpha1",
            group="jobset.x-k8s.io",
            pod_label="jobset.sigs.k8s.io/jobset-name",
        ),
        ControllerSpec(
            name="lws",
            title="LeaderWorkerSet",
            crd_dirs=("config/crd/bases",),
            crd_kustomization="config/crd/kustomization.yaml",
            webhooks="config/webhook/manifests.yaml",
            roles=("config/rbac/role.yaml",),
            config_api="config.lws.x-k8s.io/v1alpha1",
            group="leaderworkerset.x-k8s.io",
            pod_label="leaderworkerset.sigs.k8s.io/name",
        ),
        ControllerSpec(
            name="trainer",
            title="Kubeflow Trainer",
            crd_dirs=("manifests/base/crds",),
            crd_kustomization="manifests/base/crds/kustomization.yaml",
            webhooks="manifests/base/webhook/manifests.yaml",
            roles=("manifests/base/rbac/role.yaml",),
            config_api="config.trainer.kubeflow.org/v1alpha1",
            group="trainer.kubeflow.org",
            cert_key="certManagement",
            cert_dir_in_config=False,
            needs=("jobset",),
            post=("manifests/base/runtimes/torch_distributed.yaml",),
        ),
        ControllerSpec(
            name="kueue",
            title="Kueue",
            crd_dirs=("config/components/crd/bases",),
            crd_kustomization="config/components/crd/kustomization.yaml",
            webhooks="config/components/webhook/manifests.yaml",
            roles=("config/components/rbac/role.yaml", "config/components/rbac/manager_secrets_role.yaml"),
            config_api="config.kueue.x-k8s.io/v1beta2",
            group="kueue.x-k8s.io",
            namespace_selector=KUEUE_NAMESPACE_SELECTOR,
            # Its integrations' CRDs must exist when it starts, and a JobSet it admits needs JobSet.
            needs=("jobset", "lws", "trainer"),
            extra={
                "integrations": {"frameworks": list(KUEUE_FRAMEWORKS)},
                "managedJobsNamespaceSelector": KUEUE_NAMESPACE_SELECTOR,
                # VisibilityOnDemand starts an API server on 0.0.0.0; TAS is what the tests use, and
                # TASBalancedPlacement (alpha, off by default to v0.19) is what e2e/test_rack_kueue.py compares.
                "featureGates": {
                    "VisibilityOnDemand": False,
                    "TopologyAwareScheduling": True,
                    "TASBalancedPlacement": True,
                },
            },
        ),
    )
}
# Dependencies first: an order in which every controller's ``needs`` run before it.
ORDER = ("jobset", "lws", "trainer", "kueue")


def start_order(names: Iterable[str]) -> list[str]:
    """The controllers ``names`` need, themselves included, dependencies first. Raises ``KeyError`` naming
    an unknown controller."""
    want: set[str] = set()

    def add(name: str) -> None:
        if name not in SPECS:
            raise KeyError(f"unknown job controller {name!r}; known: {', '.join(ORDER)}")
        if name not in want:
            want.add(name)
            for dep in SPECS[name].needs:
                add(dep)

    for n in names:
        add(n)
    return [n for n in ORDER if n in want]


def manager_config(spec: ControllerSpec, *, webhook_port: int, cert_dir: str, probe_port: int, namespace: str) -> JSON:
    """The manager's Configuration: webhooks on 127.0.0.1 with the given certificates, its own certificate
    management off, leader election off (one replica), metrics off, health probes on loopback."""
    webhook: JSON = {"host": "127.0.0.1", "port": webhook_port}
    if spec.cert_dir_in_config:
        webhook["certDir"] = cert_dir
    doc: JSON = {
        "apiVersion": spec.config_api,
        "kind": "Configuration",
        spec.cert_key: {"enable": False},
        "webhook": webhook,
        "leaderElection": {"leaderElect": False},
        "metrics": {"bindAddress": "0"},
        "health": {"healthProbeBindAddress": f"127.0.0.1:{probe_port}"},
    }
    if spec.name == "kueue":
        doc["namespace"] = namespace
    doc.update(copy.deepcopy(dict(spec.extra)))
    return doc


def service_to_url(client_config: Mapping[str, Any], base_url: str, ca_pem: bytes) -> JSON:
    """A webhook's ``clientConfig`` calling ``base_url`` + the Service's path, trusting ``ca_pem``."""
    out = {k: v for k, v in client_config.items() if k != "service"}
    service = client_config.get("service")
    if service is not None:
        out["url"] = base_url.rstrip("/") + str(service.get("path") or "/")
    out["caBundle"] = base64.b64encode(ca_pem).decode()
    return out


def _resources(webhook: Mapping[str, Any]) -> list[tuple[str, str]]:
    return [(g, r) for rule in webhook.get("rules", []) for g in rule.get("apiGroups", []) for r in rule["resources"]]


def narrow_webhook(spec: ControllerSpec, webhook: Mapping[str, Any]) -> JSON:
    """One webhook narrowed as the project's install overlay narrows it: pod webhooks see only pods with
    ``spec.pod_label``; with ``spec.namespace_selector``, webhooks on kinds of other API groups see only
    the namespaces it selects."""
    out = copy.deepcopy(dict(webhook))
    resources = _resources(webhook)
    if spec.pod_label is not None and ("", "pods") in resources:
        out["objectSelector"] = {"matchExpressions": [{"key": spec.pod_label, "operator": "Exists"}]}
    if spec.namespace_selector is not None and any(g != spec.group for g, _ in resources):
        out["namespaceSelector"] = copy.deepcopy(dict(spec.namespace_selector))
    return out


def webhook_configurations(
    spec: ControllerSpec, documents: Sequence[Mapping[str, Any]], *, base_url: str, ca_pem: bytes
) -> list[JSON]:
    """The project's webhook configurations, named after the controller (the manifests' names are
    kustomize bases, the same in every project), calling ``base_url``, narrowed (``narrow_webhook``)."""
    out = []
    for doc in documents:
        if doc.get("kind") not in WEBHOOK_KINDS:
            continue
        obj = copy.deepcopy(dict(doc))
        obj["metadata"] = {"name": f"gputopo-e2e-{spec.name}-{doc['metadata']['name']}"}
        hooks = []
        for hook in doc.get("webhooks", []):
            narrowed = narrow_webhook(spec, hook)
            narrowed["clientConfig"] = service_to_url(hook.get("clientConfig", {}), base_url, ca_pem)
            hooks.append(narrowed)
        obj["webhooks"] = hooks
        out.append(obj)
    return out


def conversion_patches(kustomization: Mapping[str, Any], patches: Mapping[str, Mapping[str, Any]]) -> dict[str, JSON]:
    """CRD name → the ``spec.conversion`` its kustomization patches in (``patches``: patch path → the
    loaded patch; only paths the kustomization lists count)."""
    out: dict[str, JSON] = {}
    for entry in kustomization.get("patches") or []:
        patch = patches.get(str(entry.get("path", "")))
        conversion = (patch or {}).get("spec", {}).get("conversion")
        if patch is not None and conversion is not None and patch.get("kind") == "CustomResourceDefinition":
            out[str(patch["metadata"]["name"])] = copy.deepcopy(dict(conversion))
    return out


def with_conversion(
    crd: Mapping[str, Any], conversion: Mapping[str, Any] | None, *, base_url: str, ca_pem: bytes
) -> JSON:
    """The CRD with its project's conversion webhook on ``base_url``, where it has one and serves more
    than one version (with one version the API server never converts)."""
    out = copy.deepcopy(dict(crd))
    if conversion is None or len(crd.get("spec", {}).get("versions", [])) < 2:
        return out
    conv = copy.deepcopy(dict(conversion))
    hook = conv.get("webhook")
    if isinstance(hook, dict) and "clientConfig" in hook:
        hook["clientConfig"] = service_to_url(hook["clientConfig"], base_url, ca_pem)
    out["spec"]["conversion"] = conv
    return out


def rbac_objects(
    spec: ControllerSpec, documents: Sequence[Mapping[str, Any]], namespace: str, service_account: str
) -> list[JSON]:
    """The project's manager roles (``spec.roles``: its ClusterRole, and Roles such as Kueue's access to the
    Secrets of its namespace, put in ``namespace``), renamed after the controller, each bound to
    ``service_account``. Raises ``ValueError`` when the manifests hold no role."""
    out: list[JSON] = []
    subject = {"kind": "ServiceAccount", "name": service_account, "namespace": namespace}
    for doc in documents:
        if doc.get("kind") not in ("ClusterRole", "Role"):
            continue
        kind = str(doc["kind"])
        meta: JSON = {"name": f"gputopo-e2e-{spec.name}-{doc['metadata']['name']}"}
        if kind == "Role":
            meta["namespace"] = namespace
        role = copy.deepcopy(dict(doc)) | {"metadata": meta}
        binding = {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": f"{kind}Binding",
            "metadata": dict(meta),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": kind, "name": meta["name"]},
            "subjects": [dict(subject)],
        }
        out += [role, binding]
    if not out:
        raise ValueError(f"{spec.title}: no ClusterRole or Role in {', '.join(spec.roles)}")
    return out
