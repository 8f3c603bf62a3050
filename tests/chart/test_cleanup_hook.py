"""The post-delete hook of "helm uninstall": a Job that deletes the Leases written at run time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.chart.helm import NAMESPACE, RELEASE, ROOT, Doc, container, one, render

HOOK_KINDS = ("ServiceAccount", "Role", "RoleBinding", "Job")


def _hook_docs(docs: list[Doc]) -> list[Doc]:
    return [d for d in docs if d["metadata"]["labels"].get("app.kubernetes.io/component") == "cleanup"]


def test_every_cleanup_object_is_a_post_delete_hook_that_helm_deletes_whatever_the_outcome() -> None:
    docs = _hook_docs(render())
    assert sorted(d["kind"] for d in docs) == sorted(HOOK_KINDS)
    for d in docs:
        ann = d["metadata"]["annotations"]
        assert ann["helm.sh/hook"] == "post-delete", d["kind"]
        policy = set(ann["helm.sh/hook-delete-policy"].split(","))
        assert policy == {"before-hook-creation", "hook-succeeded", "hook-failed"}, d["kind"]
        # Its account and RBAC exist before the Job runs.
        assert int(ann["helm.sh/hook-weight"]) == (0 if d["kind"] == "Job" else -1), d["kind"]
        assert d["metadata"]["namespace"] == NAMESPACE


def test_cleanup_role_lists_pods_and_deletes_leases_only() -> None:
    docs = render()
    role = one(docs, "Role", component="cleanup")
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["list", "delete"]},
    ]
    binding = one(docs, "RoleBinding", component="cleanup")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "gputopo-cleanup", "namespace": NAMESPACE}]


@pytest.mark.parametrize(
    ("sets", "lease_args", "wait"),
    [
        pytest.param({}, ["--lease=gputopo-scheduler"], "120", id="defaults: the leader Lease"),
        pytest.param(
            {"scheduler__leaderElection__resourceName": "mine", "cleanup__waitSeconds": "30"},
            ["--lease=mine"],
            "30",
            id="renamed leader Lease, shorter wait",
        ),
        pytest.param({"scheduler__leaderElection__enabled": "false"}, [], "120", id="no leader election: agents only"),
        pytest.param({"scheduler__enabled": "false"}, [], "120", id="no scheduler: agents only"),
    ],
)
def test_cleanup_job_runs_the_gputopo_image_on_this_release(
    sets: dict[str, str], lease_args: list[str], wait: str
) -> None:
    job = one(render(**sets), "Job", component="cleanup")
    c = container(job)
    assert c["image"] == "ghcr.io/gputopo/gputopo:0.1.0"
    assert c["command"] == [
        "gputopo",
        "uninstall-cleanup",
        f"--namespace={NAMESPACE}",
        f"--release={RELEASE}",
        f"--wait-seconds={wait}",
        *lease_args,
    ]
    assert job["spec"]["activeDeadlineSeconds"] > int(wait)  # the wait fits in the Job's deadline
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and pod["serviceAccountName"] == "gputopo-cleanup"
    assert job["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == "cleanup"


def test_cleanup_job_is_restricted_and_runs_where_the_scheduler_ran(tmp_path: Path) -> None:
    placement: dict[str, Any] = {"nodeSelector": {"pool": "ctl"}, "tolerations": [{"key": "ctl", "operator": "Exists"}]}
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"scheduler": placement}))
    job = one(render([values]), "Job", component="cleanup")
    pod = job["spec"]["template"]["spec"]
    assert {k: pod[k] for k in placement} == placement
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 65532
    assert container(job)["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def test_manifests_carry_no_cleanup_job() -> None:
    """kubectl runs no hooks: a post-delete Job in the plain manifests would run at apply time."""
    text = (ROOT / "manifests" / "gputopo.yaml").read_text()
    assert "gputopo-cleanup" not in text and "uninstall-cleanup" not in text
