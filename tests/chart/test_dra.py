"""The chart's DRA mode (agent.dra.*): the agent as the DRA driver instead of the device plugin, the
DeviceClass, the RBAC each side needs, and the webhook's claims wired from the same values."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from gputopo.engine.dra.devices import DEVICE_CLASS, DRIVER
from gputopo.extender.settings import Settings
from tests.chart.helm import Doc, by_kind, container, env_of, one, render, render_fails, run_helm, template_args

DRA = {"agent__dra__enabled": "true"}
DRA_PATHS = {"/var/lib/kubelet/plugins", "/var/lib/kubelet/plugins_registry", "/var/run/cdi"}


def _rules_on(role: Doc, group: str, resource: str) -> set[str]:
    verbs: set[str] = set()
    for rule in role.get("rules", []):
        if group in rule["apiGroups"] and resource in rule["resources"]:
            verbs |= set(rule["verbs"])
    return verbs


def _writable_host_paths(ds: Doc) -> set[str]:
    spec = ds["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    return {
        volumes[m["name"]]["hostPath"]["path"]
        for m in container(ds)["volumeMounts"]
        if "hostPath" in volumes[m["name"]] and not m.get("readOnly")
    }


@pytest.mark.parametrize(
    ("sets", "args"),
    [
        pytest.param(DRA, ["--dra"], id="scalar partitions"),
        pytest.param(
            {**DRA, "agent__dra__listAttributes": "true", "agent__dra__deviceTaints": "true"},
            ["--dra", "--dra-list-attributes", "--dra-device-taints"],
            id="list attributes and device taints",
        ),
        pytest.param({**DRA, "agent__dra__bestFitOrder": "false"}, ["--dra"], id="best-fit order off: index order"),
    ],
)
def test_dra_agent_gets_its_flags_and_the_kubelet_dirs_instead_of_the_device_plugin(
    sets: dict[str, str], args: list[str]
) -> None:
    ds = one(render(**sets), "DaemonSet", component="agent")
    c = container(ds)
    assert c["args"] == args
    env = env_of(c)
    assert env["GPUTOPO_DEVICE_PLUGIN"] == "false"
    assert "GPUTOPO_DEVICE_PLUGIN_DIR" not in env
    assert _writable_host_paths(ds) == DRA_PATHS  # no device-plugins dir


def test_without_dra_the_agent_has_no_dra_flags_and_mounts() -> None:
    ds = one(render(), "DaemonSet", component="agent")
    assert "args" not in container(ds)
    assert _writable_host_paths(ds) == {"/var/lib/kubelet/device-plugins"}


def test_the_device_class_selects_our_driver_only_and_only_with_dra() -> None:
    assert not by_kind(render(), "DeviceClass")
    dc = one(render(**DRA), "DeviceClass")
    assert dc["apiVersion"] == "resource.k8s.io/v1"
    assert dc["metadata"]["name"] == DEVICE_CLASS
    expression = dc["spec"]["selectors"][0]["cel"]["expression"]
    assert expression.startswith(f'device.driver == "{DRIVER}" && ')  # and no block (tests/chart/test_dra_blocks.py)


# What a component is granted on a DRA kind without agent.dra.enabled (nothing elsewhere).
WITHOUT_DRA = {("extender", "resourceclaimtemplates"): {"get", "list", "watch"}}


@pytest.mark.parametrize(
    ("component", "resource", "verbs"),
    [
        ("agent", "resourceslices", {"create", "get", "list", "watch", "update", "delete"}),
        ("agent", "resourceclaims", {"get"}),
        ("agent", "resourceclaimtemplates", set()),
        ("extender", "resourceclaims", {"get", "list", "watch"}),
        ("extender", "resourceslices", {"get", "list", "watch"}),
        # create for the pods it sees, list and delete for the ones no pod names any more (the collector);
        # get, list and watch with or without DRA: which are ComputeDomains' IMEX channel templates
        ("extender", "resourceclaimtemplates", {"create", "get", "list", "watch", "delete"}),
    ],
)
def test_dra_rbac_is_what_each_side_uses(component: str, resource: str, verbs: set[str]) -> None:
    role = one(render(**DRA), "ClusterRole", component=component)
    assert _rules_on(role, "resource.k8s.io", resource) == verbs
    without = _rules_on(one(render(), "ClusterRole", component=component), "resource.k8s.io", resource)
    assert without == WITHOUT_DRA.get((component, resource), set())


def test_the_webhook_makes_claims_with_the_agents_encoding_and_sees_pods_under_our_scheduler() -> None:
    docs = render(["webhook-values.yaml"], **DRA, agent__dra__listAttributes="true")
    env = env_of(container(one(docs, "Deployment", component="scheduler"), "extender"))
    assert (env["GPUTOPO_DRA"], env["GPUTOPO_DRA_LIST_ATTRIBUTES"]) == ("true", "true")
    settings = Settings.model_validate(
        {"dra": env["GPUTOPO_DRA"], "dra_list_attributes": env["GPUTOPO_DRA_LIST_ATTRIBUTES"]}
    )
    assert settings.dra and settings.dra_list_attributes
    [hook] = one(docs, "MutatingWebhookConfiguration")["webhooks"]
    assert hook["sideEffects"] == "None"  # the webhook writes nothing: templates follow pods that exist
    conditions: dict[str, Any] = {c["name"]: c["expression"] for c in hook["matchConditions"]}
    assert "startsWith('gputopo.io/')" in conditions["gputopo-pod"]
    assert "object.spec.schedulerName == 'gputopo-scheduler'" in conditions["gputopo-pod"]
    assert "'default-scheduler'" in conditions["no-other-scheduler"]


def test_without_dra_the_extender_gets_no_dra_settings() -> None:
    env = env_of(container(one(render(["webhook-values.yaml"]), "Deployment", component="scheduler"), "extender"))
    assert "GPUTOPO_DRA" not in env


@pytest.mark.parametrize(
    ("sets", "expected"),
    [
        pytest.param({"agent__dra__listAttributes": "true"}, "set agent.dra.enabled too", id="list without DRA"),
        pytest.param({"agent__dra__deviceTaints": "true"}, "set agent.dra.enabled too", id="taints without DRA"),
        pytest.param({"agent__dra__enabled": "yes"}, "enabled", id="not a boolean"),
        pytest.param({"agent__dra__sockets": "x"}, "additional properties", id="unknown dra value"),
    ],
)
def test_impossible_dra_values_fail_naming_them(sets: dict[str, str], expected: str) -> None:
    assert expected in render_fails(**sets)


@pytest.mark.parametrize(
    ("version", "args"),
    [
        pytest.param("1.34.4", ["--dra"], id="1.34: no documented order, index order"),
        pytest.param("1.35.2", ["--dra"], id="1.35: no documented order, index order"),
        pytest.param("1.36.0", ["--dra", "--dra-best-fit-order", "--dra-blocks"], id="1.36: the documented order"),
        pytest.param("1.37.2", ["--dra", "--dra-best-fit-order", "--dra-blocks"], id="1.37: the documented order"),
    ],
)
def test_best_fit_order_is_passed_where_the_allocator_documents_its_order(version: str, args: list[str]) -> None:
    cmd = template_args((), {"agent.dra.enabled": "true"})
    cmd[cmd.index("--kube-version") + 1] = version
    docs = [d for d in yaml.safe_load_all(run_helm(cmd).stdout) if d]
    assert container(one(docs, "DaemonSet", component="agent"))["args"] == args


def test_dra_before_kubernetes_134_fails_naming_the_version() -> None:
    args = template_args((), {"agent.dra.enabled": "true"})
    args[args.index("--kube-version") + 1] = "1.33.5"
    proc = run_helm(args, check=False)
    assert proc.returncode != 0
    assert "agent.dra.enabled needs Kubernetes 1.34 or later" in proc.stderr


def _extender_config(docs: list[Doc]) -> dict[str, Any]:
    cm = one(docs, "ConfigMap", component="scheduler")
    (ext,) = yaml.safe_load(cm["data"]["config.yaml"])["extenders"]
    return dict(ext)


def test_with_dra_kube_scheduler_sends_the_extender_every_pod() -> None:
    """A DRA pod names a claim, not nvidia.com/gpu: with managedResources the extender would never see it."""
    narrowed = {"scheduler__extender__managedResources[0]__name": "nvidia.com/gpu"}
    assert _extender_config(render(**DRA, **narrowed))["managedResources"] == []
    assert [r["name"] for r in _extender_config(render(**narrowed))["managedResources"]] == ["nvidia.com/gpu"]
