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

from gputopo.engine.state.scoring import ScoreWeights
from gputopo.model import AGENT_LEASE_PREFIX, GPU_RESOURCE, SCHEDULER_NAME
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
EXTENDER_URL = "http://127.0.0.1:8888"
WEBHOOK_HOST = f"gputopo-webhook.{NAMESPACE}.svc"
SCHEDULER_USER = f"system:serviceaccount:{NAMESPACE}:gputopo-scheduler"
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


# (kind, name) of what the defaults render: no webhook, so no Service and no TLS material at all.
BASE_OBJECTS = {
    ("ServiceAccount", "gputopo-agent"),
    ("ServiceAccount", "gputopo-scheduler"),
    ("ClusterRole", "gputopo-agent"),
    ("ClusterRole", "gputopo-extender"),
    ("ClusterRoleBinding", "gputopo-agent"),
    ("ClusterRoleBinding", "gputopo-extender"),
    ("ClusterRoleBinding", "gputopo-scheduler-kube-scheduler"),
    ("ClusterRoleBinding", "gputopo-scheduler-volume-scheduler"),
    ("Role", "gputopo-agent"),
    ("Role", "gputopo-extender"),
    ("Role", "gputopo-scheduler"),
    ("RoleBinding", "gputopo-agent"),
    ("RoleBinding", "gputopo-extender"),
    ("RoleBinding", "gputopo-scheduler"),
    ("RoleBinding", f"gputopo-scheduler-{NAMESPACE}-authn-reader"),
    ("ConfigMap", "gputopo-scheduler"),
    ("DaemonSet", "gputopo-agent"),
    ("Deployment", "gputopo-scheduler"),
    ("PodDisruptionBudget", "gputopo-scheduler"),
    ("ValidatingAdmissionPolicy", "gputopo-agent"),
    ("ValidatingAdmissionPolicyBinding", "gputopo-agent"),
    ("ValidatingAdmissionPolicy", "gputopo-placement"),
    ("ValidatingAdmissionPolicyBinding", "gputopo-placement"),
    ("ValidatingAdmissionPolicy", "gputopo-gate"),
    ("ValidatingAdmissionPolicyBinding", "gputopo-gate"),
    ("NetworkPolicy", "gputopo-scheduler"),
    ("NetworkPolicy", "gputopo-agent"),
}
# The helm test hook: without the webhook it lists the scheduler pods, with its own account.
TEST_HOOK = {
    ("Pod", "gputopo-test-connection"),
    ("ServiceAccount", "gputopo-test"),
    ("Role", "gputopo-test"),
    ("RoleBinding", "gputopo-test"),
}
WEBHOOK = {
    ("MutatingWebhookConfiguration", "gputopo-webhook"),
    ("Service", "gputopo-webhook"),
    ("Pod", "gputopo-test-connection"),
}
AGENT = {(k, "gputopo-agent") for k in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")}
AGENT |= {(k, "gputopo-agent") for k in ("DaemonSet", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")}
AGENT |= {("NetworkPolicy", "gputopo-agent")}
# The post-delete hook that deletes the Leases written at run time, with its own account (on by default).
CLEANUP_HOOK = {(k, "gputopo-cleanup") for k in ("Job", "ServiceAccount", "Role", "RoleBinding")}
BASE_OBJECTS |= CLEANUP_HOOK


@pytest.mark.parametrize(
    ("values_files", "sets", "expected"),
    [
        pytest.param([], {}, BASE_OBJECTS | TEST_HOOK, id="defaults: no webhook, no Service, no TLS"),
        pytest.param(
            ["webhook-values.yaml"],
            {},
            BASE_OBJECTS | WEBHOOK | {("Secret", "gputopo-webhook-tls")},
            id="webhook on: its Service and a generated Secret",
        ),
        pytest.param(
            ["cert-manager-values.yaml"],
            {},
            BASE_OBJECTS
            | WEBHOOK
            | {
                ("Certificate", "gputopo-webhook"),
                ("Certificate", "gputopo-ca"),
                ("Issuer", "gputopo-selfsigned"),
                ("Issuer", "gputopo-ca"),
            },
            id="cert-manager on: no generated Secret",
        ),
        pytest.param(
            ["webhook-values.yaml"],
            {"tls__existingSecret": "site-tls", "tls__caBundle": "Q0E="},
            BASE_OBJECTS | WEBHOOK,
            id="existing Secret: nothing generated",
        ),
        pytest.param([], {"agent__enabled": "false"}, (BASE_OBJECTS | TEST_HOOK) - AGENT, id="agent off"),
        pytest.param(
            [],
            {
                "scheduler__placementPolicy__enabled": "false",
                "scheduler__gatePolicy__enabled": "false",
                "scheduler__podDisruptionBudget__enabled": "false",
            },
            (BASE_OBJECTS | TEST_HOOK)
            - {
                ("ValidatingAdmissionPolicy", "gputopo-placement"),
                ("ValidatingAdmissionPolicyBinding", "gputopo-placement"),
                ("ValidatingAdmissionPolicy", "gputopo-gate"),
                ("ValidatingAdmissionPolicyBinding", "gputopo-gate"),
                ("PodDisruptionBudget", "gputopo-scheduler"),
            },
            id="placement and gate policies and PDB off",
        ),
        pytest.param([], {"cleanup__enabled": "false"}, (BASE_OBJECTS | TEST_HOOK) - CLEANUP_HOOK, id="cleanup off"),
    ],
)
def test_rendered_objects(values_files: list[str], sets: dict[str, str], expected: set[tuple[str, str]]) -> None:
    assert {(d["kind"], d["metadata"]["name"]) for d in render(values_files, **sets)} == expected


def test_nothing_of_the_old_extender_deployment_remains() -> None:
    docs = render(["webhook-values.yaml"])
    assert [d["metadata"]["name"] for d in by_kind(docs, "Deployment")] == ["gputopo-scheduler"]
    assert not [d for d in by_kind(docs, "ServiceAccount") if "extender" in d["metadata"]["name"]]


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
    assert set(ext) == EXTENDER_KEYS | {"preemptVerb"}
    assert ext == {
        "urlPrefix": EXTENDER_URL,
        "filterVerb": "filter",
        "prioritizeVerb": "prioritize",
        "bindVerb": "bind",
        # Clique-aware preemption is safe on every release: no-clique nodes are unresolvable.
        "preemptVerb": "preempt",
        "weight": 200,
        "nodeCacheCapable": True,
        "httpTimeout": "5s",
        "ignorable": False,
        "managedResources": [],  # every pod of the profile: members without GPUs too
    }
    assert cfg["profiles"] == [{"schedulerName": SCHEDULER_NAME}]
    assert cfg["percentageOfNodesToScore"] == 100
    assert cfg["leaderElection"] == {
        "leaderElect": True,
        "resourceLock": "leases",
        "resourceName": "gputopo-scheduler",
        "resourceNamespace": NAMESPACE,
    }


def test_scheduler_config_options_come_from_values() -> None:
    cfg = scheduler_config(
        render(["custom-tiers-values.yaml"], scheduler__extender__preemptVerb="", scheduler__replicas="2")
    )
    [ext] = cfg["extenders"]
    assert set(ext) == EXTENDER_KEYS, "an empty preemptVerb leaves preemption to kube-scheduler alone"
    assert ext["weight"] == 10
    assert ext["httpTimeout"] == "10s"


def test_scheduler_pod_runs_upstream_kube_scheduler_and_the_extender_sidecar() -> None:
    dep = one(render(), "Deployment", component="scheduler")
    assert dep["spec"]["replicas"] == 2
    pod = _pod_spec(dep)
    assert [c["name"] for c in pod["containers"]] == ["kube-scheduler", "extender"]
    assert pod["serviceAccountName"] == "gputopo-scheduler"
    assert pod["securityContext"]["runAsNonRoot"] is True
    c = container(dep, "kube-scheduler")
    assert c["image"] == "registry.k8s.io/kube-scheduler:v1.34.4"
    assert "--config=/etc/gputopo-scheduler/config.yaml" in c["command"]
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert set(mounts) == {"/etc/gputopo-scheduler"}, "no CA: the extender is on loopback"
    assert volumes[mounts["/etc/gputopo-scheduler"]["name"]]["configMap"]["name"] == "gputopo-scheduler"
    assert dep["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
    spread = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
    assert spread["podAffinityTerm"]["labelSelector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]


def test_scheduler_pods_have_a_disruption_budget() -> None:
    docs = render()
    dep = one(docs, "Deployment", component="scheduler")
    pdb = one(docs, "PodDisruptionBudget", component="scheduler")
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]


def test_scheduler_rbac_is_the_standard_kube_scheduler_set_plus_its_lease_and_the_extenders_rules() -> None:
    docs = render()
    sa = f"system:serviceaccount:{NAMESPACE}:gputopo-scheduler"
    bound = {
        b["roleRef"]["name"]
        for b in by_kind(docs, "ClusterRoleBinding")
        if any(f"system:serviceaccount:{s['namespace']}:{s['name']}" == sa for s in b["subjects"])
    }
    assert bound == {"system:kube-scheduler", "system:volume-scheduler", "gputopo-extender"}
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


def test_extender_sidecar_is_hardened_serves_verbs_on_loopback_and_is_probed_on_metrics() -> None:
    dep = one(render(), "Deployment", component="scheduler")
    c = container(dep, "extender")
    assert c["image"] == f"ghcr.io/gputopo/gputopo:{CHART_META['appVersion']}"
    assert c["command"] == ["gputopo-extender"]
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert c["ports"] == [{"name": "metrics", "containerPort": 9402, "protocol": "TCP"}]
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
    env = env_of(c)
    assert env["GPUTOPO_HOST"] == "127.0.0.1"
    assert env["GPUTOPO_PORT"] == "8888"
    assert env["GPUTOPO_METRICS_PORT"] == "9402"
    assert env["GPUTOPO_MAX_REQUEST_BYTES"] == "8388608"
    assert env["GPUTOPO_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert not {"GPUTOPO_WEBHOOK_PORT", "GPUTOPO_TLS_CERT_FILE", "GPUTOPO_TLS_KEY_FILE"} & set(env)
    assert [m["mountPath"] for m in c["volumeMounts"]] == ["/tmp"]


@pytest.mark.parametrize(
    ("sets", "env_name", "expected"),
    [
        pytest.param({"extender__maxRequestBytes": "1048576"}, "GPUTOPO_MAX_REQUEST_BYTES", "1048576", id="body limit"),
        pytest.param({"extender__metricsPort": "9500"}, "GPUTOPO_METRICS_PORT", "9500", id="metrics port"),
        pytest.param({"extender__port": "9999"}, "GPUTOPO_PORT", "9999", id="verbs port"),
    ],
)
def test_extender_settings_come_from_values(sets: dict[str, str], env_name: str, expected: str) -> None:
    docs = render(**sets)
    assert env_of(container(one(docs, "Deployment", component="scheduler"), "extender"))[env_name] == expected
    if env_name == "GPUTOPO_PORT":
        assert scheduler_config(docs)["extenders"][0]["urlPrefix"] == "http://127.0.0.1:9999"


def test_the_webhook_turns_on_the_tls_listener_and_its_service() -> None:
    docs = render(["webhook-values.yaml"])
    dep = one(docs, "Deployment", component="scheduler")
    c = container(dep, "extender")
    env = env_of(c)
    assert env["GPUTOPO_WEBHOOK_PORT"] == "8443"
    assert env["GPUTOPO_TLS_CERT_FILE"] == "/etc/gputopo/tls/tls.crt"
    assert env["GPUTOPO_TLS_KEY_FILE"] == "/etc/gputopo/tls/tls.key"
    assert {"name": "webhook", "containerPort": 8443, "protocol": "TCP"} in c["ports"]
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in _pod_spec(dep)["volumes"]}
    assert volumes[mounts["/etc/gputopo/tls"]]["secret"]["secretName"] == "gputopo-webhook-tls"
    svc = one(docs, "Service", component="webhook")
    assert svc["metadata"]["name"] == "gputopo-webhook"
    assert svc["spec"]["ports"] == [{"name": "webhook", "port": 443, "targetPort": "webhook", "protocol": "TCP"}]
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]


def test_extender_cluster_role_reads_nodes_and_pods_and_writes_only_bindings_events_and_gate_lifts() -> None:
    docs = render()
    role = one(docs, "ClusterRole", component="extender")
    assert _verbs_on(role, "", "nodes") == {"get", "list", "watch"}
    assert not _verbs_on(role, "", "nodes") & WRITE_VERBS
    assert not _verbs_on(role, "", "nodes/status")
    # The Binding carries the placement annotation; the one Pod patch lifts gputopo's scheduling gate, and the
    # gate policy (below) refuses any other.
    assert _verbs_on(role, "", "pods") == {"get", "list", "watch", "patch"}
    assert _verbs_on(role, "", "pods/binding") == {"create"}
    assert _verbs_on(role, "", "events") == {"create"}
    assert not _verbs_on(role, "events.k8s.io", "events")
    extender_role = one(docs, "Role", component="extender")
    assert _verbs_on(extender_role, "coordination.k8s.io", "leases") == {"get", "list", "watch"}
    # A pod has one service account: the extender's rules are bound to the scheduler pod's.
    for kind in ("ClusterRoleBinding", "RoleBinding"):
        binding = one(docs, kind, component="extender")
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "gputopo-scheduler", "namespace": NAMESPACE}]


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
    env = env_of(container(one(render(**sets), "Deployment", component="scheduler"), "extender"))
    assert env.get("GPUTOPO_TIERS") == expected_env
    assert "GPUTOPO_SCORE_WEIGHTS" not in env


def test_custom_tiers_and_score_weights_reach_the_extender_as_valid_settings() -> None:
    docs = render(["custom-tiers-values.yaml"])
    env = env_of(container(one(docs, "Deployment", component="scheduler"), "extender"))
    tiers = TierConfig.model_validate_json(env["GPUTOPO_TIERS"])
    assert tiers.names == ("pod", "rack", "nvlink-domain")
    assert tiers != DEFAULT_TIERS
    assert tiers.switch_of({"example.com/rack": "r7"}, "rack") == "r7"
    assert [t.oversubscription for t in tiers.tiers] == [2.0, 1.0, 1.0]
    assert env["GPUTOPO_MAX_REQUEST_BYTES"] == "16777216", "a whole number, not 1.6777216e+07"
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
    assert {"key": GPU_RESOURCE, "operator": "Exists"} in pod["tolerations"]
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
    assert env["GPUTOPO_RESOURCE_NAME"] == GPU_RESOURCE
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
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "verbs": ["get", "create", "update", "patch", "delete"],
        }
    ]


def test_agent_admission_policy_binds_node_changes_to_the_token_node() -> None:
    docs = render()
    policy = one(docs, "ValidatingAdmissionPolicy", component="agent")
    assert policy["apiVersion"] == "admissionregistration.k8s.io/v1"
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"
    [cond] = spec["matchConditions"]
    assert f"'system:serviceaccount:{NAMESPACE}:gputopo-agent'" in cond["expression"]
    rules = {r["resources"][0]: r for r in spec["matchConstraints"]["resourceRules"]}
    assert rules["nodes"]["operations"] == ["UPDATE"]
    assert set(rules["leases"]["operations"]) == {"CREATE", "UPDATE", "DELETE"}  # DELETE: when it stops
    text = json.dumps(spec)
    assert "request.userInfo.extra['authentication.kubernetes.io/node-name']" in text
    assert "oldObject.metadata.annotations" in text
    assert "oldObject.metadata.labels" in text
    assert "object.spec == oldObject.spec" in text
    assert f"variables.leaseName == '{AGENT_LEASE_PREFIX}' + variables.nodeNames[0]" in text
    # A DELETE carries no object: the Lease's name comes from the one it removes.
    assert "request.operation == 'DELETE' ? oldObject.metadata.name : object.metadata.name" in text
    binding = one(docs, "ValidatingAdmissionPolicyBinding", component="agent")
    assert binding["apiVersion"] == "admissionregistration.k8s.io/v1"
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}


# --- placement policy ----------------------------------------------------------------------


def test_placement_policy_matches_pod_writes_and_bindings_except_the_scheduler() -> None:
    docs = render()
    policy = one(docs, "ValidatingAdmissionPolicy", component="placement")
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"
    rules = [(tuple(r["resources"]), tuple(r["operations"])) for r in spec["matchConstraints"]["resourceRules"]]
    # A Binding is admitted as resource pods, subresource binding, operation CREATE, object kind Binding.
    assert rules == [(("pods", "pods/status"), ("CREATE", "UPDATE")), (("pods/binding",), ("CREATE",))]
    assert all(r["apiGroups"] == [""] and r["apiVersions"] == ["v1"] for r in spec["matchConstraints"]["resourceRules"])
    [cond] = spec["matchConditions"]
    assert cond["expression"] == f"request.userInfo.username != '{SCHEDULER_USER}'"
    messages = [v["message"] for v in spec["validations"]]
    assert messages == [
        f"only the gputopo scheduler ({SCHEDULER_USER}) may set the gputopo.io/placement annotation",
        f"only the gputopo scheduler ({SCHEDULER_USER}) may add, change or remove the gputopo.io/placement annotation",
    ]
    assert {v["reason"] for v in spec["validations"]} == {"Forbidden"}
    binding = one(docs, "ValidatingAdmissionPolicyBinding", component="placement")
    assert binding["spec"] == {"policyName": "gputopo-placement", "validationActions": ["Deny"]}


def _placement(present: bool, value: str = "a") -> Doc:
    return {"metadata": {"annotations": {"gputopo.io/placement": value, "x": "y"} if present else {"x": "y"}}}


def _admitted(operation: str, obj: Doc, old: Doc | None) -> bool:
    """The policy's verdict, with its CEL read as Python: the variables, then every validation.

    A stand-in until the local stack proves the policy on a real kube-apiserver; it pins the logic the
    expressions encode (each one is matched textually first, so a changed expression fails here)."""
    spec = one(render(), "ValidatingAdmissionPolicy", component="placement")["spec"]
    variables = {v["name"]: " ".join(v["expression"].split()) for v in spec["variables"]}
    assert variables == {
        "hasNew": "has(object.metadata.annotations) && 'gputopo.io/placement' in object.metadata.annotations",
        "hasOld": "oldObject != null && has(oldObject.metadata.annotations)"
        " && 'gputopo.io/placement' in oldObject.metadata.annotations",
    }
    key = "gputopo.io/placement"
    has_new = key in obj["metadata"].get("annotations", {})
    has_old = old is not None and key in old["metadata"].get("annotations", {})
    expressions = [" ".join(v["expression"].split()) for v in spec["validations"]]
    assert expressions == [
        "request.operation != 'CREATE' || !variables.hasNew",
        "request.operation != 'UPDATE' || (variables.hasNew == variables.hasOld && (!variables.hasNew"
        " || object.metadata.annotations['gputopo.io/placement'] =="
        " oldObject.metadata.annotations['gputopo.io/placement']))",
    ]
    create_ok = operation != "CREATE" or not has_new
    update_ok = operation != "UPDATE" or (
        has_new == has_old
        and (not has_new or old is None or obj["metadata"]["annotations"][key] == old["metadata"]["annotations"][key])
    )
    return create_ok and update_ok


@pytest.mark.parametrize(
    ("operation", "obj", "old", "admitted"),
    [
        pytest.param("CREATE", _placement(True), None, False, id="create a pod or Binding carrying it"),
        pytest.param("CREATE", _placement(False), None, True, id="create without it"),
        pytest.param("UPDATE", _placement(True), _placement(False), False, id="add it"),
        pytest.param("UPDATE", _placement(True, "b"), _placement(True, "a"), False, id="change it"),
        pytest.param("UPDATE", _placement(False), _placement(True), False, id="remove it"),
        pytest.param("UPDATE", _placement(True), _placement(True), True, id="other changes keep it"),
        pytest.param("UPDATE", _placement(False), _placement(False), True, id="pods that never had it"),
    ],
)
def test_placement_policy_refuses_every_change_of_the_annotation(
    operation: str, obj: Doc, old: Doc | None, admitted: bool
) -> None:
    assert _admitted(operation, obj, old) is admitted


def test_placement_policy_trusts_the_service_account_the_scheduler_pod_runs_as() -> None:
    docs = render(scheduler__serviceAccount__name="gputopo-sched")
    pod = _pod_spec(one(docs, "Deployment", component="scheduler"))
    [cond] = one(docs, "ValidatingAdmissionPolicy", component="placement")["spec"]["matchConditions"]
    assert f":{pod['serviceAccountName']}'" in cond["expression"]


# --- TLS ---------------------------------------------------------------------------------


def _b64(s: str) -> str:
    return base64.b64decode(s).decode()


def test_generated_secret_holds_a_ca_and_a_serving_certificate_for_the_webhook(tmp_path: Path) -> None:
    docs = render(["webhook-values.yaml"])
    secret = one(docs, "Secret")
    assert secret["metadata"]["name"] == "gputopo-webhook-tls"
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
        "gputopo-webhook",
        WEBHOOK_HOST,
        f"{WEBHOOK_HOST}.cluster.local",
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
    serving = certs["gputopo-webhook"]
    assert serving["apiVersion"] == "cert-manager.io/v1"
    assert serving["spec"]["secretName"] == "gputopo-webhook-tls"
    assert WEBHOOK_HOST in serving["spec"]["dnsNames"]
    assert serving["spec"]["issuerRef"]["name"] == "gputopo-ca"
    assert certs["gputopo-ca"]["spec"]["isCA"] is True
    issuers = {i["metadata"]["name"]: i["spec"] for i in by_kind(docs, "Issuer")}
    assert issuers == {"gputopo-selfsigned": {"selfSigned": {}}, "gputopo-ca": {"ca": {"secretName": "gputopo-ca"}}}
    vols = _pod_spec(one(docs, "Deployment", component="scheduler"))["volumes"]
    assert any(v.get("secret", {}).get("secretName") == "gputopo-webhook-tls" for v in vols)
    webhook = one(docs, "MutatingWebhookConfiguration")
    assert webhook["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == f"{NAMESPACE}/gputopo-webhook"
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
    assert svc == {"name": "gputopo-webhook", "namespace": NAMESPACE, "path": "/mutate", "port": 443}
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


def test_helm_test_pod_curls_the_webhook_healthz_over_https_with_the_ca() -> None:
    pod = one(render(["webhook-values.yaml"]), "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["spec"]["automountServiceAccountToken"] is False
    [c] = pod["spec"]["containers"]
    assert f"https://{WEBHOOK_HOST}/healthz" in c["command"]
    assert c["command"][c["command"].index("--cacert") + 1] == "/etc/gputopo/ca/ca.crt"
    assert pod["spec"]["volumes"][0]["secret"]["secretName"] == "gputopo-webhook-tls"


def test_helm_test_pod_without_the_webhook_checks_each_scheduler_pods_metrics_healthz() -> None:
    docs = render()
    pod = one(docs, "Pod")
    [c] = pod["spec"]["containers"]
    script = c["command"][-1]
    assert "app.kubernetes.io/instance=gputopo,app.kubernetes.io/component=scheduler" in script
    assert f"/api/v1/namespaces/{NAMESPACE}/pods" in script
    assert '"http://$host:9402/healthz"' in script
    assert pod["spec"]["serviceAccountName"] == "gputopo-test"
    role = one(docs, "Role", name="gputopo-test")
    assert _rules(role) == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]
    for d in (role, one(docs, "RoleBinding", name="gputopo-test"), one(docs, "ServiceAccount", name="gputopo-test")):
        assert d["metadata"]["annotations"]["helm.sh/hook"] == "test"
        assert int(d["metadata"]["annotations"]["helm.sh/hook-weight"]) < 0, "before the test Pod"


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
