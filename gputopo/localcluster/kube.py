"""A small typed wrapper over the project's Kubernetes layer for the local control plane.

``gputopo.kube`` (the project's one Kubernetes layer) loads the kubeconfig and carries the
requests; bodies and results are plain JSON dicts, as the API server speaks them, so callers never
touch the client's untyped model classes. ``kubectl`` (the real binary) is used for
``describe`` and ``apply``.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from gputopo.kube import Kube, KubeError

# The manifests live in their own module; their names stay importable from here, where callers know them.
from gputopo.localcluster.manifests import (
    FIXED_TIME,
    JSON,
    NODE_NAME_EXTRA,
    TEST_LABEL,
    PodCondition,
    PodContainer,
    PodEvent,
    PodScheduling,
    SimNode,
    network_labels,
    pod_manifest,
)

__all__ = [
    "FIXED_TIME",
    "JSON",
    "NODE_NAME_EXTRA",
    "TEST_LABEL",
    "KubeApiError",
    "KubeClient",
    "PodCondition",
    "PodContainer",
    "PodEvent",
    "PodScheduling",
    "SimNode",
    "WaitTimeout",
    "network_labels",
    "pod_manifest",
]

T = TypeVar("T")


# The layer's one error type, under the name the local cluster's callers know.
KubeApiError = KubeError


class WaitTimeout(TimeoutError):
    """A wait helper gave up; the message says what it last saw."""


def _run_parallel(fn: Callable[[T], object], items: Sequence[T], workers: int) -> None:
    if len(items) <= 1 or workers <= 1:
        for it in items:
            fn(it)
        return
    with ThreadPoolExecutor(max_workers=min(workers, len(items))) as ex:
        for fut in [ex.submit(fn, it) for it in items]:
            fut.result()


class KubeClient(Kube):
    """Typed helpers over one kubeconfig (admin or a service-account token), on the project's
    Kubernetes layer: ``request``, lists, watches and errors (``KubeApiError``) all come from there."""

    def __init__(self, kubeconfig: Path, *, kubectl: Path | None = None, pool_size: int = 32) -> None:
        super().__init__(kubeconfig, request_timeout=30.0, pool_size=pool_size)
        self.kubeconfig = Path(kubeconfig)
        self.kubectl_path = kubectl

    def __enter__(self) -> KubeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- identity

    def whoami(self) -> JSON:
        """``status.userInfo`` of a SelfSubjectReview: username, uid, groups, extra."""
        doc = self.request(
            "POST",
            "/apis/authentication.k8s.io/v1/selfsubjectreviews",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"},
        )
        info: JSON = doc.get("status", {}).get("userInfo", {})
        return info

    def can_i(self, verb: str, resource: str, *, namespace: str = "", name: str = "", subresource: str = "") -> bool:
        """SelfSubjectAccessReview for the current identity."""
        group, _, res = resource.rpartition("/") if "/" in resource else ("", "", resource)
        attrs: JSON = {"verb": verb, "resource": res, "group": group}
        if namespace:
            attrs["namespace"] = namespace
        if name:
            attrs["name"] = name
        if subresource:
            attrs["subresource"] = subresource
        doc = self.request(
            "POST",
            "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
            {
                "apiVersion": "authorization.k8s.io/v1",
                "kind": "SelfSubjectAccessReview",
                "spec": {"resourceAttributes": attrs},
            },
        )
        return bool(doc.get("status", {}).get("allowed", False))

    # ----------------------------------------------------------------- namespaces, nodes

    def create_namespace(self, name: str, *, labels: Mapping[str, str] | None = None) -> None:
        """Create a namespace; an existing one is fine. (Without kube-controller-manager a
        namespace can never finish deleting: use fresh names instead of deleting.)"""
        body = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": dict(labels or {})}}
        try:
            self.request("POST", "/api/v1/namespaces", body)
        except KubeApiError as e:
            if e.status != 409:
                raise

    def create_nodes(self, nodes: Iterable[SimNode], *, workers: int = 16) -> None:
        """Create simulated GPU nodes (status included: capacity, allocatable, Ready) in parallel."""
        _run_parallel(self.create_node, list(nodes), workers)

    def create_node(self, node: SimNode) -> JSON:
        return self.request("POST", "/api/v1/nodes", node.manifest())

    def get_node(self, name: str) -> JSON:
        return self.request("GET", f"/api/v1/nodes/{name}")

    def list_nodes(self, *, label_selector: str = "") -> list[JSON]:
        q = {"labelSelector": label_selector} if label_selector else None
        items: list[JSON] = self.request("GET", "/api/v1/nodes", query=q).get("items", [])
        return items

    def patch_node(self, name: str, patch: Mapping[str, Any], *, status: bool = False) -> JSON:
        """JSON merge patch of a Node (``status=True``: the status subresource)."""
        path = f"/api/v1/nodes/{name}" + ("/status" if status else "")
        return self.request("PATCH", path, dict(patch), content_type="application/merge-patch+json")

    def annotate_node(self, name: str, annotations: Mapping[str, str | None]) -> JSON:
        return self.patch_node(name, {"metadata": {"annotations": dict(annotations)}})

    def delete_node(self, name: str) -> None:
        self.request("DELETE", f"/api/v1/nodes/{name}")

    # ----------------------------------------------------------------- service accounts, RBAC

    def create_service_account(self, namespace: str, name: str) -> None:
        body = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name, "namespace": namespace}}
        try:
            self.request("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts", body)
        except KubeApiError as e:
            if e.status != 409:
                raise

    def create_token(
        self,
        namespace: str,
        service_account: str,
        *,
        expiration_seconds: int = 86400,
        audiences: Sequence[str] = (),
        bound_node: str | None = None,
    ) -> str:
        """Mint a token with the TokenRequest API. ``bound_node`` binds it to that Node object
        (ServiceAccountTokenNodeBinding): the token dies with the Node and authenticates with the
        user extra ``authentication.kubernetes.io/node-name``."""
        spec: JSON = {"expirationSeconds": expiration_seconds}
        if audiences:
            spec["audiences"] = list(audiences)
        if bound_node is not None:
            node = self.get_node(bound_node)
            spec["boundObjectRef"] = {
                "apiVersion": "v1",
                "kind": "Node",
                "name": bound_node,
                "uid": node["metadata"]["uid"],
            }
        doc = self.request(
            "POST",
            f"/api/v1/namespaces/{namespace}/serviceaccounts/{service_account}/token",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec},
        )
        return str(doc["status"]["token"])

    def apply(self, objects: Iterable[Mapping[str, Any]], *, server_side: bool = False) -> str:
        """``kubectl apply`` of manifests (any kinds: RBAC, CRDs, policies...); returns its output."""
        doc = {"apiVersion": "v1", "kind": "List", "items": [dict(o) for o in objects]}
        args = ["apply", "-f", "-"]
        if server_side:
            args += ["--server-side", "--force-conflicts"]
        return self.kubectl(*args, input=json.dumps(doc))

    apply_rbac = apply

    # ----------------------------------------------------------------- pods

    def create_pod(self, manifest: Mapping[str, Any]) -> JSON:
        ns = str(manifest.get("metadata", {}).get("namespace") or "default")
        return self.request("POST", f"/api/v1/namespaces/{ns}/pods", dict(manifest))

    def create_pods(self, manifests: Iterable[Mapping[str, Any]], *, workers: int = 16) -> None:
        _run_parallel(self.create_pod, list(manifests), workers)

    def get_pod(self, namespace: str, name: str) -> JSON:
        return self.request("GET", f"/api/v1/namespaces/{namespace}/pods/{name}")

    def list_pods(self, namespace: str, *, label_selector: str = "", field_selector: str = "") -> list[JSON]:
        q: dict[str, str | int] = {}
        if label_selector:
            q["labelSelector"] = label_selector
        if field_selector:
            q["fieldSelector"] = field_selector
        items: list[JSON] = self.request("GET", f"/api/v1/namespaces/{namespace}/pods", query=q).get("items", [])
        return items

    def delete_pod(self, namespace: str, name: str) -> None:
        """Delete at once (grace period 0: without a kubelet a graceful delete never finishes)."""
        try:
            self.request(
                "DELETE",
                f"/api/v1/namespaces/{namespace}/pods/{name}",
                {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0},
            )
        except KubeApiError as e:
            if e.status != 404:
                raise

    def patch_pod(self, namespace: str, name: str, patch: Mapping[str, Any]) -> JSON:
        return self.request(
            "PATCH",
            f"/api/v1/namespaces/{namespace}/pods/{name}",
            dict(patch),
            content_type="application/merge-patch+json",
        )

    @staticmethod
    def pod_conditions(pod: Mapping[str, Any]) -> list[PodCondition]:
        return [
            PodCondition(
                type=str(c.get("type", "")),
                status=str(c.get("status", "")),
                reason=str(c.get("reason", "") or ""),
                message=str(c.get("message", "") or ""),
            )
            for c in pod.get("status", {}).get("conditions", []) or []
        ]

    def pod_events(self, namespace: str, name: str) -> list[PodEvent]:
        """Events about the pod, oldest first (core/v1 view, which includes events.k8s.io)."""
        doc = self.request(
            "GET",
            f"/api/v1/namespaces/{namespace}/events",
            query={"fieldSelector": f"involvedObject.kind=Pod,involvedObject.name={name}"},
        )
        items = sorted(
            doc.get("items", []),
            key=lambda e: str(e.get("lastTimestamp") or e.get("eventTime") or e["metadata"]["creationTimestamp"]),
        )
        out = []
        for e in items:
            src = e.get("reportingComponent") or (e.get("source") or {}).get("component") or ""
            out.append(
                PodEvent(
                    type=str(e.get("type", "")),
                    reason=str(e.get("reason", "")),
                    message=str(e.get("message", "") or ""),
                    source=str(src),
                    count=int(e.get("count") or (e.get("series") or {}).get("count") or 1),
                )
            )
        return out

    def wait_crds_established(self, names: Iterable[str], *, timeout: float = 60.0) -> None:
        """Wait until every named CustomResourceDefinition is Established (its kind served)."""
        pending = list(names)

        def established(name: str) -> bool:
            doc = self.request("GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
            conditions = doc.get("status", {}).get("conditions") or []
            return any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions)

        def check() -> bool | None:
            while pending and established(pending[0]):
                pending.pop(0)
            return True if not pending else None

        self._wait(check, timeout, "CRDs Established", lambda: f"{pending[0]} not Established")

    def wait_pod_bound(self, namespace: str, name: str, *, timeout: float = 30.0) -> str:
        """Wait until the pod has ``spec.nodeName``; returns it."""

        def check() -> str | None:
            node = self.get_pod(namespace, name).get("spec", {}).get("nodeName")
            return str(node) if node else None

        return self._wait(
            check, timeout, f"pod {namespace}/{name} bound to a node", lambda: self._pod_state(namespace, name)
        )

    def wait_pods_bound(self, namespace: str, names: Iterable[str], *, timeout: float = 60.0) -> dict[str, str]:
        """Wait until every named pod is bound; returns pod → node."""
        want = set(names)

        def check() -> dict[str, str] | None:
            got = {
                p["metadata"]["name"]: p["spec"]["nodeName"]
                for p in self.list_pods(namespace)
                if p["metadata"]["name"] in want and p.get("spec", {}).get("nodeName")
            }
            return got if len(got) == len(want) else None

        return self._wait(check, timeout, f"{len(want)} pods in {namespace} bound", lambda: "")

    def wait_pod_condition(
        self,
        namespace: str,
        name: str,
        cond_type: str = "PodScheduled",
        *,
        status: str | None = None,
        reason: str | None = None,
        timeout: float = 30.0,
    ) -> PodCondition:
        """Wait for a pod condition (optionally with the given status and reason)."""

        def check() -> PodCondition | None:
            for c in self.pod_conditions(self.get_pod(namespace, name)):
                if (
                    c.type == cond_type
                    and (status is None or c.status == status)
                    and (reason is None or c.reason == reason)
                ):
                    return c
            return None

        return self._wait(
            check,
            timeout,
            f"pod {namespace}/{name} condition {cond_type} status={status} reason={reason}",
            lambda: self._pod_state(namespace, name),
        )

    def wait_pod_event(
        self,
        namespace: str,
        name: str,
        reason: str,
        *,
        contains: str = "",
        timeout: float = 30.0,
    ) -> PodEvent:
        """Wait for an event about the pod with this reason (and message substring)."""

        def check() -> PodEvent | None:
            for ev in self.pod_events(namespace, name):
                if ev.reason == reason and contains in ev.message:
                    return ev
            return None

        return self._wait(
            check,
            timeout,
            f"event {reason!r} containing {contains!r} for pod {namespace}/{name}",
            lambda: "; ".join(f"{e.reason}: {e.message}" for e in self.pod_events(namespace, name)),
        )

    # ----------------------------------------------------------------- kubectl

    def kubectl(self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60.0) -> str:
        """Run the real kubectl against this kubeconfig; returns stdout (raises with stderr)."""
        if self.kubectl_path is None:
            raise RuntimeError("this KubeClient has no kubectl binary configured")
        cache = self.kubeconfig.parent / ".kubectl-cache"
        proc = subprocess.run(
            [str(self.kubectl_path), f"--kubeconfig={self.kubeconfig}", f"--cache-dir={cache}", *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and proc.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc.stdout

    def describe_pod(self, namespace: str, name: str) -> str:
        return self.kubectl("describe", "pod", "-n", namespace, name)

    # ----------------------------------------------------------------- internals

    def _pod_state(self, namespace: str, name: str) -> str:
        try:
            pod = self.get_pod(namespace, name)
        except KubeApiError as e:
            return str(e)
        conds = ", ".join(f"{c.type}={c.status} {c.reason} {c.message}".strip() for c in self.pod_conditions(pod))
        evs = "; ".join(f"{e.reason}: {e.message}" for e in self.pod_events(namespace, name))
        return f"nodeName={pod.get('spec', {}).get('nodeName')!r}; conditions: {conds or '-'}; events: {evs or '-'}"

    @staticmethod
    def _wait(check: Callable[[], T | None], timeout: float, what: str, state: Callable[[], str]) -> T:
        deadline = time.monotonic() + timeout
        delay = 0.05
        while True:
            got = check()
            if got is not None:
                return got
            if time.monotonic() > deadline:
                try:
                    last = state()
                except Exception as e:  # the diagnosis must not hide the timeout
                    last = f"(could not read state: {e})"
                raise WaitTimeout(f"timed out after {timeout:.0f}s waiting for {what}; last state: {last}")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)
