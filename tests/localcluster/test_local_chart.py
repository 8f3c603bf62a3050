"""The local stack's view of the Helm chart: what it applies, and the only rewrites of the scheduler
configuration a local process needs. Needs the pinned helm (skips without it)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from gputopo.localcluster.binaries import find_binaries
from gputopo.localcluster.chart import (
    ACCESS_KINDS,
    RenderedChart,
    helm_binary,
    local_extender_args,
    local_scheduler_config,
    local_values,
    render,
)


@pytest.fixture(scope="module")
def helm() -> Path:
    bin_dir = find_binaries()
    if bin_dir is None or not (bin_dir / "helm").is_file():
        pytest.skip("the pinned helm is not built (gputopo/localcluster/build_binaries.sh)")
    return helm_binary(bin_dir)


def _two(helm: Path) -> RenderedChart:
    return render(helm, local_values(replicas=2, lease_name="lease-x"), namespace="ns-a")


def test_access_objects_are_the_charts_accounts_rbac_and_policies_only(helm: Path) -> None:
    chart = _two(helm)
    kinds = [d["kind"] for d in chart.access_objects()]
    assert set(kinds) <= set(ACCESS_KINDS)
    assert {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"} <= set(kinds)
    assert "ValidatingAdmissionPolicy" in kinds
    # Accounts and roles come before the bindings that name them.
    assert kinds.index("ServiceAccount") < kinds.index("ClusterRoleBinding")
    namespaced = [d for d in chart.access_objects() if "namespace" in d["metadata"]]
    assert {d["metadata"]["namespace"] for d in namespaced} <= {"ns-a", "kube-system"}


def test_agent_reads_pods_but_never_writes_them(helm: Path) -> None:
    chart = _two(helm)
    sa = chart.agent_service_account
    bound = {
        b["roleRef"]["name"]
        for b in chart.of_kind("ClusterRoleBinding")
        if any(s.get("name") == sa for s in b.get("subjects", []))
    }
    rules = [r for role in chart.of_kind("ClusterRole") if role["metadata"]["name"] in bound for r in role["rules"]]
    pods = [r for r in rules if "pods" in r["resources"]]
    assert [sorted(r["verbs"]) for r in pods] == [["get", "list", "watch"]]


def test_two_replicas_elect_a_leader_on_the_lease_in_the_release_namespace(helm: Path) -> None:
    cfg = _two(helm).scheduler_config()
    assert cfg["leaderElection"]["leaderElect"] is True
    assert (cfg["leaderElection"]["resourceNamespace"], cfg["leaderElection"]["resourceName"]) == ("ns-a", "lease-x")
    one = render(helm, local_values(replicas=1)).scheduler_config()
    assert one["leaderElection"]["leaderElect"] is False


def test_local_rewrite_changes_only_the_kubeconfig_and_the_extender_url(helm: Path) -> None:
    chart = _two(helm)
    original = chart.scheduler_config()
    kept = copy.deepcopy(original)
    local = local_scheduler_config(
        original, kubeconfig=Path("/k/sched-1.kubeconfig"), extender_url="http://127.0.0.1:4"
    )
    assert original == kept, "the chart's configuration is not modified in place"
    assert local["clientConnection"]["kubeconfig"] == "/k/sched-1.kubeconfig"
    (ext,) = local["extenders"]
    assert ext["urlPrefix"] == "http://127.0.0.1:4"
    assert ext["enableHTTPS"] is False and "tlsConfig" not in ext
    (orig_ext,) = original["extenders"]
    tls_fields = {"urlPrefix", "enableHTTPS", "tlsConfig"}
    assert {k: v for k, v in ext.items() if k not in tls_fields} == {
        k: v for k, v in orig_ext.items() if k not in tls_fields
    }
    untouched = {k: v for k, v in local.items() if k not in ("clientConnection", "extenders")}
    assert untouched == {k: v for k, v in original.items() if k not in ("clientConnection", "extenders")}


def test_extender_runs_with_the_sidecar_containers_environment_and_only_local_flags(helm: Path) -> None:
    chart = render(helm, local_values(stale_after_seconds=6, reservation_timeout_seconds=30), namespace="ns-b")
    env = chart.extender_env()
    assert env["GPUTOPO_HOST"] == "127.0.0.1"
    assert env["GPUTOPO_NAMESPACE"] == "ns-b"  # the downward API's metadata.namespace
    assert (env["GPUTOPO_STALE_AFTER_SECONDS"], env["GPUTOPO_RESERVATION_TIMEOUT_SECONDS"]) == ("6", "30")
    args = local_extender_args(port=5, metrics_port=6, kubeconfig=Path("/k"), env=env, stale_after_seconds=6)
    assert args == ["--port=5", "--metrics-host=127.0.0.1", "--metrics-port=6", "--kubeconfig=/k"]
    # A timing the rendered environment does not hold (not whole seconds) is the one extra flag.
    more = local_extender_args(port=5, metrics_port=6, kubeconfig=Path("/k"), env=env, stale_after_seconds=0.5)
    assert more[-1] == "--stale-after-seconds=0.5"
