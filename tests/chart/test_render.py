"""What charts/gputopo renders for the important value combinations."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gputopo.engine.scoring import ScoreWeights
from gputopo.tiers import DEFAULT_TIERS, TierConfig
from tests.chart.helm import (
    CHART,
    NAMESPACE,
    ROOT,
    Doc,
    by_kind,
    ci_values_files,
    container,
    env_of,
    one,
    render,
    render_fails,
    scheduler_config,
)

WRITE_VERBS = {"create", "update", "patch", "delete", "deletecollection", "*"}
EXTENDER_URL = f"https://gputopo-extender.{NAMESPACE}.svc:8888"
CHART_META = yaml.safe_load((CHART / "Chart.yaml").read_text())

# Settings the chart passes that docs/configuration.md does not list yet. GPUTOPO_TIERS (a JSON
# TierConfig, for custom network tiers) must be added there and read by the extender.
PENDING_DOCUMENTATION: set[str] = set()


def _documented_env() -> set[str]:
    text = (ROOT / "docs" / "configuration.md").read_text()
    return set(re.findall(r"`((?:GPUTOPO|NODE)_[A-Z_]+)`", text))


def _rules(role: Doc) -> list[Doc]:
    rules: list[Doc] = role.get("rules", [])
    return rules


def _verbs_on(role: Doc, group: str, resource: str) -> set[str]:
    verbs: set[str] = set()
    for rule in _rules(role):
        if group in rule.get("apiGroups", []) and resource in rule.get("resources", []):
            verbs |= set(rule["verbs"])
    return verbs


def _pod_spec(workload: Doc) -> Doc:
    spec: Doc = workload["spec"]["template"]["spec"]
    return spec


# --- which objects exist ------------------------------------------------------------------


BASE_KINDS = {
    "ServiceAccount",
    "ClusterRole",
    "ClusterRoleBinding",
    "Role",
    "RoleBinding",
    "ConfigMap",
    "Service",
    "DaemonSet",
    "Deployment",
    "PodDisruptionBudget",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
    "Pod",  # the helm test hook
}


@pytest.mark.parametrize(
    ("values_files", "sets", "expected_kinds"),
    [
        pytest.param([], {}, BASE_KINDS | {"Secret"}, id="defaults: generated TLS Secret, no webhook"),
        pytest.param(
            ["webhook-values.yaml"],
            {},
            BASE_KINDS | {"Secret", "MutatingWebhookConfiguration"},
            id="webhook on",
        ),
        pytest.param(
            ["cert-manager-values.yaml"],
            {},
            BASE_KINDS | {"Certificate", "Issuer", "MutatingWebhookConfiguration"},
            id="cert-manager on: no generated Secret",
        ),
        pytest.param(
            [],
            {"tls__existingSecret": "site-tls"},
            BASE_KINDS,
            id="existing Secret: nothing generated",
        ),
        pytest.param(
            [],
            {"agent__enabled": "false"},
            BASE_KINDS - {"DaemonSet", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"} | {"Secret"},
            id="agent off",
        ),
    ],
)
def test_rendered_kinds(values_files: list[str], sets: dict[str, str], expected_kinds: set[str]) -> None:
    assert {d["kind"] for d in render(values_files, **sets)} == expected_kinds


@pytest.mark.parametrize("values_file", ci_values_files(), ids=lambda p: p.name)
def test_every_object_is_labelled_and_named_within_limits(values_file: Path) -> None:
    for d in render([values_file]):
        labels = d["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "gputopo"
        assert labels["app.kubernetes.io/instance"] == "gputopo"
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert len(d["metadata"]["name"]) <= 63


def test_one_resource_per_template_file() -> None:
    for path in (CHART / "templates").rglob("*.yaml"):
        assert path.read_text().count("\nkind: ") <= 1, path.name


# --- scheduler ---------------------------------------------------------------------------


EXTENDER_KEYS = {
    "urlPrefix",
    "filterVerb",
    "prioritizeVerb",
    "bindVerb",
    "weight",
    "nodeCacheCapable",
    "enableHTTPS",
    "tlsConfig",
    "httpTimeout",
    "ignorable",
    "managedResources",
}


def test_scheduler_config_has_exactly_the_extender_protocol_keys() -> None:
    cfg = scheduler_config(render())
    assert cfg["apiVersion"] == "kubescheduler.config.k8s.io/v1"
    assert cfg["kind"] == "KubeSchedulerConfiguration"
    assert set(cfg) == {"apiVersion", "kind", "leaderElection", "percentageOfNodesToScore", "profiles", "extenders"}
    [ext] = cfg["extenders"]
    assert set(ext) == EXTENDER_KEYS
    assert ext == {
        "urlPrefix": EXTENDER_URL,
        "filterVerb": "filter",
        "prioritizeVerb": "prioritize",
        "bindVerb": "bind",
        "weight": 5,
        "nodeCacheCapable": True,
        "enableHTTPS": True,
        "tlsConfig": {"caFile": "/etc/gputopo/ca/ca.crt"},
        "httpTimeout": "5s",
        "ignorable": False,
        "managedResources": [{"name": "nvidia.com/gpu", "ignoredByScheduler": False}],
    }
    assert cfg["profiles"] == [{"schedulerName": "gputopo-scheduler"}]
    assert cfg["percentageOfNodesToScore"] == 100
    assert cfg["leaderElection"] == {
        "leaderElect": True,
        "resourceLock": "leases",
        "resourceName": "gputopo-scheduler",
        "resourceNamespace": NAMESPACE,
    }


def test_scheduler_config_options_come_from_values() -> None:
    cfg = scheduler_config(
        render(["custom-tiers-values.yaml"], scheduler__extender__preemptVerb="preempt", scheduler__replicas="2")
    )
    [ext] = cfg["extenders"]
    assert set(ext) == EXTENDER_KEYS | {"preemptVerb"}
    assert ext["preemptVerb"] == "preempt"
    assert ext["weight"] == 10
    assert ext["httpTimeout"] == "10s"


def test_scheduler_runs_upstream_kube_scheduler_with_the_config_and_the_ca() -> None:
    docs = render()
    dep = one(docs, "Deployment", component="scheduler")
    c = container(dep)
    assert c["image"] == "registry.k8s.io/kube-scheduler:v1.34.4"
    assert "--config=/etc/gputopo-scheduler/config.yaml" in c["command"]
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts["/etc/gputopo/ca"]["readOnly"] is True
    volumes = {v["name"]: v for v in _pod_spec(dep)["volumes"]}
    ca_volume = volumes[mounts["/etc/gputopo/ca"]["name"]]
    assert ca_volume["secret"] == {"secretName": "gputopo-extender-tls", "items": [{"key": "ca.crt", "path": "ca.crt"}]}
    assert volumes[mounts["/etc/gputopo-scheduler"]["name"]]["configMap"]["name"] == "gputopo-scheduler"
    assert dep["spec"]["template"]["metadata"]["annotations"]["checksum/config"]


def test_scheduler_rbac_is_the_standard_kube_scheduler_set_plus_its_lease() -> None:
    docs = render()
    sa = f"system:serviceaccount:{NAMESPACE}:gputopo-scheduler"
    bound = {
        b["roleRef"]["name"]
        for b in by_kind(docs, "ClusterRoleBinding")
        if any(f"system:serviceaccount:{s['namespace']}:{s['name']}" == sa for s in b["subjects"])
    }
    assert bound == {"system:kube-scheduler", "system:volume-scheduler"}
    reader = one(docs, "RoleBinding", name=f"gputopo-scheduler-{NAMESPACE}-authn-reader")
    assert reader["metadata"]["namespace"] == "kube-system"
    assert reader["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "extension-apiserver-authentication-reader",
    }
    role = one(docs, "Role", component="scheduler")
    named = [r for r in _rules(role) if r.get("resourceNames")]
    assert named == [
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "resourceNames": ["gputopo-scheduler"],
            "verbs": ["get", "update"],
        }
    ]


# --- extender ----------------------------------------------------------------------------


def test_extender_deployment_is_hardened_and_probed_over_https() -> None:
    docs = render()
    dep = one(docs, "Deployment", component="extender")
    assert dep["spec"]["replicas"] == 2
    pod = _pod_spec(dep)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 65532
    c = container(dep)
    assert c["image"] == f"ghcr.io/gputopo/gputopo:{CHART_META['appVersion']}"
    assert c["command"] == ["gputopo-extender"]
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "https", "scheme": "HTTPS"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "https", "scheme": "HTTPS"}
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
    env = env_of(c)
    assert env["GPUTOPO_PORT"] == "8888"
    assert env["GPUTOPO_TLS_CERT_FILE"] == "/etc/gputopo/tls/tls.crt"
    assert env["GPUTOPO_TLS_KEY_FILE"] == "/etc/gputopo/tls/tls.key"
    assert env["GPUTOPO_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    pdb = one(docs, "PodDisruptionBudget", component="extender")
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    svc = one(docs, "Service", component="extender")
    assert svc["metadata"]["name"] == "gputopo-extender"
    assert svc["spec"]["ports"] == [{"name": "https", "port": 8888, "targetPort": "https", "protocol": "TCP"}]
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]


def test_extender_cluster_role_reads_nodes_and_pods_and_writes_only_bindings_and_events() -> None:
    role = one(render(), "ClusterRole", component="extender")
    assert _verbs_on(role, "", "nodes") == {"get", "list", "watch"}
    assert not _verbs_on(role, "", "nodes") & WRITE_VERBS
    assert not _verbs_on(role, "", "nodes/status")
    # The Binding carries the placement annotation: no Pod write other than pods/binding.
    assert _verbs_on(role, "", "pods") == {"get", "list", "watch"}
    assert _verbs_on(role, "", "pods/binding") == {"create"}
    assert _verbs_on(role, "", "events") == {"create"}
    assert not _verbs_on(role, "events.k8s.io", "events")
    extender_role = one(render(), "Role", component="extender")
    assert _verbs_on(extender_role, "coordination.k8s.io", "leases") == {"get", "list", "watch"}


def test_no_rule_anywhere_uses_wildcards() -> None:
    for d in render(["webhook-values.yaml"]):
        for rule in d.get("rules", []) if d["kind"] in {"Role", "ClusterRole"} else []:
            for key in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule.get(key, []), (d["metadata"]["name"], rule)


@pytest.mark.parametrize(
    ("sets", "expected_env"),
    [
        pytest.param({}, None, id="default tiers: no GPUTOPO_TIERS"),
    ],
)
def test_default_tiers_pass_no_tier_setting(sets: dict[str, str], expected_env: str | None) -> None:
    env = env_of(container(one(render(**sets), "Deployment", component="extender")))
    assert env.get("GPUTOPO_TIERS") == expected_env
    assert "GPUTOPO_SCORE_WEIGHTS" not in env


def test_custom_tiers_and_score_weights_reach_the_extender_as_valid_settings() -> None:
    docs = render(["custom-tiers-values.yaml"])
    env = env_of(container(one(docs, "Deployment", component="extender")))
    tiers = TierConfig.model_validate_json(env["GPUTOPO_TIERS"])
    assert tiers.names == ("pod", "rack", "nvlink-domain")
    assert tiers != DEFAULT_TIERS
    assert tiers.switch_of({"example.com/rack": "r7"}, "rack") == "r7"
    weights = ScoreWeights.model_validate_json(env["GPUTOPO_SCORE_WEIGHTS"])
    assert weights.clique == 4.0
    assert weights.pack == 1.0
    ds = one(docs, "DaemonSet", component="agent")
    terms = _pod_spec(ds)["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"][0]["matchExpressions"][0]["key"] == "example.com/accelerator"


@pytest.mark.parametrize("values_file", ci_values_files(), ids=lambda p: p.name)
def test_every_gputopo_setting_the_chart_passes_is_documented(values_file: Path) -> None:
    documented = _documented_env() | PENDING_DOCUMENTATION
    for d in render([values_file]):
        if d["kind"] not in {"Deployment", "DaemonSet"}:
            continue
        for c in _pod_spec(d)["containers"]:
            for name in env_of(c):
                if name.startswith("GPUTOPO_") or name == "NODE_NAME":
                    assert name in documented, f"{d['metadata']['name']}: {name} is not in docs/configuration.md"


# --- agent -------------------------------------------------------------------------------


def test_agent_daemonset_runs_on_gpu_nodes_unprivileged_by_default() -> None:
    ds = one(render(), "DaemonSet", component="agent")
    pod = _pod_spec(ds)
    assert pod["priorityClassName"] == "system-node-critical"
    assert {"key": "nvidia.com/gpu", "operator": "Exists"} in pod["tolerations"]
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    keys = {e["key"] for t in terms for e in t["matchExpressions"]}
    assert keys == {"nvidia.com/gpu.present", "feature.node.kubernetes.io/pci-10de.present"}
    c = container(ds)
    assert c["command"] == ["gputopo-agent"]
    sc = c["securityContext"]
    assert sc["privileged"] is False
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["readOnlyRootFilesystem"] is True
    assert not pod.get("hostNetwork") and not pod.get("hostPID")
    env = env_of(c)
    assert env["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    assert env["GPUTOPO_PODRESOURCES_SOCKET"] == "/var/lib/kubelet/pod-resources/kubelet.sock"
    assert env["GPUTOPO_SYSFS_ROOT"] == "/host/sys"
    assert env["GPUTOPO_METRICS_PORT"] == "9401"
    assert {"name": "metrics", "containerPort": 9401, "protocol": "TCP"} in c["ports"]
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts["pod-resources"] == {
        "name": "pod-resources",
        "mountPath": "/var/lib/kubelet/pod-resources",
        "readOnly": True,
    }
    assert volumes["pod-resources"]["hostPath"] == {"path": "/var/lib/kubelet/pod-resources", "type": "Directory"}
    assert mounts["sysfs"]["readOnly"] is True
    assert volumes["sysfs"]["hostPath"]["path"] == "/sys"
    assert env["GPUTOPO_DEVICE_PLUGIN"] == "true"
    assert env["GPUTOPO_DEVICE_PLUGIN_DIR"] == "/var/lib/kubelet/device-plugins"
    assert env["GPUTOPO_RESOURCE_NAME"] == "nvidia.com/gpu"
    assert env["GPUTOPO_DEVICE_LIST_STRATEGY"] == "envvar"
    assert env["GPUTOPO_PREFERRED_ALLOCATION"] == "placement"
    assert volumes["device-plugins"]["hostPath"] == {"path": "/var/lib/kubelet/device-plugins", "type": "Directory"}
    # The device-plugin directory is the one host path the agent may write (its gRPC socket).
    for m in c["volumeMounts"]:
        if "hostPath" in volumes[m["name"]] and m["name"] != "device-plugins":
            assert m["readOnly"] is True, m["name"]


@pytest.mark.parametrize(
    ("sets", "env_value", "mounted"),
    [
        ({}, "true", True),
        ({"agent__devicePlugin__enabled": "false"}, "false", False),
    ],
    ids=["plugin-on-by-default", "plugin-off-mounts-no-writable-host-path"],
)
def test_agent_device_plugin_is_on_by_default_and_its_dir_is_mounted_only_when_on(
    sets: dict[str, str], env_value: str, mounted: bool
) -> None:
    ds = one(render(**sets), "DaemonSet", component="agent")
    c = container(ds)
    env = env_of(c)
    assert env["GPUTOPO_DEVICE_PLUGIN"] == env_value
    assert ("GPUTOPO_DEVICE_PLUGIN_DIR" in env) is mounted
    assert ("device-plugins" in {m["name"] for m in c["volumeMounts"]}) is mounted
    assert ("device-plugins" in {v["name"] for v in _pod_spec(ds)["volumes"]}) is mounted
    writable_host = [
        m["name"]
        for m in c["volumeMounts"]
        if not m.get("readOnly") and "hostPath" in {v["name"]: v for v in _pod_spec(ds)["volumes"]}[m["name"]]
    ]
    assert writable_host == (["device-plugins"] if mounted else [])


@pytest.mark.parametrize(
    ("value", "accepted"),
    [("cdi-cri", True), ("cdi-annotations", True), ("volume-mounts", False), ("", False)],
)
def test_agent_device_list_strategy_is_checked_by_the_schema(value: str, accepted: bool) -> None:
    if accepted:
        env = env_of(
            container(one(render(agent__devicePlugin__deviceListStrategy=value), "DaemonSet", component="agent"))
        )
        assert env["GPUTOPO_DEVICE_LIST_STRATEGY"] == value
    else:
        assert "deviceListStrategy" in render_fails(agent__devicePlugin__deviceListStrategy=value)


def test_agent_is_privileged_only_when_values_ask() -> None:
    sc = container(one(render(agent__privileged="true"), "DaemonSet", component="agent"))["securityContext"]
    assert sc["privileged"] is True


def test_agent_rbac_patches_nodes_reads_pods_and_writes_leases_only() -> None:
    docs = render()
    cluster_role = one(docs, "ClusterRole", component="agent")
    assert _rules(cluster_role) == [
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
    ]
    role = one(docs, "Role", component="agent")
    assert role["metadata"]["namespace"] == NAMESPACE
    assert _rules(role) == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "create", "update", "patch"]}
    ]


def test_agent_admission_policy_binds_node_changes_to_the_token_node() -> None:
    docs = render()
    policy = one(docs, "ValidatingAdmissionPolicy")
    assert policy["apiVersion"] == "admissionregistration.k8s.io/v1"
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"
    [cond] = spec["matchConditions"]
    assert f"'system:serviceaccount:{NAMESPACE}:gputopo-agent'" in cond["expression"]
    rules = {r["resources"][0]: r for r in spec["matchConstraints"]["resourceRules"]}
    assert rules["nodes"]["operations"] == ["UPDATE"]
    assert set(rules["leases"]["operations"]) == {"CREATE", "UPDATE"}
    text = json.dumps(spec)
    assert "request.userInfo.extra['authentication.kubernetes.io/node-name']" in text
    assert "oldObject.metadata.annotations" in text
    assert "oldObject.metadata.labels" in text
    assert "object.spec == oldObject.spec" in text
    assert "'gputopo-agent-' + variables.nodeNames[0]" in text
    binding = one(docs, "ValidatingAdmissionPolicyBinding")
    assert binding["apiVersion"] == "admissionregistration.k8s.io/v1"
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}


# --- TLS ---------------------------------------------------------------------------------


def _b64(s: str) -> str:
    return base64.b64decode(s).decode()


def test_generated_secret_holds_a_ca_and_a_serving_certificate_for_the_service(tmp_path: Path) -> None:
    docs = render()
    secret = one(docs, "Secret")
    assert secret["metadata"]["name"] == "gputopo-extender-tls"
    assert secret["type"] == "kubernetes.io/tls"
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    data = {k: _b64(v) for k, v in secret["data"].items()}
    assert set(data) == {"ca.crt", "tls.crt", "tls.key"}
    assert data["ca.crt"].startswith("-----BEGIN CERTIFICATE-----")
    assert data["tls.crt"].startswith("-----BEGIN CERTIFICATE-----")
    assert "PRIVATE KEY-----" in data["tls.key"]
    openssl = shutil.which("openssl")
    if openssl is None:
        return
    (tmp_path / "ca.crt").write_text(data["ca.crt"])
    (tmp_path / "tls.crt").write_text(data["tls.crt"])
    verify = subprocess.run(
        [openssl, "verify", "-CAfile", str(tmp_path / "ca.crt"), str(tmp_path / "tls.crt")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert verify.returncode == 0, verify.stderr
    text = subprocess.run(
        [openssl, "x509", "-noout", "-text", "-in", str(tmp_path / "tls.crt")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for name in (
        "gputopo-extender",
        f"gputopo-extender.{NAMESPACE}.svc",
        f"gputopo-extender.{NAMESPACE}.svc.cluster.local",
    ):
        assert f"DNS:{name}" in text


def test_secret_is_generated_once_and_kept_across_upgrades() -> None:
    tpl = (CHART / "templates" / "_helpers.tpl").read_text()
    assert 'lookup "v1" "Secret" .Release.Namespace' in tpl
    assert "genCA" in tpl and "genSignedCert" in tpl


def test_webhook_ca_bundle_is_the_generated_ca() -> None:
    docs = render(["webhook-values.yaml"])
    secret = one(docs, "Secret")
    [hook] = one(docs, "MutatingWebhookConfiguration")["webhooks"]
    assert hook["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]


def test_cert_manager_issues_the_secret_the_pods_mount() -> None:
    docs = render(["cert-manager-values.yaml"])
    certs = {c["metadata"]["name"]: c for c in by_kind(docs, "Certificate")}
    serving = certs["gputopo-extender"]
    assert serving["apiVersion"] == "cert-manager.io/v1"
    assert serving["spec"]["secretName"] == "gputopo-extender-tls"
    assert f"gputopo-extender.{NAMESPACE}.svc" in serving["spec"]["dnsNames"]
    assert serving["spec"]["issuerRef"]["name"] == "gputopo-ca"
    assert certs["gputopo-ca"]["spec"]["isCA"] is True
    issuers = {i["metadata"]["name"]: i["spec"] for i in by_kind(docs, "Issuer")}
    assert issuers == {"gputopo-selfsigned": {"selfSigned": {}}, "gputopo-ca": {"ca": {"secretName": "gputopo-ca"}}}
    for component in ("extender", "scheduler"):
        vols = _pod_spec(one(docs, "Deployment", component=component))["volumes"]
        assert any(v.get("secret", {}).get("secretName") == "gputopo-extender-tls" for v in vols), component
    webhook = one(docs, "MutatingWebhookConfiguration")
    assert webhook["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == f"{NAMESPACE}/gputopo-extender"
    assert "caBundle" not in webhook["webhooks"][0]["clientConfig"]


def test_cert_manager_with_an_existing_issuer_creates_no_issuers() -> None:
    docs = render(
        ["cert-manager-values.yaml"],
        certManager__issuerRef__name="corp-ca",
        certManager__issuerRef__kind="ClusterIssuer",
    )
    assert not by_kind(docs, "Issuer")
    [cert] = by_kind(docs, "Certificate")
    assert cert["spec"]["issuerRef"] == {"name": "corp-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}


# --- webhook -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values_files", "present"),
    [
        pytest.param([], False, id="off by default"),
        pytest.param(["webhook-values.yaml"], True, id="on"),
    ],
)
def test_mutating_webhook_is_optional(values_files: list[str], present: bool) -> None:
    assert bool(by_kind(render(values_files), "MutatingWebhookConfiguration")) is present


def test_webhook_targets_the_extender_mutate_path_for_annotated_pods_only() -> None:
    [hook] = one(render(["webhook-values.yaml"]), "MutatingWebhookConfiguration")["webhooks"]
    svc = hook["clientConfig"]["service"]
    assert svc == {"name": "gputopo-extender", "namespace": NAMESPACE, "path": "/mutate", "port": 8888}
    assert hook["admissionReviewVersions"] == ["v1"]
    assert hook["sideEffects"] == "None"
    assert hook["failurePolicy"] == "Ignore"
    assert hook["rules"] == [
        {
            "apiGroups": [""],
            "apiVersions": ["v1"],
            "operations": ["CREATE"],
            "resources": ["pods"],
            "scope": "Namespaced",
        }
    ]
    conditions = {c["name"]: c["expression"] for c in hook["matchConditions"]}
    assert "startsWith('gputopo.io/')" in conditions["has-gputopo-annotation"]
    assert "'default-scheduler'" in conditions["no-explicit-scheduler"]
    exprs: list[dict[str, Any]] = hook["namespaceSelector"]["matchExpressions"]
    assert {"key": "gputopo.io/opt-out", "operator": "DoesNotExist"} in exprs
    assert {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": [NAMESPACE, "kube-system"]} in exprs


# --- helm test ---------------------------------------------------------------------------


def test_helm_test_pod_curls_healthz_over_https_with_the_ca() -> None:
    pod = one(render(), "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    [c] = pod["spec"]["containers"]
    assert f"{EXTENDER_URL}/healthz" in c["command"]
    assert c["command"][c["command"].index("--cacert") + 1] == "/etc/gputopo/ca/ca.crt"
    assert pod["spec"]["volumes"][0]["secret"]["secretName"] == "gputopo-extender-tls"


# --- image -------------------------------------------------------------------------------


def test_dockerfile_builds_one_non_root_image_on_python_slim() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert dockerfile.count("\nFROM ") + dockerfile.startswith("FROM ") >= 2
    assert "ARG PYTHON_IMAGE=python:3.11-slim" in dockerfile
    assert "USER 65532:65532" in dockerfile
    assert (ROOT / ".dockerignore").is_file()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["image"]["repository"] == "ghcr.io/gputopo/gputopo"
    assert values["image"]["tag"] == ""
