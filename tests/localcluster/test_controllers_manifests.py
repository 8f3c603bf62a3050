"""The job controllers' install manifests rewritten for host processes on loopback, without running anything:
webhooks call a URL with a CA bundle, pod webhooks are narrowed as the projects' overlays narrow them, CRDs get
their conversion webhook only where they convert, and each manager's configuration keeps to loopback."""

from __future__ import annotations

import base64
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gputopo.localcluster.controllermanifests import (
    KUEUE_NAMESPACE_SELECTOR,
    ORDER,
    SPECS,
    conversion_patches,
    manager_config,
    narrow_webhook,
    rbac_objects,
    service_to_url,
    start_order,
    webhook_configurations,
    with_conversion,
)
from gputopo.localcluster.jobcontrollers import BUILD_CONTROLLERS_SCRIPT, controllers_missing
from tests.paths import REPO

CA = b"-----BEGIN CERTIFICATE-----\nabc\n-----END CERTIFICATE-----\n"
BASE = "https://127.0.0.1:9443"


def _hook(name: str, group: str, resource: str, path: str) -> dict[str, Any]:
    return {
        "name": name,
        "admissionReviewVersions": ["v1"],
        "clientConfig": {"service": {"name": "webhook-service", "namespace": "system", "path": path}},
        "failurePolicy": "Fail",
        "sideEffects": "None",
        "rules": [{"apiGroups": [group], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": [resource]}],
    }


@pytest.mark.parametrize(
    ("names", "order"),
    [
        (["jobset"], ["jobset"]),
        (["lws"], ["lws"]),
        (["trainer"], ["jobset", "trainer"]),
        (["kueue"], ["jobset", "lws", "trainer", "kueue"]),
        (["kueue", "jobset"], ["jobset", "lws", "trainer", "kueue"]),
        ([], []),
    ],
)
def test_start_order_puts_what_a_controller_needs_first(names: list[str], order: list[str]) -> None:
    assert start_order(names) == order


def test_start_order_names_an_unknown_controller() -> None:
    with pytest.raises(KeyError, match="unknown job controller 'volcano'"):
        start_order(["volcano"])


@given(st.lists(st.sampled_from(ORDER)))
def test_start_order_runs_every_need_before_its_controller(names: list[str]) -> None:
    order = start_order(names)
    assert set(names) <= set(order)
    for i, name in enumerate(order):
        assert set(SPECS[name].needs) <= set(order[:i])


@pytest.mark.parametrize(
    ("client_config", "url"),
    [
        ({"service": {"name": "s", "namespace": "n", "path": "/mutate--v1-pod"}}, f"{BASE}/mutate--v1-pod"),
        ({"service": {"name": "s", "namespace": "n", "path": "/convert"}}, f"{BASE}/convert"),
        ({"service": {"name": "s", "namespace": "n"}}, f"{BASE}/"),
    ],
)
def test_service_to_url_calls_loopback_with_the_ca_bundle(client_config: dict[str, Any], url: str) -> None:
    out = service_to_url(client_config, BASE + "/", CA)
    assert out == {"url": url, "caBundle": base64.b64encode(CA).decode()}


@pytest.mark.parametrize(
    ("controller", "hook", "object_selector", "namespace_selector"),
    [
        ("jobset", _hook("mpod.kb.io", "", "pods", "/mutate--v1-pod"), "jobset.sigs.k8s.io/jobset-name", None),
        ("jobset", _hook("mjobset.kb.io", "jobset.x-k8s.io", "jobsets", "/m"), None, None),
        ("lws", _hook("vpod.kb.io", "", "pods", "/validate--v1-pod"), "leaderworkerset.sigs.k8s.io/name", None),
        # v0.9 serves a second kind of its own (DisaggregatedSet): left as the project writes it.
        ("lws", _hook("vdisaggregatedset.kb.io", "disaggregatedset.x-k8s.io", "disaggregatedsets", "/v"), None, None),
        ("kueue", _hook("mpod.kb.io", "", "pods", "/mutate--v1-pod"), None, KUEUE_NAMESPACE_SELECTOR),
        ("kueue", _hook("mjob.kb.io", "batch", "jobs", "/mutate-batch-v1-job"), None, KUEUE_NAMESPACE_SELECTOR),
        ("kueue", _hook("mworkload.kb.io", "kueue.x-k8s.io", "workloads", "/m"), None, None),
        ("trainer", _hook("v.trainjob", "trainer.kubeflow.org", "trainjobs", "/v"), None, None),
    ],
)
def test_narrow_webhook_follows_the_projects_install_overlays(
    controller: str, hook: dict[str, Any], object_selector: str | None, namespace_selector: Any
) -> None:
    out = narrow_webhook(SPECS[controller], hook)
    want = {"matchExpressions": [{"key": object_selector, "operator": "Exists"}]} if object_selector else None
    assert out.get("objectSelector") == want
    assert out.get("namespaceSelector") == namespace_selector
    assert out["rules"] == hook["rules"] and out["name"] == hook["name"]


def test_webhook_configurations_are_renamed_and_call_loopback_only() -> None:
    docs: list[dict[str, Any]] = [
        {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
         "metadata": {"name": "mutating-webhook-configuration"},
         "webhooks": [_hook("mpod.kb.io", "", "pods", "/mutate--v1-pod")]},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "webhook-service"}},
    ]  # fmt: skip
    (out,) = webhook_configurations(SPECS["jobset"], docs, base_url=BASE, ca_pem=CA)
    assert out["metadata"] == {"name": "gputopo-e2e-jobset-mutating-webhook-configuration"}
    (hook,) = out["webhooks"]
    assert "service" not in hook["clientConfig"] and hook["clientConfig"]["url"] == f"{BASE}/mutate--v1-pod"
    assert docs[0]["webhooks"][0]["clientConfig"]["service"]["path"] == "/mutate--v1-pod", "input left alone"


def _crd(name: str, versions: int) -> dict[str, Any]:
    return {"kind": "CustomResourceDefinition", "metadata": {"name": name},
            "spec": {"versions": [{"name": f"v{i}"} for i in range(versions)]}}  # fmt: skip


CONVERSION = {"strategy": "Webhook", "webhook": {"clientConfig": {"service": {"name": "s", "path": "/convert"}},
                                                 "conversionReviewVersions": ["v1"]}}  # fmt: skip


@pytest.mark.parametrize(
    ("versions", "conversion", "converts"),
    [(2, CONVERSION, True), (1, CONVERSION, False), (2, None, False)],
)
def test_with_conversion_only_where_the_crd_converts(versions: int, conversion: Any, converts: bool) -> None:
    out = with_conversion(_crd("workloads.kueue.x-k8s.io", versions), conversion, base_url=BASE, ca_pem=CA)
    if converts:
        assert out["spec"]["conversion"]["webhook"]["clientConfig"]["url"] == f"{BASE}/convert"
        assert out["spec"]["conversion"]["webhook"]["conversionReviewVersions"] == ["v1"]
    else:
        assert "conversion" not in out["spec"]


def test_conversion_patches_counts_only_the_patches_the_kustomization_lists() -> None:
    patch = {"kind": "CustomResourceDefinition", "metadata": {"name": "workloads.kueue.x-k8s.io"},
             "spec": {"conversion": CONVERSION}}  # fmt: skip
    listed = {"patches": [{"path": "patches/webhook_in_workloads.yaml"}]}
    patches = {"patches/webhook_in_workloads.yaml": patch, "patches/webhook_in_other.yaml": patch}
    assert conversion_patches(listed, patches) == {"workloads.kueue.x-k8s.io": CONVERSION}
    assert conversion_patches({}, patches) == {}


@pytest.mark.parametrize("controller", ORDER)
def test_manager_config_keeps_to_loopback_without_leader_election_or_own_certificates(controller: str) -> None:
    spec = SPECS[controller]
    doc = manager_config(spec, webhook_port=9443, cert_dir="/c", probe_port=8081, namespace="ns")
    assert doc["apiVersion"] == spec.config_api and doc["kind"] == "Configuration"
    assert doc["webhook"]["host"] == "127.0.0.1" and doc["webhook"]["port"] == 9443
    assert doc["webhook"].get("certDir") == ("/c" if spec.cert_dir_in_config else None)
    assert doc[spec.cert_key] == {"enable": False}
    assert doc["leaderElection"] == {"leaderElect": False}
    assert doc["metrics"] == {"bindAddress": "0"}
    assert doc["health"]["healthProbeBindAddress"] == "127.0.0.1:8081"


def test_kueue_config_manages_only_labelled_namespaces_with_tas_and_no_visibility_server() -> None:
    doc = manager_config(SPECS["kueue"], webhook_port=1, cert_dir="/c", probe_port=2, namespace="ns")
    assert doc["namespace"] == "ns"
    assert doc["managedJobsNamespaceSelector"] == KUEUE_NAMESPACE_SELECTOR
    assert doc["featureGates"] == {
        "VisibilityOnDemand": False,
        "TopologyAwareScheduling": True,
        "TASBalancedPlacement": True,
    }
    assert set(doc["integrations"]["frameworks"]) == {
        "batch/job", "pod", "jobset.x-k8s.io/jobset", "leaderworkerset.x-k8s.io/leaderworkerset",
        "trainer.kubeflow.org/trainjob",
    }  # fmt: skip


def test_rbac_objects_are_the_projects_roles_renamed_and_bound_to_the_managers_account() -> None:
    rules = [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}]
    docs: list[dict[str, Any]] = [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": "manager-role"},
         "rules": rules},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": {"name": "manager-secrets-role", "namespace": "system"}, "rules": rules},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "controller-manager"}},
    ]  # fmt: skip
    out = rbac_objects(SPECS["kueue"], docs, "ns", "kueue-controller-manager")
    assert [(o["kind"], o["metadata"]) for o in out] == [
        ("ClusterRole", {"name": "gputopo-e2e-kueue-manager-role"}),
        ("ClusterRoleBinding", {"name": "gputopo-e2e-kueue-manager-role"}),
        ("Role", {"name": "gputopo-e2e-kueue-manager-secrets-role", "namespace": "ns"}),
        ("RoleBinding", {"name": "gputopo-e2e-kueue-manager-secrets-role", "namespace": "ns"}),
    ]
    assert out[0]["rules"] == rules and out[2]["rules"] == rules
    for binding in out[1::2]:
        assert binding["roleRef"]["name"] == binding["metadata"]["name"]
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "kueue-controller-manager", "namespace": "ns"}
        ]
    with pytest.raises(ValueError, match="no ClusterRole or Role"):
        rbac_objects(SPECS["lws"], docs[2:], "ns", "lws-controller-manager")


def test_controllers_missing_names_the_controller_and_the_fix(tmp_path: Path) -> None:
    assert "build_controllers.sh" in str(controllers_missing(None, ["jobset"]))
    (tmp_path / "bin").mkdir()
    (tmp_path / "src" / "jobset").mkdir(parents=True)
    (tmp_path / "bin" / "jobset").write_text("")
    assert controllers_missing(tmp_path, ["jobset"]) is None
    missing = controllers_missing(tmp_path, ["jobset", "kueue"])
    assert missing is not None and missing.startswith("Kueue: ") and "bin/kueue is missing" in missing


def _pins() -> dict[str, str]:
    """The versions build_controllers.sh builds when no GPUTOPO_*_VERSION is set, by controller title."""
    text = BUILD_CONTROLLERS_SCRIPT.read_text()
    found = dict(re.findall(r'^(\w+)_VERSION="\$\{GPUTOPO_\w+_VERSION:-([0-9.]+)\}"$', text, re.M))
    titles = {"JOBSET": "JobSet", "LWS": "LeaderWorkerSet", "KUEUE": "Kueue", "TRAINER": "Kubeflow Trainer"}
    assert set(found) == set(titles), f"pins in {BUILD_CONTROLLERS_SCRIPT.name}: {found}"
    return {titles[k]: v for k, v in found.items()}


@pytest.mark.parametrize(
    "doc",
    [
        pytest.param("docs/install.md", id="install-states-the-tested-versions"),
        pytest.param("README.md", id="readme-names-the-versions-the-tests-build"),
        pytest.param("docs/local-cluster.md", id="local-cluster-names-the-versions-the-e2e-suite-runs"),
    ],
)
def test_the_docs_name_the_controller_versions_the_build_pins(doc: str) -> None:
    text = " ".join((REPO / doc).read_text().split())  # a name may wrap across lines
    for title, version in _pins().items():
        assert f"{title} v{version}" in text, f"{doc} does not name {title} v{version}"


def test_the_local_cluster_docs_name_the_cache_directory_of_the_pinned_build() -> None:
    pins = _pins()
    key = (
        f"controllers_jobset-v{pins['JobSet']}_lws-v{pins['LeaderWorkerSet']}_kueue-v{pins['Kueue']}"
        f"_trainer-v{pins['Kubeflow Trainer']}"
    )
    assert key in (REPO / "docs/local-cluster.md").read_text()
