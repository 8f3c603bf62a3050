"""manifests/gputopo.yaml is exactly what scripts/render-manifests.sh renders from the chart."""

from __future__ import annotations

import os
import subprocess

import yaml

from tests.chart.helm import ROOT, helm_or_skip

SCRIPT = ROOT / "scripts" / "render-manifests.sh"
MANIFEST = ROOT / "manifests" / "gputopo.yaml"


def _render() -> str:
    helm = helm_or_skip()
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--stdout"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
        env={**os.environ, "GPUTOPO_HELM": helm},
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_manifests_match_the_chart() -> None:
    assert MANIFEST.read_text() == _render(), (
        "manifests/gputopo.yaml is out of date with charts/gputopo: run scripts/render-manifests.sh"
    )


def test_rendering_is_deterministic() -> None:
    assert _render() == _render()


def test_manifests_carry_no_generated_secret_and_no_test_pod() -> None:
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    kinds = {d["kind"] for d in docs}
    assert "Secret" not in kinds
    assert "Pod" not in kinds
    assert {"DaemonSet", "Deployment", "ValidatingAdmissionPolicy"} <= kinds


def test_every_namespaced_object_names_its_namespace() -> None:
    cluster_scoped = {
        "ClusterRole",
        "ClusterRoleBinding",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    }
    for d in yaml.safe_load_all(MANIFEST.read_text()):
        if d and d["kind"] not in cluster_scoped:
            assert d["metadata"].get("namespace") in {"gputopo-system", "kube-system"}, d["metadata"]["name"]
