"""The chart's side of gang gating (docs/annotations.md, "While a gang is gated"): webhook.groupGate reaches the
extender and makes the webhook see pods under gputopo's scheduler; scheduler.gatePolicy lets the scheduler's
service account update a pod only to lift gputopo's gate."""

from __future__ import annotations

from typing import Any

import pytest

from gputopo.extender.settings import Settings
from gputopo.model.gates import GROUP_GATE
from tests.chart.helm import container, env_of, one, render, render_fails

SCHEDULER_USER = "system:serviceaccount:gputopo-system:gputopo-scheduler"
# Every field a pod update may change, besides its scheduling gates, is compared old to new.
KEPT = (
    "metadata.labels",
    "metadata.annotations",
    "metadata.ownerReferences",
    "metadata.finalizers",
    "spec.containers",
    "spec.initContainers",
    "spec.tolerations",
    "spec.nodeSelector",
    "spec.affinity",
    "spec.activeDeadlineSeconds",
    "spec.terminationGracePeriodSeconds",
)


@pytest.mark.parametrize(
    ("sets", "gate", "release"),
    [
        pytest.param({}, False, 900.0, id="off-by-default-release-still-set"),
        pytest.param({"webhook__groupGate__enabled": "true"}, True, 900.0, id="on"),
        pytest.param(
            {"webhook__groupGate__enabled": "true", "webhook__groupGate__releaseSeconds": "60"}, True, 60.0, id="bound"
        ),
    ],
)
def test_group_gate_values_reach_the_extender(sets: dict[str, str], gate: bool, release: float) -> None:
    docs = render(["webhook-values.yaml"], **sets)
    env = env_of(container(one(docs, "Deployment", component="scheduler"), "extender"))
    settings = Settings.model_validate(
        {k.removeprefix("GPUTOPO_").lower(): v for k, v in env.items() if k.startswith("GPUTOPO_GROUP_GATE")}
    )
    assert (settings.group_gate, settings.group_gate_release_seconds) == (gate, release)


@pytest.mark.parametrize(
    ("sets", "lease"),
    [
        pytest.param({}, "gputopo-scheduler", id="election-on-the-extender-reads-its-lease"),
        pytest.param({"scheduler__leaderElection__resourceName": "other"}, "other", id="the-lease-named"),
        pytest.param({"scheduler__leaderElection__enabled": "false"}, "", id="no-election-every-replica-leads"),
    ],
)
def test_the_extender_lifts_only_beside_the_leader(sets: dict[str, str], lease: str) -> None:
    docs = render(["webhook-values.yaml"], **sets)
    env = env_of(container(one(docs, "Deployment", component="scheduler"), "extender"))
    assert Settings.model_validate({"leader_lease": env.get("GPUTOPO_LEADER_LEASE", "")}).leader_lease == lease


def test_with_the_group_gate_the_webhook_sees_pods_under_gputopos_scheduler() -> None:
    docs = render(["webhook-values.yaml"], webhook__groupGate__enabled="true")
    [hook] = one(docs, "MutatingWebhookConfiguration")["webhooks"]
    conditions: dict[str, Any] = {c["name"]: c["expression"] for c in hook["matchConditions"]}
    assert "object.spec.schedulerName == 'gputopo-scheduler'" in conditions["gputopo-pod"]


@pytest.mark.parametrize(
    "sets",
    [
        pytest.param({"webhook__groupGate__releaseSeconds": "0"}, id="zero-release"),
        pytest.param({"webhook__groupGate__enabled": "yes"}, id="not-a-boolean"),
        pytest.param({"webhook__groupGate__forever": "true"}, id="unknown-key"),
        pytest.param({"scheduler__gatePolicy__failurePolicy": "Maybe"}, id="bad-failure-policy"),
    ],
)
def test_impossible_gate_values_fail(sets: dict[str, str]) -> None:
    assert render_fails(**sets)


def test_gate_policy_matches_only_pod_updates_by_the_scheduler() -> None:
    spec = one(render(), "ValidatingAdmissionPolicy", component="gate")["spec"]
    assert spec["failurePolicy"] == "Fail"
    assert spec["matchConstraints"]["resourceRules"] == [
        {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["UPDATE"], "resources": ["pods"]}
    ]
    [cond] = spec["matchConditions"]
    assert cond["expression"] == f"request.userInfo.username == '{SCHEDULER_USER}'"
    binding = one(render(), "ValidatingAdmissionPolicyBinding", component="gate")
    assert binding["spec"] == {"policyName": "gputopo-gate", "validationActions": ["Deny"]}


def test_gate_policy_lets_only_gputopos_gate_go_and_keeps_every_other_field() -> None:
    validations = one(render(), "ValidatingAdmissionPolicy", component="gate")["spec"]["validations"]
    gates, *kept = validations
    text = " ".join(gates["expression"].split())
    assert f"oldObject.spec.schedulingGates.exists(g, g.name == '{GROUP_GATE}')" in text
    assert f"object.spec.schedulingGates == oldObject.spec.schedulingGates.filter(g, g.name != '{GROUP_GATE}')" in text
    assert (
        gates["message"]
        == f"the gputopo scheduler ({SCHEDULER_USER}) may only remove the {GROUP_GATE} scheduling gate from a pod"
    )
    assert [" ".join(v["expression"].split()) for v in kept] == [
        f"has(object.{f}) == has(oldObject.{f}) && (!has(object.{f}) || object.{f} == oldObject.{f})" for f in KEPT
    ]
    assert {v["reason"] for v in validations} == {"Forbidden"}


def test_gate_policy_off_renders_no_policy() -> None:
    docs = render(scheduler__gatePolicy__enabled="false")
    assert not [d for d in docs if d["metadata"]["name"] == "gputopo-gate"]
